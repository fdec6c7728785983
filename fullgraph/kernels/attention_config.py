"""The decode and prefill attention kernel's launch configuration (``paged_attention``): tiles,
warps and pipeline stages, fixed per step shape (never autotuned: graphs are captured with them)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import env

# Read once, at import: the interpreter runs every program in Python, so it gets small tiles.
INTERPRET = env.triton_interpret()

LONG_PROGRAM_KEYS = 1024  # a decode program walking this many keys or more streams with deeper pipelines


@dataclass(frozen=True)
class KernelConfig:
    """Launch configuration: fixed per (head_dim, dtype, step kind), never autotuned (capture)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def default_config(head_dim: int, dtype: torch.dtype, decode: bool, keys_per_split: int | None = None,
                   programs_per_sm: float | None = None) -> KernelConfig:
    """Hopper-oriented tiles for fp16/bf16; small ones for fp32 and for the interpreter.

    Decode (memory-bound: one query token x GROUP heads) depends on how many keys one program
    walks at most (``keys_per_split``, static: ``max_model_len / num_splits``). Measured on H200
    (``benchmarks/sweep_decode_attention.py``): a program of one or two tiles is latency-bound and
    wants no pipelining (llama-1b b1: 6.1 -> 5.1 us, Phi-3 b1: 11.4 -> 8.4 us); longer ones want
    two warps and two stages, with 32-key tiles at head_dim 128 (llama-1b b32: 26.0 -> 23.9 us,
    Phi-3 b16: 47.4 -> 38.5 us). Unsplit programs over a whole sequence (``LONG_PROGRAM_KEYS`` or
    more keys, a full GPU: ``num_kv_splits``) at head_dim <= 64, at most two an SM
    (``programs_per_sm``), want 128-key tiles, four warps and three stages (H100, 2026-12-06,
    decode steps, context 1024 / 4096: llama-1b b32 1.856 -> 1.797 / 3.190 -> 2.901 ms, SmolLM2 b64
    1.850 -> 1.671 / 4.109 -> 3.335); with four an SM (llama-1b b64) they lost 1-2%; Phi-3's
    head_dim 128 keeps its tiles.
    """
    if INTERPRET:
        return KernelConfig(16 if decode else 32, 32, 1, 1)
    if dtype == torch.float32:  # correctness runs only (no tensor-core speed to chase)
        return KernelConfig(16 if decode else 32, 32, 4, 2)
    if decode:
        if keys_per_split is not None and keys_per_split <= 128:
            return KernelConfig(16, 64 if head_dim <= 128 else 32, 4, 1)
        if (keys_per_split is not None and keys_per_split >= LONG_PROGRAM_KEYS and head_dim <= 64
                and programs_per_sm is not None and programs_per_sm <= 2):
            return KernelConfig(16, 128, 4, 3)
        return KernelConfig(16, 64 if head_dim <= 64 else 32, 2, 2)
    if head_dim <= 64:
        return KernelConfig(128, 64, 4, 3)
    if head_dim <= 128:
        return KernelConfig(128, 64, 8, 3)
    return KernelConfig(64, 64, 8, 2)
