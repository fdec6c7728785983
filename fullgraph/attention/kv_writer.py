"""KVWriter: the one place a step's new keys and values go into the paged KV cache.

The ``Attention`` layer calls its backend's writer before the backend's ``forward``, so no backend
writes the cache itself. Two implementations, one contract (slot -1 writes nothing; the cache is
byte-identical there):

- ``"kernel"``: our Triton ``kv_write``; given a rotary embedding that ``fusable`` allows, the
  fused ``rope_kv_write`` rotates q and stores rotated keys in one launch (the rotated k then
  never exists as a tensor, unless the caller asks to keep it).
- ``"reference"``: plain PyTorch (``reference.write_kv_indexed``), RoPE applied first; the
  write index depends only on the step, so it is built once and shared by every layer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import reference

if TYPE_CHECKING:
    from .interface import AttentionMetadata, Rotary


def _kernels():
    try:
        from .. import kernels
    except ImportError:  # no Triton (e.g. macOS)
        return None
    return kernels


class KVWriter:
    IMPLS = ("kernel", "reference", "auto")

    def __init__(self, impl: str) -> None:
        if impl not in ("kernel", "reference"):
            raise ValueError(f"KVWriter impl must be 'kernel' or 'reference', got {impl!r}")
        self.impl = impl
        self._kernels = _kernels() if impl == "kernel" else None
        if impl == "kernel" and self._kernels is None:
            raise ValueError("KVWriter 'kernel' needs the Triton kernels, which cannot be imported here")

    @classmethod
    def for_backend(cls, impl: str, device: torch.device) -> KVWriter:
        """``impl`` resolved for ``device``: "auto" is the kernel on CUDA (when Triton imports), else the reference."""
        if impl == "auto":
            impl = "kernel" if torch.device(device).type == "cuda" and _kernels() is not None else "reference"
        return cls(impl)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 metadata: AttentionMetadata, rope: Rotary | None = None, positions: torch.Tensor | None = None,
                 keep_kv: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Write the new keys/values at ``metadata.slot_mapping``; returns (q rotated (T, H, D),
        k rotated, v) — k and v are None when RoPE was fused into the write and not ``keep_kv``.

        q: (T, H, D), or grouped (T, KVH, G, D) with ``rope``; k, v: (T, KVH, D), unrotated when
        ``rope`` is given; kv_cache: (2, num_blocks, block_size, KVH, D).
        """
        slot_mapping = metadata.require("slot_mapping", "KVWriter")
        if self.impl == "kernel":
            if rope is not None and not keep_kv and rope.fusable(q):
                q = self._kernels.rope_kv_write(query=q, key=k, value=v, kv_cache=kv_cache, slot_mapping=slot_mapping,
                                                positions=positions, cos=rope.cos, sin=rope.sin)   # (T, H, D)
                return q, None, None
            if rope is not None:
                q, k = rope(positions, q, k)
            self._kernels.kv_write(key=k, value=v, kv_cache=kv_cache, slot_mapping=slot_mapping)
            return q.reshape(q.shape[0], -1, q.shape[-1]), k, v
        if rope is not None:
            q, k = rope(positions, q, k)
        safe, valid = metadata.per_step("kv_write_index", lambda: reference.write_index(slot_mapping))
        reference.write_kv_indexed(kv_cache, k, v, safe, valid)
        return q.reshape(q.shape[0], -1, q.shape[-1]), k, v

    def __repr__(self) -> str:
        return f"KVWriter({self.impl!r})"
