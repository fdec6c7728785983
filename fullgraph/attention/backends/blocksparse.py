"""``blocksparse``: Phi-3-Small's block-sparse attention (local + vertical-stride blocks).

Two implementations behind one contract, picked once at construction:

- ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``): the block-sparse kernels of
  ``fullgraph.kernels`` over a :class:`BlockSparseLayout` built once per (pattern, heads) on the
  device. Mixed steps run the varlen prefill kernel (chunked prefill and cached context included;
  decode tokens of a mixed step are 1-token chunks); decode-only steps run the GQA-packed split-KV
  paged decode kernel over a :class:`BlockSparseGroupLayout` (each KV head reads the union of its
  query heads' blocks once), whose partial buffers are allocated here, once, from
  ``BackendLimits``. Its KV writer is the Triton one: ``rope_kv_write`` rotates q and stores rotated keys
  and values in one launch, where RoPE and then the write took two.
- ``"torch"`` (CPU otherwise; also the test path): plain PyTorch over the gathered pages with the
  pattern computed from positions on the fly; no dense ``max_len x max_len`` mask is ever stored;
  the plain-PyTorch KV write.

Capture-safe: ``forward`` has no host syncs, no data-dependent shapes and branches only on
``metadata.decode_only`` and tensor shapes. Heads are global (``head_offset``), so prefill, decode
and every tensor-parallel rank use the same pattern.
"""
from __future__ import annotations

import logging

import torch

from ... import env
from ...padding import PaddingPolicy
from .. import reference
from ..blocksparse import BlockSparseConfig, BlockSparseGroupLayout, BlockSparseLayout, build_group_layout, build_layout
from ..interface import AttentionBackend, AttentionMetadata, BackendLimits, register_backend
from ..kv_writer import KVWriter

logger = logging.getLogger("fullgraph")
IMPLS = ("auto", "triton", "torch")


def triton_unsupported_reason(limits: BackendLimits, layers) -> str | None:
    """Why the Triton kernels cannot serve these layers (None when they can)."""
    for layer in layers:
        d, b = layer.head_dim, layer.sparse.block_size
        if d < 16 or d > 256 or d & (d - 1):
            return f"head_dim {d} is not a power of two in [16, 256]"
        if b < 16:
            return f"sparse block_size {b} < 16 (the kernels tile by the sparse block)"
    if limits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {limits.dtype} is not float16/bfloat16/float32"
    return None


@register_backend
class BlockSparseBackend(AttentionBackend):
    name = "blocksparse"
    kinds = frozenset({"blocksparse"})
    policy = PaddingPolicy(
        name="blocksparse",
        reads=frozenset({"query_start_loc", "seq_lens", "block_table", "slot_mapping"}),
        graph_steps=frozenset({"mixed", "decode"}),
    )

    impl_choice: str = "auto"  # a subclass may pin "triton" or "torch"

    def __init__(self, limits: BackendLimits, layers, *, impl: str | None = None) -> None:
        super().__init__(limits, layers)
        impl = self.impl_choice if impl is None else impl
        for layer in layers:
            layer.sparse.check_page_size(limits.block_size)
        self.impl = self._pick_impl(impl, limits, layers)
        self.kv_writer = KVWriter("kernel" if self.impl == "triton" else "reference")
        self._layouts: dict[tuple[BlockSparseConfig, int], BlockSparseLayout] = {}
        self._group_layouts: dict[tuple[BlockSparseConfig, int, int], BlockSparseGroupLayout] = {}
        if self.impl == "triton":
            self._init_triton(limits, layers)

    @staticmethod
    def _pick_impl(impl: str, limits: BackendLimits, layers) -> str:
        if impl not in IMPLS:
            raise ValueError(f"BlockSparseBackend impl must be one of {IMPLS}, got {impl!r}")
        reason = triton_unsupported_reason(limits, layers)
        if impl == "triton" and reason:
            raise ValueError(f"blocksparse impl='triton' cannot serve these layers: {reason}")
        if impl != "auto":
            return impl
        # the interpreter runs the same kernels on CPU tensors
        if limits.device.type != "cuda" and not env.triton_interpret():
            return "torch"
        if reason:
            logger.info("fullgraph: blocksparse uses the PyTorch path: %s", reason)
            return "torch"
        return "triton"

    def _init_triton(self, limits: BackendLimits, layers) -> None:
        # Imported here: Triton kernels are defined in interpreter or compiled mode at import time.
        from ...kernels.blocksparse_decode import blocksparse_decode, decode_num_splits
        from ...kernels.blocksparse_prefill import blocksparse_prefill
        self._prefill, self._decode, self._num_splits = blocksparse_prefill, blocksparse_decode, decode_num_splits
        for layer in layers:
            key = (layer.sparse, layer.num_heads)
            if key not in self._layouts:
                self._layouts[key] = build_layout(layer.sparse, layer.num_heads, limits.max_model_len, limits.device)
            if key + (layer.num_kv_heads,) not in self._group_layouts:
                self._group_layouts[key + (layer.num_kv_heads,)] = build_group_layout(self._layouts[key],
                                                                                     layer.num_kv_heads)
        # Split-KV workspace, shared by every layer (they run one after another): sized for the
        # largest R * H * splits any decode step can ask for.
        rows = max(r * glay.layout.num_heads * self._splits(r, glay)
                   for glay in self._group_layouts.values() for r in range(1, limits.max_num_seqs + 1))
        head_dim = max(layer.head_dim for layer in layers)
        self._partial_out = torch.empty(rows, head_dim, dtype=torch.float32, device=limits.device)
        self._partial_ml = torch.empty(rows, 2, dtype=torch.float32, device=limits.device)
        # FULLGRAPH_FUSE=reduce: the last split merges in the decode launch, counted in here (zero
        # between launches, never poisoned: not a workspace).
        self._arrivals = None
        if "reduce" in env.fused():
            heads = max(glay.num_kv_heads for glay in self._group_layouts.values())
            self._arrivals = torch.zeros(limits.max_num_seqs * heads, dtype=torch.int32, device=limits.device)

    def _splits(self, num_reqs: int, glay: BlockSparseGroupLayout) -> int:
        return self._num_splits(num_reqs, glay.num_kv_heads, glay.width, glay.layout.config.block_size)

    def layout(self, layer) -> BlockSparseLayout:
        """The per-head device layout serving ``layer``'s prefill (Triton implementation only)."""
        return self._layouts[(layer.sparse, layer.num_heads)]

    def group_layout(self, layer) -> BlockSparseGroupLayout:
        """The per-KV-head union layout serving ``layer``'s decode (Triton implementation only)."""
        return self._group_layouts[(layer.sparse, layer.num_heads, layer.num_kv_heads)]

    def workspaces(self) -> dict[str, torch.Tensor]:
        if self.impl != "triton":
            return {}
        return {"partial_out": self._partial_out, "partial_ml": self._partial_ml}

    def forward(self, layer, q: torch.Tensor, k, v, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        # q: (T, H, D) rotated; kv_cache holds this step's keys -> (T, H, D)
        qsl = metadata.require("query_start_loc", self.name)
        seq_lens = metadata.require("seq_lens", self.name)
        block_table = metadata.require("block_table", self.name)
        if self.impl == "torch":
            return blocksparse_attention_torch(q, kv_cache, qsl, seq_lens, block_table, scale=layer.scale,
                                               decode_only=metadata.decode_only, sparse=layer.sparse)
        block = layer.sparse.block_size
        if metadata.decode_only and q.shape[0] == seq_lens.shape[0]:
            glay = self.group_layout(layer)
            return self._decode(q, kv_cache, seq_lens, block_table, glay.counts, glay.entries,
                                self._partial_out, self._partial_ml, sm_scale=layer.scale,
                                sparse_block_size=block, num_splits=self._splits(seq_lens.shape[0], glay),
                                arrivals=self._arrivals)
        layout = self.layout(layer)
        return self._prefill(q, kv_cache, qsl, seq_lens, block_table, layout.counts, layout.indices,
                             sm_scale=layer.scale, sparse_block_size=block)


def blocksparse_attention_torch(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                                seq_lens: torch.Tensor, block_table: torch.Tensor, *, scale: float,
                                decode_only: bool, sparse: BlockSparseConfig) -> torch.Tensor:
    """Plain-PyTorch block-sparse paged attention; shapes as ``reference.paged_attention``.

    The pattern is computed per step from positions (``BlockSparseConfig.keep``), sized by the
    padded step (R, H, Qm, L), never max_len x max_len.
    """
    return reference.paged_attention_op(q, kv_cache, query_start_loc, seq_lens, block_table, scale,
                                        decode_only, sparse.as_ints())
