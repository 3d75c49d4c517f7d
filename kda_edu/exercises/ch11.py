"""Exercises of chapter 11 (MLA, NoPE and the hybrid): checkers and worked solutions.

Each `check_*` compares the reader's function with what the library does: the scores of an `MLA` layer, the
cost formulas of `kda_edu.models.costs`, and `HybridLM.generate`; each `solution_*` is the worked solution the book
shows.
"""

import torch

from kda_edu.exercises import WrongAnswer, expect, passed, raised
from kda_edu.layers.kda_layer import KDAConfig
from kda_edu.layers.mla import MLAConfig
from kda_edu.models.costs import mla_token_cost
from kda_edu.models.model import HybridConfig, HybridLM


def _call(fn, *args):
    try:
        return fn(*args)
    except (TypeError, ValueError, RuntimeError, IndexError, AttributeError) as error:
        raise raised(error) from None


# Exercise 1: absorb the key up-projection into the query.


def solution_absorb_query(q: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """Absorbed queries `[T, H, r]` from queries q `[T, H, d_k]` and `w_uk` `[H, d_k, r]`:
    `q_h . (W_uk,h c) = (W_uk,h^T q_h) . c`."""
    return torch.einsum("thd,hdr->thr", q, w_uk)


def check_absorb_query(fn) -> str:
    """`fn(q, w_uk)` must give absorbed queries whose dot products with the latents are the MHA scores."""
    gen = torch.Generator().manual_seed(20)
    for T, S, H, dk, r in ((1, 5, 1, 4, 6), (3, 9, 2, 8, 12), (4, 16, 4, 16, 8)):
        q = torch.randn(T, H, dk, generator=gen, dtype=torch.float64)
        w_uk = torch.randn(H, dk, r, generator=gen, dtype=torch.float64)
        c = torch.randn(S, r, generator=gen, dtype=torch.float64)
        a = _call(fn, q.clone(), w_uk.clone())
        expect(
            isinstance(a, torch.Tensor) and tuple(a.shape) == (T, H, r),
            f"return absorbed queries of shape [T, H, r] = {(T, H, r)}, got "
            f"{tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__}",
        )
        keys = torch.einsum("hdr,sr->shd", w_uk, c)  # MHA mode: expanded keys [S, H, dk]
        want = torch.einsum("thd,shd->ths", q, keys)
        got = torch.einsum("thr,sr->ths", a, c)
        error = (got - want).abs().max().item()
        expect(
            error < 1e-9,
            f"scores over the latents are off by {error:.3g}. Hint: q . (W_uk c) = (W_uk^T q) . c: contract "
            "over d_k.",
        )
    return passed("One r-wide vector per head and query: attention runs over the cache as it is.")


# Exercise 2: MQA mode's attention FLOPs per cached position, relative to MHA mode.


def solution_mqa_over_mha(config: MLAConfig, rope_head_dim: int = 0) -> float:
    """Attention FLOPs per cached position, MQA mode over MHA mode: scores and the weighted sum run over
    r-wide latents (plus the d_r-wide RoPE key) instead of d_k-wide keys and d_v-wide values."""
    r, dk, dv = config.kv_rank, config.qk_head_dim, config.v_head_dim
    return (2 * r + rope_head_dim) / (dk + rope_head_dim + dv)


def check_mqa_over_mha(fn) -> str:
    """`fn(config, rope_head_dim)` must equal the ratio of the attention parts of `kda_edu.models.costs`."""
    cases = [
        (MLAConfig(num_heads=128, kv_rank=512, qk_head_dim=128, v_head_dim=128), 64),
        (MLAConfig(num_heads=32, kv_rank=512, qk_head_dim=128, v_head_dim=128), 0),
        (MLAConfig(num_heads=4, kv_rank=64, qk_head_dim=32, v_head_dim=16), 0),
        (MLAConfig(num_heads=8, kv_rank=256, qk_head_dim=64, v_head_dim=64), 32),
    ]
    for config, dr in cases:
        mha = mla_token_cost(config, 1024, context_len=4096, mode="mha", rope_head_dim=dr)
        mqa = mla_token_cost(config, 1024, context_len=4096, mode="mqa", rope_head_dim=dr)
        want = mqa.parts["attention"] / mha.parts["attention"]
        got = _call(fn, config, dr)
        expect(
            isinstance(got, (int, float)) and abs(got - want) < 1e-9 * want,
            f"d_r = {dr}: ratio {want:.4g}, got {got!r:.8}. Hint: count key plus value widths; in MQA both "
            "are the latent.",
        )
    return passed("DeepSeek-V3's and Kimi Linear's dimensions give (2 * 512 + 64) / (128 + 64 + 128) = 3.4.")


# Exercise 3: greedy decoding through the cache.


def solution_greedy_decode(model: HybridLM, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Prefill the prompt once, then one cached step per new token, each time taking the argmax."""
    cache = model.new_cache()
    out = [ids]
    with torch.no_grad():
        logits = model(ids, cache=cache)[:, -1]
        for i in range(n):
            next_id = logits.argmax(dim=-1, keepdim=True)
            out.append(next_id)
            if i + 1 < n:
                logits = model(next_id, cache=cache)[:, -1]
    return torch.cat(out, dim=1)


def check_greedy_decode(fn) -> str:
    """`fn(model, ids, n)` must return the prompt and n greedy tokens, as `HybridLM.generate` does."""
    config = HybridConfig(
        vocab_size=50,
        d_model=32,
        n_layers=4,
        kda=KDAConfig(num_heads=2, head_dim=16, chunk_size=8),
        mla=MLAConfig(num_heads=2, kv_rank=16, qk_head_dim=16, v_head_dim=16),
        init_std=0.5,  # large weights: peaked logits, so greedy choices are clear-cut
    )
    torch.manual_seed(3)
    model = HybridLM(config).double().eval()
    gen = torch.Generator().manual_seed(4)
    for B, T, n in ((1, 5, 3), (2, 12, 6)):
        ids = torch.randint(0, 50, (B, T), generator=gen)
        got = _call(fn, model, ids.clone(), n)
        want = model.generate(ids, n)
        expect(
            isinstance(got, torch.Tensor) and tuple(got.shape) == (B, T + n),
            f"return the prompt followed by the new tokens, shape [B, T + n] = {(B, T + n)}",
        )
        if not torch.equal(got, want):
            b, i = (got != want).nonzero()[0].tolist()  # the first token that differs
            expect(
                i >= T,
                f"sequence {b}: prompt position {i} changed; return the prompt as given, then the new tokens",
            )
            raise WrongAnswer(
                f"sequence {b}, new token {i - T}: {got[b, i].item():g}, generate() says "
                f"{want[b, i].item():g}. Hint: after the prompt, feed only the new token."
            )
    return passed("One prefill, then one cached step per token: the same tokens as generate().")
