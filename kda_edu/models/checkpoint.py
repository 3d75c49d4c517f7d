"""Save and load a `HybridLM` as one safetensors file: the tensors, plus the config as JSON in its metadata.

safetensors stores raw tensor bytes behind a JSON header, so loading a checkpoint never runs code (unlike a
pickle from `torch.save`). A checkpoint that cannot be used raises a `CheckpointError` that says why: not a
safetensors file, not a kda_edu checkpoint, a config that does not parse, tensors missing, unexpected or of
the wrong shape, or (for `load_weights`) a config that differs from the model's.

A tied output projection shares its storage with the embedding, so it is stored once, under the embedding's
name.

`save_pretrained(model, directory)` / `from_pretrained(directory)` keep the layout of Hugging Face model
directories: `config.json` (the `HybridConfig`, readable without any library) beside `model.safetensors` (the
checkpoint above). `from_pretrained` builds the model from `config.json` and refuses a `model.safetensors`
whose own config differs from it.
"""

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kda_edu.models.model import HybridConfig, HybridLM

FORMAT = "kda_edu.HybridLM"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be loaded, with the reason."""


def save_checkpoint(model: HybridLM, path: str | os.PathLike) -> None:
    """Write the model's tensors and config to `path` (a `.safetensors` file).

    Args:
        model: the `HybridLM` to save.
        path: the file to write; it is overwritten if it exists.
    """
    if not isinstance(model, HybridLM):
        raise TypeError(f"model must be a HybridLM, got {type(model).__name__}")
    tensors = {name: t.detach().cpu().contiguous() for name, t in _stored_tensors(model).items()}
    metadata = {"format": FORMAT, "config": json.dumps(model.config.to_dict())}
    save_file(tensors, str(path), metadata=metadata)


def read_checkpoint(path: str | os.PathLike) -> tuple[HybridConfig, dict[str, torch.Tensor]]:
    """The config and the tensors (on the CPU) stored in a checkpoint, without building a model.

    Raises:
        FileNotFoundError: no file at `path`.
        CheckpointError: the file is not a safetensors file, or not a kda_edu checkpoint, or its config is
            invalid.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint file at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as e:
        raise CheckpointError(f"{path} is not a safetensors file ({e})") from e
    if metadata.get("format") != FORMAT or "config" not in metadata:
        raise CheckpointError(
            f"{path} is a safetensors file but not a kda_edu checkpoint: its metadata needs "
            f"format = {FORMAT!r} and a config, got keys {sorted(metadata)}"
        )
    try:
        config = HybridConfig.from_dict(json.loads(metadata["config"]))
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path} holds an invalid config: {e}") from e
    return config, tensors


def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu") -> HybridLM:
    """Build the model a checkpoint describes and load its weights.

    Args:
        path: a file written by `save_checkpoint`.
        device: where to put the model.

    Returns:
        The `HybridLM`, in float32 parameters (the stored values converted if they were saved in another
        dtype), on `device`.
    """
    config, tensors = read_checkpoint(path)
    model = HybridLM(config)
    _load_tensors(model, tensors, path)
    return model.to(device)


def load_weights(model: HybridLM, path: str | os.PathLike) -> None:
    """Load a checkpoint's weights into an existing model with the same config (in place).

    Raises:
        CheckpointError: the checkpoint's config differs from `model.config` (the differing fields are
            named), or its tensors do not match the model's.
    """
    if not isinstance(model, HybridLM):
        raise TypeError(f"model must be a HybridLM, got {type(model).__name__}")
    config, tensors = read_checkpoint(path)
    if config != model.config:
        ours, theirs = _flatten(model.config.to_dict()), _flatten(config.to_dict())
        diffs = [
            f"{k}: model {ours.get(k)!r}, checkpoint {theirs.get(k)!r}"
            for k in ours
            if ours[k] != theirs.get(k)
        ]
        raise CheckpointError(f"{path} was saved from a different config; " + "; ".join(diffs))
    _load_tensors(model, tensors, path)


def _stored_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every shared tensor (a tied weight) kept once, under its first name."""
    stored, seen = {}, set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape), t.stride())
        if key not in seen:
            seen.add(key)
            stored[name] = t
    return stored


def _load_tensors(model: HybridLM, tensors: dict[str, torch.Tensor], path) -> None:
    """Check names and shapes against the model, then copy the values in."""
    expected = {name: tuple(t.shape) for name, t in _stored_tensors(model).items()}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong_shape = [
        f"{name} (model {list(shape)}, checkpoint {list(tensors[name].shape)})"
        for name, shape in expected.items()
        if name in tensors and tuple(tensors[name].shape) != shape
    ]
    problems = []
    for what, names in (("missing tensors", missing), ("unexpected tensors", unexpected)):
        if names:
            problems.append(f"{what}: {', '.join(names)}")
    if wrong_shape:
        problems.append(f"tensors of the wrong shape: {', '.join(wrong_shape)}")
    if problems:
        raise CheckpointError(f"{path} does not match the model; " + "; ".join(problems))
    model.load_state_dict(tensors, strict=False)  # only tied aliases are absent, and they share storage


def _flatten(d: dict, prefix: str = "") -> dict:
    """{"kda": {"num_heads": 2}} -> {"kda.num_heads": 2}."""
    flat = {}
    for k, v in d.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"


def save_pretrained(model: HybridLM, directory: str | os.PathLike) -> None:
    """Write `directory/config.json` and `directory/model.safetensors` (creating the directory if needed,
    overwriting both files)."""
    if not isinstance(model, HybridLM):
        raise TypeError(f"model must be a HybridLM, got {type(model).__name__}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_NAME).write_text(
        json.dumps({"format": FORMAT, **model.config.to_dict()}, indent=2) + "\n"
    )
    save_checkpoint(model, directory / WEIGHTS_NAME)


def from_pretrained(directory: str | os.PathLike, device: str | torch.device = "cpu") -> HybridLM:
    """The `HybridLM` that `save_pretrained` wrote to `directory`, on `device`.

    Raises:
        FileNotFoundError: `config.json` or `model.safetensors` is missing.
        CheckpointError: config.json is not a kda_edu config, or the weights were saved from another config.
    """
    directory = Path(directory)
    config_path = directory / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in {directory}")
    try:
        d = json.loads(config_path.read_text())
        if not isinstance(d, dict) or d.pop("format", None) != FORMAT:
            raise ValueError(f'it needs "format": {FORMAT!r}')
        config = HybridConfig.from_dict(d)
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{config_path} is not a valid kda_edu config: {e}") from e
    model = HybridLM(config)
    load_weights(model, directory / WEIGHTS_NAME)
    return model.to(device)
