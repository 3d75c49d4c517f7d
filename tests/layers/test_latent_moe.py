"""The latent mixture of experts and the routing bias that balances every MoE without a loss term."""

import pytest
import torch

from kda_edu.layers.ffn import FFNConfig, LatentMoE, MoE, build_ffn, ffn_active_parameters, ffn_parameters

D = 16


def make(latent_dim=8, num_experts=4, top_k=2, num_shared=1, seed=0):
    torch.manual_seed(seed)
    config = FFNConfig(
        num_experts=num_experts, top_k=top_k, expert_hidden=8, num_shared=num_shared, latent_dim=latent_dim
    )
    return build_ffn(D, config).double()


def test_build_ffn_picks_the_latent_moe():
    assert type(make()) is LatentMoE
    assert type(make(latent_dim=None)) is MoE


def test_latent_moe_is_the_formula_token_by_token():
    moe = make()
    x = torch.randn(3, 5, D, dtype=torch.float64)
    tokens = x.reshape(-1, D)
    weights, experts = moe.route(tokens)
    rows = []
    for t, ws, es in zip(tokens, weights, experts, strict=True):
        u = moe.latent_down(t)
        routed = sum(w * moe.experts[int(e)](u) for w, e in zip(ws, es, strict=True))
        rows.append(moe.shared_expert(t) + moe.latent_up(routed))
    torch.testing.assert_close(moe(x), torch.stack(rows).reshape(x.shape), rtol=1e-12, atol=1e-12)


def test_identity_projections_give_back_the_plain_moe():
    """With latent width D and identity down/up projections the latent MoE is the MoE with the same experts:
    the projections are linear and commute with the weighted sum (float64, rounding only)."""
    latent = make(latent_dim=D)
    plain = make(latent_dim=None)
    with torch.no_grad():
        latent.latent_down.weight.copy_(torch.eye(D))
        latent.latent_up.weight.copy_(torch.eye(D))
    plain.load_state_dict({k: v for k, v in latent.state_dict().items() if not k.startswith("latent_")})
    x = torch.randn(20, D, dtype=torch.float64)
    torch.testing.assert_close(latent(x), plain(x), rtol=1e-12, atol=1e-12)


def test_shared_experts_are_one_wider_swiglu_and_can_be_absent():
    assert make(num_shared=2).shared_expert.up_proj.weight.shape == (16, D)
    moe = make(num_shared=0)
    assert moe.shared_expert is None
    x = torch.randn(6, D, dtype=torch.float64)
    weights, experts = moe.route(x)
    torch.testing.assert_close(moe(x), moe.latent_up(moe.combine(moe.latent_down(x), weights, experts)))


def test_the_bias_chooses_but_does_not_weigh():
    moe = make(latent_dim=None, num_experts=4, top_k=2)
    x = torch.randn(50, D, dtype=torch.float64)
    probs = torch.softmax(moe.router(x), dim=-1)
    moe.route_bias[3] = 10.0  # expert 3 wins every token's first place
    weights, experts = moe.route(x)
    assert (experts[:, 0] == 3).all()
    chosen = probs.gather(1, experts)
    torch.testing.assert_close(weights, chosen / chosen.sum(dim=1, keepdim=True))


def test_bias_updates_balance_a_skewed_router():
    """A router skewed towards expert 0 sends it most tokens. 400 bias updates of 0.005, each after one batch
    of 256 tokens, bring the largest load of a large fixed batch (8192 tokens, so counting noise is about 3% of
    the mean) from over 2.5 times the mean to under 1.5 times (measured: 3.3 -> 1.25; the fixed-size sign
    steps keep it oscillating between about 1.1 and 1.5 afterwards). Only the bias moves, never the router."""
    moe = make(latent_dim=None, num_experts=8, top_k=2)
    with torch.no_grad():
        moe.router.weight[0] += 0.5  # tokens with a positive sum of coordinates prefer expert 0
    gen = torch.Generator().manual_seed(1)
    probe = torch.randn(8192, D, generator=gen, dtype=torch.float64) + 0.3
    router_before = moe.router.weight.clone()

    def imbalance() -> float:
        moe.route(probe)
        value = moe.imbalance()
        moe.load.zero_()
        return value

    moe.train()
    before = imbalance()
    for _ in range(400):
        moe.route(torch.randn(256, D, generator=gen, dtype=torch.float64) + 0.3)
        moe.update_routing_bias(0.005)
    after = imbalance()
    assert before > 2.5, before
    assert after < 1.5, after
    assert moe.route_bias[0] < 0
    assert torch.equal(moe.router.weight, router_before)


def test_load_is_counted_in_training_only_and_reset_by_the_update():
    moe = make()
    x = torch.randn(10, D, dtype=torch.float64)
    moe.eval()
    moe(x)
    assert moe.load.sum() == 0 and moe.imbalance() == 0.0
    moe.train()
    moe(x)
    assert moe.load.sum() == 10 * 2
    moe.update_routing_bias(0.1)
    assert moe.load.sum() == 0
    assert torch.count_nonzero(moe.route_bias) > 0


def test_parameter_counts_match_the_modules():
    for latent_dim, num_shared in ((None, 1), (8, 2), (8, 0), (None, 0)):
        moe = make(latent_dim=latent_dim, num_shared=num_shared)
        config = FFNConfig(
            num_experts=4, top_k=2, expert_hidden=8, num_shared=num_shared, latent_dim=latent_dim
        )
        assert sum(ffn_parameters(D, config).values()) == sum(p.numel() for p in moe.parameters())
    assert ffn_parameters(D, FFNConfig(hidden=24)) == {"dense": 3 * D * 24}


def test_active_parameters_are_the_ones_a_token_touches():
    """Backpropagate from one token: the parameters that receive a gradient are the ones it used."""
    moe = make(latent_dim=8, num_experts=6, top_k=2, num_shared=1)
    moe(torch.randn(1, D, dtype=torch.float64)).sum().backward()
    touched = sum(p.numel() for p in moe.parameters() if p.grad is not None)
    config = FFNConfig(num_experts=6, top_k=2, expert_hidden=8, num_shared=1, latent_dim=8)
    assert touched == ffn_active_parameters(D, config)


def test_gradients_reach_router_projections_and_experts():
    moe = make(num_experts=3, top_k=3)
    moe(torch.randn(12, D, dtype=torch.float64)).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in moe.parameters())


def test_bad_configs_and_rates_are_named():
    with pytest.raises(ValueError, match="FFNConfig.latent_dim must be None or >= 1 with num_experts >= 1"):
        FFNConfig(latent_dim=8)
    with pytest.raises(ValueError, match="FFNConfig.num_shared must be >= 0"):
        FFNConfig(num_experts=2, num_shared=-1)
    with pytest.raises(ValueError, match="LatentMoE needs config.latent_dim"):
        LatentMoE(D, FFNConfig(num_experts=2))
    with pytest.raises(ValueError, match="rate must be a number >= 0"):
        make().update_routing_bias(-1.0)
    with pytest.raises(ValueError, match=r"x must have shape \[..., D\] with D = 16"):
        make()(torch.randn(3, 8, dtype=torch.float64))
