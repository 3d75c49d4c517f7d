"""A small, deterministic, resumable training loop for the memory tasks of chapter 12.

`train(task, model_config, train_config)` builds a `RecallLM`, trains it with AdamW on fresh batches of the
task, and evaluates token accuracy on held-out sequences every `eval_every` steps. The recipe:

- AdamW (betas 0.9 / 0.95); weight decay on matrices only (not on norms, biases, gate parameters);
- learning rate: linear warm-up from 0 to `lr` over `warmup` steps, then a cosine decay to `min_lr_ratio * lr`
  at the last step (`lr_at`);
- the gradient's global norm clipped to `grad_clip`;
- loss: cross entropy on the scored positions of the task (`TaskBatch.mask`) only.

On a CUDA device `cuda_graph=True` records one whole training step (forward, backward, clipping, AdamW) as a
CUDA graph after three ordinary steps, and replays it for every later step. The small models of chapter 12
launch a few hundred short kernels a step; launching them one by one from Python costs more time than running
them, and a replayed graph launches them all at once. The steps compute the same operations on the same
data; AdamW then keeps its step count and learning rate on the GPU (`capturable=True`), which rounds a little
differently from the default AdamW, so a graphed run and an ordinary one agree closely but not bit for bit.

Determinism: the model is initialised from `torch.manual_seed(seed)` (inside `torch.random.fork_rng`, so the
caller's random state is left alone); the training batch of step s is `task.sample(batch_size,
data_seed(seed, s))` and the evaluation set is one sample with another seed, so the data depend only on the
seed and the step. Nothing else draws random numbers, so the same configuration gives the same numbers on the
same machine, and a run resumed from a checkpoint continues exactly as the uninterrupted run would have.

A checkpoint is one safetensors file: the model's tensors (`model.*`), AdamW's moments and step counts
(`optim.*`), and as JSON metadata the task, both configs, the step reached and the history so far. It is
written atomically (`kda_edu.models.checkpoint.atomic_write`), and everything in it is checked before a
resumed run uses any of it: a file that is not a complete training checkpoint, a missing, unexpected,
misshapen or non-finite tensor, a negative second moment or a step count that is not a whole number in
[1, step reached] raises a `CheckpointError` (a ValueError) naming the file, the tensor and what was expected.
"""

import json
import math
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from kda_edu.layers.kda_layer import GATE_PARAMETERS  # make_optimizer reads it from this module
from kda_edu.layers.mixers import DELTA_RULE_KINDS
from kda_edu.models.checkpoint import CheckpointError, atomic_write, check_tensors
from kda_edu.models.recall import RecallConfig, RecallLM
from kda_edu.training.tasks import TaskBatch, task_to_dict

FORMAT = "kda_edu.training.train"


@dataclass
class TrainConfig:
    """How to train.

    Attributes:
        steps: optimiser steps in all.
        batch_size: sequences per step.
        lr: peak learning rate.
        warmup: steps of linear warm-up.
        min_lr_ratio: the learning rate at the last step, as a fraction of `lr`.
        weight_decay: AdamW's decoupled weight decay, applied to matrices only.
        grad_clip: largest global gradient norm.
        eval_every: evaluate (and record the history) every this many steps, and at the last step.
        eval_size: number of held-out sequences.
        seed: the seed of the initialisation and of the data.
        cuda_graph: replay each training step as one CUDA graph (CUDA devices only; see the module doc).
    """

    steps: int = 500
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_size: int = 256
    seed: int = 0
    cuda_graph: bool = False

    def __post_init__(self):
        for name in ("steps", "batch_size", "eval_every", "eval_size"):
            if isinstance(getattr(self, name), bool) or getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.warmup < 0 or self.seed < 0:
            raise ValueError(f"TrainConfig.warmup and seed must be >= 0, got {self.warmup}, {self.seed}")
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1 and self.grad_clip > 0):
            raise ValueError(
                f"TrainConfig needs lr > 0, 0 <= min_lr_ratio <= 1, grad_clip > 0, got {self.lr}, "
                f"{self.min_lr_ratio}, {self.grad_clip}"
            )


@dataclass
class TrainResult:
    """What a run produced.

    Attributes:
        model: the trained `RecallLM`.
        history: one dict per evaluation: `step`, `lr`, `train_loss` (mean over the steps since the last
            evaluation), `eval_loss`, `eval_acc` (token accuracy on the scored positions of the held-out set).
        seconds: wall time of the steps run in this call (not counting a resumed run's earlier part).
    """

    model: RecallLM
    history: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def final_accuracy(self) -> float:
        """Held-out token accuracy at the last evaluation."""
        return self.history[-1]["eval_acc"]


def lr_at(step: int, config: TrainConfig) -> float:
    """The learning rate of step `step` (0-based): linear warm-up to `lr` over `warmup` steps, then a cosine
    from `lr` down to `min_lr_ratio * lr` at step `steps - 1`."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    span = max(config.steps - 1 - config.warmup, 1)
    progress = min((step - config.warmup) / span, 1.0)
    floor = config.min_lr_ratio * config.lr
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def data_seed(seed: int, step: int) -> int:
    """The seed of the training batch of `step`; step -1 is the held-out evaluation set."""
    return (seed + 1) * 1_000_003 + step + 1


def masked_loss_and_accuracy(logits: torch.Tensor, batch: TaskBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross entropy (mean) and token accuracy over the scored positions only.

    Args:
        logits: `[n, T, vocab]`.
        batch: the `TaskBatch` the logits were computed from.

    Returns:
        `(loss, accuracy)`, two scalar tensors; the loss carries the gradient. Computed in float32, or in
        float64 for float64 logits (a float64 model's gradients, as `kda_edu.training.probes` uses them, must
        not pass through a float32 loss).
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    # Weighted by the mask rather than indexed with it: indexing would make the CPU wait for the GPU to count
    # the scored positions, which a CUDA graph cannot hold.
    weight = batch.mask.to(dtype)
    count = weight.sum()
    ce = F.cross_entropy(logits.to(dtype).flatten(0, 1), batch.targets.flatten(), reduction="none")
    hits = (logits.argmax(dim=-1) == batch.targets).to(dtype)
    return (ce.view_as(weight) * weight).sum() / count, (hits * weight).sum() / count


EVAL_BATCH = 64  # sequences per forward pass of `evaluate`


@torch.no_grad()
def evaluate(model: RecallLM, batch: TaskBatch, batch_size: int = EVAL_BATCH) -> tuple[float, float]:
    """`(loss, token accuracy)` of `model` on `batch`, over the scored positions, in slices of `batch_size`."""
    was_training = model.training
    model.eval()
    total_loss, correct, count = 0.0, 0.0, 0
    for i in range(0, batch.inputs.shape[0], batch_size):
        part = TaskBatch(*(t[i : i + batch_size] for t in (batch.inputs, batch.targets, batch.mask)))
        loss, acc = masked_loss_and_accuracy(model(part.inputs), part)
        n = int(part.mask.sum())
        total_loss, correct, count = total_loss + loss.item() * n, correct + acc.item() * n, count + n
    model.train(was_training)
    return total_loss / count, correct / count


# The initialisation draws from PyTorch's one global generator: two threads building models at once would
# interleave their draws (chapter 12's sweep trains several runs in one process, a thread each).
_GLOBAL_RNG = threading.Lock()


def build_model(model_config: RecallConfig, seed: int) -> RecallLM:
    """A `RecallLM` initialised from `torch.manual_seed(seed)`, without touching the caller's random state
    (one thread at a time)."""
    with _GLOBAL_RNG, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return RecallLM(model_config)


def is_decayed(name: str, parameter: torch.Tensor) -> bool:
    """Whether AdamW's weight decay applies to the parameter `name`: to the weight matrices, the embedding and
    the convolution kernels (two or more dimensions), not to norm weights, biases or the gates'
    `GATE_PARAMETERS`, whatever their shape."""
    return parameter.dim() >= 2 and name.rsplit(".", 1)[-1] not in GATE_PARAMETERS


def make_optimizer(model: RecallLM, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay where `is_decayed` says so, none elsewhere."""
    named = list(model.named_parameters())
    decay = [p for n, p in named if is_decayed(n, p)]
    no_decay = [p for n, p in named if not is_decayed(n, p)]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if config.cuda_graph:  # the learning rate is a tensor that the graph reads, and is refilled every step
        lr = torch.tensor(config.lr, device=decay[0].device)
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), capturable=True)
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95))


def train_step(model: RecallLM, optimizer: torch.optim.Optimizer, batch: TaskBatch, grad_clip: float):
    """One optimiser step on `batch`: loss, backward, gradient clipping, AdamW. Returns the (detached) loss."""
    loss, _ = masked_loss_and_accuracy(model(batch.inputs), batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.detach()


GRAPH_WARMUP_STEPS = 3  # ordinary steps before the capture: they create AdamW's state and compile the kernels


class _GraphedStep:
    """`train_step` recorded once as a CUDA graph on fixed input buffers, then replayed with each new batch.

    Capturing records the kernels without running them; every call copies its batch into the buffers and
    replays the whole step. The parameters, gradients and AdamW state are the same tensors throughout, so
    evaluations and checkpoints between replays see the current model."""

    def __init__(self, model, optimizer, batch: TaskBatch, grad_clip: float):
        self.batch = TaskBatch(batch.inputs.clone(), batch.targets.clone(), batch.mask.clone())
        optimizer.zero_grad(set_to_none=True)  # the captured backward writes fresh gradients
        self.graph = torch.cuda.CUDAGraph()
        # Another thread's run (chapter 12's sweep can train several runs in one process) may synchronise or
        # allocate while this one captures: only this thread's calls must be capturable (thread_local), and the
        # capture gets a stream of its own (torch.cuda.graph's default capture stream is one per process).
        capture = torch.cuda.Stream(batch.inputs.device)
        with torch.cuda.graph(self.graph, stream=capture, capture_error_mode="thread_local"):
            self.loss = train_step(model, optimizer, self.batch, grad_clip)

    def __call__(self, batch: TaskBatch) -> torch.Tensor:
        for buffer, new in zip(
            (self.batch.inputs, self.batch.targets, self.batch.mask),
            (batch.inputs, batch.targets, batch.mask),
            strict=True,
        ):
            if buffer.shape != new.shape:
                raise ValueError(
                    f"a CUDA-graphed step needs batches of one shape {tuple(buffer.shape)}, got {tuple(new.shape)}"
                )
            buffer.copy_(new, non_blocking=True)
        self.graph.replay()
        return self.loss.clone()  # the next replay overwrites self.loss


def train(
    task,
    model_config: RecallConfig,
    config: TrainConfig,
    *,
    device: str | torch.device = "cpu",
    checkpoint: str | os.PathLike | None = None,
    resume: bool = False,
    stop_after: int | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train a `RecallLM` on `task`.

    Args:
        task: an `MQAR`, `Palindrome` or `Stack` (anything with `vocab_size` and `sample(n, seed)`).
        model_config: the model; its `vocab_size` must be at least the task's.
        config: a `TrainConfig`.
        device: where to train.
        checkpoint: a `.safetensors` path; when given, the run is saved there after every evaluation.
        resume: continue from `checkpoint` (which must exist and hold the same task and configs).
        stop_after: stop once this many steps are done in all (to split a run in parts); None runs all.
        progress: show a tqdm progress bar.

    Returns:
        A `TrainResult`.
    """
    if model_config.vocab_size < task.vocab_size:
        raise ValueError(f"model vocab_size {model_config.vocab_size} < task vocab_size {task.vocab_size}")
    if resume and checkpoint is None:
        raise ValueError("resume=True needs a checkpoint path")
    if config.cuda_graph and torch.device(device).type != "cuda":
        raise ValueError(f"TrainConfig.cuda_graph=True needs a CUDA device, got device={device!r}")
    mixer = model_config.mixer
    if config.cuda_graph and mixer.backend == "torch" and mixer.kind in DELTA_RULE_KINDS:
        raise ValueError(
            f"TrainConfig.cuda_graph=True cannot record the {mixer.kind!r} mixer with backend='torch': its PyTorch "
            "form checks the gate and beta values, which makes the CPU wait for the GPU inside the step; use "
            "MixerConfig(backend='triton')"
        )
    model = build_model(model_config, config.seed).to(device)
    optimizer = make_optimizer(model, config)
    start, history = 0, []
    if resume:
        start, history = load_training_checkpoint(checkpoint, model, optimizer, task, model_config, config)
    eval_set = task.sample(config.eval_size, data_seed(config.seed, -1)).to(device)
    end = config.steps if stop_after is None else min(stop_after, config.steps)

    model.train()
    # Training losses are kept on the device until an evaluation reads them: a `.item()` every step would make
    # the CPU wait for the GPU each step instead of sampling the next batch while the GPU works.
    losses, t0 = [], time.perf_counter()
    graph, side = None, torch.cuda.Stream(device) if config.cuda_graph else None
    bar = tqdm(range(start, end), total=end, initial=start, disable=not progress, leave=False, ncols=90)
    for step in bar:
        lr = lr_at(step, config)
        for group in optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # the graph reads this tensor
            else:
                group["lr"] = lr
        batch = task.sample(config.batch_size, data_seed(config.seed, step)).to(device)
        if config.cuda_graph and graph is None and step - start >= GRAPH_WARMUP_STEPS:
            graph = _GraphedStep(model, optimizer, batch, config.grad_clip)
        if graph is not None:
            loss = graph(batch)
        elif side is not None:  # the ordinary steps before a capture run on a side stream, as CUDA graphs ask
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                loss = train_step(model, optimizer, batch, config.grad_clip)
            torch.cuda.current_stream(device).wait_stream(side)
        else:
            loss = train_step(model, optimizer, batch, config.grad_clip)
        losses.append(loss)
        if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
            eval_loss, eval_acc = evaluate(model, eval_set)
            history.append(
                {
                    "step": step + 1,
                    "lr": lr,
                    "train_loss": sum(torch.stack(losses).tolist()) / len(losses),
                    "eval_loss": eval_loss,
                    "eval_acc": eval_acc,
                }
            )
            losses = []
            bar.set_postfix(loss=f"{eval_loss:.3f}", acc=f"{eval_acc:.3f}")
            if checkpoint is not None:
                save_training_checkpoint(
                    checkpoint, model, optimizer, task, model_config, config, step + 1, history
                )
    bar.close()
    return TrainResult(model, history, time.perf_counter() - t0)


def _metadata(task, model_config: RecallConfig, config: TrainConfig) -> dict[str, str]:
    return {
        "format": FORMAT,
        "task": json.dumps(task_to_dict(task)),
        "model_config": json.dumps(model_config.to_dict()),
        "train_config": json.dumps(asdict(config)),
    }


def save_training_checkpoint(path, model, optimizer, task, model_config, config, step, history) -> None:
    """Write the model, AdamW's state, the configs, the step reached and the history to one safetensors file
    (atomically: a crash while saving leaves the previous checkpoint)."""
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    for i, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            tensors[f"optim.{i}.{name}"] = torch.as_tensor(value).detach().cpu().contiguous()
    metadata = {**_metadata(task, model_config, config), "step": str(step), "history": json.dumps(history)}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def load_training_checkpoint(path, model, optimizer, task, model_config, config) -> tuple[int, list[dict]]:
    """Load a checkpoint written by `save_training_checkpoint` into `model` and `optimizer` (in place).

    Everything is checked before anything is loaded, so on an error `model` and `optimizer` are unchanged.

    Returns:
        `(step, history)`: the number of steps the checkpoint had done, and its history.

    Raises:
        FileNotFoundError: no file at `path`.
        CheckpointError (a ValueError): the file is not a complete safetensors file or not a training
            checkpoint, was written for another task or config, or holds tensors that do not fit the model
            and AdamW (each named with what was expected).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint file at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as e:
        raise CheckpointError(f"{path} is not a complete safetensors file ({e})") from e
    if metadata.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not a kda_edu training checkpoint (format {metadata.get('format')!r})"
        )
    expected = _metadata(task, model_config, config)
    saved = {}
    for key in ("task", "model_config", "train_config", "step", "history"):
        try:
            saved[key] = json.loads(metadata[key])
        except (KeyError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path} has no valid JSON metadata {key!r} ({e!r})") from e
    for key in ("task", "model_config", "train_config"):
        if saved[key] != json.loads(expected[key]):
            raise CheckpointError(
                f"{path} was written for another {key}: {metadata[key]} (expected {expected[key]})"
            )
    step, history = saved["step"], saved["history"]
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= config.steps:
        raise CheckpointError(f"{path}: metadata 'step' must be an int in [0, {config.steps}], got {step!r}")
    if not isinstance(history, list) or not all(isinstance(h, dict) for h in history):
        raise CheckpointError(
            f"{path}: metadata 'history' must be a list of dicts, got {metadata['history']!r}"
        )

    model_tensors = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    optim_tensors = {k: v for k, v in tensors.items() if k.startswith("optim.")}
    others = sorted(set(tensors) - {f"model.{k}" for k in model_tensors} - set(optim_tensors))
    if others:
        raise CheckpointError(f"{path} holds unexpected tensors {others} (only model.* and optim.*)")
    check_tensors(model, model_tensors, path, prefix="model.", tied_once=False)
    optim_state = _check_optimizer_state(optimizer, optim_tensors, step, path)

    device = next(model.parameters()).device
    model.load_state_dict(model_tensors)
    state = optimizer.state_dict()
    for i, values in optim_state.items():
        state["state"][i] = {
            key: value.to(device) if key != "step" else value for key, value in values.items()
        }
    optimizer.load_state_dict(state)
    return step, history


def _check_optimizer_state(optimizer, tensors: dict[str, torch.Tensor], step: int, path) -> dict[int, dict]:
    """AdamW's per-parameter state from the `optim.<i>.<key>` tensors, checked against the optimizer: every
    index names a parameter; each parameter with a state has exactly AdamW's keys; the moments have the
    parameter's shape, are finite, and the second ones >= 0; the step count is a whole number in [1, step]."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    amsgrad = any(group.get("amsgrad", False) for group in optimizer.param_groups)
    moments = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    keys = {"step", *moments}
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        parts = name.split(".")
        if len(parts) != 3 or not parts[1].isdigit() or int(parts[1]) >= len(params) or parts[2] not in keys:
            raise CheckpointError(
                f"{path}: unexpected optimizer tensor {name!r}; expected optim.<i>.<key> with i a parameter "
                f"index in [0, {len(params)}) and key one of {sorted(keys)}"
            )
        state.setdefault(int(parts[1]), {})[parts[2]] = value
    for i, values in sorted(state.items()):
        missing = sorted(keys - set(values))
        if missing:
            raise CheckpointError(
                f"{path}: AdamW's state of parameter {i} lacks {', '.join(f'optim.{i}.{k}' for k in missing)} "
                f"(each parameter with a state needs {sorted(keys)})"
            )
        shape = tuple(params[i].shape)
        for key in moments:
            t, name = values[key], f"optim.{i}.{key}"
            if tuple(t.shape) != shape or not t.is_floating_point():
                raise CheckpointError(
                    f"{path}: {name} must be a floating tensor of its parameter's shape {list(shape)}, got "
                    f"{list(t.shape)} {t.dtype}"
                )
            if not bool(torch.isfinite(t).all()):
                raise CheckpointError(
                    f"{path}: {name} holds NaN or inf ({int((~torch.isfinite(t)).sum())} of {t.numel()} values)"
                )
            if key != "exp_avg" and not bool((t >= 0).all()):
                raise CheckpointError(
                    f"{path}: {name} (a second moment) must be >= 0, got min {t.min().item()!r}"
                )
        t = values["step"]
        count = t.item() if t.numel() == 1 else None
        if count is None or not math.isfinite(count) or count != int(count) or not 1 <= count <= step:
            shown = t.tolist() if t.numel() <= 4 else f"a tensor of shape {list(t.shape)}"
            raise CheckpointError(
                f"{path}: optim.{i}.step must be one whole number in [1, {step}] (the steps this parameter "
                f"was updated, at most the checkpoint's step), got {shown!r}"
            )
    return state
