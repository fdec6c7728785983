"""``triton``: the Triton paged-attention backend (CUDA; CPU only under ``TRITON_INTERPRET=1``).

A layer runs two launches. Before ``forward``, the layer's KV writer (``kv_write = "kernel"``)
puts the step's new keys/values in the cache at ``slot_mapping`` (slot -1 skipped, so padding
never touches the cache), rotating q and the keys in the same launch (``rope_kv_write``) where
the rotary embedding allows. Then ``forward`` runs one ``paged_attention`` launch that reads every
key from the cache for the whole step: prefill, chunked prefill with cached context, decode and
mixed batches alike. Decode steps split long contexts over several programs (split-KV) and merge
the partials in a second, tiny launch (or, with ``FULLGRAPH_FUSE=reduce``, in the same launch: the
last split to finish merges). Sliding-window layers skip the pages wholly outside the
window (the kernel's loop starts at the window), and their splits divide only the window.

Capture-safe, because:
* both launchers take their grids from static shapes (T, R, the block-table width) and read the
  lengths from device tensors inside the kernels: no ``.item()``/``.cpu()``, no host branch on values;
* the padding policy keeps ``query_start_loc`` non-decreasing (tail repeats the last value), which
  the kernel's on-device binary search needs; padded requests have ``seq_len`` 0 and the null
  block, padded tokens slot -1 (written rows get zeros, the cache is untouched);
* the split count is a function of R (static per graph), the KV head count, ``max_model_len`` and
  the SM count, never of ``seq_lens``; its float32 workspaces are allocated here, once, at the size
  the largest split layout needs, so no step allocates data-dependent memory or moves an address;
* launch configurations are fixed per (head_dim, dtype, step kind): no autotuning inside capture.
"""
from __future__ import annotations

import torch

from ... import env
from ...padding import PaddingPolicy
from ..interface import AttentionBackend, AttentionMetadata, BackendLimits, register_backend

try:
    from ...kernels import num_kv_splits, paged_attention, split_workspace_rows
    _IMPORT_ERROR: str | None = None
except ImportError as exc:  # triton missing (e.g. macOS): the backend reports itself unsupported
    _IMPORT_ERROR = f"the Triton kernels cannot be imported ({exc})"

MIN_PAGE_SIZE = 16
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# CPU stand-in for the SM count, so the interpreter runs split decode on small batches too.
INTERPRET_NUM_SMS = 8


def _head_dim_reason(head_dim: int) -> str | None:
    if 16 <= head_dim <= 256 and head_dim % 8 == 0:
        return None
    return f"head_dim {head_dim} is unsupported (need a multiple of 8 in [16, 256], e.g. 64, 80, 96, 128, 256)"


@register_backend
class TritonBackend(AttentionBackend):
    """Paged attention and KV write in Triton (see the module docstring for capture safety)."""

    name = "triton"
    kinds = frozenset({"dense"})
    kv_write = "kernel"
    policy = PaddingPolicy(
        name="triton",
        reads=frozenset({"query_start_loc", "seq_lens", "block_table", "slot_mapping"}),
        graph_steps=frozenset({"mixed", "decode"}),
    )

    def __init__(self, limits: BackendLimits, layers: list) -> None:
        super().__init__(limits, layers)
        reason = self.unsupported_reason(limits.device, limits.dtype, layers)
        if reason:
            raise ValueError(f"attention backend 'triton': {reason}")
        page = limits.block_size
        if page < MIN_PAGE_SIZE or page & (page - 1):
            raise ValueError(f"attention backend 'triton' needs block_size a power of two >= {MIN_PAGE_SIZE}, "
                             f"got {page}; set RunnerConfig.block_size (e.g. 16 or 64)")
        device = torch.device(limits.device)
        if device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        else:
            self.num_sms = INTERPRET_NUM_SMS
        out_numel = lse_numel = 0
        for layer in layers:
            rows = split_workspace_rows(limits.max_num_seqs, layer.num_kv_heads, limits.max_model_len,
                                        self.num_sms) * layer.num_heads
            out_numel = max(out_numel, rows * (1 << (layer.head_dim - 1).bit_length()))
            lse_numel = max(lse_numel, rows)
        # Shared by every layer: layers run one after another on one stream. Every split writes
        # its rows before the reduce reads them, so validate mode may poison them (workspaces).
        self.part_out = torch.empty(out_numel, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(lse_numel, dtype=torch.float32, device=device)
        # FULLGRAPH_FUSE=reduce: the last split of a (request, KV head) merges the partials in the
        # attention launch itself, counted in here. Not a workspace: zero between launches (each
        # launch leaves it so), never poisoned.
        self.arrivals = None
        if "reduce" in env.fused():
            heads = max((layer.num_kv_heads for layer in layers), default=1)
            self.arrivals = torch.zeros(limits.max_num_seqs * heads, dtype=torch.int32, device=device)

    @classmethod
    def unsupported_reason(cls, device: torch.device, dtype: torch.dtype, layers: list) -> str | None:
        if _IMPORT_ERROR:
            return _IMPORT_ERROR
        device = torch.device(device)
        if device.type != "cuda" and not env.triton_interpret():
            return f"needs a CUDA device (got {device}); on CPU set TRITON_INTERPRET=1 before importing fullgraph"
        if dtype not in DTYPES:
            return f"dtype {dtype} is unsupported (need one of {[str(d) for d in DTYPES]})"
        if device.type == "cuda" and not env.triton_interpret() and dtype == torch.bfloat16 \
                and torch.cuda.get_device_capability(device) < (8, 0):
            return "bfloat16 tensor-core dots need compute capability >= 8.0"
        for layer in layers:
            reason = _head_dim_reason(layer.head_dim)
            if reason:
                return reason
        return None

    def num_splits(self, num_reqs: int, num_kv_heads: int, window: int = 0) -> int:
        """Split-KV count of a decode step with R = ``num_reqs`` (static per graph key); a sliding
        window bounds the keys one request reads, so it bounds the splits too."""
        keys = min(window, self.limits.max_model_len) if window else self.limits.max_model_len
        return num_kv_splits(num_reqs, num_kv_heads, keys, self.num_sms)

    def workspaces(self) -> dict[str, torch.Tensor]:
        return {"part_out": self.part_out, "part_lse": self.part_lse}

    def forward(self, layer, q: torch.Tensor, k, v, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        # q: (T, H, D) rotated; kv_cache: (2, num_blocks, block_size, KVH, D), this step's keys in it -> (T, H, D)
        query_start_loc = metadata.require("query_start_loc", self.name)
        seq_lens = metadata.require("seq_lens", self.name)
        block_table = metadata.require("block_table", self.name)
        # The decode kernel maps token i to request i; any other decode layout takes the general path.
        decode = metadata.decode_only and block_table.shape[0] == q.shape[0]
        window = layer.sliding_window or 0
        splits = self.num_splits(block_table.shape[0], layer.num_kv_heads, window) if decode else 1
        return paged_attention(q, kv_cache, query_start_loc, seq_lens, block_table, scale=layer.scale,
                               decode_only=decode, num_splits=splits, part_out=self.part_out,
                               part_lse=self.part_lse, arrivals=self.arrivals, window=window, num_sms=self.num_sms)
