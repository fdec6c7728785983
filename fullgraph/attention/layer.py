"""The attention layer models use: projections stay in the model; this writes the KV cache once
(through the backend's ``KVWriter``) and dispatches the attention itself to a backend."""
from __future__ import annotations

import torch
from torch import nn

from .. import env
from .interface import AttentionMetadata, Rotary


class Attention(nn.Module):
    """Paged attention over new tokens and the KV cache of their requests.

    ``forward`` writes the new keys/values into ``kv_cache`` at ``metadata.slot_mapping`` and
    attends causally over each request's whole sequence (or its last ``sliding_window`` tokens).
    It is capture-safe: no host syncs, no data-dependent shapes (the backends guarantee it).

    Given ``rope`` and ``positions``, q and k arrive unrotated and are rotated here: inside the KV
    write where the writer's kernels can fuse it (one launch, rotated keys go straight to the
    cache), else before it. Both mean the same.

    Args:
        num_heads, num_kv_heads, head_dim: query heads, KV heads (GQA), head size.
        scale: softmax scale (1/sqrt(head_dim) for Llama; models may differ).
        kind: "dense" or "blocksparse"; the runner maps each kind to a backend.
        sparse: the block-sparse pattern when ``kind == "blocksparse"``.
        sliding_window: attend only to the last ``sliding_window`` positions (the query's own
            included), as Mistral / Qwen2 do; None: the whole sequence.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
                 kind: str = "dense", sparse=None, sliding_window: int | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if (kind == "blocksparse") != (sparse is not None):
            raise ValueError('a "blocksparse" attention layer needs its sparse config (and only it)')
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
        if sliding_window is not None and kind != "dense":
            raise ValueError(f"sliding_window is a property of dense layers; a {kind!r} layer has its own pattern")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.kind, self.sparse, self.sliding_window = scale, kind, sparse, sliding_window
        self.fuse_rope = "rope" in env.fused()  # read once, at construction

    def projection_writes(self, metadata: AttentionMetadata, rope: Rotary | None, x: torch.Tensor) -> bool:
        """Whether the projection that makes q, k and v from ``x`` may rotate them and write k and v
        into the cache itself (one kernel: ``kernels.linear_rope_kv_write``): switched on
        (``FULLGRAPH_FUSE=rope``, the default), the backend writes with our kernel, reads the new
        keys from the cache, and the rotation fuses for ``x``. Models ask only when their QKV
        projection takes the kernel path (``Linear.uses_kernel``: one row, batch-1 decode).
        The layer is then called with ``written=True``."""
        backend = metadata.backends[self.kind]
        return (rope is not None and backend.kv_writer.impl == "kernel" and not backend.reads_new_kv
                and rope.fusable(x) and self.fuse_rope)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, *, rope: Rotary | None = None,
                positions: torch.Tensor | None = None, written: bool = False) -> torch.Tensor:
        # q: (T, num_heads, head_dim), or grouped (T, num_kv_heads, G, head_dim) with rope;
        # k, v: (T, num_kv_heads, head_dim) -> (T, num_heads * head_dim). written: q is rotated and
        # the new keys and values are in the cache already (``projection_writes``); k, v are None.
        if (rope is None) != (positions is None):
            raise ValueError("Attention.forward takes rope and positions together (or neither)")
        backend = metadata.backends[self.kind]
        if written:
            if k is not None or v is not None or rope is not None or backend.reads_new_kv:
                raise ValueError("Attention.forward(written=True) takes the rotated q alone (k, v, rope None), for a "
                                 f"backend that reads the new keys from the cache ({backend.name!r} does not)")
        else:
            q, k, v = backend.kv_writer(q, k, v, kv_cache, metadata, rope, positions, keep_kv=backend.reads_new_kv)
        out = backend.forward(self, q, k, v, kv_cache, metadata)                     # (T, H, D)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        window = f", sliding_window={self.sliding_window}" if self.sliding_window else ""
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"scale={self.scale:.4g}, kind={self.kind}{window}")
