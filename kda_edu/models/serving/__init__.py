"""Serving a hybrid model: the decoding path of chapter 13 and a small engine for agentic workloads.

- `decoder`: `ServingDecoder` (preallocated pools, continuous batching, absorbed MLA and KDA with state
  indices, the step as a CUDA graph) and `mla_append` (one append into a preallocated MLA cache).
- `engine`: `Engine`, greedy generation for many requests with paged MLA caches, prefix caching (MLA blocks
  and KDA state snapshots) and chunked prefill mixed with decodes; built from `blocks` (the block pool and
  prefix index), `paged_mla` (the paged latent cache), `kda_prefix` (KDA state slots and snapshots) and
  `scheduler` (the token budget's pieces).
- `graphs`: CUDA-graph buckets for the decoder's step (a batch padded to the next captured size).
- `workload`: `agent_sessions`, a seeded agent workload (turns over a growing history), and `replay`, which
  plays it through the engine as concurrent agents; the engine does not depend on it.
"""

from kda_edu.models.serving.blocks import BlockPool
from kda_edu.models.serving.decoder import ServingDecoder, mla_append
from kda_edu.models.serving.engine import Engine
from kda_edu.models.serving.workload import AgentSession, AgentTurn, agent_sessions, replay

__all__ = [
    "AgentSession",
    "AgentTurn",
    "BlockPool",
    "Engine",
    "ServingDecoder",
    "agent_sessions",
    "mla_append",
    "replay",
]
