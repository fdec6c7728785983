"""The attention layer models use: projections stay in the model, this dispatches to a backend."""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from .metadata import AttentionMetadata


class Rotary(Protocol):
    """What the layer needs of a rotary embedding (``models.layers.RotaryEmbedding`` owns the tables)."""

    cos: torch.Tensor  # (P, D/2) float32
    sin: torch.Tensor

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (q (T, H, D), k (T, KVH, D)); q may be the grouped view (T, KVH, G, D)."""

    def fusable(self, x: torch.Tensor) -> bool:
        """Whether fused kernels may apply the rotation for ``x`` (CUDA, kernels on, not tracing)."""


class Attention(nn.Module):
    """Paged attention over new tokens and the KV cache of their requests.

    ``forward`` writes the new keys/values into ``kv_cache`` at ``metadata.slot_mapping`` and
    attends causally over each request's whole sequence. It is capture-safe: no host syncs,
    no data-dependent shapes (the backends guarantee it).

    Given ``rope`` and ``positions``, q and k arrive unrotated and the layer applies the rotation:
    a backend with ``fuses_rope`` folds it into its KV write when ``rope.fusable(q)`` (one launch,
    rotated keys go straight to the cache); otherwise ``rope(positions, q, k)`` runs first and the
    backend gets rotated q, k as without ``rope``. Both mean the same.

    Args:
        num_heads, num_kv_heads, head_dim: query heads, KV heads (GQA), head size.
        scale: softmax scale (1/sqrt(head_dim) for Llama; models may differ).
        kind: "dense" or "blocksparse"; the runner maps each kind to a backend.
        sparse: the block-sparse pattern when ``kind == "blocksparse"``.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
                 kind: str = "dense", sparse=None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if (kind == "blocksparse") != (sparse is not None):
            raise ValueError('a "blocksparse" attention layer needs its sparse config (and only it)')
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.kind, self.sparse = scale, kind, sparse

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, *, rope: Rotary | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        # q: (T, num_heads, head_dim), or grouped (T, num_kv_heads, G, head_dim) with rope;
        # k, v: (T, num_kv_heads, head_dim) -> (T, num_heads * head_dim)
        if (rope is None) != (positions is None):
            raise ValueError("Attention.forward takes rope and positions together (or neither)")
        backend = metadata.backends[self.kind]
        if rope is not None and backend.fuses_rope and rope.fusable(q):
            out = backend.forward(self, q, k, v, kv_cache, metadata, rope=rope, positions=positions)
        else:
            if rope is not None:
                q, k = rope(positions, q, k)
            out = backend.forward(self, q, k, v, kv_cache, metadata)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"scale={self.scale:.4g}, kind={self.kind}")
