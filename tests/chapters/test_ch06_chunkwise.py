"""The chapter's one-listing chunked KDA against the float64 loop."""

import math

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


def test_gate_bound_errors_break_where_the_exponents_overflow():
    from kda_edu.chapters.ch06_chunkwise import gate_bound_errors

    # At -1 every scheme is accurate; at -6 the chunk-start split (64 x 6) and 16-row anchors (16 x 6) overflow.
    errors = gate_bound_errors([-1.0, -6.0], T=64, d=8)
    assert all(errs[0] < 1e-5 for errs in errors.values())
    assert errors["split at chunk start"][1] == errors["anchored every 16 rows"][1] == math.inf
    assert errors["kda_chunked"][1] < 1e-5


def test_plots_draw_every_series(monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kda_edu.chapters.ch06_chunkwise import plot_chunk_timings, plot_gate_bound_errors

    monkeypatch.setattr(plt, "show", lambda: None)
    fig = plot_gate_bound_errors([-1.0, -6.0], {"a": [1e-7, math.inf], "b": [1e-7, 1e-7], "c": [1e-7, 1e-7]})
    assert [line.get_ydata()[1] for line in fig.axes[0].get_lines()[:3]] == [1.0, 1e-7, 1e-7]
    t = {4: 1.0, 16: 2.0}
    fig = plot_chunk_timings([4, 16], t, t, {16: {4: 0.5, 16: 0.5}}, {4: 1.0, 16: 0.25})
    assert len(fig.axes[0].get_lines()) == 4 and list(fig.axes[1].get_lines()[1].get_ydata()) == [1.0, 8.0]
    plt.close("all")
