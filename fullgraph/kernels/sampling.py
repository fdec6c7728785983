"""Sample one token per row of float32 logits without sorting the vocabulary.

Semantics, tie rules and RNG are exactly ``fullgraph.sampling.sample_reference`` (see that module):
``s = logits * (1 / T)``; keep ``s >= v_k`` (top-k), then ``s >= v_p`` (top-p over the top-k mass), then
``exp(s - s_max) >= min_p``; the token is the Gumbel-max ``argmax(s + g)`` over the kept set, with
Philox4x32-10 noise keyed on the seed, counter ``(v >> 2, offset lo, offset hi, 0)``, lane ``v & 3``.

Algorithm: rows are split into C chunks; five passes in four launches: three of (R, C) programs
(passes 3 and 4 share one, ``_tail_kernel``), then one of R programs. Rows
with top-p alone or no filter ("chain rows") are decided in the first two (``sampling_chain``);
rows with a top-k up to TOP_VALUES x C ("top-k rows", with or without top-p and min-p) list their
candidates in the first two for pass 5 (``sampling_topk``); the other filtered rows (min-p, a
larger top-k) and rows of either kind that fall back take the histogram path.
1. ``_scan_kernel``: per chunk, the max and lowest argmax of the raw logits (NaN as -inf). The greedy
   answer, and ``s_max = max * (1 / T)`` (the scaling is monotone). Chain rows also list the chunk's
   best Gumbel scores and a bound of the rest; top-k rows a few of the chunk's largest values.
2. ``_hist_kernel`` (in ``sampling_hist``, as is the tail) level 1. Chain rows: Z and the masses
   above the chain's first links; the row's last program decides the token or sends the row to the
   histogram path (from launch 3). Top-k rows: the ids of the tokens at or above the k-th largest
   listed value, as pass 5's list; where that list is short (<= CB_SORT tokens), the row's last
   program takes the token from it as pass 5 would (the sort below) and the row is decided. Rows on
   the histogram path: each token's ``d = s_max - s`` falls in bucket ``floor(d * BPN)`` of 1/BPN
   nat (the last also takes d >= (NB - 1) / BPN, -inf and lanes past V): a count histogram per row
   (``tl.histogram``, one atomic add per program) and ``Z = sum exp(s - s_max)``. The row's last
   program to finish derives the zones: buckets ``< b_hi`` are kept by top-k and top-p for certain,
   buckets ``> b_lo`` dropped for certain (exact counts for top-k; for top-p the bounds
   ``exp(-(b+1)/BPN) <= e < exp(-b/BPN)`` on each token's mass; ``-log(min_p)`` for min-p).
3. ``_tail_kernel``, level 2 (rows whose undecided zone holds > REFINE_ABOVE tokens): the same over
   that zone split ``sub`` times finer (a power of two, so bucket edges stay exact), on top of the
   exact count and mass of the tokens above it. Positions ("pos") are level-2 buckets for such rows.
   Chain rows that fell back run level 1 here (and no level 2: pass 5 narrows a wide zone itself).
4. ``_tail_kernel``, compacting (rows on the histogram path; where the row had level-2 work, after a
   barrier of the row's programs, so that its zones are in): sums the exact mass of the surely-kept
   zone, takes the Gumbel winner among its min-p survivors (noise only for blocks that hold one),
   and writes the ids of the undecided tokens (``b_hi <= pos <= b_lo``) to the chunk's segment of
   ``cand``.
5. ``_select_kernel``: the token where level 1 decided (the chain, a short top-k list); otherwise
   exact ``v_k`` and ``v_p`` over the undecided (or top-k-listed) tokens by a search on the
   order-preserving int32 key of s (counts, then masses, on top of the surely-kept zone's), the
   winner among the kept ones against the surely-kept winner; greedy rows take pass 1's argmax.
   A list of at most ``CB_SORT`` (128) tokens, a top-k of 50's, is sorted instead (v_k is its
   (k - n_hi)-th score, v_p where the running mass reaches the cut) and its winner taken from the same
   registers. Up to CAND_BLOCK undecided tokens are searched in registers. More are first narrowed with exact
   per-position counts and masses over the list (the threshold's position, < REFINE_BUCKETS past
   b_hi, is then searched in registers). Failing that (a bucket of > CAND_BLOCK tokens, e.g. a huge
   tie) an exact slow path re-reads the row at every search step. The select pass writes the
   thresholds it found into the row's zones (columns 10-11, float bits) for tests and inspection.
The max and histogram passes keep per-lane accumulators (running max and first argmax, masses)
across their loop steps and reduce them once at the end, and the compacting pass takes a step's
Gumbel winner and its index in one reduction: a program's loop is a chain of dependent steps, and
each block-wide reduction in it is a barrier. Only float summation order differs from the
reference, so results can differ only where a mass
sits within rounding of ``top_p * Z_k`` or two scores tie to the last bit. Capture-safe: grids and
workspaces come from shapes, every decision is made on the device.

Measured (V = 128256, per call in a CUDA graph, ``benchmarks/bench_sampling.py``; BENCHMARKS.md
has the tables): before the chain, top-p 0.9 cost 107 / 193 us at batch 32 / 64 on an H200 (the
histogram path: level-1 histogram 24, level-2 28, compact 30-56 us); with it 32 / 47 us (scan 14,
check 12.5, three passes with nothing to do 1.3-2.2 us each). Top-k 50 + top-p 0.95: 69 / 116 us on
the histogram path, 44-45 / 57-58 with the top-k list (scan 8.7, listing 15.3, select 14.8); on an
H100 40.6 / 62.5 before the sorted short lists, 31.7 / 51.6 with them (select 15.3 -> 6.3 us).
Passes 3 and 4 in one launch and short top-k lists decided in level 1 (H100): top-p 0.9 30.5 /
46.3 -> 27.8 / 42.8 us, top-k 50 + top-p 0.95 31.5 / 51.2 -> 28.1 / 47.1 at batch 32 / 64; the
tail launch with nothing to do costs 1.6-1.8 us.

Layout contract:
    logits:        (R, V) float32/bf16/fp16, ``stride(-1) == 1``
    temperature, top_p, min_p: (R,) float32; top_k: (R,) int32; seeds, offsets: (R,) int64
    returns:       (R,) int64 in [0, V)
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import env
from . import compile_ahead, pdl
from .sampling_chain import CHAIN, LIST_TOP, _is_chain, _scan_chain
from .sampling_common import (BLOCK, BUCKETS_PER_NAT, CAND_BLOCK, CAND_SMALL, LIST_BLOCK, NUM_BUCKETS, REFINE_ABOVE,
                              REFINE_BUCKETS, ZONES_W, _chunk_max)
from .sampling_topk import TOP_VALUES, _is_topk, _scan_values
from .sampling_hist import _hist_kernel, _tail_kernel
from .sampling_select import _select_kernel
from .._compat import custom_op

@compile_ahead.kernel
@triton.jit
def _scan_kernel(
        logits_ptr, temp_ptr, top_k_ptr, min_p_ptr, seed_ptr, offset_ptr,             # pointers
        part_f_ptr, part_i_ptr, hist_ptr, zones_ptr, list_f_ptr, list_i_ptr, values_ptr,
        vocab, chunk, num_chunks,                                                     # sizes
        stride_l,                                                                     # strides
        NB: tl.constexpr, BLOCK: tl.constexpr, T: tl.constexpr, TK: tl.constexpr, FAST: tl.constexpr,
        USE_PDL: tl.constexpr):
    pdl.wait(USE_PDL)
    pdl.start_dependents(USE_PDL)
    row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if c == 0:                                       # the histogram's atomics; zones, arrival count, chain state
        tl.store(hist_ptr + row * NB + tl.arange(0, NB), tl.zeros([NB], tl.int32))
        tl.store(zones_ptr + row * ZONES_W + tl.arange(0, ZONES_W), tl.zeros([ZONES_W], tl.int32))
    x_row = logits_ptr + row * stride_l
    slot = row * num_chunks + c
    t = tl.load(temp_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    if _is_topk(t, top_k, vocab, num_chunks, TK):
        first = _scan_values(x_row, part_f_ptr + slot * 4, values_ptr + slot * TK, c, chunk, vocab,
                             tl.math.div_rn(1.0, t), BLOCK, TK)
    elif _is_chain(t, top_k, tl.load(min_p_ptr + row), vocab):
        first = _scan_chain(x_row, part_f_ptr + slot * 4, list_f_ptr + slot * (2 * T + 1), list_i_ptr + slot * T,
                            c, chunk, vocab, tl.math.div_rn(1.0, t), tl.load(seed_ptr + row),
                            tl.load(offset_ptr + row), BLOCK, T, FAST)
    else:
        m, first = _chunk_max(x_row, c, chunk, vocab, BLOCK)
        tl.store(part_f_ptr + slot * 4, m)
    tl.store(part_i_ptr + slot * 3, first)


INTERPRET = env.triton_interpret()   # read once: the interpreter has no fast_log2f
MANY_ROWS = 16  # from this many rows the row passes take BLOCK-token steps over 4 programs per SM ...
MOST_ROWS = 64  # ... and from this many over 8


@functools.cache
def _sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _launch_shape(rows: int, device: torch.device) -> tuple[int, int]:
    """(tokens per loop step, programs a row pass aims at). Each program's loop is a chain of
    dependent steps (load, bucket, histogram, scan), so once there are rows enough, short chains
    in many programs beat long ones in few: on the H200 (``bench_sampling.py --sweep``, V =
    128256) top-p 0.9 at batch 32 took 148 us with 4096-token steps at 2 programs per SM and 107
    us with 1024 at 8 (batch 64: 292 -> 193). Between 16 and 64 rows 4 programs per SM beat 8
    (H100, 1024-token steps, batch 32: top-p 0.9 30.4-30.6 us against 31.3, top-k 50 + top-p 0.95
    39.3-40.4 against 44.6-45.5); at 64 rows 8 stay (the H200 took 113 us for top-p at 4 an SM,
    47 at 8). Fewer rows keep the shape measured there before (4096 at 2 per SM: one step a
    program already). A row has 17-33 chunks on an H200 at V = 128256 (the select pass finds a
    listed token's chunk by binary search)."""
    if rows >= MOST_ROWS:
        return BLOCK, 8 * _sms(device)
    if rows >= MANY_ROWS:
        return BLOCK, 4 * _sms(device)
    return 4 * BLOCK, 2 * _sms(device)


def launch(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor, *, block: int | None = None,
           num_chunks: int | None = None, cand_block: int = CAND_BLOCK, refine_above: int = REFINE_ABOVE,
           list_top: int = LIST_TOP, chain: int = CHAIN, fuse_tail: bool | None = None,
           workspace: dict | None = None) -> torch.Tensor:
    """Launch the passes; ``block``, ``num_chunks``, ``cand_block``, ``refine_above``, ``list_top``
    and ``chain`` (1, 2 or 4) are tuning knobs (tests shrink them to reach every path on small
    vocabularies; None: ``_launch_shape``); ``fuse_tail`` runs passes 3 and 4 in one launch (None:
    everywhere but under the interpreter, which cannot); a ``workspace`` dict receives the
    intermediate tensors (``zones``: see ``sampling_hist._level_zones`` and ``sampling_chain``).
    Capture-safe: the launch shape depends on the row count only."""
    if fuse_tail and INTERPRET:
        raise ValueError("fuse_tail=True needs a GPU: under TRITON_INTERPRET programs run one after another, "
                         "and the fused launch's programs wait for each other")
    fuse_tail = not INTERPRET if fuse_tail is None else fuse_tail
    rows, vocab = logits.shape
    out = compile_ahead.output(rows, torch.int64, logits.device)
    if rows == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    shape_block, target = _launch_shape(rows, logits.device)
    block = block or shape_block
    max_chunks = triton.cdiv(vocab, block)
    c = num_chunks or max(1, min(max_chunks, triton.cdiv(target, rows)))
    c = min(c, max_chunks)
    chunk = triton.cdiv(triton.cdiv(vocab, c), block) * block
    c = triton.cdiv(vocab, chunk)
    dev = logits.device
    part_f = torch.empty(rows, c, 4, dtype=torch.float32, device=dev)   # max, Z, surely-kept mass, score
    part_i = torch.empty(rows, c, 3, dtype=torch.int32, device=dev)     # argmax, winner id, undecided
    hist = torch.empty(rows, NUM_BUCKETS, dtype=torch.int32, device=dev)
    zones = torch.empty(rows, ZONES_W.value, dtype=torch.int32, device=dev)   # see sampling_hist; [7] arrivals
    cand = torch.empty(rows, c, chunk, dtype=torch.int32, device=dev)     # undecided ids, per chunk
    c_pad = triton.next_power_of_2(c)
    scratch = torch.empty(rows, cand_block + c_pad, dtype=torch.int32, device=dev)   # packed ids, segment ends
    list_f = torch.empty(rows, c, 2 * list_top + 1, dtype=torch.float32, device=dev)  # scores, values, bound
    list_i = torch.empty(rows, c, list_top, dtype=torch.int32, device=dev)            # the listed ids
    chain_f = torch.empty(rows, c, 5, dtype=torch.float32, device=dev)   # masses above links 0 .. 3, Z
    values = torch.empty(rows, c, TOP_VALUES, dtype=torch.float32, device=dev)   # top-k rows' listed values
    if workspace is not None:
        workspace.update(part_f=part_f, part_i=part_i, hist=hist, zones=zones, cand=cand, list_f=list_f,
                         list_i=list_i, chain_f=chain_f, values=values)
    # No FMA contraction: s = x * (1 / T) and s - s_max round exactly as in PyTorch.
    meta = dict(NB=NUM_BUCKETS, BLOCK=block, enable_fp_fusion=False, **pdl.options(logits))
    warps = 8 if block >= 2048 else 4
    _scan_kernel[(rows, c)](logits, temperature, top_k, min_p, seeds, offsets, part_f, part_i, hist, zones, list_f,
                            list_i, values, vocab, chunk, c, logits.stride(0), T=list_top, TK=TOP_VALUES,
                            FAST=not INTERPRET, num_warps=warps, **meta)
    meta.update(BPN=BUCKETS_PER_NAT, C_PAD=c_pad)
    params = (temperature, top_k, top_p, min_p, seeds, offsets)
    _hist_kernel[(rows, c)](logits, *params, part_f, hist, zones, list_f, list_i, chain_f, values, part_i, cand,
                            vocab, chunk, c, refine_above, cand_block, logits.stride(0), T=list_top, J=chain,
                            TK=TOP_VALUES, num_warps=warps, **meta)
    for phase in ((0,) if fuse_tail else (2, 3)):
        _tail_kernel[(c, rows)](logits, *params, part_f, part_i, hist, zones, list_f, list_i, chain_f, values, cand,
                                vocab, chunk, c, refine_above, cand_block, logits.stride(0), T=list_top, J=chain,
                                TK=TOP_VALUES, PHASE=phase, num_warps=warps, **meta)
    _select_kernel[(rows,)](logits, *params, part_f, part_i, zones, cand, scratch, out, vocab, c, chunk,
                            logits.stride(0), CB=cand_block, CB_SMALL=max(16, min(CAND_SMALL, cand_block // 4)),
                            RB=REFINE_BUCKETS, LB=LIST_BLOCK, C_BITS=c_pad.bit_length() - 1,
                            num_warps=16 if cand_block >= 4096 else 4, **meta)
    return out


@custom_op("fullgraph::sample", mutates_args=())
def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(R,) int64 token ids; see the module docstring."""
    return launch(logits, temperature, top_k, top_p, min_p, seeds, offsets)


@sample.register_fake
def _(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)
