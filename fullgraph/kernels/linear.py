"""``y = norm(x) @ w.T (+ b)``, then a gated activation or ``+ residual``, for few rows (decode
batches): a weight-streaming GEMM with the decoder layer's small ops in its prologue and epilogue.

At decode batch sizes a linear layer reads its whole weight to produce a few output rows, so
its time is the weight's bytes over the bandwidth one launch reaches, and every small kernel
around it (a norm, an add) costs a launch and a ramp of its own.

Algorithm: one program per BLOCK_N output columns walks K in BLOCK_K steps, loading a
(BLOCK_N, BLOCK_K) weight tile and the matching (M, BLOCK_K) slice of x (a few KB, L2-resident)
and accumulating in float32: a broadcast multiply and row sum for one row, ``tl.dot`` (rows
padded to 16) otherwise. Its first PREFETCH weight tiles (and the bias) are loaded before the
PDL wait, overlapping the kernel ahead. RMSNorm on load: x is scaled by the norm weight as it
is loaded, each program sums the squares of the row it streams anyway, and the products are
divided by the rms at the end (no pass over x before the first weight tile). LayerNorm on load
(one row): x - x[0] is scaled by the norm weight as it is loaded, the program sums the shifted row
and its squares (the shift keeps the variance's float32 sums from cancelling), and the epilogue
takes the two constants of each weight row that a LayerNorm adds, ``sum(w g)`` and ``sum(w b)``
(precomputed from the weights: ``layer_norm_sums``), so that ``W @ layer_norm(x) = rstd *
(sum(w (x - x0) g) - mean' * sum(w g)) + sum(w b)`` (``mean'`` the shifted row's mean): the
RMSNorm's loop plus one running sum. Epilogue: bias,
then optionally a gated activation (GeGeLU over interleaved column pairs, SwiGLU over
[gate | up] halves, whose rows a program loads interleaved) or the residual add.

Layout contract: x (M, K) with unit column stride, w (N, K) contiguous, b (N,) or None, norm
weight (K,) or None, LayerNorm sums (N, 2) float32 or None (a LayerNorm; one row only), residual
(M, N) with unit column stride or None; returns a new (M, N) (or (M, N // 2) gated) tensor in x's dtype.
Registered as ``fullgraph::linear`` (with a fake), so ``torch.compile`` keeps it one opaque
launch; for more than one row the op takes cuBLAS unless
``linear_choice`` says this kernel or ``skinny_linear``'s.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import compile_ahead, linear_choice, pdl
from .._compat import custom_op


@triton.jit
def columns(pid, N, ACT: tl.constexpr, BLOCK_N: tl.constexpr):
    """The weight rows program ``pid`` reads (and which exist): BLOCK_N consecutive rows, or with
    SwiGLU (ACT 2) gate row c and up row c interleaved, so each program's pairs are adjacent."""
    j = tl.arange(0, BLOCK_N)
    if ACT == 2:  # [gate | up] halves: local rows interleave gate row c and up row c
        col = pid * (BLOCK_N // 2) + j // 2
        rn = (j % 2) * (N // 2) + col
        n_ok = col < N // 2
    else:
        rn = pid * BLOCK_N + j
        n_ok = rn < N
    return rn, n_ok


@triton.jit
def store(acc, out_ptr, M, stride_om, pid, rn, n_ok, N, limit, ACT: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr):
    """Store the (BLOCK_M, BLOCK_N) float32 results of :func:`columns`' rows, through the gated
    activation when ACT is 1 (GeGeLU over adjacent pairs) or 2 (SwiGLU)."""
    rm = tl.arange(0, BLOCK_M)
    if ACT == 0:
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rm < M)[:, None] & n_ok[None, :])
    else:  # pairs (a, b) are adjacent local columns
        a, b = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
        if ACT == 1:  # GeGeLU: a = min(a, limit), b = clamp(b, -limit, limit), infinities unchanged
            a = tl.where(a == float("inf"), a, tl.minimum(a, limit))
            b = tl.where((b == float("inf")) | (b == -float("inf")), b, tl.minimum(tl.maximum(b, -limit), limit))
            y = a * tl.sigmoid(1.702 * a) * (b + 1.0)
        else:  # SwiGLU
            y = a * tl.sigmoid(a) * b
        oc = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + rm[:, None] * stride_om + oc[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=(rm < M)[:, None] & (oc < N // 2)[None, :])


@triton.jit
def _row_tile(w, g, x_ptr, k0, rk, K, NORM: tl.constexpr):
    """One K tile of one row: (the (BLOCK_N,) partial products with weight tile ``w``, the tile's
    sum of squares of x). With NORM, x is scaled by ``g``, the norm weight's tile (the 1/rms comes later)."""
    x = tl.load(x_ptr + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
    ss = 0.0
    if NORM:
        ss = tl.sum(x * x, axis=0)
        x = x * g
    return tl.sum(w.to(tl.float32) * x[None, :], axis=1), ss


@triton.jit
def _layer_norm_row_tile(w, g, x_ptr, x0, k0, rk, K):
    """One K tile of one row under a LayerNorm on load (NORM 2): the (BLOCK_N,) partial products
    ``sum(w * (x - x0) * g)`` and the tile's ``x - x0`` (its sum and squares accumulate elementwise,
    reduced once after the loop)."""
    ok = k0 + rk < K
    xs = tl.where(ok, tl.load(x_ptr + k0 + rk, mask=ok, other=0.0).to(tl.float32) - x0, 0.0)
    return tl.sum(w.to(tl.float32) * (xs * g)[None, :], axis=1), xs


@triton.jit
def _norm_tile(g_ptr, k0, rk, K, NORM: tl.constexpr):
    """The norm weight's K tile as float32 (a parameter: loadable before the PDL wait); 0 without NORM."""
    if NORM:
        return tl.load(g_ptr + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
    return tl.zeros(rk.shape, tl.float32)


@triton.jit
def x_tile(ss, x_ptr, g_ptr, stride_xm, M, k0, rk, k_ok, rows, DTYPE: tl.constexpr, NORM: tl.constexpr):
    """The (rows, K tile) of x at ``k0`` (rows past M and columns off ``k_ok`` zero), in DTYPE; with
    NORM, scaled by the norm weight's tile (rounded to DTYPE), and ``ss`` += each row's sum of squares."""
    x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + rk)[None, :], mask=(rows < M)[:, None] & k_ok[None, :],
                other=0.0)
    if NORM:
        xf = x.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
        x = (xf * tl.load(g_ptr + k0 + rk, mask=k_ok, other=0.0).to(tl.float32)[None, :]).to(DTYPE)
    return x, ss


@triton.jit
def _rows_tile(acc, ss, w, x_ptr, g_ptr, stride_xm, M, k0, rk, K, NORM: tl.constexpr, BLOCK_M: tl.constexpr):
    """One K tile of BLOCK_M rows on the tensor cores: ``acc`` += x_tile @ w_tile.T (:func:`x_tile`)."""
    x, ss = x_tile(ss, x_ptr, g_ptr, stride_xm, M, k0, rk, k0 + rk < K, tl.arange(0, BLOCK_M), w.dtype, NORM)
    if w.dtype == tl.float32:  # exact float32 products (tl.dot's default is TF32)
        return tl.dot(x, tl.trans(w), acc, input_precision="ieee"), ss
    return tl.dot(x, tl.trans(w), acc), ss


@triton.jit
def product(x_ptr, w_ptr, b_ptr, g_ptr, sums_ptr, res_ptr, M, K, eps, stride_xm, stride_rm, rn, n_ok,
            HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, PREFETCH: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
            PDL_LATE: tl.constexpr):
    """The (BLOCK_M, BLOCK_N) float32 product ``norm(x) @ w[rn].T + b[rn] (+ residual[:, rn])`` of a
    program's weight rows ``rn`` (those with ``n_ok``); NORM 0 none, 1 RMSNorm (weight ``g``), 2
    LayerNorm (weight ``g``; ``sums`` (N, 2) float32 holds each weight row's ``(sum(w g), sum(w
    b))``; one row). Waits for the kernel ahead (PDL) after loading its first PREFETCH weight
    tiles, the norm weight's, the sums and the bias, which are parameters, and lets
    the kernel behind start; the residual is loaded right after the wait."""
    tl.static_assert(NORM < 2 or BLOCK_M == 1, "a LayerNorm on load serves one row")
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    w0 = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & (rk < K)[None, :], other=0.0)
    if PREFETCH > 1:
        w1 = tl.load(w_rows + (BLOCK_K + rk)[None, :], mask=n_ok[:, None] & (BLOCK_K + rk < K)[None, :], other=0.0)
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    if BLOCK_M == 1:  # the norm weight's first tiles are parameters too
        g0 = _norm_tile(g_ptr, 0, rk, K, NORM)
        if PREFETCH > 1:
            g1 = _norm_tile(g_ptr, BLOCK_K, rk, K, NORM)
        if NORM == 2:  # (sum(w g), sum(w b)) of each weight row
            wg = tl.load(sums_ptr + 2 * rn, mask=n_ok, other=0.0)
            wb = tl.load(sums_ptr + 2 * rn + 1, mask=n_ok, other=0.0)
    pdl.wait(USE_PDL)
    if not PDL_LATE:
        pdl.start_dependents(USE_PDL)
    if HAS_RES:  # issued now, so its round trip overlaps the K loop instead of following it
        rm0 = tl.arange(0, BLOCK_M)
        res = tl.load(res_ptr + rm0[:, None] * stride_rm + rn[None, :], mask=(rm0 < M)[:, None] & n_ok[None, :],
                      other=0.0)
    if NORM == 2:  # one row (static_assert above)
        x0 = tl.load(x_ptr).to(tl.float32)           # the shift: the row's first element
        acc1, xs = _layer_norm_row_tile(w0, g0, x_ptr, x0, 0, rk, K)
        s1, ss = xs, xs * xs                          # elementwise over the K tiles, reduced after the loop
        if PREFETCH > 1:
            part, xs = _layer_norm_row_tile(w1, g1, x_ptr, x0, BLOCK_K, rk, K)
            acc1 += part
            s1 += xs
            ss += xs * xs
        for k0 in range(PREFETCH * BLOCK_K, K, BLOCK_K):
            w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_ok[:, None] & (k0 + rk < K)[None, :], other=0.0)
            part, xs = _layer_norm_row_tile(w, _norm_tile(g_ptr, k0, rk, K, NORM), x_ptr, x0, k0, rk, K)
            acc1 += part
            s1 += xs
            ss += xs * xs
        mean = tl.sum(s1, axis=0) / K                 # of x - x0
        rstd = 1.0 / tl.sqrt(tl.maximum(tl.sum(ss, axis=0) / K - mean * mean, 0.0) + eps)
        acc = (rstd * (acc1 - mean * wg) + wb)[None, :]
    elif BLOCK_M == 1:
        acc1, ss = _row_tile(w0, g0, x_ptr, 0, rk, K, NORM)
        if PREFETCH > 1:
            part, part_ss = _row_tile(w1, g1, x_ptr, BLOCK_K, rk, K, NORM)
            acc1 += part
            ss += part_ss
        for k0 in range(PREFETCH * BLOCK_K, K, BLOCK_K):
            w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_ok[:, None] & (k0 + rk < K)[None, :], other=0.0)
            part, part_ss = _row_tile(w, _norm_tile(g_ptr, k0, rk, K, NORM), x_ptr, k0, rk, K, NORM)
            acc1 += part
            ss += part_ss
        if NORM:
            acc1 = acc1 / tl.sqrt(ss / K + eps)
        acc = acc1[None, :]
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc, ss = _rows_tile(acc, ss, w0, x_ptr, g_ptr, stride_xm, M, 0, rk, K, NORM, BLOCK_M)
        if PREFETCH > 1:
            acc, ss = _rows_tile(acc, ss, w1, x_ptr, g_ptr, stride_xm, M, BLOCK_K, rk, K, NORM, BLOCK_M)
        for k0 in range(PREFETCH * BLOCK_K, K, BLOCK_K):
            w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_ok[:, None] & (k0 + rk < K)[None, :], other=0.0)
            acc, ss = _rows_tile(acc, ss, w, x_ptr, g_ptr, stride_xm, M, k0, rk, K, NORM, BLOCK_M)
        if NORM:
            acc = acc / tl.sqrt(ss / K + eps)[:, None]
    if PDL_LATE:  # every weight tile is in: the kernel behind may take this program's slot soon
        pdl.start_dependents(USE_PDL)
    if HAS_BIAS:
        acc += bias[None, :]
    if HAS_RES:  # the residual stream's new value: this product plus the stream (no activation)
        acc += res.to(tl.float32)
    return acc


@compile_ahead.kernel
@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, g_ptr, sums_ptr, res_ptr, out_ptr,
    M, N, K, limit, eps,
    stride_xm, stride_rm, stride_om,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
    PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr, PDL_LATE: tl.constexpr,
):
    pid = tl.program_id(0)
    rn, n_ok = columns(pid, N, ACT, BLOCK_N)
    acc = product(x_ptr, w_ptr, b_ptr, g_ptr, sums_ptr, res_ptr, M, K, eps, stride_xm, stride_rm, rn, n_ok,
                  HAS_BIAS, NORM, HAS_RES, PREFETCH, BLOCK_M, BLOCK_N, BLOCK_K, USE_PDL, PDL_LATE)
    store(acc, out_ptr, M, stride_om, pid, rn, n_ok, N, limit, ACT, BLOCK_M, BLOCK_N)


def launch_config(n: int, m: int = 1, layer_norm: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, PREFETCH, num_stages) for ``m`` rows and N output columns,
    from ``benchmarks/sweep_linear.py`` on an H200 (bf16, the llama-1b and Phi-3-Small layers): narrow
    layers need small column blocks for enough programs to stream HBM; wide ones do not. With a
    LayerNorm on load (one row), from ``benchmarks/sweep_layer_norm.py`` on an H100 and an H200
    (Phi-3-Small's QKV with RoPE, 6144 x 4096, and GeGeLU up projection, 28672 x 4096): 16 x 512 and
    16 x 256 run under the LayerNorm kernel + projection on both (H200 15.5 / 56.4 us against 15.8 /
    57.6); the defaults below cost the QKV shape 3-4 us on the H100."""
    if m > 1:  # rows padded to 16 for tl.dot
        return (16 if n <= 8192 else 32), 256, 4, 1, 3
    if layer_norm:
        return (16, 512, 4, 1, 1) if n <= 8192 else (16, 256, 4, 1, 1)
    if n <= 3072:
        return 4, 1024, 8, 1, 1
    if n <= 4096:
        return 8, 1024, 8, 1, 1
    if n <= 8192:
        return 4, 512, 4, 1, 1
    return 32, 256, 8, 1, 1


ACTIVATIONS = {"none": 0, "gegelu": 1, "silu_and_mul": 2}
NO_LIMIT = 1e38   # a GeGeLU limit no finite float32 value reaches (an op schema cannot default to inf)


def launch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, activation: str = "none",
           limit: float = NO_LIMIT, config: tuple[int, ...] | None = None, norm_weight: torch.Tensor | None = None,
           eps: float = 0.0, residual: torch.Tensor | None = None,
           layer_norm_sums: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton launch behind :func:`linear`; ``config`` (BLOCK_N, BLOCK_K, num_warps[, PREFETCH[,
    num_stages]]) overrides :func:`launch_config` (benchmarks sweep it)."""
    (m, k), n = x.shape, w.shape[0]
    _check(x, w, b, activation, norm_weight, residual, layer_norm_sums)
    out = compile_ahead.output((m, n if activation == "none" else n // 2), x.dtype, x.device)
    if m == 0:
        return out
    block_n, block_k, num_warps, prefetch, stages = (*(config or launch_config(n, m, layer_norm_sums is not None)),
                                                     1, 1)[:5]
    block_m = 1 if m == 1 else max(16, triton.next_power_of_2(m))
    _linear_kernel[(triton.cdiv(n, block_n),)](
        x, w, w if b is None else b, w if norm_weight is None else norm_weight,
        w if layer_norm_sums is None else layer_norm_sums, out if residual is None else residual,
        out, m, n, k, limit, eps, x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0),
        HAS_BIAS=b is not None, ACT=ACTIVATIONS[activation], NORM=norm_kind(norm_weight, layer_norm_sums),
        HAS_RES=residual is not None, PREFETCH=prefetch, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=stages, PDL_LATE=pdl.late(), **pdl.options(x))
    return out


def norm_kind(norm_weight: torch.Tensor | None, layer_norm_sums: torch.Tensor | None) -> int:
    """The kernels' NORM: 0 none, 1 RMSNorm (a weight), 2 LayerNorm (a weight and the weight rows' sums)."""
    return 0 if norm_weight is None else 1 if layer_norm_sums is None else 2


@torch.no_grad()
def layer_norm_sums(w: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``(w @ norm_weight, w @ norm_bias)`` as an (N, 2) float32 tensor (into ``out`` if given): the
    two constants a LayerNorm on load needs of each weight row (the module docstring). Computed in
    float64, 4,096 weight rows at a time; once per set of weights, never in a step."""
    n = w.shape[0]
    out = torch.empty((n, 2), dtype=torch.float32, device=w.device) if out is None else out
    gb = torch.stack((norm_weight, norm_bias), dim=1).to(torch.float64)           # (K, 2)
    for i in range(0, n, 4096):
        out[i:i + 4096] = (w[i:i + 4096].to(torch.float64) @ gb).float()
    return out


def _check(x, w, b, activation, norm_weight, residual, layer_norm_sums=None) -> None:
    (m, k), n = x.shape, w.shape[0]
    if activation not in ACTIVATIONS or (activation != "none" and n % 2):
        raise ValueError(f"linear: activation must be one of {sorted(ACTIVATIONS)} (gated ones need an even "
                         f"number of weight rows), got {activation!r} with {n} rows")
    if w.shape[1] != k or w.stride() != (k, 1) or x.stride(-1) != 1 or (b is not None and b.shape != (n,)):
        raise ValueError(f"linear: x {tuple(x.shape)} (unit column stride), w {tuple(w.shape)} contiguous with "
                         f"{k} columns, b (N,) or None; got w strides {w.stride()}, b "
                         f"{None if b is None else tuple(b.shape)}")
    if norm_weight is not None and (norm_weight.shape != (k,) or norm_weight.stride() != (1,)):
        raise ValueError(f"linear: norm_weight must be a contiguous ({k},) vector, got {tuple(norm_weight.shape)}")
    if layer_norm_sums is not None and (norm_weight is None or m != 1 or layer_norm_sums.shape != (n, 2)
                                        or layer_norm_sums.dtype != torch.float32
                                        or not layer_norm_sums.is_contiguous()):
        raise ValueError(f"linear: a LayerNorm on load (layer_norm_sums) needs one row, a norm_weight and contiguous "
                         f"({n}, 2) float32 sums; got {m} rows, norm_weight "
                         f"{None if norm_weight is None else 'given'}, layer_norm_sums "
                         f"{tuple(layer_norm_sums.shape)} {layer_norm_sums.dtype}")
    if residual is not None and (activation != "none" or residual.shape != (m, n) or residual.stride(-1) != 1):
        raise ValueError(f"linear: residual must be ({m}, {n}) with unit column stride and no activation, got "
                         f"{tuple(residual.shape)} with activation {activation!r}")


@custom_op("fullgraph::linear", mutates_args=())
def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, activation: str = "none",
           limit: float = NO_LIMIT, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
           residual: torch.Tensor | None = None, layer_norm_sums: torch.Tensor | None = None) -> torch.Tensor:
    """``norm(x) @ w.T + b`` (M, K) x (N, K) -> (M, N) in x's dtype, float32 accumulation; with a gated
    ``activation`` ("gegelu" over interleaved columns, "silu_and_mul" over [gate | up] halves, as
    in ``kernels.activation``) applied to the float32 result: -> (M, N // 2); or plus ``residual``
    (M, N). ``norm_weight``: x is RMS-normalised first (``eps``), on load: each program sums the
    squares of the row it streams anyway, and scales its products by 1/rms at the end. With
    ``layer_norm_sums`` too (:func:`layer_norm_sums` of ``w`` and the norm's weight and bias), a
    LayerNorm instead (one row: see the module docstring).

    One launch of the weight-streaming kernel for one row; for more rows, cuBLAS with the norm and
    the activation as kernels of their own, unless ``linear_choice`` says ours or the split-K one."""
    args = (x, w, b, activation, limit)
    if layer_norm_sums is not None:  # one row (the launch checks): the one-row kernel
        return launch(*args, None, norm_weight, eps, residual, layer_norm_sums)
    impl = linear_choice.choose(x)
    if impl == "cublas":
        return linear_choice.unfused(*args, norm_weight, eps, residual)
    if impl == "skinny":
        from . import skinny_linear  # (it builds on this module)

        return skinny_linear.launch(*args, None, norm_weight, eps, residual)
    return launch(*args, None, norm_weight, eps, residual)


@linear.register_fake
def _(x, w, b=None, activation="none", limit=NO_LIMIT, norm_weight=None, eps=0.0, residual=None,
      layer_norm_sums=None):
    return x.new_empty((x.shape[0], w.shape[0] if activation == "none" else w.shape[0] // 2))
