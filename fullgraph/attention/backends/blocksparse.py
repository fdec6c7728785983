"""``blocksparse``: Phi-3-Small's block-sparse attention (local + vertical-stride blocks).

Capture-safe. On CPU (and as the reference) it runs the plain-PyTorch paged path with the
pattern computed from positions on the fly (``BlockSparseConfig.keep``): no dense
``max_len x max_len`` mask is ever stored.
"""
from __future__ import annotations

import torch

from ...padding import PaddingPolicy
from .. import torch_ops
from ..metadata import AttentionMetadata
from .base import AttentionBackend, BackendLimits, register_backend


@register_backend
class BlockSparseBackend(AttentionBackend):
    name = "blocksparse"
    kinds = frozenset({"blocksparse"})
    policy = PaddingPolicy(
        name="blocksparse",
        reads=frozenset({"query_start_loc", "seq_start_loc", "seq_lens", "block_table", "slot_mapping"}),
        graph_steps=frozenset({"mixed", "decode"}),
    )

    def __init__(self, limits: BackendLimits, layers) -> None:
        super().__init__(limits, layers)
        for layer in layers:
            layer.sparse.check_page_size(limits.block_size)

    def forward(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        torch_ops.write_kv(kv_cache, k, v, metadata.require("slot_mapping", self.name))
        sparse, num_heads = layer.sparse, layer.num_heads
        return torch_ops.paged_attention(
            q, kv_cache, metadata.require("query_start_loc", self.name),
            metadata.require("seq_lens", self.name), metadata.require("block_table", self.name),
            scale=layer.scale, decode_only=metadata.decode_only,
            keep=lambda q_pos, k_pos: sparse.keep(num_heads, q_pos, k_pos))
