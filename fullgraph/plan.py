"""chunks -> StepPlan: the pure host function that validates a step and lays out its arrays.

No torch, no device work: numpy only, vectorised, so planning a large decode batch costs tens of
microseconds. The padded plan is exactly what the static buffers will hold.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Hashable, Sequence
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
    """Per-chunk lengths and the flat token / block arrays, validated.

    One fused check on the fast path; only when it fails does ``_explain`` find the first
    offending chunk and field (so a valid step pays for a handful of numpy calls, not dozens).
    """
    n = len(chunks)
    if n == 0:
        raise ValueError("a step needs at least one chunk")
    if n > config.max_num_seqs:
        raise ValueError(f"{n} chunks in one step: more than max_num_seqs = {config.max_num_seqs}")
    meta = np.array([(len(c.token_ids), c.start_pos, len(c.block_ids)) for c in chunks], np.int64)
    q_lens, starts, n_blocks = meta[:, 0], meta[:, 1], meta[:, 2]
    ends = starts + q_lens
    total, n_blk = int(q_lens.sum()), int(n_blocks.sum())
    tokens = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), np.int64, total)
    blocks = np.fromiter(itertools.chain.from_iterable(c.block_ids for c in chunks), np.int64, n_blk)
    ok = (total <= config.max_num_tokens and q_lens.min() > 0 and starts.min() >= 0
          and ends.max() <= config.max_model_len and n_blocks.max() <= config.max_blocks_per_seq
          and (n_blocks * config.block_size >= ends).all()
          and blocks.min() > 0 and blocks.max() < num_blocks
          and (vocab_size is None or (tokens.min() >= 0 and tokens.max() < vocab_size)))
    if ok and n_blk > 1:
        if n_blk <= 512:
            ordered = np.sort(blocks)
            ok = not (ordered[1:] == ordered[:-1]).any()
        else:
            ok = np.bincount(blocks).max() <= 1
    if not ok:
        _explain(chunks, config, num_blocks, vocab_size, q_lens, starts, n_blocks, tokens, blocks)
    return q_lens, starts, n_blocks, tokens, blocks


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
              pad: bool = True, num_blocks: int | None = None, vocab_size: int | None = None) -> StepPlan:
    """Validate ``chunks`` and lay out one step, padded to its bucket with ``policy`` when ``pad``.

    ``num_blocks`` defaults to ``config.num_blocks`` (pass the resolved value when that is None).
    Raises ``ValueError`` naming the chunk and field for any bad input; nothing is modified.
    """
    num_blocks = num_blocks or config.num_blocks
    if num_blocks is None:
        raise ValueError("plan_step needs num_blocks: pass it, or use the runner's resolved config")
    q_lens, starts, n_blocks, tokens, blocks = _gather(chunks, config, num_blocks, vocab_size)
    t_pad, r_pad = _padded_sizes(len(tokens), config, pad)
    return _layout(q_lens, starts, n_blocks, tokens, blocks, config, policy, t_pad,
                   len(chunks) if r_pad is None else r_pad, num_blocks)


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
    plan = _layout(q_lens, np.zeros(r, np.int64), n_blocks, np.zeros(num_tokens, np.int64), blocks,
                   config, policy, num_tokens, r_pad, num_blocks)
    plan.slot_mapping[:] = -1
    return dataclasses.replace(plan, decode_only=decode_only)


def _layout(q_lens, starts, n_blocks, tokens, blocks, config: RunnerConfig, policy: PaddingPolicy,
            t_pad: int, r_pad: int, num_blocks: int) -> StepPlan:
    nr, nt, bs, mb = len(q_lens), len(tokens), config.block_size, config.max_blocks_per_seq
    decode_only = nt == nr  # every chunk has one token (none is empty)

    qsl = np.empty(r_pad + 1, np.int32)
    qsl[0] = 0
    np.cumsum(q_lens, out=qsl[1: nr + 1])
    qsl[nr + 1:] = _tail(policy.tail("query_start_loc"), nt)
    seq_lens = np.empty(r_pad, np.int32)
    ends = starts + q_lens
    seq_lens[:nr] = ends
    seq_lens[nr:] = _tail(policy.tail("seq_lens"), 0)
    ssl = np.empty(r_pad + 1, np.int32)
    ssl[0] = 0
    np.cumsum(ends, out=ssl[1: nr + 1])
    ssl[nr + 1:] = _tail(policy.tail("seq_start_loc"), ssl[nr])

    blk_start = np.zeros(nr, np.int64)
    np.cumsum(n_blocks[:-1], out=blk_start[1:])
    block_table = np.zeros((r_pad, mb), np.int32)  # a real row's unused pages: the null block
    block_table[nr:] = policy.tail("block_table")
    block_table.ravel()[np.repeat(np.arange(nr) * mb - blk_start, n_blocks) + np.arange(len(blocks))] = blocks

    positions = np.empty(t_pad, np.int64)
    positions[:nt] = starts if decode_only else np.arange(nt) + np.repeat(starts - qsl[:nr], q_lens)
    positions[nt:] = policy.tail("positions")
    real = positions[:nt]
    page = blk_start if decode_only else np.repeat(blk_start, q_lens)
    slots = np.empty(t_pad, np.int64)
    slots[:nt] = blocks[page + real // bs] * bs + real % bs
    slots[nt:] = policy.tail("slot_mapping")
    input_ids = np.empty(t_pad, np.int64)
    input_ids[:nt] = tokens
    input_ids[nt:] = policy.tail("input_ids")
    logits_indices = np.full(r_pad, nt - 1, np.int64)
    logits_indices[:nr] = qsl[1: nr + 1] - 1
    return StepPlan(
        input_ids=input_ids, positions=positions, query_start_loc=qsl, seq_start_loc=ssl,
        seq_lens=seq_lens, block_table=block_table, slot_mapping=slots, logits_indices=logits_indices,
        num_reqs=nr, num_tokens=nt, num_reqs_padded=r_pad, num_tokens_padded=t_pad,
        decode_only=decode_only, max_query_len=int(q_lens.max()),
        max_seq_len=int(ends.max()), block_size=bs, num_blocks=num_blocks)
