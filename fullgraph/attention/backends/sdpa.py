"""``sdpa``: the plain-PyTorch reference backend (CPU and GPU, capture-safe).

Mixed and prefill steps gather each request's pages through ``block_table`` at the static width
MB, mask from positions derived on the device (``seq_lens`` and ``query_start_loc``), and call
``F.scaled_dot_product_attention``: slow next to the kernels, but short enough to trust; every
other backend is tested against it.

Decode-only steps take a fast path, because inside a graph each small kernel costs a few
microseconds and the general path launches dozens per layer. The gather index and the mask bias
(``torch_ops.decode_index``) and the KV-write index depend only on the step, so they are built
once in the first layer and shared through ``metadata.per_step``; per layer only the KV write
(three kernels), one gather of K/V (whole cache slots through a flat index: CUDA's vectorized
gather) and the attention itself (bias copy, QK^T, softmax, PV) remain. It agrees with the
general path on every real row (tests check both against each other, NaN-poisoned cache included).
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
        slot_mapping = metadata.require("slot_mapping", self.name)
        safe, valid = metadata.per_step("sdpa_write", lambda: torch_ops.write_index(slot_mapping))
        torch_ops.write_kv_indexed(kv_cache, k, v, safe, valid)
        seq_lens = metadata.require("seq_lens", self.name)
        block_table = metadata.require("block_table", self.name)
        if metadata.decode_only:
            _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
            gather = torch_ops.DECODE_GATHER
            index, bias = metadata.per_step(
                ("sdpa_decode", gather, num_blocks, block_size, num_kv_heads, kv_cache.dtype),
                lambda: torch_ops.decode_index(seq_lens, block_table, block_size, num_kv_heads,
                                               num_blocks * block_size, kv_cache.dtype, gather))
            return torch_ops.decode_attention_op(q, kv_cache, index, bias, layer.scale, gather,
                                                 torch_ops.DECODE_ATTENTION)
        return torch_ops.paged_attention_op(q, kv_cache, metadata.require("query_start_loc", self.name),
                                            seq_lens, block_table, layer.scale, False)
