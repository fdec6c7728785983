"""AttentionMetadata: the per-step device tensors every attention layer receives."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .backends.base import AttentionBackend


@dataclass
class AttentionMetadata:
    """Metadata of one step (views of the static buffers in padded/graph modes).

    Shapes: T tokens (padded), R requests (padded), MB = max blocks per sequence.
    A field no active backend reads is ``None``: a backend that reads a field it did not declare
    fails loudly instead of reading stale memory.

    Attributes:
        query_start_loc: (R + 1,) int32, cu_seqlens of the new tokens.
        seq_start_loc: (R + 1,) int32, cu_seqlens of whole sequences (context + new).
        seq_lens: (R,) int32, context + new tokens per request (0 for padded requests).
        block_table: (R, MB) int32, KV pages per request (null block 0 where unused).
        slot_mapping: (T,) int64, flat cache slot of each new token (-1: do not write).
        decode_only: every real request has exactly one new token (a static property of the
            graph key, so backends may branch on it on the host).
        backends: attention kind ("dense", "blocksparse") -> the backend serving it.
    """

    query_start_loc: torch.Tensor | None
    seq_start_loc: torch.Tensor | None
    seq_lens: torch.Tensor | None
    block_table: torch.Tensor | None
    slot_mapping: torch.Tensor | None
    decode_only: bool
    backends: Mapping[str, AttentionBackend]

    def require(self, name: str, backend: str) -> torch.Tensor:
        value = getattr(self, name)
        if value is None:
            raise RuntimeError(
                f"attention backend {backend!r} read metadata field {name!r}, which it does not "
                "declare in its padding policy, so the runner did not build it")
        return value
