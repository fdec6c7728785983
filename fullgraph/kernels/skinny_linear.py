"""``y = norm(x) @ w.T (+ b)``, then a gated activation or ``+ residual``, for 1-64 rows (decode
batches): a weight-streaming GEMM that reads the weight once, split over K where the layer is narrow.

Why not ``linear``'s own few-row path: there a program streams BLOCK_N = 16-32 weight rows and,
with every weight tile, the matching tile of all M rows of x, so at 32 rows it moves twice as many
bytes of x (from L2) as of weights (from HBM); measured at about half cuBLAS's speed. Here a
program owns BLOCK_N = 64-128 weight rows over a range of K, so x costs M / BLOCK_N of the
weight's bytes, and the product is taken swapped, ``w_tile @ x_tile.T`` -> (BLOCK_N, BLOCK_M): the
weight rows fill the MMA's large dimension, the few rows of x its small one (padded to 16).

A layer with too few column blocks to keep every SM streaming splits K over SPLIT_K programs per
column block. Each stores its float32 partial (and, with the norm, its rows' partial sums of
squares) into a workspace, counts in with an acq_rel atomic after a barrier, and the last of a
column block to arrive sums the SPLIT_K partials (read through L2), finishes and resets the
counter, which is zero again for the next launch or graph replay: no second kernel, no memset.

Finishing (one program per column block): RMSNorm's 1/rms (x was scaled by the norm weight on
load and each program summed the squares of the x it streamed anyway), the bias, then the gated
activation or the residual add, as ``linear``'s ``store``. Before the PDL wait a program loads its
first weight tile only (a parameter); the workspace is touched only after the wait, so a kernel
behind that starts early never sees this one's partials.

Layout contract: as ``linear.launch`` (x (M, K) with unit column stride, w (N, K) contiguous, b
(N,), norm weight (K,), residual (M, N) with unit column stride); 1 <= M <= 64 (one row: padded
to 16 in the MMA; its masked rows load nothing). The workspace is one per device, grown eagerly (never while a CUDA graph is being captured: the runner's warm-up
runs come first) and never freed, as captured graphs keep its address.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import compile_ahead, pdl
from .linear import ACTIVATIONS, NO_LIMIT, _check, columns, store, x_tile
from .linear_rope_kv import LAYOUTS, pair_columns, rope_kv_epilogue
from .linear_rope_kv import _check as _check_rope_kv
from .rope import rope_rows, rope_tables

MAX_ROWS = 64


@triton.jit
def _weight_tile(w_rows, n_ok, k0, k_hi, rk, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """The (BLOCK_N, BLOCK_K) weight tile at ``k0``; masked only where a block can overhang (a
    mask per element costs the pipelined loads registers and stages)."""
    if EVEN_N and EVEN_K:
        return tl.load(w_rows + (k0 + rk)[None, :])
    if EVEN_K:
        return tl.load(w_rows + (k0 + rk)[None, :], mask=n_ok[:, None], other=0.0)
    return tl.load(w_rows + (k0 + rk)[None, :], mask=n_ok[:, None] & (k0 + rk < k_hi)[None, :], other=0.0)


@triton.jit
def _tile(acc, ss, w, x_ptr, g_ptr, stride_xm, M, k0, k_hi, rk, rm, NORM: tl.constexpr, EVEN_K: tl.constexpr):
    """One K tile: ``acc`` (BLOCK_N, BLOCK_M) += w_tile @ x_tile.T (``linear.x_tile``: the norm on load)."""
    x, ss = x_tile(ss, x_ptr, g_ptr, stride_xm, M, k0, rk, (k0 + rk < k_hi) | EVEN_K, rm, w.dtype, NORM)
    if w.dtype == tl.float32:  # exact float32 products (tl.dot's default is TF32)
        return tl.dot(w, tl.trans(x), acc, input_precision="ieee"), ss
    return tl.dot(w, tl.trans(x), acc), ss


@triton.jit
def streamed_product(x_ptr, w_ptr, b_ptr, g_ptr, res_ptr, part_ptr, ss_ptr, count_ptr, M, K, eps, stride_xm,
                     stride_rm, k_per_split, pid, rn, n_ok, pos_ptr, cos_ptr, sin_ptr, slot_ptr, num_slots,
                     HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, SPLIT_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr,
                     EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, PDL_LATE: tl.constexpr, ROPE_PAIRS: tl.constexpr,
                     ROPE_HALF: tl.constexpr):
    """The (BLOCK_M, BLOCK_N) float32 ``norm(x) @ w[rn].T + b[rn] (+ residual[:, rn])`` of column
    block ``pid`` (its weight rows ``rn``, those with ``n_ok``), over K split ``program_id(1)``;
    whether this program holds the whole product (no split, or the last split of the block to
    arrive: it summed the others' partials); and with ROPE_PAIRS > 0 what the fused QKV
    projection's epilogue reads (else 0s). Waits for the kernel ahead (PDL) after loading its
    first weight tile and the bias (parameters). What the finish reads besides the partials is
    loaded early, so its round trips overlap work instead of following the exchange: the rows'
    positions and slots right after the wait; the residual and the cos / sin rows of those
    positions right after the weight stream, beside the exchange (held through the K loop, the
    tables took the 32-row kernel from 80 to 127 registers)."""
    split = tl.program_id(1)
    rk = tl.arange(0, BLOCK_K)
    rm = tl.arange(0, BLOCK_M)
    k_lo = split * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    w0 = _weight_tile(w_rows, n_ok, k_lo, k_hi, rk, EVEN_N, EVEN_K)
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    pdl.wait(USE_PDL)
    if not PDL_LATE:
        pdl.start_dependents(USE_PDL)
    rope_pos, rope_slot, rope_cos, rope_sin = 0, 0, 0.0, 0.0
    if ROPE_PAIRS > 0:
        rope_pos, rope_slot = rope_rows(M, pos_ptr, slot_ptr, num_slots, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc, ss = _tile(acc, ss, w0, x_ptr, g_ptr, stride_xm, M, k_lo, k_hi, rk, rm, NORM, EVEN_K)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        w = _weight_tile(w_rows, n_ok, k0, k_hi, rk, EVEN_N, EVEN_K)
        acc, ss = _tile(acc, ss, w, x_ptr, g_ptr, stride_xm, M, k0, k_hi, rk, rm, NORM, EVEN_K)
    if PDL_LATE:  # every weight tile is in: the kernel behind may take this program's slot soon
        pdl.start_dependents(USE_PDL)
    if ROPE_PAIRS > 0:
        rope_cos, rope_sin = rope_tables(pid, M, rope_pos, cos_ptr, sin_ptr, ROPE_PAIRS, ROPE_HALF, BLOCK_M, BLOCK_N)
    if HAS_RES:
        res = tl.load(res_ptr + rm[:, None] * stride_rm + rn[None, :], mask=(rm < M)[:, None] & n_ok[None, :],
                      other=0.0)
    done = True
    if SPLIT_K > 1:
        j = tl.arange(0, BLOCK_N)
        tiles = part_ptr + pid.to(tl.int64) * (SPLIT_K * BLOCK_N * BLOCK_M) + j[:, None] * BLOCK_M + rm[None, :]
        tl.store(tiles + split * (BLOCK_N * BLOCK_M), acc)
        sums = ss_ptr + pid * (SPLIT_K * BLOCK_M) + rm
        if NORM:
            tl.store(sums + split * BLOCK_M, ss)
        tl.debug_barrier()                     # every thread's partial is written ...
        arrival = count_ptr + pid
        done = tl.atomic_add(arrival, 1, sem="acq_rel") == SPLIT_K - 1   # ... before it counts in
        if done:
            tl.atomic_xchg(arrival, 0, sem="relaxed")                   # ready for the next launch
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(tiles + s * (BLOCK_N * BLOCK_M), cache_modifier=".cg")
                if NORM:
                    ss += tl.load(sums + s * BLOCK_M, cache_modifier=".cg")
    y = tl.trans(acc)
    if NORM:
        y = y / tl.sqrt(ss / K + eps)[:, None]
    if HAS_BIAS:
        y += bias[None, :]
    if HAS_RES:
        y += res.to(tl.float32)
    return y, done, rope_slot, rope_cos, rope_sin


@compile_ahead.kernel
@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, g_ptr, res_ptr, out_ptr, part_ptr, ss_ptr, count_ptr,
    M, N, K, limit, eps, stride_xm, stride_rm, stride_om, k_per_split,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, PDL_LATE: tl.constexpr,
):
    pid = tl.program_id(0)
    rn, n_ok = columns(pid, N, ACT, BLOCK_N)
    y, done, _, _, _ = streamed_product(x_ptr, w_ptr, b_ptr, g_ptr, res_ptr, part_ptr, ss_ptr, count_ptr, M, K, eps,
                                        stride_xm, stride_rm, k_per_split, pid, rn, n_ok, x_ptr, x_ptr, x_ptr, x_ptr, 0,
                                        HAS_BIAS, NORM, HAS_RES, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_N, EVEN_K,
                                        USE_PDL, PDL_LATE, 0, 1)
    if done:
        store(y, out_ptr, M, stride_om, pid, rn, n_ok, N, limit, ACT, BLOCK_M, BLOCK_N)


@compile_ahead.kernel
@triton.jit
def _skinny_rope_kv_kernel(
    x_ptr, w_ptr, b_ptr, g_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, q_out_ptr, kv_ptr, part_ptr, ss_ptr, count_ptr,
    M, K, eps, num_slots, stride_xm, stride_kv, stride_cb, stride_cs, stride_ch, k_per_split,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr,
    LAYOUT: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr, PDL_LATE: tl.constexpr,
):
    """``linear_rope_kv``'s QKV projection on this file's streamed product: its column pairs, its epilogue."""
    pid = tl.program_id(0)
    NUM_PAIRS: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HALF
    rn, pair_ok = pair_columns(pid, NUM_PAIRS, HALF, BLOCK_N)
    y, done, slot, c, s = streamed_product(x_ptr, w_ptr, b_ptr, g_ptr, x_ptr, part_ptr, ss_ptr, count_ptr, M, K, eps,
                                           stride_xm, 0, k_per_split, pid, rn, pair_ok, pos_ptr, cos_ptr, sin_ptr,
                                           slot_ptr, num_slots, HAS_BIAS, NORM, False, SPLIT_K, BLOCK_M, BLOCK_N,
                                           BLOCK_K, EVEN_N, EVEN_K, USE_PDL, PDL_LATE, NUM_PAIRS, HALF)
    if done:
        rope_kv_epilogue(y, pid, M, slot, c, s, q_out_ptr, kv_ptr, num_slots,
                         stride_kv, stride_cb, stride_cs, stride_ch, NUM_HEADS, NUM_KV_HEADS, HALF, PAGE_SIZE, LAYOUT,
                         BLOCK_M, BLOCK_N)


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def launch_config(m: int, n: int, k: int, num_sms: int = 132, norm: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) for ``m`` rows of an (n, k) weight, from
    ``sweep_linear.py --skinny`` (H100, 32 rows, every layer shape of llama-1b, Llama-8B, Phi-3-Small
    and SmolLM2): 64-column blocks (128 past 16384 columns), K split in powers of two until the grid
    holds about 0.7 programs an SM (one an SM with the RMSNorm on load, whose K tiles are half as
    long), never below one K tile a split. More programs only shorten each one's weight stream:
    the old rule of two an SM took 1.3-1.7x the best configuration's time on the big matrices."""
    block_m = max(16, triton.next_power_of_2(m))
    block_n = 64 if n <= 16384 else 128
    block_k = 64 if norm or block_m > 32 else 128   # 64 rows: half the K tile (shared memory)
    target = num_sms if norm else 0.7 * num_sms
    blocks, split = triton.cdiv(n, block_n), 1
    while blocks * split < target and k >= 2 * split * block_k:
        split *= 2
    return block_n, block_k, split, 4, 4


class _Workspace:
    """The split-K partials, row sums of squares and arrival counters of one device (counters zero
    between launches). Grown eagerly by the largest need seen; an outgrown buffer stays alive, as
    graphs captured over it keep its address."""

    def __init__(self) -> None:
        self.buffers: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.outgrown: list[tuple[torch.Tensor, ...]] = []

    def get(self, device: torch.device, floats: int, sums: int, counters: int):
        have = self.buffers.get(device)
        if have is not None and have[0].numel() >= floats and have[1].numel() >= sums and have[2].numel() >= counters:
            return have
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny_linear: its split-K workspace must grow while a CUDA graph is being captured; "
                               "run the step eagerly once first (the runner's warm-up does)")
        if have is not None:
            self.outgrown.append(have)
            floats, sums, counters = (max(floats, have[0].numel()), max(sums, have[1].numel()),
                                      max(counters, have[2].numel()))
        made = (torch.empty(floats, dtype=torch.float32, device=device),
                torch.empty(max(1, sums), dtype=torch.float32, device=device),
                torch.zeros(counters, dtype=torch.int32, device=device))
        self.buffers[device] = made
        return made


WORKSPACE = _Workspace()


class _Plan(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split: int
    k_per_split: int
    blocks: int
    num_warps: int
    stages: int
    workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _plan(x: torch.Tensor, n: int, norm: bool, config: tuple[int, ...] | None, who: str) -> _Plan:
    """The grid, tiles and workspace of one launch over ``x``'s rows and ``n`` weight rows."""
    m, k = x.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"{who}: {m} rows; it serves 1 .. {MAX_ROWS} (more: cuBLAS)")
    block_n, block_k, split, num_warps, stages = config or launch_config(m, n, k, _num_sms(x.device), norm)
    block_m = max(16, triton.next_power_of_2(m))
    blocks = triton.cdiv(n, block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)  # no split without a K tile
    workspace = WORKSPACE.get(x.device, blocks * split * block_n * block_m if split > 1 else 1,
                              blocks * split * block_m if split > 1 and norm else 1, blocks)
    return _Plan(block_m, block_n, block_k, split, k_per_split, blocks, num_warps, stages, workspace)


def launch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, activation: str = "none",
           limit: float = NO_LIMIT, config: tuple[int, ...] | None = None, norm_weight: torch.Tensor | None = None,
           eps: float = 0.0, residual: torch.Tensor | None = None) -> torch.Tensor:
    """What ``linear.launch`` computes, for 1 .. 64 rows (one row padded to 16 in the MMA: its loads
    are masked off, its pipelined weight stream is the same); ``config`` (BLOCK_N, BLOCK_K, SPLIT_K,
    num_warps, num_stages) overrides :func:`launch_config` (benchmarks sweep it)."""
    (m, k), n = x.shape, w.shape[0]
    _check(x, w, b, activation, norm_weight, residual)
    p = _plan(x, n, norm_weight is not None, config, "skinny_linear")
    if activation != "none" and p.block_n % 2:
        raise ValueError(f"skinny_linear: a gated activation needs an even BLOCK_N, got {p.block_n}")
    out = compile_ahead.output((m, n if activation == "none" else n // 2), x.dtype, x.device)
    _skinny_kernel[(p.blocks, p.split)](   # (SwiGLU: BLOCK_N // 2 gate rows and their up rows a program)
        x, w, w if b is None else b, w if norm_weight is None else norm_weight, out if residual is None else residual,
        out, *p.workspace, m, n, k, limit, eps, x.stride(0), 0 if residual is None else residual.stride(0),
        out.stride(0), p.k_per_split,
        HAS_BIAS=b is not None, ACT=ACTIVATIONS[activation], NORM=norm_weight is not None,
        HAS_RES=residual is not None, SPLIT_K=p.split, BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k,
        EVEN_N=n % p.block_n == 0, EVEN_K=k % p.block_k == 0, num_warps=p.num_warps, num_stages=p.stages,
        PDL_LATE=pdl.late(), **pdl.options(x))
    return out


def launch_rope_kv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, norm_weight: torch.Tensor | None,
                   eps: float, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, layout: str,
                   config: tuple[int, ...] | None = None) -> torch.Tensor:
    """What ``linear_rope_kv.launch`` computes (the QKV projection, RoPE, the KV write; returns the
    rotated q), for 1 .. 64 rows on this file's split-K product; ``config`` as :func:`launch`'s
    (BLOCK_N a power of 2 >= 2: column pairs)."""
    _check_rope_kv(x, w, b, norm_weight, kv_cache, slot_mapping, positions, cos, sin, num_heads, num_kv_heads, layout)
    (m, k), n, head_dim = x.shape, w.shape[0], kv_cache.shape[-1]
    p = _plan(x, n, norm_weight is not None, config, "skinny_linear.launch_rope_kv")
    if p.block_n < 2 or p.block_n & (p.block_n - 1):
        raise ValueError(f"skinny_linear.launch_rope_kv: BLOCK_N must be a power of 2 >= 2 (column pairs), "
                         f"got {p.block_n}")
    q_out = compile_ahead.output((m, num_heads, head_dim), x.dtype, x.device)
    _skinny_rope_kv_kernel[(p.blocks, p.split)](
        x, w, w if b is None else b, w if norm_weight is None else norm_weight, positions, cos, sin, slot_mapping,
        q_out, kv_cache, *p.workspace, m, k, eps, slot_mapping.shape[0], x.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), p.k_per_split,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2, PAGE_SIZE=kv_cache.shape[2],
        LAYOUT=LAYOUTS[layout], HAS_BIAS=b is not None, NORM=norm_weight is not None, SPLIT_K=p.split,
        BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, EVEN_N=n % p.block_n == 0, EVEN_K=k % p.block_k == 0,
        num_warps=p.num_warps, num_stages=p.stages, PDL_LATE=pdl.late(), **pdl.options(x))
    return q_out
