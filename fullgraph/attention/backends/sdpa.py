"""``sdpa``: the plain-PyTorch reference backend (CPU and GPU, capture-safe).

Mixed and prefill steps gather each request's pages through ``block_table`` at the static width
MB, mask from positions derived on the device (``seq_lens`` and ``query_start_loc``), and call
``F.scaled_dot_product_attention``: slow next to the kernels, but short enough to trust; every
other backend is tested against it. Its KV write is the plain-PyTorch one too (``kv_write =
"reference"``), so a bug in the Triton write shows against it.

Decode-only steps take a fast path, because inside a graph each small kernel costs a few
microseconds and the general path launches dozens per layer. The gather index and the mask bias
(``reference.decode_index``) depend only on the step, so they are built once in the first layer
and shared through ``metadata.per_step``; per layer only one gather of K/V (whole cache slots
through a flat index: CUDA's vectorized gather) and the attention itself (bias copy, QK^T,
softmax, PV) remain. It agrees with the general path on every real row (tests check both against
each other, NaN-poisoned cache included). ``decode_gather`` / ``decode_attention`` choose its
variants (see ``reference``); a subclass may change them.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from ...padding import PaddingPolicy
from .. import reference
from ..interface import AttentionBackend, AttentionMetadata, register_backend


@register_backend
class SdpaBackend(AttentionBackend):
    name = "sdpa"
    kinds = frozenset({"dense"})
    kv_write = "reference"
    policy = PaddingPolicy(
        name="sdpa",
        reads=frozenset({"query_start_loc", "seq_lens", "block_table", "slot_mapping"}),
        graph_steps=frozenset({"mixed", "decode"}),
    )
    decode_gather: ClassVar[str] = "slots"       # one of reference.DECODE_GATHERS
    decode_attention: ClassVar[str] = "matmul"   # one of reference.DECODE_ATTENTIONS

    def forward(self, layer, q: torch.Tensor, k, v, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        seq_lens = metadata.require("seq_lens", self.name)
        block_table = metadata.require("block_table", self.name)
        window = layer.sliding_window or 0
        if metadata.decode_only:
            _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
            gather = self.decode_gather
            index, bias = metadata.per_step(
                ("sdpa_decode", gather, num_blocks, block_size, num_kv_heads, kv_cache.dtype, window),
                lambda: reference.decode_index(seq_lens, block_table, block_size, num_kv_heads,
                                               num_blocks * block_size, kv_cache.dtype, gather, window))
            out = reference.decode_attention_op(q, kv_cache, index, bias, layer.scale, gather, self.decode_attention)
            live = metadata.per_step("sdpa_live", lambda: (seq_lens > 0)[:, None, None])    # (R, 1, 1)
            return torch.where(live, out, 0.0)   # padded requests: zeros, as the general path gives
        return reference.paged_attention_op(q, kv_cache, metadata.require("query_start_loc", self.name),
                                            seq_lens, block_table, layer.scale, False, None, window)
