"""Feed-forward layers: SwiGLU and the mixture of experts, routing included."""

import pytest
import torch
import torch.nn.functional as F

from kda_edu.layers.ffn import FFNConfig, MoE, SwiGLU, build_ffn

D = 16


def make_moe(num_experts: int = 4, top_k: int = 2) -> MoE:
    torch.manual_seed(0)
    return MoE(D, FFNConfig(num_experts=num_experts, top_k=top_k, expert_hidden=8)).double()


def test_swiglu_formula():
    torch.manual_seed(0)
    mlp = SwiGLU(D, 24)
    x = torch.randn(2, 3, D)
    expected = (F.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    torch.testing.assert_close(mlp(x), expected)


def test_build_ffn_picks_dense_or_moe():
    assert isinstance(build_ffn(D, FFNConfig(hidden=32)), SwiGLU)
    assert isinstance(build_ffn(D, FFNConfig(num_experts=3, top_k=1)), MoE)


def test_routing_picks_the_top_k_experts_and_renormalises():
    moe = make_moe()
    x = torch.randn(20, D, dtype=torch.float64)
    weights, experts = moe.route(x)
    probs = torch.softmax(x @ moe.router.weight.T, dim=-1)
    assert weights.shape == experts.shape == (20, 2)
    assert torch.equal(experts[:, 0], probs.argmax(dim=-1))
    assert (experts[:, 0] != experts[:, 1]).all()
    chosen = probs.gather(1, experts)
    assert (chosen.min(dim=1).values >= probs.topk(2, dim=-1).values[:, 1] - 1e-12).all()
    torch.testing.assert_close(weights, chosen / chosen.sum(dim=1, keepdim=True))


def test_moe_output_is_the_weighted_sum_of_chosen_experts_plus_the_shared_one():
    moe = make_moe()
    x = torch.randn(3, 5, D, dtype=torch.float64)
    tokens = x.reshape(-1, D)
    weights, experts = moe.route(tokens)
    expected = torch.stack(
        [
            moe.shared_expert(t) + sum(w * moe.experts[int(e)](t) for w, e in zip(ws, es, strict=True))
            for t, ws, es in zip(tokens, weights, experts, strict=True)
        ]
    )
    torch.testing.assert_close(moe(x), expected.reshape(x.shape))


def test_top_k_equal_to_all_experts_is_the_dense_softmax_mixture():
    moe = make_moe(num_experts=3, top_k=3)
    x = torch.randn(7, D, dtype=torch.float64)
    probs = torch.softmax(x @ moe.router.weight.T, dim=-1)
    dense = moe.shared_expert(x) + sum(probs[:, e, None] * moe.experts[e](x) for e in range(3))
    torch.testing.assert_close(moe(x), dense)


def test_unrouted_expert_gets_no_gradient_and_router_does():
    moe = make_moe(num_experts=4, top_k=1)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0, 0] = 10.0  # with x[:, 0] > 0 every token prefers expert 0
    x = torch.randn(6, D, dtype=torch.float64)
    x[:, 0] = x[:, 0].abs() + 1
    assert (moe.route(x)[1] == 0).all()
    moe(x).sum().backward()
    assert moe.experts[0].up_proj.weight.grad.abs().sum() > 0
    assert all(moe.experts[e].up_proj.weight.grad is None for e in (1, 2, 3))
    assert moe.shared_expert.up_proj.weight.grad.abs().sum() > 0


def test_bad_configs_and_inputs_are_named():
    with pytest.raises(ValueError, match="FFNConfig.top_k must lie in"):
        FFNConfig(num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="FFNConfig.num_experts must be >= 0"):
        FFNConfig(num_experts=-1)
    with pytest.raises(ValueError, match=r"x must have shape \[..., D\] with D = 16"):
        make_moe()(torch.randn(2, 3, 15, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x must have shape \[..., D\] with D = 16"):
        SwiGLU(D, 8)(torch.randn(4, 8))
