"""kda_edu: the code behind the book "From softmax attention to Kimi Delta Attention".

The package is a library plus the book's experiments (CONTRIBUTING.md has the tree and the rules):

- `kda_edu.ops`: reference operators, the equations in plain PyTorch (softmax attention to KDA);
- `kda_edu.kernels`: the Triton kernels (imported on demand: ``import kda_edu`` never imports Triton);
- `kda_edu.layers`: `torch.nn` layers (KDA, MLA, feed-forward, the recall mixers);
- `kda_edu.models`: the hybrid language model, its checkpoints and its cost accounting;
- `kda_edu.training`: the synthetic tasks and the training loop;
- `kda_edu.chapters`: each chapter's own experiments and measurements; `kda_edu.exercises`: the checkers;
- `kda_edu.device`, `kda_edu.plotting`, `kda_edu.book`: where the notebooks run, their figures, their helpers.

The names below are the public API: the model and its layers, and the reference operators.
"""

__version__ = "0.1.0"

from kda_edu.layers.kda_layer import KDAConfig, KDALayer
from kda_edu.layers.mla import MLA, MLAConfig
from kda_edu.models.model import HybridConfig, HybridLM
from kda_edu.ops.attention import softmax_attention, softmax_attention_step
from kda_edu.ops.delta_rule import delta_rule_chunked, delta_rule_recurrent
from kda_edu.ops.gated_delta import gated_delta_chunked, gated_delta_recurrent
from kda_edu.ops.kda import kda_chunked, kda_recurrent, kda_step
from kda_edu.ops.linear_attention import (
    linear_attention_chunked,
    linear_attention_parallel,
    linear_attention_recurrent,
)
from kda_edu.ops.recurrence import general_recurrence

__all__ = [
    "HybridConfig",
    "HybridLM",
    "KDAConfig",
    "KDALayer",
    "MLA",
    "MLAConfig",
    "delta_rule_chunked",
    "delta_rule_recurrent",
    "gated_delta_chunked",
    "gated_delta_recurrent",
    "general_recurrence",
    "kda_chunked",
    "kda_recurrent",
    "kda_step",
    "linear_attention_chunked",
    "linear_attention_parallel",
    "linear_attention_recurrent",
    "softmax_attention",
    "softmax_attention_step",
]
