"""How far a model's gate gradients are from float64, head by head: a probe for training that goes wrong.

A suspect for Gated DeltaNet's collapse on the GPU: when a head's gate is strongly negative, its
gradient is small and may be dominated by rounding (bf16 kernel inputs, TF32 products), and Adam, which
divides by the gradient's running scale, turns even a tiny noisy gradient into a full-size step. The probe
measures exactly that at one point of training:

- the gradients of one batch through the model as it trains (its backend and kernel dtype);
- the same gradients through a float64 copy of the model running the PyTorch forms (the reference);
- per mixer and head: the gate's values on that batch (mean, minimum, the share of steps below a bound), and
  for the gate's parameters (`A_log`, `dt_bias`, the head's row of `f_proj`) the norm of the reference
  gradient and the error of the model's gradient relative to it.

A relative error near or above 1 means the model's gate gradient for that head is mostly rounding: its sign
and size are noise, and Adam would step on it all the same.

- `gate_gradient_probe(model, batch)`: the table, a list of one dict per (layer, head).
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from kda_edu.layers.mixers import TokenMixer
from kda_edu.ops.gates import kda_gate
from kda_edu.training.tasks import TaskBatch
from kda_edu.training.train import masked_loss_and_accuracy

GATE_PARAMETERS = ("A_log", "dt_bias", "f_proj.weight")


def _gradients(model, batch: TaskBatch) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss, _ = masked_loss_and_accuracy(model(batch.inputs), batch)
    loss.backward()
    grads = {
        name: p.grad.detach().double().cpu() for name, p in model.named_parameters() if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    return grads


def _gated_mixers(model) -> list[tuple[str, TokenMixer]]:
    return [
        (name, m) for name, m in model.named_modules() if isinstance(m, TokenMixer) and hasattr(m, "A_log")
    ]


def gate_gradient_probe(model, batch: TaskBatch, low: float = -5.0) -> list[dict]:
    """Per (layer, head) of every mixer with a per-head gate: its gate values and its gate gradients' error.

    Args:
        model: a `RecallLM` (or any model of `TokenMixer`s) as it trains; it is not changed (its gradients
            are cleared after use).
        batch: the batch whose loss is differentiated (on the model's device).
        low: the gate value (log decay per step) below which a step counts as strongly decaying.

    Returns:
        One dict per head: `layer`, `head`, `g_mean`, `g_min`, `share_below_low`, and for each of
        `A_log`, `dt_bias`, `f_proj.weight` (the head's row) `<name> ref norm` (the float64 reference's
        gradient norm) and `<name> rel error` (the model's gradient's distance from it, over that norm).
    """
    mixers = _gated_mixers(model)
    if not mixers:
        raise ValueError("model has no mixer with a per-head gate (kinds 'gated_deltanet', 'decay_only')")
    path = _gradients(model, batch)

    reference = copy.deepcopy(model).double()
    inputs: dict[str, torch.Tensor] = {}
    for name, mixer in _gated_mixers(reference):
        mixer.config = dataclasses.replace(mixer.config, backend="torch", kernel_dtype="float32")
        mixer.register_forward_pre_hook(
            lambda module, args, name=name: inputs.__setitem__(name, args[0].detach())
        )
    ref = _gradients(reference, batch)

    rows = []
    for name, mixer in _gated_mixers(reference):
        with torch.no_grad():
            g = kda_gate(mixer.f_proj(inputs[name]), mixer.A_log, mixer.dt_bias).flatten(0, 1)  # [B*T, H]
        for h in range(g.shape[-1]):
            row = {
                "layer": name,
                "head": h,
                "g_mean": g[:, h].mean().item(),
                "g_min": g[:, h].min().item(),
                "share_below_low": (g[:, h] < low).double().mean().item(),
            }
            for param in GATE_PARAMETERS:
                key = f"{name}.{param}"
                want, got = ref[key][h], path[key][h]
                norm = want.norm().item()
                row[f"{param} ref norm"] = norm
                row[f"{param} rel error"] = (got - want).norm().item() / norm if norm > 0 else float("inf")
            rows.append(row)
    return rows
