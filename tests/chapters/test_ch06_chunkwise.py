"""The chapter's one-listing chunked KDA against the float64 loop."""

import pytest
import torch

from kda_edu.chapters.ch06_chunkwise import chunked_kda
from kda_edu.ops.chunkwise import random_inputs
from kda_edu.ops.delta_rule import delta_rule_recurrent
from kda_edu.ops.kda import kda_recurrent


def _one_head(T, lower_bound=-1.0, seed=0):
    x = random_inputs(1, T, 1, 8, 6, lower_bound=lower_bound, at_bound=0.25, dtype=torch.float64, seed=seed)
    return x, {name: t[0, :, 0] for name, t in x.items()}


@pytest.mark.parametrize("T, C", [(1, 16), (16, 16), (50, 16), (150, 64), (37, 64)])
def test_equals_the_loop(T, C):
    # T = 50 and 150 leave a short last chunk; T = 37 < C is a single short chunk.
    x, h = _one_head(T, seed=T)
    o_ref, S_ref = kda_recurrent(**x, output_final_state=True)
    o, S = chunked_kda(h["q"], h["k"], h["v"], h["g"], h["beta"], chunk_size=C)
    torch.testing.assert_close(o, o_ref[0, :, 0], rtol=0, atol=1e-12)
    torch.testing.assert_close(S, S_ref[0, 0], rtol=0, atol=1e-12)


def test_finite_and_exact_at_the_gate_floor_in_float32():
    # Gates at -5 over a chunk of 64: a split at the chunk start would need exp(320); differences do not.
    x, h = _one_head(200, lower_bound=-5.0, seed=1)
    o_ref = kda_recurrent(**x)[0][0, :, 0]
    o = chunked_kda(*(h[n].float() for n in ("q", "k", "v", "g", "beta")), chunk_size=64)[0].double()
    assert o.isfinite().all()
    assert (o - o_ref).norm() / o_ref.norm() < 1e-5


def test_without_decay_it_is_the_delta_rule():
    x, h = _one_head(70, seed=2)
    o_ref, S_ref = delta_rule_recurrent(x["q"], x["k"], x["v"], x["beta"], output_final_state=True)
    o, S = chunked_kda(h["q"], h["k"], h["v"], torch.zeros_like(h["g"]), h["beta"], chunk_size=32)
    torch.testing.assert_close(o, o_ref[0, :, 0], rtol=0, atol=1e-12)
    torch.testing.assert_close(S, S_ref[0, 0], rtol=0, atol=1e-12)
