"""Checkpoints: a safetensors round trip, and a clear error for every way a file can be unusable."""

import json

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
    from kda_edu.models.checkpoint import from_pretrained

    model = tiny_model(seed=5, layer_pattern="KA", kda=KDAConfig(num_heads=2, head_dim=8, gate="lower_bound"))
    model.save_pretrained(tmp_path / "run")
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["format"] == "kda_edu.HybridLM" and config["layer_pattern"] == "KA"
    assert config["kda"]["gate"] == "lower_bound"
    loaded = HybridLM.from_pretrained(tmp_path / "run")
    assert loaded.config == model.config
    x = torch.randint(0, 40, (2, 9))
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)  # same weights, same code, same order
    assert from_pretrained(tmp_path / "run").config == model.config


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
