"""chunks -> StepPlan: the pure host function that validates a step and lays out its arrays.

No torch, no device work: numpy only, vectorised. The padded plan is exactly what the static
buffers will hold, and a runner has it written straight into its staging area (``out``).

Planning is serial with an idle GPU, and for a decode batch each numpy call (~0.5 us) costs more
than its data: valid steps pay for one fused check, and a step whose chunks all have one token
skips the sums and repeats over chunks.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import struct
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .config import RunnerConfig
from .padding import REPEAT_LAST, PaddingPolicy


@dataclass(frozen=True)
class SeqChunk:
    """The new tokens of one request in one step.

    Attributes:
        token_ids: the tokens to run (a prefill chunk, or one decode token).
        start_pos: position of the first of them (= tokens of this request already in the cache).
        block_ids: the request's KV-cache pages, in order, covering positions
            ``0 .. start_pos + len(token_ids) - 1`` (more may be passed; none may be the null block 0).
        request_id: optional name used in error messages.
    """

    token_ids: Sequence[int]
    start_pos: int
    block_ids: Sequence[int]
    request_id: Hashable | None = None


@dataclass(frozen=True, eq=False)
class StepPlan:
    """Host arrays of one step, padded to its bucket (see ``padding.check`` for the invariants).

    Shapes: T = num_tokens_padded, R = num_reqs_padded, MB = config.max_blocks_per_seq.
    """

    input_ids: np.ndarray        # (T,) int64
    positions: np.ndarray        # (T,) int64
    query_start_loc: np.ndarray  # (R + 1,) int32
    seq_start_loc: np.ndarray    # (R + 1,) int32
    seq_lens: np.ndarray         # (R,) int32
    block_table: np.ndarray      # (R, MB) int32
    slot_mapping: np.ndarray     # (T,) int64, -1 = write nothing
    logits_indices: np.ndarray   # (R,) int64: each chunk's last token
    num_reqs: int
    num_tokens: int
    num_reqs_padded: int
    num_tokens_padded: int
    decode_only: bool            # every chunk has exactly one token
    max_query_len: int           # of the real chunks (host-side information, for eager runs)
    max_seq_len: int
    block_size: int
    num_blocks: int

    @property
    def key(self) -> tuple[int, bool]:
        """The graph key: (padded token count, decode-only)."""
        return self.num_tokens_padded, self.decode_only


def array_shapes(num_tokens: int, num_reqs: int, max_blocks_per_seq: int) -> dict[str, tuple[tuple[int, ...], type]]:
    """Shape and dtype of each StepPlan array for T tokens and R requests (the static buffers hold the maxima)."""
    t, r = num_tokens, num_reqs
    return {"input_ids": ((t,), np.int64), "positions": ((t,), np.int64), "slot_mapping": ((t,), np.int64),
            "logits_indices": ((r,), np.int64), "query_start_loc": ((r + 1,), np.int32),
            "seq_start_loc": ((r + 1,), np.int32), "seq_lens": ((r,), np.int32),
            "block_table": ((r, max_blocks_per_seq), np.int32)}


def _who(chunks: Sequence[SeqChunk], i: int) -> str:
    rid = chunks[i].request_id
    return f"chunk {i}" + (f" (request {rid!r})" if rid is not None else "")


def _fail(chunks: Sequence[SeqChunk], bad: np.ndarray, field: str, message) -> None:
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{_who(chunks, i)}: {field}: {message(i)}")


def bucket_for(num_tokens: int, buckets: Sequence[int]) -> int | None:
    """Smallest bucket >= num_tokens, or None when the step is larger than every bucket."""
    i = bisect.bisect_left(buckets, num_tokens)
    return buckets[i] if i < len(buckets) else None


def _gather(chunks: Sequence[SeqChunk], config: RunnerConfig, num_blocks: int, vocab_size: int | None):
    """The chunks as arrays, validated: ``(q_lens, starts, ends, n_blocks, tokens, blocks, max_seq_len)``;
    ``q_lens`` is None when every chunk has one token (a decode-only step).

    One fused check on the fast path (Python's builtins over the per-chunk lists, one reduction per
    range; ``int()`` truncates as the int64 conversion does); only when it fails does ``_explain``
    find the first offending chunk and field.
    """
    n = len(chunks)
    if n == 0:
        raise ValueError("a step needs at least one chunk")
    if n > config.max_num_seqs:
        raise ValueError(f"{n} chunks in one step: more than max_num_seqs = {config.max_num_seqs}")
    tok_lists, blk_lists = [c.token_ids for c in chunks], [c.block_ids for c in chunks]
    q_list, nb_list = list(map(len, tok_lists)), list(map(len, blk_lists))
    total, n_blk, q_min = sum(q_list), sum(nb_list), min(q_list)
    start_list = [c.start_pos for c in chunks]
    starts, n_blocks = np.array(start_list, np.int64), np.array(nb_list, np.int64)
    tokens, blocks = _flatten(tok_lists, total), _flatten(blk_lists, n_blk)
    if total == n and q_min == 1:
        q_lens, ends, max_seq_len = None, starts + 1, int(max(start_list)) + 1
    else:
        q_lens = np.array(q_list, np.int64)
        ends = starts + q_lens
        max_seq_len = int(ends.max())
    ok = (total <= config.max_num_tokens and q_min > 0 and max(nb_list) <= config.max_blocks_per_seq
          and int(min(start_list)) >= 0 and max_seq_len <= config.max_model_len
          and (n_blocks * config.block_size >= ends).all() and _in_range(blocks, 1, num_blocks)
          and (vocab_size is None or _in_range(tokens, 0, vocab_size)) and _distinct(blocks, num_blocks))
    if not ok:
        _explain(chunks, config, num_blocks, vocab_size, np.array(q_list, np.int64), starts, n_blocks, tokens, blocks)
    return q_lens, starts, ends, n_blocks, tokens, blocks, max_seq_len


def _flatten(seqs: list[Sequence[int]], count: int) -> np.ndarray:
    """The sequences concatenated, as int64: the bulk of planning a large batch (its block ids).

    numpy arrays (a caller keeping its block tables in numpy) are concatenated, with no Python int
    in between (~20x faster). Python ints go through ``struct`` from ~100 on, about 1.4x faster
    than ``np.fromiter``; what it refuses (a float, say) takes the ``np.fromiter`` way, so such
    input behaves as it always did."""
    if isinstance(seqs[0], np.ndarray):
        return np.concatenate(seqs).astype(np.int64, copy=False)
    if count >= 128:
        try:
            return np.frombuffer(struct.pack(f"{count}q", *itertools.chain.from_iterable(seqs)), np.int64)
        except struct.error:
            pass
    return np.fromiter(itertools.chain.from_iterable(seqs), np.int64, count)


def _in_range(values: np.ndarray, lo: int, hi: int) -> bool:
    """Whether every value lies in ``[lo, hi)``: one reduction, as an unsigned comparison in which
    a value below ``lo`` wraps around to a huge one."""
    return bool(((values - lo) if lo else values).view(np.uint64).max() < hi - lo)


def _distinct(blocks: np.ndarray, num_blocks: int) -> bool:
    """Whether no id repeats (ids already in ``[0, num_blocks)``). Every id writes its index into a
    scratch table and a repeated id keeps only its last index: linear in ``len(blocks)``, unlike a
    sort or a ``bincount``, and the scratch table needs no initialisation."""
    index = np.arange(len(blocks), dtype=np.int32)
    last = np.empty(num_blocks, np.int32)
    last[blocks] = index
    return bool((last[blocks] == index).all())


def _explain(chunks, config, num_blocks, vocab_size, q_lens, starts, n_blocks, tokens, blocks) -> None:
    """Raise the ValueError for the first problem, in a fixed order of checks."""
    n = len(chunks)
    _fail(chunks, q_lens == 0, "token_ids", lambda i: "empty chunk (a chunk needs at least one token)")
    total = int(q_lens.sum())
    if total > config.max_num_tokens:
        raise ValueError(f"{total} tokens in one step: more than max_num_tokens = {config.max_num_tokens}")
    ends = starts + q_lens
    _fail(chunks, starts < 0, "start_pos", lambda i: f"{starts[i]} is negative")
    _fail(chunks, ends > config.max_model_len, "start_pos",
          lambda i: f"start_pos {starts[i]} + {q_lens[i]} tokens = {ends[i]} exceeds max_model_len = {config.max_model_len}")
    need = -(-ends // config.block_size)
    _fail(chunks, n_blocks < need, "block_ids",
          lambda i: f"{n_blocks[i]} blocks cover {n_blocks[i] * config.block_size} positions; "
                    f"positions up to {ends[i] - 1} need {need[i]} (block_size {config.block_size})")
    mb = config.max_blocks_per_seq
    _fail(chunks, n_blocks > mb, "block_ids",
          lambda i: f"{n_blocks[i]} blocks: more than max_blocks_per_seq = {mb} (max_model_len / block_size)")
    tok_owner = np.repeat(np.arange(n), q_lens)
    blk_owner = np.repeat(np.arange(n), n_blocks)
    if vocab_size is not None:
        bad = (tokens < 0) | (tokens >= vocab_size)
        _fail(chunks, np.bincount(tok_owner[bad], minlength=n) > 0, "token_ids",
              lambda i: f"token id {tokens[bad & (tok_owner == i)][0]} outside the vocabulary [0, {vocab_size})")
    bad = (blocks <= 0) | (blocks >= num_blocks)
    _fail(chunks, np.bincount(blk_owner[bad], minlength=n) > 0, "block_ids",
          lambda i: f"block id {blocks[bad & (blk_owner == i)][0]} is the null block or outside [1, {num_blocks})")
    order = np.argsort(blocks, kind="stable")
    dup = np.flatnonzero(blocks[order][1:] == blocks[order][:-1])
    if dup.size:
        a, b = order[dup[0]], order[dup[0] + 1]
        other = "the same chunk" if blk_owner[a] == blk_owner[b] else _who(chunks, int(blk_owner[a]))
        raise ValueError(f"{_who(chunks, int(blk_owner[b]))}: block_ids: block {blocks[b]} is also used by {other}")
    raise AssertionError("_explain found no problem the fast check reported")


def _padded_sizes(num_tokens: int, config: RunnerConfig, pad: bool) -> tuple[int, int | None]:
    if not pad:
        return num_tokens, None
    bucket = bucket_for(num_tokens, config.buckets)
    t_pad = num_tokens if bucket is None else bucket
    return t_pad, min(t_pad, config.max_num_seqs)


def _tail(rule, last) -> int:
    return last if rule == REPEAT_LAST else rule


def plan_step(chunks: Sequence[SeqChunk], config: RunnerConfig, policy: PaddingPolicy, *,
              pad: bool = True, num_blocks: int | None = None, vocab_size: int | None = None,
              out: Mapping[str, np.ndarray] | None = None) -> StepPlan:
    """Validate ``chunks`` and lay out one step, padded to its bucket with ``policy`` when ``pad``.

    ``num_blocks`` defaults to ``config.num_blocks`` (pass the resolved value when that is None).
    ``out``: arrays to write the plan into instead of new ones (a runner's staging area), each at
    least as large as ``array_shapes`` of the padded step; the plan's arrays are then views of them.
    Raises ``ValueError`` naming the chunk and field for any bad input, before anything is written.
    """
    num_blocks = num_blocks or config.num_blocks
    if num_blocks is None:
        raise ValueError("plan_step needs num_blocks: pass it, or use the runner's resolved config")
    q_lens, starts, ends, n_blocks, tokens, blocks, max_seq_len = _gather(chunks, config, num_blocks, vocab_size)
    t_pad, r_pad = _padded_sizes(len(tokens), config, pad)
    r_pad = len(chunks) if r_pad is None else r_pad
    return _layout(q_lens, starts, ends, n_blocks, tokens, blocks, max_seq_len, config, policy, t_pad, r_pad,
                   num_blocks, out or _new_arrays(t_pad, r_pad, config))


def _new_arrays(num_tokens: int, num_reqs: int, config: RunnerConfig) -> dict[str, np.ndarray]:
    return {name: np.empty(shape, dtype)
            for name, (shape, dtype) in array_shapes(num_tokens, num_reqs, config.max_blocks_per_seq).items()}


def capture_plan(config: RunnerConfig, policy: PaddingPolicy, num_blocks: int, num_tokens: int,
                 decode_only: bool, num_reqs: int | None = None) -> StepPlan:
    """A plan to capture the graph of one key with: short sequences that read only the null block
    and write nothing (every slot -1), so capture neither depends on nor touches the cache.
    ``num_reqs`` (default: as many as the bucket pads to) spreads the tokens over that many."""
    r = num_reqs or min(num_tokens, config.max_num_seqs)
    q_lens = np.full(r, num_tokens // r, np.int64)
    q_lens[: num_tokens % r] += 1
    n_blocks = -(-q_lens // config.block_size)
    blocks = np.zeros(int(n_blocks.sum()), np.int64)
    r_pad = min(num_tokens, config.max_num_seqs) if num_reqs is None else r
    plan = _layout(None if r == num_tokens else q_lens, np.zeros(r, np.int64), q_lens, n_blocks,
                   np.zeros(num_tokens, np.int64), blocks, int(q_lens.max()), config, policy, num_tokens, r_pad,
                   num_blocks, _new_arrays(num_tokens, r_pad, config))
    plan.slot_mapping[:] = -1
    return dataclasses.replace(plan, decode_only=decode_only)


def _layout(q_lens, starts, ends, n_blocks, tokens, blocks, max_seq_len: int, config: RunnerConfig,
            policy: PaddingPolicy, t_pad: int, r_pad: int, num_blocks: int, out: Mapping[str, np.ndarray]) -> StepPlan:
    """Write the padded step into ``out``. ``q_lens`` None: token i is chunk i's only token."""
    nr, nt, bs = len(starts), len(tokens), config.block_size
    input_ids, positions, slots = out["input_ids"][:t_pad], out["positions"][:t_pad], out["slot_mapping"][:t_pad]
    qsl, ssl, seq_lens = out["query_start_loc"][: r_pad + 1], out["seq_start_loc"][: r_pad + 1], out["seq_lens"][:r_pad]
    block_table, logits_indices = out["block_table"][:r_pad], out["logits_indices"][:r_pad]

    qsl[0] = ssl[0] = 0
    if q_lens is None:
        rows = np.arange(nr)  # each token's chunk
        qsl[1: nr + 1] = rows + 1
        positions[:nt] = starts
    else:
        cu_q = q_lens.cumsum()
        rows = np.repeat(np.arange(nr), q_lens)
        qsl[1: nr + 1] = cu_q
        positions[:nt] = np.arange(nt) + (starts - (cu_q - q_lens))[rows]
    ssl[1: nr + 1] = ends.cumsum()
    seq_lens[:nr] = ends
    logits_indices[:nr] = qsl[1: nr + 1] - 1
    input_ids[:nt] = tokens
    block_table[:nr] = 0  # a real row's unused pages: the null block
    # the mask's row-major order is the order of the chunks' block lists, concatenated
    block_table[:nr][np.arange(block_table.shape[1]) < n_blocks[:, None]] = blocks
    page = positions[:nt] // bs
    slots[:nt] = (block_table[rows, page] - page) * bs + positions[:nt]  # block * bs + offset, in int64

    tails = policy.tails  # the padded tails (none where the step fills its bucket)
    if nt < t_pad:
        input_ids[nt:] = tails["input_ids"]
        positions[nt:] = tails["positions"]
        slots[nt:] = tails["slot_mapping"]
    if nr < r_pad:
        qsl[nr + 1:] = _tail(tails["query_start_loc"], nt)
        ssl[nr + 1:] = _tail(tails["seq_start_loc"], ssl[nr])
        seq_lens[nr:] = _tail(tails["seq_lens"], 0)
        block_table[nr:] = tails["block_table"]
        logits_indices[nr:] = nt - 1
    return StepPlan(
        input_ids=input_ids, positions=positions, query_start_loc=qsl, seq_start_loc=ssl,
        seq_lens=seq_lens, block_table=block_table, slot_mapping=slots, logits_indices=logits_indices,
        num_reqs=nr, num_tokens=nt, num_reqs_padded=r_pad, num_tokens_padded=t_pad,
        decode_only=q_lens is None, max_query_len=1 if q_lens is None else int(q_lens.max()),
        max_seq_len=max_seq_len, block_size=bs, num_blocks=num_blocks)
