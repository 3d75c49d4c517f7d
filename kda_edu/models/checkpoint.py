"""Save and load a `HybridLM` as one safetensors file: the tensors, plus the config as JSON in its metadata.

safetensors stores raw tensor bytes behind a JSON header, so loading a checkpoint never runs code (unlike a
pickle from `torch.save`). A checkpoint that cannot be used raises a `CheckpointError` that says why: not a
safetensors file, not a kda_edu checkpoint, a config that does not parse or holds a value of the wrong type,
tensors missing, unexpected, of the wrong shape or holding NaN or inf, or (for `load_weights`) a config that
differs from the model's.

Saving is atomic: every file is written beside its destination under a temporary name, flushed to disk and
then renamed over it (`atomic_write`), so a crash at any moment (an exception, SIGKILL, a power cut) leaves
either the previous file or the new one, never a partial one.

A tied output projection shares its storage with the embedding, so it is stored once, under the embedding's
name.

`save_pretrained(model, directory)` / `from_pretrained(directory)` keep the layout of Hugging Face model
directories: `config.json` (the `HybridConfig`, readable without any library) beside `model.safetensors` (the
checkpoint above). `from_pretrained` builds the model from `config.json` and refuses a `model.safetensors`
whose own config differs from it. `save_pretrained` writes both new files under temporary names before it
renames either; between its two renames the directory holds the new weights and the old `config.json`, and
`from_pretrained` then takes the new config from its fully written temporary file, so a crash at any point
leaves a directory that loads, as the previous save or the new one.
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
    atomic_write(path, lambda tmp: _write_checkpoint(model, tmp))


def _write_checkpoint(model: HybridLM, path: Path) -> None:
    tensors = {name: t.detach().cpu().contiguous() for name, t in _stored_tensors(model).items()}
    metadata = {"format": FORMAT, "config": json.dumps(model.config.to_dict())}
    save_file(tensors, str(path), metadata=metadata)


def atomic_write(path: str | os.PathLike, write) -> None:
    """Replace the file `path` by what `write(tmp)` writes to the path `tmp`, atomically: a crash at any
    moment leaves the old file or the new one at `path`, never a partial one.

    `tmp` is `.<name>.tmp` in the same directory (a rename within one file system is atomic); it is flushed
    to disk (fsync) before it is renamed over `path`, and the directory after, so the new file also survives
    a power cut. If `write` raises, `tmp` is removed and `path` is left as it was.
    """
    path = Path(path)
    os.replace(_write_pending(path, write), path)
    _fsync_directory(path.parent)


def _pending(path: Path) -> Path:
    """Where the next version of `path` is written before it is renamed over `path`."""
    return path.with_name(f".{path.name}.tmp")


def _write_pending(path: Path, write) -> Path:
    """Write the next version of `path` to `_pending(path)` through `write`, flush it to disk and return that
    temporary path (removed again if anything fails)."""
    tmp = _pending(path)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _fsync_directory(directory: Path) -> None:
    """Flush a directory's entries (its renames) to disk, where the system lets a directory be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # Windows cannot open a directory; its renames are durable on their own
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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


def _build(config: HybridConfig, path) -> HybridLM:
    """The model of a config read from `path`; a config that passes its own checks but cannot build a model
    is the file's fault, so its error is a CheckpointError naming the file."""
    try:
        return HybridLM(config)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path} holds a config that does not build a model: {e}") from e


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
    model = _build(config, path)
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
    _require_same_config(model.config, config, path)
    _load_tensors(model, tensors, path)


def _require_same_config(ours: HybridConfig, theirs: HybridConfig, path) -> None:
    if theirs != ours:
        a, b = _flatten(ours.to_dict()), _flatten(theirs.to_dict())
        diffs = [f"{k}: model {a.get(k)!r}, checkpoint {b.get(k)!r}" for k in a if a[k] != b.get(k)]
        raise CheckpointError(f"{path} was saved from a different config; " + "; ".join(diffs))


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
    """Check names, shapes and values against the model, then copy the values in."""
    check_tensors(model, tensors, path)
    model.load_state_dict(tensors, strict=False)  # only tied aliases are absent, and they share storage


def check_tensors(
    model: torch.nn.Module, tensors: dict[str, torch.Tensor], path, prefix: str = "", tied_once: bool = True
) -> None:
    """Raise a `CheckpointError` naming `path` unless `tensors` hold exactly the model's state dict (a tied
    weight once, under its first name, with `tied_once`), each of the model's shape and without NaN or inf.
    Tensor names in the message get `prefix` (the file's names for them)."""
    state = _stored_tensors(model) if tied_once else model.state_dict()
    expected = {name: tuple(t.shape) for name, t in state.items()}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong_shape = [
        f"{prefix}{name} (model {list(shape)}, checkpoint {list(tensors[name].shape)})"
        for name, shape in expected.items()
        if name in tensors and tuple(tensors[name].shape) != shape
    ]
    problems = []
    for what, names in (("missing tensors", missing), ("unexpected tensors", unexpected)):
        if names:
            problems.append(f"{what}: {', '.join(prefix + name for name in names)}")
    if wrong_shape:
        problems.append(f"tensors of the wrong shape: {', '.join(wrong_shape)}")
    if problems:
        raise CheckpointError(f"{path} does not match the model; " + "; ".join(problems))
    nonfinite = [
        f"{prefix}{name} ({int((~torch.isfinite(t)).sum())} of {t.numel()})"
        for name, t in tensors.items()
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]
    if nonfinite:
        raise CheckpointError(f"{path} holds NaN or inf values in tensors: {', '.join(nonfinite)}")


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
    replacing both files and leaving any other file in it alone).

    Both new files are written under temporary names and flushed to disk first; then the weights are renamed
    over `model.safetensors` and the config over `config.json`. A crash before the first rename leaves the
    previous save; a crash between the two leaves the new weights beside the old config.json and the new
    config in its temporary file, which `from_pretrained` reads in that case (see `_read_pretrained_config`).
    """
    if not isinstance(model, HybridLM):
        raise TypeError(f"model must be a HybridLM, got {type(model).__name__}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights_path, config_path = directory / WEIGHTS_NAME, directory / CONFIG_NAME
    text = json.dumps({"format": FORMAT, **model.config.to_dict()}, indent=2) + "\n"
    weights = _write_pending(weights_path, lambda tmp: _write_checkpoint(model, tmp))
    try:
        config = _write_pending(config_path, lambda tmp: tmp.write_text(text))
    except BaseException:
        weights.unlink(missing_ok=True)
        raise
    os.replace(weights, weights_path)
    _fsync_directory(directory)
    os.replace(config, config_path)
    _fsync_directory(directory)


def from_pretrained(directory: str | os.PathLike, device: str | torch.device = "cpu") -> HybridLM:
    """The `HybridLM` that `save_pretrained` wrote to `directory`, on `device`.

    Raises:
        FileNotFoundError: `config.json` or `model.safetensors` is missing.
        CheckpointError: config.json is not a valid kda_edu config, or the weights were saved from another
            config, or do not fit it, or hold NaN or inf.
    """
    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    pending = _pending(config_path)
    if not config_path.is_file() and not pending.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in {directory}")
    if not weights_path.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_NAME} in {directory}")
    saved, tensors = read_checkpoint(weights_path)
    config = _read_pretrained_config(config_path, saved)
    _require_same_config(config, saved, weights_path)
    model = _build(config, config_path)
    _load_tensors(model, tensors, weights_path)
    return model.to(device)


def _read_pretrained_config(config_path: Path, saved: HybridConfig) -> HybridConfig:
    """config.json's config, or, when the weights were saved with another config (`saved`) and a fully
    written `.config.json.tmp` holds exactly `saved`, that one: a `save_pretrained` stopped between renaming
    its new weights and its new config into place."""
    pending = _pending(config_path)
    if pending.is_file():
        try:
            candidate = _parse_config(pending)
        except CheckpointError:
            candidate = None  # a config write that was itself cut short: the rename never happened
        if candidate == saved and (not config_path.is_file() or _parse_config(config_path) != saved):
            return candidate
    return _parse_config(config_path)


def _parse_config(config_path: Path) -> HybridConfig:
    try:
        d = json.loads(config_path.read_text())
        if not isinstance(d, dict) or d.pop("format", None) != FORMAT:
            raise ValueError(f'it needs "format": {FORMAT!r}')
        return HybridConfig.from_dict(d)
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{config_path} is not a valid kda_edu config: {e}") from e
