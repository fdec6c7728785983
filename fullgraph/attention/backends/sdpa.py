"""``sdpa``: the plain-PyTorch reference backend (CPU and GPU, capture-safe).

Gathers each request's pages through ``block_table`` at the static width MB, masks from
positions derived on the device (``seq_lens`` and ``query_start_loc``), and calls
``F.scaled_dot_product_attention``. Slow next to the kernels, but short enough to trust; every
other backend is tested against it.
"""
from __future__ import annotations

import torch

from ...padding import PaddingPolicy
from .. import torch_ops
from ..metadata import AttentionMetadata
from .base import AttentionBackend, register_backend


@register_backend
class SdpaBackend(AttentionBackend):
    name = "sdpa"
    kinds = frozenset({"dense"})
    policy = PaddingPolicy(
        name="sdpa",
        reads=frozenset({"query_start_loc", "seq_lens", "block_table", "slot_mapping"}),
        graph_steps=frozenset({"mixed", "decode"}),
    )

    def forward(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        torch_ops.write_kv(kv_cache, k, v, metadata.require("slot_mapping", self.name))
        return torch_ops.paged_attention_op(
            q, kv_cache, metadata.require("query_start_loc", self.name),
            metadata.require("seq_lens", self.name), metadata.require("block_table", self.name),
            layer.scale, metadata.decode_only)
