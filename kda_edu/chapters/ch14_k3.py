"""Chapter 14: Kimi K3's shape in our model family, what it costs, and a small experiment with its additions.

Accounting (from the configs, never typed in):

- `k3_config()` and `kimi_linear_48b_config()`: `HybridConfig`s with the published shapes of Kimi K3 and
  Kimi Linear 48B (third-party copies of their configs; see the chapter for what differs from our layers).
- `parameter_report(config)`: total and active (per-token) parameters, by part.
- `cache_report(config, context_len, extra_key_dim)`: the bytes one sequence keeps, MLA latents (growing) and
  KDA states (fixed), in bf16 latents and float32 states.
- `mixing_flops_per_token(config, context_len, extra_key_dim)`: the sequence-mixing FLOPs of one decoded
  token (MLA attention in MQA mode, KDA's recurrent step), all layers.

Experiment (equal active parameters, several seeds):

- `stdlib_bytes(max_bytes)`: real text available offline, the Python standard library's own source files.
- `TextTask`: byte-level next-token prediction on those bytes, with the interface of `kda_edu.training.tasks`.
- `train_hybrid(config, task, ...)`: a short AdamW run of a `HybridLM` (updating the MoE routing bias after
  every step), returning the held-out loss.
- `K3_VARIANTS` and `variant_config(name, base)`: the baseline and one config per K3 addition.
"""

import dataclasses
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from kda_edu.chapters.ch11_hybrid import hybrid_parameters
from kda_edu.layers.ffn import FFNConfig, ffn_active_parameters, ffn_parameters
from kda_edu.layers.kda_layer import KDAConfig
from kda_edu.layers.mla import MLAConfig
from kda_edu.models.costs import cache_bytes, kda_token_cost, mla_token_cost
from kda_edu.models.model import HybridConfig, HybridLM
from kda_edu.training.tasks import TaskBatch
from kda_edu.training.train import TrainConfig, lr_at, make_optimizer, masked_loss_and_accuracy

# The shapes, as public copies of the configs state them (claims, not measurements).
K3_STATED = {
    "total parameters": 2.8e12,
    "active parameters": 104e9,
    "layers": 93,
    "KDA layers": 69,
    "MLA layers": 24,
}
KIMI_LINEAR_STATED = {"total parameters": 48e9, "active parameters": 3e9}


def k3_config() -> HybridConfig:
    """Kimi K3 in our model family: 93 blocks, MLA at every fourth and the last (69 KDA, 24 MLA), width 7168,
    96 KDA heads of 128 with the -5 lower-bounded gate and a full-rank output gate, gated NoPE MLA with 96
    heads and a 512-wide latent, 896 routed experts (top 16) of hidden width 3072 in a 3584-wide latent,
    2 shared experts, the first block dense, block attention residuals of 12 sublayers, vocabulary 163840.

    Our MLA has full-rank queries (K3: a 1536-wide low-rank query) and no extra 64-wide key slot, and the
    dense first block's width (18432) is Kimi K2's; the chapter counts what these differences change.
    """
    return HybridConfig(
        vocab_size=163840,
        d_model=7168,
        n_layers=93,
        layer_pattern="KKKA" * 23 + "A",
        kda=KDAConfig(num_heads=96, head_dim=128, gate="lower_bound", lower_bound=-5.0, full_rank="output"),
        mla=MLAConfig(num_heads=96, kv_rank=512, qk_head_dim=128, v_head_dim=128, output_gate=True),
        ffn=FFNConfig(
            hidden=18432, num_experts=896, top_k=16, expert_hidden=3072, num_shared=2, latent_dim=3584
        ),
        dense_layers=1,
        attn_residuals="block",
        attn_res_block_size=12,
        tie_embeddings=False,
    )


def kimi_linear_48b_config() -> HybridConfig:
    """Kimi Linear 48B in our model family: 27 blocks with MLA at blocks 4, 8, ..., 24 and 27, width 2304,
    32 KDA heads of 128, MLA with 32 heads and a 512-wide latent, 256 routed experts (top 8) of width 1024
    and one shared, the first block dense (width 9216), vocabulary 163840, untied embeddings."""
    return HybridConfig(
        vocab_size=163840,
        d_model=2304,
        n_layers=27,
        layer_pattern="KKKA" * 6 + "KKA",
        kda=KDAConfig(num_heads=32, head_dim=128),
        mla=MLAConfig(num_heads=32, kv_rank=512, qk_head_dim=128, v_head_dim=128),
        ffn=FFNConfig(hidden=9216, num_experts=256, top_k=8, expert_hidden=1024, num_shared=1),
        dense_layers=1,
        tie_embeddings=False,
    )


def parameter_report(config: HybridConfig) -> dict[str, float]:
    """Parameters of `HybridLM(config)` by part (`kda_edu.chapters.ch11_hybrid.hybrid_parameters`), their total, and the
    active parameters: the total minus the routed experts a token is not sent to, in every MoE block."""
    parts = hybrid_parameters(config)
    total = sum(parts.values())
    moe_blocks = config.n_layers - config.dense_layers
    idle = moe_blocks * (
        sum(ffn_parameters(config.d_model, config.ffn).values())
        - ffn_active_parameters(config.d_model, config.ffn)
    )
    return {**parts, "total": total, "active": total - idle}


def cache_report(config: HybridConfig, context_len: int, extra_key_dim: int = 0) -> dict[str, float]:
    """Bytes one sequence keeps after `context_len` tokens: `"mla"` (bf16 latents, plus `extra_key_dim`
    numbers per token and MLA layer for a cached extra key slot), `"kda"` (float32 states and bf16
    convolution windows, fixed), and `"per_token_mla"`, the MLA bytes each token adds."""
    base = cache_bytes(config, context_len, dtype_bytes=2)
    mla_layers = config.layer_kinds.count("A")
    per_token = mla_layers * (config.mla.kv_rank + extra_key_dim) * 2
    return {"mla": per_token * context_len, "kda": base["kda"], "per_token_mla": per_token}


def mixing_flops_per_token(
    config: HybridConfig, context_len: int, extra_key_dim: int = 0
) -> dict[str, float]:
    """Sequence-mixing FLOPs of one decoded token at `context_len`, all layers: MLA in MQA mode (absorbed
    query, attention over the latents, value up-projection; `kda_edu.models.costs.mla_token_cost` without its
    projections) and KDA's recurrent step (`kda_token_cost`'s "recurrence")."""
    kinds = config.layer_kinds
    mla = mla_token_cost(config.mla, config.d_model, context_len, "mqa", rope_head_dim=extra_key_dim).parts
    kda = kda_token_cost(config.kda, config.d_model).parts
    return {
        "mla": kinds.count("A") * (mla["attention"] + mla["absorb"]),
        "kda": kinds.count("K") * kda["recurrence"],
    }


def stdlib_bytes(max_bytes: int = 2_000_000) -> bytes:
    """The first `max_bytes` bytes of the Python standard library's own `.py` files (sorted by path, top
    level of the library only), joined by newlines. Text that ships with every Python, read offline."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for path in sorted(root.glob("*.py")):
        out += path.read_bytes() + b"\n"
        if len(out) >= max_bytes:
            break
    return bytes(out[:max_bytes])


@dataclass(frozen=True)
class TextTask:
    """Byte-level language modelling on `data`: windows of `seq_len + 1` bytes, inputs the first `seq_len`,
    targets the next byte at every position (all scored). The last `holdout` fraction of the bytes is kept
    for evaluation: `sample(n, seed)` draws training windows, `heldout(n)` evenly spaced held-out ones."""

    data: bytes
    seq_len: int = 128
    holdout: float = 0.1

    @property
    def vocab_size(self) -> int:
        return 256

    def _windows(self, starts: torch.Tensor, tokens: torch.Tensor) -> TaskBatch:
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        chunk = tokens[idx]
        inputs, targets = chunk[:, :-1], chunk[:, 1:]
        return TaskBatch(inputs, targets, torch.ones_like(inputs, dtype=torch.bool))

    def _split(self) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.frombuffer(bytearray(self.data), dtype=torch.uint8).long()
        cut = int(len(tokens) * (1 - self.holdout))
        return tokens[:cut], tokens[cut:]

    def sample(self, n: int, seed: int) -> TaskBatch:
        train, _ = self._split()
        gen = torch.Generator().manual_seed(seed)
        return self._windows(torch.randint(0, len(train) - self.seq_len - 1, (n,), generator=gen), train)

    def heldout(self, n: int) -> TaskBatch:
        _, held = self._split()
        return self._windows(torch.linspace(0, len(held) - self.seq_len - 2, n).long(), held)


# Each K3 addition as a change of the baseline config (see `variant_config`).
K3_VARIANTS = ("baseline", "latent MoE", "attention residuals", "gated MLA", "full-rank gate", "all four")


def variant_config(name: str, base: HybridConfig) -> HybridConfig:
    """`base` with one of Kimi K3's additions, at equal active parameters where the addition allows:

    - "latent MoE": the routed experts run in a latent of half the width l = D / 2, with twice as many experts
      and twice the top-k (LatentMoE's own recipe); their hidden width shrinks from h to `h - D / (3 top_k)`
      so that the active routed parameters and the two latent projections together, `2 top_k 3 l h' + 2 D l`,
      equal the baseline's active routed parameters `top_k 3 D h` (up to rounding and the larger router).
    - "attention residuals": block attention residuals over sums of one block (two sublayers).
    - "gated MLA": the MLA layers' sigmoid output gate.
    - "full-rank gate": the KDA output gate as one full matrix.
    - "all four": all of them.
    `base` needs an MoE (`base.ffn.num_experts >= 1`).
    """
    if name not in K3_VARIANTS:
        raise ValueError(f"name must be one of {K3_VARIANTS}, got {name!r}")
    if base.ffn.num_experts < 1:
        raise ValueError("variant_config needs a base config with an MoE (ffn.num_experts >= 1)")
    changes = {}
    if name in ("latent MoE", "all four"):
        f, D = base.ffn, base.d_model
        hidden = max(1, f.expert_hidden - round(D / (3 * f.top_k)))
        changes["ffn"] = dataclasses.replace(
            f, num_experts=2 * f.num_experts, top_k=2 * f.top_k, expert_hidden=hidden, latent_dim=D // 2
        )
    if name in ("attention residuals", "all four"):
        changes.update(attn_residuals="block", attn_res_block_size=2)
    if name in ("gated MLA", "all four"):
        changes["mla"] = dataclasses.replace(base.mla, output_gate=True)
    if name in ("full-rank gate", "all four"):
        changes["kda"] = dataclasses.replace(base.kda, full_rank="output")
    return dataclasses.replace(base, **changes)


def train_hybrid(
    config: HybridConfig,
    task,
    steps: int,
    seed: int,
    batch_size: int = 16,
    lr: float = 3e-3,
    bias_rate: float = 1e-3,
    eval_batch: TaskBatch | None = None,
    device: str | torch.device = "cpu",
) -> dict:
    """Train `HybridLM(config)` (initialised from `seed`) on `task.sample(batch_size, seed-dependent)` with
    AdamW (`kda_edu.training.train`'s optimiser and warm-up/cosine schedule), update the routing bias of every MoE by
    `bias_rate` after each step, and evaluate on `eval_batch` (default `task.sample(64, ...)` with a seed no
    training step uses). The model and the batches live on `device`; the data are drawn on the CPU.

    Returns:
        `{"eval_loss", "eval_acc", "train_loss" (mean of the last 10 steps), "parameters", "seconds"}`.
    """
    import time

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = HybridLM(config).to(device)
    train_cfg = TrainConfig(
        steps=steps, batch_size=batch_size, lr=lr, warmup=max(1, steps // 10), weight_decay=0.1
    )
    optimizer = make_optimizer(model, train_cfg)
    losses = []
    start = time.perf_counter()
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, train_cfg)
        batch = task.sample(batch_size, 1_000_003 * (seed + 1) + step).to(device)
        loss, _ = masked_loss_and_accuracy(model(batch.inputs), batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        model.update_routing_bias(bias_rate)
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    eval_batch = (task.sample(64, 999_999_937) if eval_batch is None else eval_batch).to(device)
    model.eval()
    with torch.no_grad():
        eval_loss, eval_acc = masked_loss_and_accuracy(model(eval_batch.inputs), eval_batch)
    return {
        "eval_loss": eval_loss.item(),
        "eval_acc": eval_acc.item(),
        "train_loss": sum(losses[-10:]) / len(losses[-10:]),
        "parameters": parameter_report(config),
        "seconds": seconds,
    }


def bits_per_byte(loss_nats: float) -> float:
    """A cross entropy in nats per byte, in bits per byte."""
    return loss_nats / math.log(2)
