"""Serving a hybrid model: the decoding path of chapter 13.

- `decoder`: `ServingDecoder` (preallocated pools, continuous batching, absorbed MLA and KDA with state
  indices, the step as a CUDA graph) and `mla_append` (one append into a preallocated MLA cache).
"""

from kda_edu.models.serving.decoder import ServingDecoder, mla_append

__all__ = ["ServingDecoder", "mla_append"]
