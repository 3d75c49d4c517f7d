"""The training loop: the schedule, a tiny run that must learn, determinism, and exact resumption."""

import math
from dataclasses import replace

import pytest
import torch

from kda_edu.layers.mixers import MixerConfig
from kda_edu.models.recall import RecallConfig, RecallLM
from kda_edu.training.sweep import PRESETS, run_specs, run_sweep, summarize, task_for
from kda_edu.training.tasks import MQAR
from kda_edu.training.train import (
    GATE_PARAMETERS,
    TrainConfig,
    lr_at,
    make_optimizer,
    masked_loss_and_accuracy,
    train,
)

TASK = MQAR(seq_len=16, num_pairs=2, num_keys=4, num_values=4)
MODEL = RecallConfig(
    vocab_size=TASK.vocab_size, d_model=32, ffn_hidden=64, mixer=MixerConfig("deltanet", 2, 8, chunk_size=8)
)
CONFIG = TrainConfig(steps=20, batch_size=16, lr=3e-3, warmup=4, eval_every=5, eval_size=64, seed=3)


def test_schedule_warms_up_then_decays_to_the_floor():
    c = TrainConfig(steps=100, lr=1e-3, warmup=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, c) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10], strict=False))
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:], strict=False))
    assert lrs[-1] == pytest.approx(1e-4)


def test_a_tiny_run_reduces_the_loss():
    config = TrainConfig(steps=60, batch_size=16, lr=1e-2, warmup=5, eval_every=10, eval_size=64, seed=0)
    history = train(TASK, MODEL, config, progress=False).history
    assert history[0]["eval_loss"] < math.log(TASK.vocab_size) + 0.1  # starts near chance
    assert history[-1]["eval_loss"] < 0.8 * history[0]["eval_loss"]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert history[-1]["eval_acc"] > 1.5 / TASK.num_values  # better than guessing a value


@pytest.mark.parametrize("kind", ["kda", "gated_deltanet", "attention"])
def test_weight_decay_spares_norms_biases_and_the_gates(kind):
    """KDA's dt_bias is [H, K], a matrix by shape: it must be left undecayed like Gated DeltaNet's [H] one,
    or the two mixers' decays would be trained under different rules."""
    model = RecallLM(replace(MODEL, mixer=MixerConfig(kind, 2, 8, chunk_size=8)))
    decay, no_decay = make_optimizer(model, CONFIG).param_groups
    assert decay["weight_decay"] == CONFIG.weight_decay and no_decay["weight_decay"] == 0.0
    ids = {id(p) for p in decay["params"]}
    for name, p in model.named_parameters():
        last = name.rsplit(".", 1)[-1]
        expected = p.dim() >= 2 and last not in GATE_PARAMETERS
        assert (id(p) in ids) == expected, name
    gates = [n for n, _ in model.named_parameters() if n.rsplit(".", 1)[-1] in GATE_PARAMETERS]
    assert len(gates) == (0 if kind == "attention" else 2 * MODEL.n_layers)
    dt_bias = [p for n, p in model.named_parameters() if n.endswith("dt_bias")]
    assert all(id(p) not in ids for p in dt_bias) and all(
        p.dim() == (2 if kind == "kda" else 1) for p in dt_bias
    )
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.fixture(scope="module")
def whole_run():
    return train(TASK, MODEL, CONFIG, progress=False)


def test_training_is_deterministic_given_the_seed(whole_run):
    a, b = whole_run, train(TASK, MODEL, CONFIG, progress=False)
    assert a.history == b.history
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    other = train(TASK, MODEL, TrainConfig(**{**CONFIG.__dict__, "seed": 4}), stop_after=5, progress=False)
    assert other.history[0] != a.history[0]


def test_resuming_from_a_checkpoint_matches_the_uninterrupted_run(whole_run, tmp_path):
    whole = whole_run
    path = tmp_path / "run.safetensors"
    first = train(TASK, MODEL, CONFIG, checkpoint=path, stop_after=10, progress=False)
    assert [h["step"] for h in first.history] == [5, 10]
    resumed = train(TASK, MODEL, CONFIG, checkpoint=path, resume=True, progress=False)
    assert resumed.history == whole.history
    for p, q in zip(resumed.model.parameters(), whole.model.parameters(), strict=True):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="train_config"):
        train(TASK, MODEL, TrainConfig(**{**CONFIG.__dict__, "lr": 1e-3}), checkpoint=path, resume=True)


def test_sweep_presets_build_their_tasks_and_summaries_pick_the_best_rate():
    for preset in PRESETS.values():
        for spec in run_specs(preset):
            task_for(spec["task"], spec["seq_len"], preset["tasks"][spec["task"]])
    runs = [
        {"task": "mqar", "seq_len": 8, "mixer": "kda", "lr": lr, "seed": s, "final_acc": acc}
        for lr, s, acc in [(1e-3, 0, 0.5), (1e-3, 1, 0.7), (3e-3, 0, 0.9), (3e-3, 1, 0.6)]
    ]
    (row,) = summarize(runs)
    assert row["best_lr"] == 3e-3 and row["mean"] == pytest.approx(0.75)
    assert (row["min"], row["max"], row["n_seeds"]) == (0.6, 0.9, 2)


def test_cuda_graph_needs_a_cuda_device_and_a_capturable_mixer():
    with pytest.raises(ValueError, match="cuda_graph=True needs a CUDA device"):
        train(TASK, MODEL, TrainConfig(steps=2, cuda_graph=True), progress=False)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="backend='triton'"):  # MODEL: DeltaNet in PyTorch
            train(TASK, MODEL, TrainConfig(steps=2, cuda_graph=True), device="cuda", progress=False)


def test_masked_loss_counts_only_scored_positions():
    """The mask-weighted loss and accuracy equal the plain ones over the scored positions alone."""
    torch.manual_seed(0)
    batch = TASK.sample(8, 5)
    logits = torch.randn(8, TASK.seq_len, TASK.vocab_size)
    loss, acc = masked_loss_and_accuracy(logits, batch)
    scored, target = logits[batch.mask], batch.targets[batch.mask]
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(scored, target), rtol=1e-6)
    assert torch.allclose(acc, (scored.argmax(-1) == target).float().mean())


def test_masked_loss_of_float64_logits_is_float64():
    """float64 logits give a float64 loss and gradient (the gate probe's reference depends on it): within 1e-13
    of the loss computed by hand in float64 (a few hundred float64 terms), while the float32 loss of the same
    logits is off by more than 1e-10 (float32 keeps 24 bits: about 6e-8 of a loss near log 8 ~ 2)."""
    batch = TASK.sample(8, 5)
    logits = torch.randn(
        8, TASK.seq_len, TASK.vocab_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    loss, acc = masked_loss_and_accuracy(logits, batch)
    scored, target = logits[batch.mask], batch.targets[batch.mask]
    by_hand = (scored.logsumexp(-1) - scored.gather(1, target[:, None])[:, 0]).mean()
    assert loss.dtype == acc.dtype == torch.float64
    assert abs(loss.item() - by_hand.item()) < 1e-13
    loss32, _ = masked_loss_and_accuracy(logits.float(), batch)
    assert loss32.dtype == torch.float32 and abs(loss32.item() - by_hand.item()) > 1e-10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("kind", PRESETS["gpu"]["mixers"])
def test_cuda_graph_steps_match_ordinary_steps(kind):
    """A run replayed as CUDA graphs follows the ordinary run: the same losses and accuracies, up to AdamW's
    capturable rounding (the graph must also read every new batch and learning rate, or it would drift).
    Every mixer of the GPU sweep: decay_only once failed every capture there (a value check synced with the
    host inside the graph), which only a run of that mixer shows."""
    mixer = MixerConfig(kind, 2, 16, chunk_size=16, backend="triton")  # KDA through the Triton kernel
    model = RecallConfig(vocab_size=TASK.vocab_size, d_model=32, ffn_hidden=64, mixer=mixer)
    config = TrainConfig(steps=30, batch_size=16, lr=3e-3, warmup=4, eval_every=5, eval_size=64, seed=3)
    runs = [
        train(TASK, model, replace(config, cuda_graph=g), device="cuda", progress=False)
        for g in (False, True)
    ]
    for a, b in zip(runs[0].history, runs[1].history, strict=True):
        assert abs(a["train_loss"] - b["train_loss"]) <= 1e-3 * abs(a["train_loss"]), (a, b)
        assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-3 * abs(a["eval_loss"]), (a, b)


def tiny_preset(lengths: list[int]) -> dict:
    """A two-step sweep of linear attention on MQAR with 4 keys, at the given lengths."""
    return {
        **PRESETS["quick"],
        "train": {"steps": 2, "batch_size": 4, "warmup": 1, "eval_every": 2, "eval_size": 4},
        "tasks": {"mqar": {"lengths": lengths, "pairs_per_token": 1 / 8, "num_keys": 4, "num_values": 4}},
        "mixers": ["linear_attention"],
    }


@pytest.mark.slow
def test_sweep_records_a_failed_run_and_goes_on(tmp_path, monkeypatch):
    """A run that raises is listed under "failed" with its traceback; the other runs are trained and saved,
    and the next invocation tries the failed run again (here it fails again: MQAR at T = 64 needs 8 keys)."""
    monkeypatch.setitem(PRESETS, "tiny", tiny_preset([16, 64]))
    out = tmp_path / "sweep.json"
    for _ in range(2):
        data = run_sweep("tiny", out, workers=1, device="cpu")
        assert [r["seq_len"] for r in data["runs"]] == [16]
        assert [f["seq_len"] for f in data["failed"]] == [64] and "num_keys" in data["failed"][0]["error"]
    assert out.with_suffix(".csv").read_text().count("\n") == 2  # header and the one finished run


@pytest.mark.slow
def test_sweep_skips_cells_and_refuses_a_graph_preset_on_the_cpu(tmp_path, monkeypatch):
    """`skip` leaves (task, length) cells for a later invocation, which then trains them; a preset that
    replays CUDA graphs raises on the CPU before any run starts (instead of every run failing on its own)."""
    tiny = tiny_preset([16, 32])
    monkeypatch.setitem(PRESETS, "tiny", tiny)
    out = tmp_path / "sweep.json"
    data = run_sweep("tiny", out, workers=1, device="cpu", skip=(("mqar", 32),))
    assert [r["seq_len"] for r in data["runs"]] == [16]
    data = run_sweep("tiny", out, workers=1, device="cpu")
    assert [r["seq_len"] for r in data["runs"]] == [16, 32]
    monkeypatch.setitem(PRESETS, "tiny_graph", {**tiny, "train": {**tiny["train"], "cuda_graph": True}})
    with pytest.raises(ValueError, match="needs a CUDA device"):
        run_sweep("tiny_graph", tmp_path / "graph.json", workers=1, device="cpu")
    assert not (tmp_path / "graph.json").exists()


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A checkpoint after 5 steps, its tensors and its metadata."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = tmp_path_factory.mktemp("run") / "run.safetensors"
    train(TASK, MODEL, CONFIG, checkpoint=path, stop_after=5, progress=False)
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    return path, load_file(str(path)), metadata


def _spoil(name, value):
    def change(tensors, metadata):
        tensors[name].view(-1)[0] = value

    return change


BAD_CHECKPOINTS = {
    # each was measured failing later, elsewhere: KeyError: 'exp_avg_sq'; "The size of tensor a (3) must match
    # the size of tensor b (32)"; ZeroDivisionError: float division by zero; the gate check's "beta ... got
    # values in [nan, nan]"; KeyError: 'history'; RuntimeError: Error(s) in loading state_dict
    "missing_exp_avg_sq": (
        lambda t, m: t.pop("optim.0.exp_avg_sq"),
        r"parameter 0 lacks optim\.0\.exp_avg_sq \(each parameter with a state needs \['exp_avg', 'exp_avg_sq', 'step'\]\)",
    ),
    "exp_avg_wrong_shape": (
        lambda t, m: t.update({"optim.0.exp_avg": torch.zeros(3)}),
        r"optim\.0\.exp_avg must be a floating tensor of its parameter's shape \[9, 32\], got \[3\]",
    ),
    "step_negative": (
        lambda t, m: t.update({"optim.0.step": torch.tensor(-1.0)}),
        r"optim\.0\.step must be one whole number in \[1, 5\] .* got -1\.0",
    ),
    "step_past_the_checkpoint": (
        lambda t, m: t.update({"optim.2.step": torch.tensor(6.0)}),
        r"optim\.2\.step must be one whole number in \[1, 5\]",
    ),
    "step_fraction": (
        lambda t, m: t.update({"optim.2.step": torch.tensor(2.5)}),
        r"optim\.2\.step .* got 2\.5",
    ),
    "nan_moment": (_spoil("optim.1.exp_avg", float("nan")), r"optim\.1\.exp_avg holds NaN or inf \(1 of "),
    "inf_second_moment": (
        _spoil("optim.1.exp_avg_sq", float("inf")),
        r"optim\.1\.exp_avg_sq holds NaN or inf",
    ),
    "negative_second_moment": (
        _spoil("optim.1.exp_avg_sq", -1.0),
        r"optim\.1\.exp_avg_sq \(a second moment\) must be >= 0, got min -1\.0",
    ),
    "unknown_optimizer_key": (
        lambda t, m: t.update({"optim.0.momentum_buffer": torch.zeros(1)}),
        r"unexpected optimizer tensor 'optim\.0\.momentum_buffer'",
    ),
    "parameter_index_out_of_range": (
        lambda t, m: t.update({"optim.99.step": torch.tensor(1.0)}),
        r"unexpected optimizer tensor 'optim\.99\.step'; expected optim\.<i>\.<key> with i a parameter index",
    ),
    "missing_model_tensor": (
        lambda t, m: t.pop("model.blocks.0.ffn.down_proj.weight"),
        r"does not match the model; missing tensors: model\.blocks\.0\.ffn\.down_proj\.weight",
    ),
    "nan_model_weight": (
        _spoil("model.blocks.0.ffn.down_proj.weight", float("nan")),
        r"holds NaN or inf values in tensors: model\.blocks\.0\.ffn\.down_proj\.weight \(1 of ",
    ),
    "no_history": (lambda t, m: m.pop("history"), "has no valid JSON metadata 'history'"),
    "step_not_a_number": (lambda t, m: m.update(step="five"), "has no valid JSON metadata 'step'"),
    "step_out_of_range": (lambda t, m: m.update(step="-1"), r"metadata 'step' must be an int in \[0, 20\]"),
}


@pytest.mark.parametrize("case", BAD_CHECKPOINTS, ids=list(BAD_CHECKPOINTS))
def test_resuming_from_a_bad_checkpoint_names_the_file_and_the_tensor(saved_run, tmp_path, case):
    """Every defect is a CheckpointError (a ValueError) naming the file and what was expected, raised before
    the model or the optimizer is touched."""
    from safetensors.torch import save_file

    from kda_edu.models.checkpoint import CheckpointError
    from kda_edu.training.train import build_model, load_training_checkpoint

    _, tensors, metadata = saved_run
    tensors, metadata = {k: v.clone() for k, v in tensors.items()}, dict(metadata)
    change, message = BAD_CHECKPOINTS[case]
    change(tensors, metadata)
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(CheckpointError, match=message) as info:
        train(TASK, MODEL, CONFIG, checkpoint=path, resume=True, stop_after=6, progress=False)
    assert str(path) in str(info.value)
    model = build_model(MODEL, 0)
    optimizer = make_optimizer(model, CONFIG)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError):
        load_training_checkpoint(path, model, optimizer, TASK, MODEL, CONFIG)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and not optimizer.state


def test_a_truncated_training_checkpoint_is_a_value_error_naming_the_file(saved_run, tmp_path):
    """It used to raise safetensors' own SafetensorError ("incomplete metadata, file not fully covered"),
    which names no file and is not the ValueError the docstring promises."""
    data = saved_run[0].read_bytes()
    for size in (len(data) // 2, 7):
        path = tmp_path / f"cut{size}.safetensors"
        path.write_bytes(data[:size])
        with pytest.raises(ValueError, match=f"{path} is not a complete safetensors file"):
            train(TASK, MODEL, CONFIG, checkpoint=path, resume=True, progress=False)
