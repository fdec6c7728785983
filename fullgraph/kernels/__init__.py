"""Triton kernels, one per file, each with a thin capture-safe launcher registered as a torch op.

Kernels know tensors and sizes only (no runner, model or policy imports).
"""
from __future__ import annotations

from .activation import gegelu, silu_and_mul
from .kv_write import kv_write
from .linear import NO_LIMIT as linear_no_limit
from .linear import layer_norm_sums, linear
from .linear_choice import MAX_ROWS as linear_max_rows
from .linear_choice import fused_rows as linear_fused_rows
from .linear_choice import max_skinny_rows as linear_skinny_rows
from .linear_rope_kv import linear_rope_kv_write
from .norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from .paged_attention import KernelConfig, default_config, paged_attention
from .rope import rope
from .rope_kv_write import rope_kv_write
from .split_kv_reduce import num_kv_splits, split_kv_reduce, split_workspace_rows

__all__ = ["KernelConfig", "add_layer_norm", "add_rms_norm", "default_config", "gegelu", "kv_write",
           "layer_norm", "layer_norm_sums", "linear", "linear_fused_rows", "linear_max_rows", "linear_skinny_rows",
           "linear_no_limit", "linear_rope_kv_write", "num_kv_splits", "paged_attention", "rms_norm", "rope",
           "rope_kv_write", "silu_and_mul", "split_kv_reduce", "split_workspace_rows"]
