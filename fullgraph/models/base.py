"""The model protocol: what a model must provide to be wrapped by ``FullGraphRunner``.

A model is a plain ``nn.Module`` with:

- ``vocab_size: int``
- ``attention_layers() -> list[Attention]``: its attention layers in the order of ``kv_caches``
  (the runner allocates one cache per entry, shaped from the layer's heads and head size, and maps
  each layer's ``kind`` to a backend).
- ``forward(input_ids, positions, kv_caches, metadata) -> hidden``: ``input_ids`` and
  ``positions`` are (T,) int64, ``kv_caches`` a list of per-layer caches, ``metadata`` an
  ``AttentionMetadata``; returns (T, hidden_size). It must be capture-safe: no host syncs, no
  data-dependent shapes; everything per-step comes in through these arguments.
- ``compute_logits(hidden) -> logits``: (N, hidden_size) -> (N, vocab_size) float32, including
  any final scaling or masking the model defines.

Optional: ``layers``, an ``nn.ModuleList`` of decoder layers, each returning its hidden state
(or ``(output, residual)`` whose sum is it): ``fullgraph.debug.compare`` hooks them to find the
first layer where two modes diverge.

The model never sees the runner, the planner or the static buffers.
"""
from __future__ import annotations

from torch import nn

from ..attention import Attention


def check_model(model: nn.Module) -> list[Attention]:
    """Validate the protocol; returns the attention layers."""
    missing = [name for name in ("vocab_size", "attention_layers", "forward", "compute_logits")
               if not hasattr(model, name)]
    if missing:
        raise ValueError(f"{type(model).__name__} does not follow the model protocol: missing {missing} "
                         "(see fullgraph.models.base)")
    layers = list(model.attention_layers())
    if not layers or not all(isinstance(layer, Attention) for layer in layers):
        raise ValueError(f"{type(model).__name__}.attention_layers() must return a non-empty list of Attention layers")
    return layers
