"""AttentionMetadata: the per-step device tensors every attention layer receives."""
from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
        cache: tensors a backend derives from this step's metadata alone, built in the first
            layer and reused by the others (see :meth:`per_step`). Only valid for one step, so
            build a new ``AttentionMetadata`` per step (as the runner does).
    """

    query_start_loc: torch.Tensor | None
    seq_start_loc: torch.Tensor | None
    seq_lens: torch.Tensor | None
    block_table: torch.Tensor | None
    slot_mapping: torch.Tensor | None
    decode_only: bool
    backends: Mapping[str, AttentionBackend]
    cache: dict[Hashable, Any] = field(default_factory=dict, repr=False)

    def require(self, name: str, backend: str) -> torch.Tensor:
        value = getattr(self, name)
        if value is None:
            raise RuntimeError(
                f"attention backend {backend!r} read metadata field {name!r}, which it does not "
                "declare in its padding policy, so the runner did not build it")
        return value

    def per_step(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """``build()`` once per step under ``key`` (name it by everything ``build`` reads besides
        this metadata, e.g. block size and dtype); later layers get the same tensors.

        Under ``torch.compile`` the dict lives only while the step is traced, so the graph computes
        the value once and feeds it to every layer; inside a CUDA graph it is recomputed on each
        replay like any other op of the step."""
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]
