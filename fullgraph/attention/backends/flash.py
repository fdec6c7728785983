"""``flash``: FlashAttention-2, from the ``flash_attn`` package when importable, else PyTorch's own.

Paged (``block_table`` + ``seqused_k``) where the implementation supports it: every step kind.
Without paging (PyTorch < 2.13's built-in FA2) only steps whose requests have no cached context
can run: the new keys *are* the whole sequence, so ``cu_seqlens_k = query_start_loc``; the runner
refuses other steps (``step_unsupported_reason``) before anything is written.

Capture-safe: the host scalars FlashAttention takes (``max_seqlen_q/k``) are static maxima of
the graph key (padded token count, or 1 for decode; ``max_model_len`` for paged keys), never
values read from the step's tensors. Padded requests have zero-length rows in ``query_start_loc``
(its tail repeats the last real value, FlashAttention's non-decreasing contract) and
``seqused_k = 0``; rows of padded tokens are left unwritten by the kernel and never read.
"""
from __future__ import annotations

import functools

import torch

from ...padding import PaddingPolicy
from .. import torch_ops
from ..metadata import AttentionMetadata
from .base import AttentionBackend, BackendLimits, register_backend


@functools.lru_cache(maxsize=1)
def _flash_attn_package():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


@functools.lru_cache(maxsize=1)
def _torch_has_paged_flash() -> bool:
    schema = torch.ops.aten._flash_attention_forward.default._schema
    return any(arg.name == "block_table" for arg in schema.arguments)


def _kv_write():
    try:  # the Triton kernel when the triton backend is installed, else the PyTorch write
        from ...kernels.kv_write import write_kv
        return write_kv
    except ImportError:
        return torch_ops.write_kv


@register_backend
class FlashBackend(AttentionBackend):
    name = "flash"
    kinds = frozenset({"dense"})
    policy = PaddingPolicy(
        name="flash",
        reads=frozenset({"query_start_loc", "seq_start_loc", "seq_lens", "block_table", "slot_mapping"}),
        tails={"seq_lens": 0},  # seqused_k of a padded request: nothing to attend to
        graph_steps=frozenset({"mixed", "decode"}),
    )

    def __init__(self, limits: BackendLimits, layers) -> None:
        super().__init__(limits, layers)
        self._write_kv = _kv_write()
        # flash_attn's FA2 pages only in multiples of 256 tokens; otherwise PyTorch's own.
        self._package = _flash_attn_package() if limits.block_size % 256 == 0 else None
        self._paged = self._package is not None or _torch_has_paged_flash()

    @classmethod
    def supports_context(cls) -> bool:
        return _flash_attn_package() is not None or _torch_has_paged_flash()

    @classmethod
    def unsupported_reason(cls, device, dtype, layers) -> str | None:
        if device.type != "cuda":
            return "FlashAttention needs a CUDA device"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"FlashAttention needs float16 or bfloat16 (model is {dtype})"
        if not torch.backends.cuda.is_flash_attention_available():
            return "this PyTorch build has no FlashAttention kernels"
        bad = sorted({l.head_dim for l in layers if l.head_dim % 8 or l.head_dim > 256})
        return f"head_dim {bad} unsupported (multiples of 8 up to 256)" if bad else None

    def step_unsupported_reason(self, plan) -> str | None:
        if self._paged:
            return None
        nr = plan.num_reqs
        q_lens = plan.query_start_loc[1: nr + 1] - plan.query_start_loc[:nr]
        cached = plan.seq_lens[:nr] > q_lens
        if cached.any():
            return (f"chunk {int(cached.argmax())} attends to cached context, and this PyTorch "
                    f"({torch.__version__}) has no paged FlashAttention (block_table needs 2.13+) nor the "
                    "flash_attn package; use attention='triton' (or 'sdpa')")
        return None

    def forward(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        md, name = metadata, self.name
        self._write_kv(kv_cache, k, v, md.require("slot_mapping", name))
        qsl = md.require("query_start_loc", name)
        max_q = 1 if md.decode_only else q.shape[0]
        if self._package is not None:
            return self._package(q, kv_cache[0], kv_cache[1], qsl, md.require("seq_start_loc", name), max_q,
                                 self.limits.max_model_len, softmax_scale=layer.scale, causal=True,
                                 block_table=md.require("block_table", name))
        if _torch_has_paged_flash():
            return torch.ops.aten._flash_attention_forward(
                q, kv_cache[0], kv_cache[1], qsl, md.require("seq_start_loc", name), max_q,
                self.limits.max_model_len, 0.0, True, False, scale=layer.scale,
                seqused_k=md.require("seq_lens", name), block_table=md.require("block_table", name))[0]
        # No paging: only prompt-only steps reach here (step_unsupported_reason), so the new
        # keys are each request's whole sequence.
        return torch.ops.aten._flash_attention_forward(
            q, k, v, qsl, qsl, max_q, max_q, 0.0, True, False, scale=layer.scale)[0]
