"""Exercises of chapter 13 (inference): checkers and worked solutions.

The checkers compare the reader's numbers with the cost formulas of `kda_edu.models.costs`, with live caches of
`HybridLM`s, and with a step-time model; each `solution_*` is the worked solution the book shows.
"""

import math

import torch

from kda_edu.exercises import expect, passed, raised
from kda_edu.layers.kda_layer import KDAConfig
from kda_edu.layers.mla import MLAConfig
from kda_edu.models.costs import mla_token_cost
from kda_edu.models.model import HybridConfig, HybridLM


def _number(fn, *args) -> float:
    try:
        got = fn(*args)
    except (TypeError, ValueError, RuntimeError, ZeroDivisionError, AttributeError) as error:
        raise raised(error) from None
    expect(isinstance(got, (int, float)) and math.isfinite(got), f"return a finite number, got {got!r:.40}")
    return float(got)


# Exercise 1: the append length where MHA mode becomes cheaper than MQA mode.


def solution_crossover(config: MLAConfig) -> float:
    """Tokens appended per call above which MHA mode does fewer FLOPs per token than MQA mode (NoPE).

    Per cached position and appended token, MHA mode costs `2 H (d_k + d_v) (r / n + 1)` (expansion shared by
    the n tokens, then attention) and MQA mode `2 H 2 r`; they are equal at `n = r (d_k + d_v) / (2 r - d_k - d_v)`.
    """
    r, dkv = config.kv_rank, config.qk_head_dim + config.v_head_dim
    return r * dkv / (2 * r - dkv)


def check_crossover(fn) -> str:
    """`fn(config)` must give the append length n* where the two modes' FLOPs per token cross at long context."""
    cases = [
        MLAConfig(num_heads=32, kv_rank=512, qk_head_dim=128, v_head_dim=128),
        MLAConfig(num_heads=4, kv_rank=64, qk_head_dim=32, v_head_dim=32),
        MLAConfig(num_heads=8, kv_rank=256, qk_head_dim=64, v_head_dim=96),
    ]
    for config in cases:
        n_star = _number(fn, config)
        S = 10**7  # long context: the per-position terms dominate
        lo = mla_token_cost(config, 64, S, "mha", appended=max(1, math.floor(n_star * 0.9))).flops
        hi = mla_token_cost(config, 64, S, "mha", appended=math.ceil(n_star * 1.1)).flops
        mqa = mla_token_cost(config, 64, S, "mqa", appended=max(1, round(n_star))).flops
        expect(
            n_star > 1 and lo > mqa > hi,
            f"n* = {n_star:.1f} misses the crossover. Hint: per position MHA costs (d_k + d_v)(r / n + 1), "
            "MQA 2 r.",
        )
    return passed("Decoding (n = 1) is far on MQA mode's side; a long prefill far on MHA mode's.")


# Exercise 2: the growing part of a hybrid's cache.


def solution_growing_fraction(layer_pattern: str, n_layers: int) -> float:
    """Fraction of a full-attention model's growing cache that the hybrid keeps: MLA layers / all layers."""
    kinds = "".join(layer_pattern[i % len(layer_pattern)] for i in range(n_layers))
    return kinds.count("A") / n_layers


def check_growing_fraction(fn) -> str:
    """`fn(pattern, n_layers)` must equal the measured growth of a live cache relative to pure attention."""
    for pattern, n_layers in (("KKKA", 8), ("KKKA", 6), ("KA", 5), ("KKKKKKKA", 27), ("K", 3)):
        growth = {}
        for p in (pattern, "A"):
            config = HybridConfig(
                vocab_size=20,
                d_model=16,
                n_layers=n_layers,
                layer_pattern=p,
                kda=KDAConfig(num_heads=1, head_dim=8),
                mla=MLAConfig(num_heads=1, kv_rank=4, qk_head_dim=8, v_head_dim=8),
            )
            torch.manual_seed(0)
            model = HybridLM(config).eval()
            cache = model.new_cache()
            sizes = []
            with torch.no_grad():
                for T in (3, 5):
                    model(torch.randint(0, 20, (1, T)), cache=cache)
                    sizes.append(cache.nbytes())
            growth[p] = sizes[1] - sizes[0]
        want = growth[pattern] / growth["A"]
        got = _number(fn, pattern, n_layers)
        expect(
            abs(got - want) < 1e-12,
            f"{pattern!r} over {n_layers} layers: want {want:.4g}, got {got:.4g}. Hint: the pattern repeats, "
            "maybe cut short.",
        )
    return passed("Kimi Linear's 3:1 pattern keeps a quarter: the 75% reduction.")


# Exercise 3: a bandwidth bound on decoding throughput.


def solution_bandwidth_tokens_per_s(
    weight_bytes: float, cache_bytes_per_sequence: float, batch: int, bandwidth: float
) -> float:
    """Tokens/s if a decoding step only had to read the weights once and every sequence's cache once at
    `bandwidth` bytes/s: one step makes `batch` tokens."""
    step_seconds = (weight_bytes + batch * cache_bytes_per_sequence) / bandwidth
    return batch / step_seconds


def check_bandwidth_tokens_per_s(fn) -> str:
    """`fn(weight_bytes, cache_bytes_per_sequence, batch, bandwidth)`: the memory-bound decoding throughput."""
    cases = [(1e9, 1e6, 1, 1e12), (2e10, 3e8, 16, 4.8e12), (1e9, 0.0, 64, 1e12), (6e9, 1.7e10, 3, 4.8e12)]
    for w, c, b, bw in cases:
        got = _number(fn, w, c, b, bw)
        bytes_per_token = (
            w / b + c
        )  # the weights are shared by the batch, each cache is read for its own token
        want = bw / bytes_per_token
        expect(
            abs(got - want) <= 1e-9 * want,
            f"batch {b}: want {want:.4g} tokens/s, got {got:.4g}: a step reads the weights once, every cache "
            "once.",
        )
    return passed("A bigger batch amortises the weights; only a smaller cache amortises nothing away.")
