"""The fused QKV projection with RoPE and the paged KV-cache write in its epilogue: one launch
where ``linear`` then ``rope_kv_write`` take two, and the (T, N) qkv tensor never exists.

Algorithm: the weight-streaming product of ``linear`` (``product``: RMSNorm on load, PREFETCH
weight tiles and the bias before the PDL wait), over a grid of column *pairs*. Rotate-half RoPE
mixes column i of a head with column i + D/2, so program p's local column j reads weight row
``hh * D + i + (j % 2) * D/2`` of pair ``u = p * BLOCK_N/2 + j // 2`` (head block hh = u // (D/2),
i = u % (D/2)): both members of a pair land in the same program, adjacent, as SwiGLU's gate and
up rows do in ``linear.columns``. The epilogue splits the float32 tile into the pairs (a, b),
takes the cos/sin row of ``positions[m]`` and ``slot = slot_mapping[m]`` for each row m
(``rope.rope_rows`` / ``rope.rope_tables``: after the weight stream here; the split-K kernel loads
the rows right after its PDL wait, the tables beside its split exchange), and by the head block's
role (from the layout, a constexpr):

    q head h:  q_out[m, h, i] = a*cos - b*sin, q_out[m, h, i + D/2] = b*cos + a*sin   (x's dtype)
    k head g:  the same rotation, stored at kv_cache[0, slot // PAGE_SIZE, slot % PAGE_SIZE, g]
    v head g:  (a, b) unrotated, stored at kv_cache[1, ...]                          (cache dtype)

exactly as ``rope_kv_write`` does with the rotation computed on the float32 accumulator (the
projection is not rounded to x's dtype first). A row with slot -1 is padding: it writes no cache
byte and its q_out row is zeros; a row past the slot mapping (m >= S) is rotated into q_out and
writes nothing. Only shapes choose the grid (capture-safe).

Layout contract: x (T, K) with unit column stride; w (N, K) contiguous with N = (H + 2 KVH) D,
its head blocks of D rows ordered by ``layout``:
    "llama":   [q_0 .. q_{H-1} | k_0 .. k_{KVH-1} | v_0 .. v_{KVH-1}]
    "grouped": per KV group g (head-major, Phi-3-Small), G = H / KVH: [q_{gG} .. q_{gG+G-1}, k_g, v_g]
b (N,) or None; norm_weight (K,) or None; layer_norm_sums (N, 2) float32 or None (with norm_weight:
a LayerNorm, one row); kv_cache (2, num_blocks, PAGE_SIZE, KVH, D) with unit
stride on D; slot_mapping (S,) int64, S <= T; positions (T,) int; cos, sin (P, D/2) float32
contiguous. Returns q_out, a new contiguous (T, H, D) tensor in x's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import compile_ahead, linear_choice, pdl
from .linear import NO_LIMIT, launch_config, norm_kind, product
from .linear import _check as _check_linear
from .rope import rope_rows, rope_tables
from .rope_kv_write import rope_kv_write
from .._compat import custom_op

LAYOUTS = {"llama": 0, "grouped": 1}


@triton.jit
def pair_columns(pid, NUM_PAIRS: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr):
    """The weight rows program ``pid`` reads: local column j is member j % 2 of pair u = pid *
    BLOCK_N/2 + j // 2 (columns i and i + D/2 of head block u // (D/2)); and which pairs exist."""
    j = tl.arange(0, BLOCK_N)
    u = pid * (BLOCK_N // 2) + j // 2                     # this column's pair
    rn = (u // HALF) * (2 * HALF) + u % HALF + (j % 2) * HALF
    return rn, u < NUM_PAIRS


@triton.jit
def rope_kv_epilogue(acc, pid, M, slot, c, s, q_out_ptr, kv_ptr, num_slots,
                     stride_kv, stride_cb, stride_cs, stride_ch,
                     NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The (BLOCK_M, BLOCK_N) float32 product of :func:`pair_columns`' rows -> q heads rotated into
    ``q_out``, k heads rotated and v heads as they are into the cache (the module docstring);
    ``slot``, ``c``, ``s``: the rows' slots and the pairs' cos / sin (``rope.rope_rows``, ``rope.rope_tables``)."""
    NUM_PAIRS: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HALF
    a, b = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))   # columns i and i + D/2 of a head
    up = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    pair_ok = up < NUM_PAIRS
    hh, i = up // HALF, up % HALF
    if LAYOUT == 0:  # [q | k | v]
        is_q, is_k = hh < NUM_HEADS, (hh >= NUM_HEADS) & (hh < NUM_HEADS + NUM_KV_HEADS)
        q_head, kv_head = hh, tl.where(is_k, hh - NUM_HEADS, hh - NUM_HEADS - NUM_KV_HEADS)
    else:  # per group: [q_{gG} .. q_{gG+G-1}, k_g, v_g]
        GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
        kv_head, r = hh // (GROUP + 2), hh % (GROUP + 2)
        is_q, is_k = r < GROUP, r == GROUP
        q_head = kv_head * GROUP + r
    is_v = pair_ok & ~is_q & ~is_k
    is_q, is_k = pair_ok & is_q, pair_ok & is_k

    rm = tl.arange(0, BLOCK_M)
    row_ok = rm < M
    live = (slot >= 0) | (rm >= num_slots)                   # not padding: q_out gets the rotation
    out1, out2 = a * c - b * s, b * c + a * s

    q_dst = q_out_ptr + rm.to(tl.int64)[:, None] * (NUM_HEADS * 2 * HALF) + (q_head * (2 * HALF) + i)[None, :]
    q_ok = row_ok[:, None] & is_q[None, :]
    q_ty = q_out_ptr.dtype.element_ty
    tl.store(q_dst, tl.where(live[:, None], out1, 0.0).to(q_ty), mask=q_ok)
    tl.store(q_dst + HALF, tl.where(live[:, None], out2, 0.0).to(q_ty), mask=q_ok)

    # keys rotated into [0], values as computed into [1]; padding and rows past the mapping: nothing
    kv_dst = (kv_ptr + ((slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs)[:, None]
              + (tl.where(is_v, stride_kv, 0) + kv_head.to(tl.int64) * stride_ch + i)[None, :])
    kv_ok = (row_ok & (slot >= 0))[:, None] & (is_k | is_v)[None, :]
    kv_ty = kv_ptr.dtype.element_ty
    tl.store(kv_dst, tl.where(is_v[None, :], a, out1).to(kv_ty), mask=kv_ok)
    tl.store(kv_dst + HALF, tl.where(is_v[None, :], b, out2).to(kv_ty), mask=kv_ok)


@compile_ahead.kernel
@triton.jit
def _linear_rope_kv_kernel(
    x_ptr, w_ptr, b_ptr, g_ptr, sums_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, q_out_ptr, kv_ptr,
    M, K, eps, num_slots, stride_xm, stride_kv, stride_cb, stride_cs, stride_ch,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr,
    LAYOUT: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, PREFETCH: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr, PDL_LATE: tl.constexpr,
):
    pid = tl.program_id(0)
    NUM_PAIRS: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HALF
    rn, pair_ok = pair_columns(pid, NUM_PAIRS, HALF, BLOCK_N)
    acc = product(x_ptr, w_ptr, b_ptr, g_ptr, sums_ptr, x_ptr, M, K, eps, stride_xm, 0, rn, pair_ok,
                  HAS_BIAS, NORM, False, PREFETCH, BLOCK_M, BLOCK_N, BLOCK_K, USE_PDL, PDL_LATE)   # waits (PDL) inside
    # after the weight stream: loaded right after the PDL wait instead, these took llama-1b's one-row
    # step 1.4% longer on an H100 (SmolLM2's, whose K loop is 3.6x shorter, 3% shorter)
    pos, slot = rope_rows(M, pos_ptr, slot_ptr, num_slots, BLOCK_M)
    c, s = rope_tables(pid, M, pos, cos_ptr, sin_ptr, NUM_PAIRS, HALF, BLOCK_M, BLOCK_N)
    rope_kv_epilogue(acc, pid, M, slot, c, s, q_out_ptr, kv_ptr, num_slots,
                     stride_kv, stride_cb, stride_cs, stride_ch, NUM_HEADS, NUM_KV_HEADS, HALF, PAGE_SIZE, LAYOUT,
                     BLOCK_M, BLOCK_N)


def launch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
           kv_cache: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor, num_heads: int, num_kv_heads: int, layout: str,
           config: tuple[int, ...] | None = None, layer_norm_sums: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton launch behind :func:`linear_rope_kv_write`; ``config`` (BLOCK_N, BLOCK_K,
    num_warps[, PREFETCH[, num_stages]]) overrides ``linear.launch_config`` (BLOCK_N a power of 2 >= 2)."""
    _check(x, w, b, norm_weight, kv_cache, slot_mapping, positions, cos, sin, num_heads, num_kv_heads, layout,
           layer_norm_sums)
    (m, k), n, head_dim = x.shape, w.shape[0], kv_cache.shape[-1]
    q_out = compile_ahead.output((m, num_heads, head_dim), x.dtype, x.device)
    if m == 0:
        return q_out
    block_n, block_k, num_warps, prefetch, stages = (*(config or launch_config(n, m, layer_norm_sums is not None)),
                                                     1, 1)[:5]
    if block_n < 2 or block_n & (block_n - 1):
        raise ValueError(f"linear_rope_kv_write: BLOCK_N must be a power of 2 >= 2 (column pairs), got {block_n}")
    block_m = 1 if m == 1 else max(16, triton.next_power_of_2(m))
    _linear_rope_kv_kernel[(triton.cdiv(n // 2, block_n // 2),)](
        x, w, w if b is None else b, w if norm_weight is None else norm_weight,
        w if layer_norm_sums is None else layer_norm_sums,
        positions, cos, sin, slot_mapping,
        q_out, kv_cache, m, k, eps, slot_mapping.shape[0], x.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2, PAGE_SIZE=kv_cache.shape[2],
        LAYOUT=LAYOUTS[layout], HAS_BIAS=b is not None, NORM=norm_kind(norm_weight, layer_norm_sums), PREFETCH=prefetch,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=stages,
        PDL_LATE=pdl.late(), **pdl.options(x))
    return q_out


def _check(x, w, b, norm_weight, kv_cache, slot_mapping, positions, cos, sin, num_heads, num_kv_heads,
           layout, layer_norm_sums=None) -> None:
    name = "linear_rope_kv_write"
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"{name}: x must be (T, K) and w (N, K), got {tuple(x.shape)} and {tuple(w.shape)}")
    try:
        _check_linear(x, w, b, "none", norm_weight, None, layer_norm_sums)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    if layout not in LAYOUTS:
        raise ValueError(f"{name}: layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.stride(-1) != 1:
        raise ValueError(f"{name}: kv_cache must be (2, num_blocks, PAGE_SIZE, KVH, D) with unit stride on D, got "
                         f"{tuple(kv_cache.shape)} with strides {kv_cache.stride()}")
    head_dim = kv_cache.shape[-1]
    if (num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads or kv_cache.shape[3] != num_kv_heads
            or head_dim % 2 or w.shape[0] != (num_heads + 2 * num_kv_heads) * head_dim):
        raise ValueError(f"{name}: need H % KVH == 0, kv_cache KVH = num_kv_heads, D even and w rows "
                         f"(H + 2 KVH) * D; got H {num_heads}, KVH {num_kv_heads}, kv_cache {tuple(kv_cache.shape)},"
                         f" w {tuple(w.shape)}")
    num_tokens = x.shape[0]
    if (slot_mapping.dim() != 1 or slot_mapping.dtype != torch.int64 or slot_mapping.shape[0] > num_tokens
            or positions.shape != (num_tokens,) or positions.dtype.is_floating_point):
        raise ValueError(f"{name}: slot_mapping {tuple(slot_mapping.shape)} {slot_mapping.dtype} must be (S,) int64 "
                         f"with S <= T = {num_tokens}; positions {tuple(positions.shape)} {positions.dtype} must be "
                         "(T,) integers")
    if (cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_dim // 2 or cos.dtype != torch.float32
            or sin.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous())):
        raise ValueError(f"{name}: cos {tuple(cos.shape)} {cos.dtype} / sin {tuple(sin.shape)} {sin.dtype} must be "
                         f"contiguous (P, {head_dim // 2}) float32")
    if len({t.device for t in (x, w, kv_cache, slot_mapping, positions, cos, sin)}) != 1:
        raise ValueError(f"{name}: all tensors must be on one device")


@custom_op("fullgraph::linear_rope_kv_write", mutates_args=("kv_cache",))
def linear_rope_kv_write(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, norm_weight: torch.Tensor | None,
                         eps: float, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                         layout: str, layer_norm_sums: torch.Tensor | None = None) -> torch.Tensor:
    """q_out (T, H, D) = the rotated q heads of ``norm(x) @ w.T + b``; the rotated k heads and the
    v heads written into ``kv_cache`` at ``slot_mapping`` (in place). One launch; see the module
    docstring for the algorithm and the layout contract. For more than one row: that launch, or
    ``linear`` then ``rope_kv_write`` (cuBLAS for the product), or ``skinny_linear``'s split-K form
    of this launch, as ``linear_choice`` says. ``layer_norm_sums`` (with ``norm_weight``): a
    LayerNorm on load instead of the RMSNorm, one row only (``linear.layer_norm_sums``)."""
    args = (x, w, b, norm_weight, eps, kv_cache, slot_mapping, positions, cos, sin, num_heads, num_kv_heads, layout)
    if layer_norm_sums is not None:  # one row (the launch checks): the one-row kernel
        return launch(*args, layer_norm_sums=layer_norm_sums)
    impl = linear_choice.choose(x)
    if impl == "skinny":
        from . import skinny_linear  # (it builds on this module)

        return skinny_linear.launch_rope_kv(*args)
    if impl == "cublas":
        return _two_launches(*args)
    return launch(*args)


def _two_launches(x, w, b, norm_weight, eps, kv_cache, slot_mapping, positions, cos, sin, num_heads, num_kv_heads,
                  layout) -> torch.Tensor:
    """The same with the product on its own (``linear_choice.unfused``), then ``rope_kv_write``."""
    _check(x, w, b, norm_weight, kv_cache, slot_mapping, positions, cos, sin, num_heads, num_kv_heads, layout)
    y = linear_choice.unfused(x, w, b, "none", NO_LIMIT, norm_weight, eps, None)       # (T, (H + 2 KVH) D)
    t, d = x.shape[0], kv_cache.shape[-1]
    if layout == "llama":
        q, k, v = y.split((num_heads * d, num_kv_heads * d, num_kv_heads * d), dim=-1)
        q, k, v = q.view(t, num_heads, d), k.view(t, num_kv_heads, d), v.view(t, num_kv_heads, d)
    else:  # head-major groups: (T, KVH, G + 2, D)
        g = num_heads // num_kv_heads
        grouped = y.view(t, num_kv_heads, g + 2, d)
        q, k, v = grouped[:, :, :g], grouped[:, :, g], grouped[:, :, g + 1]
    return rope_kv_write(query=q, key=k, value=v, kv_cache=kv_cache, slot_mapping=slot_mapping, positions=positions,
                         cos=cos, sin=sin)


@linear_rope_kv_write.register_fake
def _(x, w, b, norm_weight, eps, kv_cache, slot_mapping, positions, cos, sin, num_heads, num_kv_heads, layout,
      layer_norm_sums=None):
    return x.new_empty((x.shape[0], num_heads, kv_cache.shape[-1]))
