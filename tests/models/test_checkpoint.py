"""Checkpoints: a safetensors round trip, and a clear error for every way a file can be unusable."""

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kda_edu.layers.ffn import FFNConfig
from kda_edu.layers.kda_layer import KDAConfig
from kda_edu.layers.mla import MLAConfig
from kda_edu.models.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_weights,
    read_checkpoint,
    save_checkpoint,
)
from kda_edu.models.model import HybridConfig, HybridLM


def tiny_model(seed: int = 0, **overrides) -> HybridLM:
    torch.manual_seed(seed)
    config = dict(
        vocab_size=40,
        d_model=16,
        n_layers=4,
        kda=KDAConfig(num_heads=2, head_dim=8, chunk_size=8),
        mla=MLAConfig(num_heads=2, kv_rank=8, qk_head_dim=8, v_head_dim=8, output_gate=True),
        ffn=FFNConfig(hidden=24),
    )
    return HybridLM(HybridConfig(**{**config, **overrides}))


@pytest.fixture
def saved(tmp_path):
    model = tiny_model()
    path = tmp_path / "model.safetensors"
    save_checkpoint(model, path)
    return model, path


def rewrite(path, out, change):
    """Copy a checkpoint with its tensors changed by `change(tensors)`, metadata kept."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(out), metadata=metadata)
    return out


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_embeddings": False, "ffn": FFNConfig(num_experts=3, top_k=2, expert_hidden=8)}],
    ids=["tied", "untied-moe"],
)
def test_round_trip_gives_the_same_model(tmp_path, overrides):
    model = tiny_model(**overrides)
    path = tmp_path / "m.safetensors"
    save_checkpoint(model, path)
    loaded = load_checkpoint(path)
    assert loaded.config == model.config
    x = torch.randint(0, 40, (2, 7))
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    if model.config.tie_embeddings:
        assert loaded.lm_head.weight is loaded.embed.weight


def test_tied_weight_is_stored_once(saved):
    _, path = saved
    assert "embed.weight" in load_file(str(path)) and "lm_head.weight" not in load_file(str(path))


def test_load_weights_into_an_existing_model(saved):
    model, path = saved
    other = tiny_model(seed=5)
    load_weights(other, path)
    for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_pickle_is_not_accepted(tmp_path):
    path = tmp_path / "model.pt"
    torch.save(tiny_model().state_dict(), path)
    with pytest.raises(CheckpointError, match="is not a safetensors file"):
        load_checkpoint(path)


def test_garbage_and_missing_files(tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"\x00\x01 definitely not a checkpoint")
    with pytest.raises(CheckpointError, match="is not a safetensors file"):
        read_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="no checkpoint file at"):
        read_checkpoint(tmp_path / "absent.safetensors")


def test_safetensors_without_our_metadata(tmp_path):
    path = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(CheckpointError, match="not a kda_edu checkpoint"):
        load_checkpoint(path)


def test_invalid_config_in_metadata(tmp_path):
    path = tmp_path / "bad.safetensors"
    bad = {**tiny_model().config.to_dict(), "n_heads": 3}
    save_file(
        {"w": torch.zeros(2)}, str(path), metadata={"format": "kda_edu.HybridLM", "config": json.dumps(bad)}
    )
    with pytest.raises(
        CheckpointError, match=r"invalid config: HybridConfig has unknown fields \['n_heads'\]"
    ):
        load_checkpoint(path)


def test_missing_extra_and_misshapen_tensors_are_named(saved, tmp_path):
    _, path = saved
    missing = rewrite(path, tmp_path / "a.safetensors", lambda t: t.pop("blocks.3.mixer.kv_down.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: blocks\.3\.mixer\.kv_down\.weight"):
        load_checkpoint(missing)
    extra = rewrite(path, tmp_path / "b.safetensors", lambda t: t.update(extra_bias=torch.zeros(3)))
    with pytest.raises(CheckpointError, match="unexpected tensors: extra_bias"):
        load_checkpoint(extra)

    def shrink(t):
        t["blocks.0.mixer.A_log"] = torch.zeros(3)

    wrong = rewrite(path, tmp_path / "c.safetensors", shrink)
    with pytest.raises(
        CheckpointError, match=r"wrong shape: blocks\.0\.mixer\.A_log \(model \[2\], checkpoint \[3\]\)"
    ):
        load_checkpoint(wrong)


def test_loading_into_a_model_with_another_config(saved):
    _, path = saved
    other = tiny_model(kda=KDAConfig(num_heads=2, head_dim=8, chunk_size=8, gate="lower_bound"))
    with pytest.raises(
        CheckpointError, match="different config; kda.gate: model 'lower_bound', checkpoint 'softplus'"
    ):
        load_weights(other, path)


def test_save_pretrained_writes_a_config_json_beside_the_weights(tmp_path):
    from kda_edu.models.checkpoint import from_pretrained, save_pretrained

    model = tiny_model(seed=5, layer_pattern="KA", kda=KDAConfig(num_heads=2, head_dim=8, gate="lower_bound"))
    save_pretrained(model, tmp_path / "run")
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["format"] == "kda_edu.HybridLM" and config["layer_pattern"] == "KA"
    assert config["kda"]["gate"] == "lower_bound"
    loaded = from_pretrained(tmp_path / "run")
    assert loaded.config == model.config
    x = torch.randint(0, 40, (2, 9))
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)  # same weights, same code, same order


def test_from_pretrained_names_what_is_wrong(tmp_path):
    from kda_edu.models.checkpoint import from_pretrained, save_pretrained

    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_pretrained(tmp_path)
    save_pretrained(tiny_model(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_layers": 2}))
    with pytest.raises(CheckpointError, match="n_layers: model 2, checkpoint 4"):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "format": "other"}))
    with pytest.raises(CheckpointError, match="not a valid kda_edu config"):
        from_pretrained(tmp_path)


def same_weights(a: HybridLM, b: HybridLM) -> bool:
    return a.config == b.config and all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_or_inf_weights_are_refused_and_named(tmp_path, value):
    """A NaN weight used to load silently (the first forward then blamed the gate)."""
    from kda_edu.models.checkpoint import from_pretrained, save_pretrained

    save_pretrained(tiny_model(), tmp_path)
    path = tmp_path / "model.safetensors"

    def spoil(t):
        t["blocks.1.mixer.q_proj.weight"][2, 3] = value
        t["norm.weight"][:2] = -value

    rewrite(path, path, spoil)
    match = (
        r"model\.safetensors holds NaN or inf values in tensors: .*blocks\.1\.mixer\.q_proj\.weight \(1 of "
    )
    with pytest.raises(CheckpointError, match=match):
        from_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"norm\.weight \(2 of 16\)"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="NaN or inf"):
        load_weights(tiny_model(), path)


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda c: c.update(n_layers=4.0), "HybridConfig.n_layers must be int, got 4.0 (float)"),
        (lambda c: c.update(d_model="16"), "HybridConfig.d_model must be int, got '16' (str)"),
        (lambda c: c.update(tie_embeddings=1), "HybridConfig.tie_embeddings must be bool, got 1 (int)"),
        (lambda c: c["kda"].update(num_heads=2.0), "HybridConfig.kda.num_heads must be int, got 2.0"),
        (lambda c: c["kda"].update(num_v_heads=[2]), "HybridConfig.kda.num_v_heads must be int or None"),
    ],
)
def test_config_json_values_of_the_wrong_type_are_a_checkpoint_error(tmp_path, change, words):
    """`"n_layers": 4.0` used to escape as a raw TypeError ("'float' object cannot be interpreted as an
    integer") from building the model."""
    from kda_edu.models.checkpoint import from_pretrained, save_pretrained

    save_pretrained(tiny_model(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    change(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError, match="config.json is not a valid kda_edu config: " + re.escape(words)
    ):
        from_pretrained(tmp_path)
    assert (
        HybridConfig.from_dict({**tiny_model().config.to_dict(), "norm_eps": 1}).norm_eps == 1
    )  # int for float


def test_a_failed_save_pretrained_leaves_the_previous_save(tmp_path, monkeypatch):
    """An exception while the weights or the config are written: the previous save still loads and no
    temporary file is left. (Writing config.json in place first used to leave the new config beside the
    old weights: "was saved from a different config; n_layers: model 2, checkpoint 4".)"""
    from kda_edu.models import checkpoint

    old, new = tiny_model(0), tiny_model(1, n_layers=2)
    checkpoint.save_pretrained(old, tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")  # someone else's file: left alone

    def crash(*args, **kwargs):
        raise RuntimeError("crash while writing")

    monkeypatch.setattr(checkpoint, "save_file", crash)
    with pytest.raises(RuntimeError, match="crash while writing"):
        checkpoint.save_pretrained(new, tmp_path)
    monkeypatch.undo()
    assert same_weights(checkpoint.from_pretrained(tmp_path), old)

    monkeypatch.setattr(Path, "write_text", crash)
    with pytest.raises(RuntimeError, match="crash while writing"):
        checkpoint.save_pretrained(new, tmp_path)
    monkeypatch.undo()
    assert same_weights(checkpoint.from_pretrained(tmp_path), old)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]


def test_a_save_pretrained_stopped_between_its_renames_loads_the_new_model(tmp_path, monkeypatch):
    """The weights are renamed into place, the config is not: the directory holds the new weights beside the
    old config.json, and from_pretrained takes the new config from its fully written temporary file."""
    from kda_edu.models import checkpoint

    old, new = tiny_model(0), tiny_model(1, n_layers=2)
    checkpoint.save_pretrained(old, tmp_path)
    renames, replace = [], os.replace

    def replace_once(src, dst):
        if renames:
            raise RuntimeError("crash between the renames")
        renames.append(dst)
        replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_once)
    with pytest.raises(RuntimeError, match="between the renames"):
        checkpoint.save_pretrained(new, tmp_path)
    monkeypatch.undo()
    assert [Path(p).name for p in renames] == ["model.safetensors"]
    assert json.loads((tmp_path / "config.json").read_text())["n_layers"] == 4  # still the old config.json
    assert same_weights(checkpoint.from_pretrained(tmp_path), new)
    checkpoint.save_pretrained(new, tmp_path)  # the next save completes the directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert same_weights(checkpoint.from_pretrained(tmp_path), new)


CHILD = """
import os, signal, sys
sys.path[:0] = [{root!r}, {tests!r}]
from kda_edu.models import checkpoint
from test_checkpoint import tiny_model

write = checkpoint.save_file

def write_then_die(*args, **kwargs):  # SIGKILL right after the new weights reach the disk
    write(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)

checkpoint.save_file = write_then_die
checkpoint.save_pretrained(tiny_model(1, n_layers=2), {directory!r})
"""


def test_save_pretrained_killed_mid_save_leaves_a_directory_that_loads(tmp_path):
    """A process SIGKILLed inside save_pretrained, once the new weights are written: the previous save
    loads. (Writing in place, the directory held the new config.json and the old weights: refused.)"""
    import signal
    import subprocess
    import sys

    from kda_edu.models.checkpoint import from_pretrained, save_pretrained

    old = tiny_model(0)
    save_pretrained(old, tmp_path)
    here = Path(__file__).parent
    code = CHILD.format(root=str(here.parents[1]), tests=str(here), directory=str(tmp_path))
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert same_weights(from_pretrained(tmp_path), old)


LOOP = """
import sys
sys.path[:0] = [{root!r}, {tests!r}]
from kda_edu.models.checkpoint import save_pretrained
from test_checkpoint import tiny_model

models = [tiny_model(0), tiny_model(1, n_layers=2)]
save_pretrained(models[0], {directory!r})
print("saved", flush=True)
i = 1
while True:
    save_pretrained(models[i % 2], {directory!r})
    i += 1
"""


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.3])
def test_save_pretrained_killed_at_any_moment_leaves_one_of_the_saves(tmp_path, delay):
    """A process saving two models in turn, SIGKILLed at an arbitrary moment: the directory loads, as one
    of the two."""
    import subprocess
    import sys
    import time

    from kda_edu.models.checkpoint import from_pretrained

    here = Path(__file__).parent
    code = LOOP.format(root=str(here.parents[1]), tests=str(here), directory=str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "saved"
        time.sleep(delay)
    finally:
        child.kill()
        child.wait(timeout=60)
    loaded = from_pretrained(tmp_path)
    assert same_weights(loaded, tiny_model(0)) or same_weights(loaded, tiny_model(1, n_layers=2))


def test_save_checkpoint_is_atomic(saved, monkeypatch):
    """A failed save_checkpoint leaves the previous file whole and no temporary file behind."""
    from kda_edu.models import checkpoint

    model, path = saved

    def crash(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise RuntimeError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(tiny_model(1), path)
    monkeypatch.undo()
    assert same_weights(load_checkpoint(path), model)
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.safetensors"]


def test_a_first_save_pretrained_stopped_between_its_renames_loads(tmp_path, monkeypatch):
    """No previous save: the weights are in place, config.json only in its temporary file."""
    from kda_edu.models import checkpoint

    model, replace = tiny_model(2), os.replace

    def replace_weights_only(src, dst):
        if Path(dst).name != "model.safetensors":
            raise RuntimeError("crash before the config's rename")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_weights_only)
    with pytest.raises(RuntimeError, match="crash before"):
        checkpoint.save_pretrained(model, tmp_path / "new")
    monkeypatch.undo()
    assert not (tmp_path / "new" / "config.json").exists()
    assert same_weights(checkpoint.from_pretrained(tmp_path / "new"), model)
