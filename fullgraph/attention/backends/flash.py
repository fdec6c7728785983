"""``flash``: FlashAttention-2 varlen, from the ``flash_attn`` package when installed, else PyTorch's
own (``aten._flash_attention_forward``, CUDA, fp16/bf16).

Paged attention needs ``block_table`` support: ``flash_attn`` (pages a multiple of 256 tokens) or
PyTorch 2.13+. Without it the backend serves prompt-only steps (no cached context), attending over
the step's own new keys and values (``reads_new_kv``); ``prepare`` refuses any other step on the
host, before anything is written. Its KV write is the writer's default (Triton on CUDA).

Capture-safe: the host scalars FlashAttention takes (``max_seqlen_q/k``) are static maxima of
the graph key (padded token count, or 1 for decode; ``max_model_len`` for paged keys), never
values read from the step's tensors. Padded requests have zero-length rows in ``query_start_loc``
(its tail repeats the last real value, FlashAttention's non-decreasing contract) and
``seqused_k = 0``; rows of padded tokens are left unwritten by the kernel and never read.
Sliding-window layers pass the window as FlashAttention's ``window_size_left``.
"""
from __future__ import annotations

import functools

import torch

from ... import _compat
from ...padding import PaddingPolicy
from ..interface import AttentionBackend, AttentionMetadata, BackendLimits, register_backend


@functools.lru_cache(maxsize=1)
def _flash_attn_package():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


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
        # flash_attn's FA2 pages only in multiples of 256 tokens; otherwise PyTorch's own.
        self._package = _flash_attn_package() if limits.block_size % 256 == 0 else None
        self._paged = self._package is not None or _compat.torch_has_paged_flash()
        self.reads_new_kv = not self._paged  # the unpaged path attends over the new keys themselves

    @classmethod
    def supports_context(cls) -> bool:
        return _flash_attn_package() is not None or _compat.torch_has_paged_flash()

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

    def prepare(self, plan) -> str | None:
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

    def forward(self, layer, q: torch.Tensor, k, v, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        md, name = metadata, self.name
        qsl = md.require("query_start_loc", name)
        max_q = 1 if md.decode_only else q.shape[0]
        left = layer.sliding_window - 1 if layer.sliding_window else -1   # keys q - left .. q
        window = {"window_size_left": left, "window_size_right": 0} if left >= 0 else {}
        if self._package is not None:
            return self._package(q, kv_cache[0], kv_cache[1], qsl, md.require("seq_start_loc", name), max_q,
                                 self.limits.max_model_len, softmax_scale=layer.scale, causal=True,
                                 window_size=(left, 0), block_table=md.require("block_table", name))
        if self._paged:
            return _compat.flash_attention_forward(
                q, kv_cache[0], kv_cache[1], qsl, md.require("seq_start_loc", name), max_q,
                self.limits.max_model_len, 0.0, True, False, scale=layer.scale, **window,
                seqused_k=md.require("seq_lens", name), block_table=md.require("block_table", name))
        # No paging: only prompt-only steps reach here (prepare), so the new keys are each
        # request's whole sequence.
        return _compat.flash_attention_forward(q, k, v, qsl, qsl, max_q, max_q, 0.0, True, False, scale=layer.scale,
                                               **window)
