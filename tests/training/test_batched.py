"""Copies trained together by `train_batched` are the runs `train` trains one by one, copy by copy."""

from dataclasses import replace

import pytest
import torch

from kda_edu.layers.mixers import MixerConfig
from kda_edu.models.recall import RecallConfig
from kda_edu.training.batched import check_batchable, copy_configs, train_batched
from kda_edu.training.sweep import PRESETS, run_batched, run_one, run_sweep
from kda_edu.training.tasks import MQAR
from kda_edu.training.train import TrainConfig, train

TASK = MQAR(seq_len=16, num_pairs=2, num_keys=4, num_values=4)
# grad_clip small enough that every step clips, so that clipping the copies together (one norm over all of
# them) instead of one by one would show; a large weight decay, so that decaying a parameter the single run
# leaves alone (or the reverse) would show.
BASE = TrainConfig(
    steps=6, batch_size=4, warmup=2, eval_every=3, eval_size=10, grad_clip=0.05, weight_decay=0.5
)
SEEDS, LRS = [0, 1, 2], [1e-2, 3e-3, 3e-2]


def model_config(kind: str) -> RecallConfig:
    mixer = MixerConfig(kind, num_heads=2, head_dim=8, gate_rank=4, chunk_size=8)
    return RecallConfig(vocab_size=TASK.vocab_size, d_model=16, n_layers=2, ffn_hidden=16, mixer=mixer)


@pytest.fixture
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.mark.parametrize("kind", ["kda", "gated_deltanet", "attention"])
def test_copies_match_separate_runs_in_float64(kind, float64):
    """Each copy's parameters, training losses, evaluation losses and accuracies, learning rates and steps agree
    with a separate `train` run of its seed and rate to 1e-9. A rate, seed, data seed or clipping norm shared
    between the copies, a decay on the gate parameters or a missed warm-up would each move a copy off its run."""
    configs = copy_configs(BASE, SEEDS, LRS)
    together = train_batched(TASK, model_config(kind), configs)
    assert len(together) == len(configs)
    for config, batched in zip(configs, together, strict=True):
        alone = train(TASK, model_config(kind), config, progress=False)
        named = dict(alone.model.named_parameters())
        for name, p in batched.model.named_parameters():
            assert p.dtype == torch.float64
            torch.testing.assert_close(
                p, named[name], rtol=0, atol=1e-9, msg=f"{kind} seed {config.seed}: {name}"
            )
        assert [h["step"] for h in batched.history] == [h["step"] for h in alone.history] == [3, 6]
        for b, a in zip(batched.history, alone.history, strict=True):
            assert b["lr"] == a["lr"]
            for key in ("train_loss", "eval_loss", "eval_acc"):
                assert b[key] == pytest.approx(a[key], abs=1e-9, rel=0), (kind, config.seed, key)
    # the copies did train apart: different rates and seeds give different models
    first, second = (dict(r.model.named_parameters()) for r in together[:2])
    assert all(not torch.equal(first[n], second[n]) for n in first)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="2 seeds and 3 lrs"):
        copy_configs(BASE, [0, 1], LRS)
    with pytest.raises(ValueError, match="at least one copy"):
        copy_configs(BASE, [], [])
    with pytest.raises(ValueError, match="M = 0"):
        train_batched(TASK, model_config("attention"), [])
    with pytest.raises(ValueError, match=r"differs from configs\[0\] in \['steps'\]"):
        train_batched(TASK, model_config("attention"), [BASE, replace(BASE, steps=7)])
    with pytest.raises(ValueError, match="CUDA graphs"):
        check_batchable(model_config("attention"), [replace(BASE, cuda_graph=True)], "cpu")
    triton = replace(model_config("kda"), mixer=replace(model_config("kda").mixer, backend="triton"))
    with pytest.raises(ValueError, match="backend='torch'"):
        check_batchable(triton, [BASE], "cpu")
    # the kinds without a kernel batch under any backend
    check_batchable(replace(triton, mixer=replace(triton.mixer, kind="attention")), [BASE], "cpu")


def test_a_sweep_trains_the_seeds_and_rates_of_a_cell_as_one_batched_run(tmp_path, monkeypatch):
    """`run_sweep(batched=4)` hands the 4 runs of its one cell (2 seeds x 2 rates) to one worker as one batched
    run; each record is the record `run_one` writes for that run (float32, two steps: to 1e-5) and says so."""
    tiny = {
        **PRESETS["quick"],
        "train": {"steps": 2, "batch_size": 4, "warmup": 1, "eval_every": 2, "eval_size": 4},
        "tasks": {"mqar": {"lengths": [16], "pairs_per_token": 1 / 8, "num_keys": 4, "num_values": 4}},
        "mixers": ["linear_attention"],
        "seeds": [0, 1],
        "lrs": [2e-3, 5e-3],
    }
    monkeypatch.setitem(PRESETS, "tiny", tiny)
    with pytest.raises(ValueError, match="not both"):
        run_sweep("tiny", tmp_path / "no.json", device="cpu", batched=2, together=2)
    with pytest.raises(ValueError, match="batched must be an int >= 1"):
        run_sweep("tiny", tmp_path / "no.json", device="cpu", batched=0)
    data = run_sweep("tiny", tmp_path / "sweep.json", workers=1, device="cpu", batched=4)
    assert data["invocations"][-1]["batched"] == 4 and len(data["runs"]) == 4
    assert len({r["invocation"] for r in data["runs"]}) == 1
    for record in data["runs"]:
        assert record["batched"] == 4
        spec = {k: record[k] for k in ("task", "seq_len", "mixer", "lr", "seed")}
        alone = run_one(tiny, spec)
        assert record["train_config"] == alone["train_config"]
        for a, b in zip(record["history"], alone["history"], strict=True):
            for key in ("train_loss", "eval_loss", "eval_acc"):
                assert a[key] == pytest.approx(b[key], abs=1e-5), (spec, key)
    with pytest.raises(ValueError, match="one task, length and mixer"):
        run_batched(tiny, [{**spec, "mixer": "kda"}, spec])
