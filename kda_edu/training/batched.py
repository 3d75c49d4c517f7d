"""Several copies of one recall model trained at once: one process, one forward and backward per step.

The runs of chapter 12's sweeps are small: a 2-layer `RecallLM` of width 128 uses a sliver of a GPU, and its
step time is the time to launch a few hundred short kernels, not the time to run them. A learning-rate grid
trains the same configuration many times over, with other seeds and rates. `train_batched` trains M such
copies together: the M models' parameters are stacked along a new first dimension
(`torch.func.stack_module_state`), and one `torch.func.vmap` of the model's forward and gradient
(`functional_call`, `grad_and_value`) computes all M losses and gradients with the same number of kernel
launches as one run, each kernel M times larger.

Each copy is a run of `kda_edu.training.train.train` in everything but the process it runs in:

- its own initialisation (`build_model` with its seed), its own training batches and held-out set (the data
  seeds of `data_seed`), its own learning rate and schedule (`lr_at`);
- AdamW written out on the stacked tensors, with a learning rate per copy: the same update as
  `torch.optim.AdamW` (betas 0.9 / 0.95, eps 1e-8, decoupled weight decay on the parameters `is_decayed`
  names, none on norms, biases and gate parameters);
- the gradient's global norm clipped per copy (each copy's norm over its own parameters), as
  `torch.nn.utils.clip_grad_norm_` does for one model;
- the same masked loss and accuracy (`masked_loss_and_accuracy`) and the same evaluation in slices of
  `EVAL_BATCH` sequences.

So in float64 a copy's parameters, losses and accuracies agree with the separate run's to rounding (the
stacked AdamW orders a few operations differently from PyTorch's); in float32 they drift apart slowly, as two
builds of one run do.

What vmap cannot batch. The delta-rule mixers' Triton kernels (`kda_edu.kernels.chunk_kda`, and KDA's fused
gate, norm and convolution kernels) are `torch.autograd.Function`s without a rule for vmap, so
`train_batched` refuses a "deltanet", "gated_deltanet" or "kda" mixer whose backend would run them and asks for
`backend="torch"`: their chunked PyTorch forms batch (the value checks on g and beta, which would read a
value per copy, are skipped under vmap: `kda_edu.ops._checks.under_vmap`). Linear attention, decay-only and
softmax attention have no kernel and batch under any backend. CUDA graphs (`TrainConfig.cuda_graph`) are not
recorded here.
"""

import copy
import time
from collections.abc import Sequence
from dataclasses import asdict, replace

import torch
from torch.func import functional_call, grad_and_value, stack_module_state, vmap
from tqdm import tqdm

from kda_edu.backend import use_triton
from kda_edu.layers.mixers import DELTA_RULE_KINDS
from kda_edu.models.recall import RecallConfig
from kda_edu.training.tasks import TaskBatch
from kda_edu.training.train import (
    EVAL_BATCH,
    TrainConfig,
    TrainResult,
    build_model,
    data_seed,
    is_decayed,
    lr_at,
    masked_loss_and_accuracy,
)

BETAS, EPS = (0.9, 0.95), 1e-8  # make_optimizer's AdamW (eps: PyTorch's default)
PER_COPY = ("lr", "seed")  # the TrainConfig fields in which the copies may differ


def copy_configs(config: TrainConfig, seeds: Sequence[int], lrs: Sequence[float]) -> list[TrainConfig]:
    """The configs of M copies of `config`: copy i has seed `seeds[i]` and learning rate `lrs[i]`.

    Raises:
        ValueError: `seeds` and `lrs` differ in length, or are empty.
    """
    if len(seeds) != len(lrs):
        raise ValueError(
            f"seeds and lrs must have one entry per copy, got {len(seeds)} seeds and {len(lrs)} lrs"
        )
    if not seeds:
        raise ValueError("copy_configs needs at least one copy (seeds and lrs are empty)")
    return [replace(config, seed=s, lr=lr) for s, lr in zip(seeds, lrs, strict=True)]


def check_batchable(model_config: RecallConfig, configs: Sequence[TrainConfig], device) -> None:
    """Raise a ValueError unless `train_batched` can train `configs` together: at least one, all equal but for
    `lr` and `seed`, no CUDA graph, and a mixer that vmap can batch on `device` (see the module doc)."""
    if not isinstance(configs, Sequence) or not all(isinstance(c, TrainConfig) for c in configs):
        raise ValueError(f"configs must be a sequence of TrainConfig, got {configs!r:.100}")
    if len(configs) == 0:
        raise ValueError("train_batched needs at least one TrainConfig (M = 0 copies)")
    shared = {k: v for k, v in asdict(configs[0]).items() if k not in PER_COPY}
    for i, c in enumerate(configs[1:], 1):
        other = {k: v for k, v in asdict(c).items() if k not in PER_COPY}
        if other != shared:
            diff = sorted(k for k in shared if shared[k] != other[k])
            raise ValueError(
                f"configs[{i}] differs from configs[0] in {diff}: copies trained together may differ only in "
                f"{PER_COPY}"
            )
    if configs[0].cuda_graph:
        raise ValueError("train_batched does not record CUDA graphs: pass TrainConfig(cuda_graph=False)")
    mixer = model_config.mixer
    probe = torch.empty(0, device=device)
    if mixer.kind in DELTA_RULE_KINDS and use_triton(mixer.backend, probe):
        raise ValueError(
            f"train_batched cannot vmap the {mixer.kind!r} mixer's Triton kernels (backend={mixer.backend!r} on "
            f"{device}): they are autograd Functions without a vmap rule; use MixerConfig(backend='torch'), "
            "whose chunked PyTorch form batches"
        )


def train_batched(
    task,
    model_config: RecallConfig,
    configs: Sequence[TrainConfig],
    *,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> list[TrainResult]:
    """Train M = `len(configs)` copies of one `RecallLM` configuration together (see the module doc).

    Args:
        task: as for `train` (`vocab_size`, `sample(n, seed)`).
        model_config: the model of every copy.
        configs: one `TrainConfig` per copy, equal but for `lr` and `seed` (`copy_configs` makes them).
        device: where to train.
        progress: show a tqdm progress bar.

    Returns:
        One `TrainResult` per copy, in the order of `configs`, as `train` returns it: the copy's trained
        model and its history. Its `seconds` is the whole batched run's wall time divided by M, the time one
        copy cost.

    Raises:
        ValueError: see `check_batchable`; or the model's vocabulary is smaller than the task's.
    """
    check_batchable(model_config, configs, device)
    if model_config.vocab_size < task.vocab_size:
        raise ValueError(f"model vocab_size {model_config.vocab_size} < task vocab_size {task.vocab_size}")
    M, shared = len(configs), configs[0]
    models = [build_model(model_config, c.seed).to(device) for c in configs]
    params, buffers = stack_module_state(models)
    params = {name: p.detach() for name, p in params.items()}
    # A skeleton without storage: functional_call runs its forward with the stacked tensors' slices.
    skeleton = copy.deepcopy(models[0]).to("meta")
    decayed = {name: is_decayed(name, p) for name, p in models[0].named_parameters()}
    exp_avg = {name: torch.zeros_like(p) for name, p in params.items()}
    exp_avg_sq = {name: torch.zeros_like(p) for name, p in params.items()}
    dtype = next(iter(params.values())).dtype

    def loss_of(p, b, inputs, targets, mask):
        logits = functional_call(skeleton, (p, b), (inputs,))
        return masked_loss_and_accuracy(logits, TaskBatch(inputs, targets, mask))

    gradients = vmap(grad_and_value(loss_of, has_aux=True))
    losses_of = vmap(loss_of)

    def sample(n: int, step: int) -> TaskBatch:
        parts = [task.sample(n, data_seed(c.seed, step)) for c in configs]
        stacked = (
            torch.stack([getattr(b, f) for b in parts]).to(device) for f in ("inputs", "targets", "mask")
        )
        return TaskBatch(*stacked)

    eval_set = sample(shared.eval_size, -1)
    history: list[list[dict]] = [[] for _ in configs]
    losses, t0 = [], time.perf_counter()
    skeleton.train()
    for step in tqdm(range(shared.steps), disable=not progress, leave=False, ncols=90):
        lrs = [lr_at(step, c) for c in configs]
        batch = sample(shared.batch_size, step)
        grads, (loss, _) = gradients(params, buffers, batch.inputs, batch.targets, batch.mask)
        _clip_per_copy(grads, shared.grad_clip)
        _adamw_step(params, grads, exp_avg, exp_avg_sq, step + 1, lrs, shared.weight_decay, decayed, dtype)
        losses.append(loss.detach())
        if (step + 1) % shared.eval_every == 0 or step + 1 == shared.steps:
            skeleton.eval()
            eval_loss, eval_acc = _evaluate(losses_of, params, buffers, eval_set)
            skeleton.train()
            train_losses = torch.stack(losses).T.tolist()  # [M, steps since the last evaluation]
            for i in range(M):
                history[i].append(
                    {
                        "step": step + 1,
                        "lr": lrs[i],
                        "train_loss": sum(train_losses[i]) / len(train_losses[i]),
                        "eval_loss": eval_loss[i],
                        "eval_acc": eval_acc[i],
                    }
                )
            losses = []
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        for i, model in enumerate(models):
            for name, p in model.named_parameters():
                p.copy_(params[name][i])
    return [TrainResult(model, h, seconds / M) for model, h in zip(models, history, strict=True)]


def _clip_per_copy(grads: dict[str, torch.Tensor], max_norm: float) -> None:
    """Scale each copy's gradients (dim 0 of every tensor) so that their global norm is at most `max_norm`,
    as `torch.nn.utils.clip_grad_norm_` does for one model (the same 1e-6 in the denominator)."""
    norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads.values()])  # [P, M]
    total = torch.linalg.vector_norm(norms, dim=0)
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads.values():
        g.mul_(scale.view(-1, *[1] * (g.dim() - 1)))


@torch.no_grad()
def _adamw_step(params, grads, exp_avg, exp_avg_sq, step: int, lrs, weight_decay, decayed, dtype) -> None:
    """One AdamW step on stacked tensors, copy i with learning rate `lrs[i]`: PyTorch's AdamW update
    (decoupled decay, bias-corrected moments) applied to every copy at once."""
    beta1, beta2 = BETAS
    lr = torch.tensor(lrs, dtype=torch.float64)
    bias1, bias2_sqrt = 1 - beta1**step, (1 - beta2**step) ** 0.5
    device = next(iter(params.values())).device  # one copy of the per-copy factors to the device per step
    shrink = (1 - lr * weight_decay).to(device, dtype)
    step_size = (lr / bias1).to(device, dtype)
    for name, p in params.items():
        view = (-1, *[1] * (p.dim() - 1))
        g, m, v = grads[name], exp_avg[name], exp_avg_sq[name]
        if decayed[name]:
            p.mul_(shrink.view(view))
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bias2_sqrt).add_(EPS)
        p.sub_(step_size.view(view) * m / denom)


@torch.no_grad()
def _evaluate(losses_of, params, buffers, batch: TaskBatch, batch_size: int = EVAL_BATCH):
    """Per copy `(loss, token accuracy)` lists on its held-out set, over the scored positions, in slices of
    `batch_size` sequences, as `kda_edu.training.train.evaluate` sums them."""
    M = batch.inputs.shape[0]
    total_loss, correct, count = [0.0] * M, [0.0] * M, [0] * M
    for i in range(0, batch.inputs.shape[1], batch_size):
        part = [t[:, i : i + batch_size] for t in (batch.inputs, batch.targets, batch.mask)]
        loss, acc = losses_of(params, buffers, *part)
        ns = part[2].flatten(1).sum(dim=1).tolist()
        for c, (lo, ac, n) in enumerate(zip(loss.tolist(), acc.tolist(), ns, strict=True)):
            n = int(n)
            total_loss[c], correct[c], count[c] = total_loss[c] + lo * n, correct[c] + ac * n, count[c] + n
    return [t / n for t, n in zip(total_loss, count, strict=True)], [
        c / n for c, n in zip(correct, count, strict=True)
    ]
