"""Chapter 5's two-timescale task, its equal-state baselines and its rotated-keys control."""

import math

import pytest
import torch

from kda_edu.chapters import ch05_two_timescales as tt

SMALL = dict(batch=8, half=4, value_dim=4, n_facts=2, n_stream=30, recent=2, noise=0.5)


def test_two_heads_compute_what_kda_computes_on_aligned_keys():
    task = tt.make_task(**SMALL, seed=3)
    pairs = torch.tensor([[0.0, -0.2], [-0.01, -1.0], [-0.3, 0.0]])
    kda = tt.retrieval_errors(task, tt.channel_gates(pairs[:, 0], pairs[:, 1], task.half))
    heads = tt.gdn_heads_errors(task, pairs)
    for a, b in zip(kda, heads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_rotation_leaves_a_scalar_gate_unchanged_and_moves_a_per_channel_one():
    task = tt.make_task(**SMALL, seed=4)
    rotated = tt.rotate_keys(task, seed=2)
    scalar = tt.channel_gates(torch.tensor([-0.1]), torch.tensor([-0.1]), task.half)
    for a, b in zip(tt.retrieval_errors(task, scalar), tt.retrieval_errors(rotated, scalar), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    split = tt.channel_gates(torch.tensor([0.0]), torch.tensor([-1.0]), task.half)
    before, after = tt.retrieval_errors(task, split), tt.retrieval_errors(rotated, split)
    assert (before[0] - after[0]).abs() > 0.05  # per-channel decay depends on the key basis


def test_learned_memory_trains_and_reports():
    r = tt.train_learned_memory(1, True, seed=0, steps=3, task_kwargs=dict(batch=4, n_stream=20))
    assert (
        set(r) == {"fact", "recent", "mean", "gates", "initial_gates", "loss"}
        and len(r["gates"]) == 16
        and len(r["loss"]) == 3
    )
    assert all(g <= 0 for g in r["gates"])
    assert r["gates"] != r["initial_gates"]  # three Adam steps moved them


@pytest.mark.parametrize("heads, per_channel", [(1, True), (2, False), (1, False)])
def test_per_token_gates_start_as_the_constant_ones_and_learn_from_the_tokens(heads, per_channel):
    """W_g = 0 gives the constant-gate model's forward exactly (float64); the gates then have one value per
    token, and the loss's gradient reaches W_g."""
    torch.manual_seed(0)
    task = tt.rotate_keys(tt.make_task(**SMALL, seed=7), 1)
    task = tt.TwoTimescaleTask(*(t.double() for t in (task.k, task.v, task.queries, task.targets)), 2, 4)
    const = tt.LearnedMemory(8, heads, per_channel, seed=0, gate_init="spread").double()
    token = tt.LearnedMemory(8, heads, per_channel, seed=0, gate_init="spread", per_token=True).double()
    for a, b in zip(const.errors(task), token.errors(task), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    B, T = task.k.shape[:2]
    g = token.token_gates(task)
    assert g.shape == ((B, T, 1, 8) if per_channel else (B, T, heads, 1)) and g.dtype == torch.float64
    sum(token.errors(task)).backward()
    assert token.W_g.grad.shape == (8 if per_channel else heads, 8) and token.W_g.grad.abs().max() > 0
    with torch.no_grad():
        token.W_g.normal_()
    g = token.token_gates(task)
    assert (g <= 0).all() and g.std(1).min() > 0  # now the gate differs from token to token
    assert token.errors(task)[0] != const.errors(task)[0]


def test_per_token_training_reports_the_gates_over_tokens():
    r = tt.train_learned_memory(
        1, True, seed=0, steps=3, task_kwargs=dict(batch=4, n_stream=20), gate_init="spread", per_token=True
    )
    per_token = ("gates", "gates_fact_tokens", "gates_stream_tokens", "gates_token_std")
    assert all(len(r[key]) == 16 for key in per_token) and r["W_g_norm"] > 0
    assert r["gates"] != r["gates_stream_tokens"]  # the mean over all tokens includes the fact tokens
    with pytest.raises(TypeError, match="per_token must be True or False"):
        tt.LearnedMemory(16, 1, True, seed=0, per_token="yes")


def _run(model, init, mean, gates, **per_token):
    return dict(model=model, seed=0, gate_init=init, mean=mean, gates=gates, **per_token)


def test_compare_gate_runs_pairs_the_runs_and_measures_the_change():
    kept_fast = [0.0] * 5 + [-0.2] * 11
    constant = [_run("GDN, 1 head", "flat", 0.20, [0.0]), _run("KDA", "spread", 0.25, kept_fast)]
    tok = dict(gates_token_std=[0.0] * 5 + [0.08] * 11, loss_every_50=[9.0, 1.0, 1.1, 1.0, 1.0])
    moved = [0.0] * 4 + [-0.2] * 12  # one kept channel now decays
    per_token = [
        _run("GDN, 1 head", "flat", 0.21, [0.0], gates_stream_tokens=[0.0], **tok),
        _run("KDA", "spread", 0.20, kept_fast, gates_stream_tokens=moved, **tok),
    ]
    c = tt.compare_gate_runs(constant, per_token)
    assert c["runs"] == 2 and c["error_change"] == pytest.approx(0.2)  # KDA: 0.20 / 0.25 - 1
    assert c["kda_split"] == [((5, 11), (4, 12))] and c["token_std"] == 0.08
    assert c["loss_tail"] == pytest.approx(0.1)  # only the last four points: 1.0 ... 1.1
    with pytest.raises(ValueError, match="runs out of step"):
        tt.compare_gate_runs(constant, per_token[::-1])
    with pytest.raises(ValueError, match="the same runs"):
        tt.compare_gate_runs(constant, per_token[:1])


@pytest.mark.parametrize("heads, per_channel", [(1, True), (2, False), (1, False)])
def test_a_spread_start_covers_the_rates_log_uniformly(heads, per_channel):
    """Spread: the rates -g run log-uniformly over SPREAD (16 channels, or 2 heads at its ends); one scalar
    gate at the middle, the geometric mean. Flat: every gate at -softplus(-6)."""
    lo, hi = tt.SPREAD
    rates = -tt.LearnedMemory(16, heads, per_channel, seed=0, gate_init="spread").gates().detach().double()
    if len(rates) == 1:
        torch.testing.assert_close(
            rates, torch.tensor([(lo * hi) ** 0.5], dtype=torch.float64), rtol=1e-5, atol=0
        )
    else:
        torch.testing.assert_close(
            rates[[0, -1]], torch.tensor([lo, hi], dtype=torch.float64), rtol=1e-5, atol=0
        )
        steps = rates.log().diff()
        torch.testing.assert_close(steps, steps[:1].expand_as(steps), rtol=1e-4, atol=0)
    flat = tt.LearnedMemory(16, heads, per_channel, seed=0).gates().detach()
    torch.testing.assert_close(flat, torch.full_like(flat, -math.log1p(math.exp(-6.0))))


def test_an_unknown_gate_start_is_refused():
    with pytest.raises(ValueError, match="gate_init must be one of"):
        tt.LearnedMemory(16, 1, True, seed=0, gate_init="mamba")


def test_mix_halves_keeps_overlaps_and_spreads_keys_over_both_halves():
    task = tt.make_task(**SMALL, seed=5)
    assert tt.mix_halves(task, 0.0).k.equal(task.k)
    mixed = tt.mix_halves(task, 0.3)
    gram = lambda t: torch.einsum("btk,bsk->bts", t.k[:, :, 0], t.k[:, :, 0])  # noqa: E731
    torch.testing.assert_close(gram(mixed), gram(task), rtol=0, atol=1e-5)
    fact_on_fast = mixed.k[:, : task.n_facts, 0, task.half :].norm(dim=-1)
    torch.testing.assert_close(fact_on_fast, torch.full_like(fact_on_fast, torch.tensor(0.3).sin().item()))
    # The split gate (slow half kept, fast half decayed) loses facts once they lean into the fast half.
    split = tt.channel_gates(torch.tensor([0.0]), torch.tensor([-1.0]), task.half)
    assert tt.retrieval_errors(mixed, split)[0] > tt.retrieval_errors(task, split)[0] + 0.02


def test_control_errors_runs_every_model_and_two_heads_match_kda():
    task = tt.make_task(**SMALL, seed=6)
    grid = torch.tensor([0.0, -0.1, -1.0])
    pairs = torch.tensor([[0.0, -1.0], [-0.1, -0.1]])
    runs = tt.control_errors(task, grid, pairs, {"pi/4": torch.pi / 4.0}, rotate_seed=2)
    assert set(runs) == {
        "GDN, 1 head",
        "GDN, 2 heads",
        "KDA",
        "GDN, 1 head, rotated keys",
        "KDA, rotated keys",
        "KDA, keys tilted pi/4",
    }
    assert runs["GDN, 1 head"][0].shape == (3,) and runs["KDA"][0].shape == (2,)
    torch.testing.assert_close(runs["GDN, 2 heads"][0], runs["KDA"][0], rtol=0, atol=1e-5)
    assert tt.best_mean(runs["KDA"]) == min((f + r).item() / 2 for f, r in zip(*runs["KDA"], strict=True))


def test_figures_draw(monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setattr(plt, "show", lambda: None)
    decays = torch.tensor([0.0, -0.1, -1.0])
    errors = (torch.tensor([0.1, 0.5, 1.0]), torch.tensor([0.4, 0.2, 0.1]))
    tt.plot_gate_sweeps(decays, errors, errors)
    tt.plot_controls({"GDN, 1 head": [0.2, 0.21, 0.19], "KDA": [0.1, 0.12, 0.11]})
    tt.plot_retention_settings([("softplus", 3.0, "spread"), ("lower bound", 0.0, "one bias")])
    x = torch.linspace(-5, 5, 11, dtype=torch.float64)
    tt.plot_gate_shapes(x, -torch.nn.functional.softplus(x), -5 * torch.sigmoid(x))
    tt.plot_channel_half_lives("lower bound", dt_spread=0.0)
    assert len(plt.get_fignums()) >= 5
    plt.close("all")
