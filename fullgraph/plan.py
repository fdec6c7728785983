"""chunks -> StepPlan: a step's planning on the host, one straight pipeline, each stage once.

    read_chunks  (chunks.py)  check the chunks (types, sizes, limits, ids in range, distinct
                              pages) and read them into flat arrays              -> StepInputs
    padded_sizes              the bucket the step pads to, and its request rows  -> (t_pad, r_pad)
    layout       (layout.py)  write the padded arrays into the target's          -> StepPlan

A runner then checks the plan against its page ledger, uploads it, launches and reads the outputs.
A decode step (every chunk one token: the common serving step) is a variant inside each stage, not
a route of its own. No torch, no device work: numpy only, vectorised, and for a decode batch, where
each numpy call (~0.5 us) costs more than its data, as few calls as the step needs. The padded
plan is exactly what the static buffers will hold; a runner has it written straight into its
staging area and keeps a ``BlockIdCache`` (the previous step's block ids) across steps.
"""
from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence

import numpy as np

from .block_ids import BlockIdCache
from .chunks import SeqChunk, StepInputs, read_chunks
from .config import RunnerConfig
from .fields import CORE_FIELDS, FieldTable, StepPlan
from .layout import Target, layout
from .padding import PaddingPolicy


def plan_step(chunks: Sequence[SeqChunk], config: RunnerConfig, policy: PaddingPolicy, *,
              pad: bool = True, num_blocks: int | None = None, vocab_size: int | None = None,
              out: Mapping[str, np.ndarray] | None = None, fields: FieldTable | None = None,
              values: Mapping[str, Sequence] | None = None) -> StepPlan:
    """Validate ``chunks`` and lay out one step, padded to its bucket with ``policy`` when ``pad``.

    ``num_blocks`` defaults to ``config.num_blocks`` (pass the resolved value when that is None).
    ``out``: arrays to write the plan into instead of new ones (a runner's staging area), each at
    least as large as ``array_shapes`` of the padded step; the plan's arrays are then views of them.
    ``fields``: the step fields to lay out (default: ``policy.table``, the core fields and the
    policy's own); ``values``: the real rows of fields whose ``source`` is "caller", one value per
    chunk (unset: the field's default).
    Raises ``ValueError`` naming the chunk and field for any bad input, before anything is written.
    """
    target = Target(fields or policy.table, policy, values, out)
    return plan_with_cache(chunks, config, target, pad, num_blocks, vocab_size, None)


def plan_with_cache(chunks: Sequence[SeqChunk], config: RunnerConfig, target: Target, pad: bool,
                    num_blocks: int | None, vocab_size: int | None, cache: BlockIdCache | None,
                    shared: np.ndarray | None = None) -> StepPlan:
    """``plan_step`` for a runner: its ``Target`` built once, a ``BlockIdCache`` kept across steps; ``shared``
    (``BlockAllocator.shared_pages()``): a bool mask of block ids several chunks may name (cached pages)."""
    num_blocks = num_blocks or config.num_blocks
    if num_blocks is None:
        raise ValueError("plan_step needs num_blocks: pass it, or use the runner's resolved config")
    inputs = read_chunks(chunks, config, num_blocks, vocab_size, cache, shared)
    t_pad, r_pad = padded_sizes(len(inputs.tokens), len(inputs.starts), config, pad)
    return layout(inputs, config, target, t_pad, r_pad, num_blocks)


def capture_plan(config: RunnerConfig, target: Target | PaddingPolicy, num_blocks: int, num_tokens: int,
                 decode_only: bool, num_reqs: int | None = None, context: int = 0) -> StepPlan:
    """A plan to capture the graph of one key with: short sequences that read only the null block
    and write nothing (every slot -1), so capture neither depends on nor touches the cache.
    ``num_reqs`` (default: as many as the bucket pads to) spreads the tokens over that many.
    ``context``: tokens each sequence already holds (at most what ``max_model_len`` leaves), on
    pages taken in turn from ``[1, num_blocks)``, so that the step reads as much of the cache as a
    decode step at that context does (a step to time a graph on; it still writes nothing)."""
    if isinstance(target, PaddingPolicy):
        target = Target(target.table, target, None, None)
    target = Target(target.fields, target.policy, target.values, None)  # fresh arrays, never the staging area
    r_pad = config.padded_num_reqs(num_tokens) if num_reqs is None else num_reqs
    q_lens = np.full(r_pad, num_tokens // r_pad, np.int64)
    q_lens[: num_tokens % r_pad] += 1
    context = max(0, min(context, config.max_model_len - int(q_lens.max()))) if num_blocks > 1 else 0
    starts = np.full(r_pad, context, np.int64)
    n_blocks = -(-(starts + q_lens) // config.block_size)
    total = int(n_blocks.sum())
    blocks = np.zeros(total, np.int64) if not context else 1 + np.arange(total) % (num_blocks - 1)
    inputs = StepInputs(None if r_pad == num_tokens else q_lens, starts, starts + q_lens,
                        np.zeros(num_tokens, np.int64), blocks, n_blocks, context + int(q_lens.max()), None)
    plan = layout(inputs, config, target, num_tokens, r_pad, num_blocks)
    plan.slot_mapping[:] = -1
    return plan.replace(decode_only=decode_only)


def padded_sizes(num_tokens: int, num_reqs: int, config: RunnerConfig, pad: bool) -> tuple[int, int]:
    """(tokens, requests) of the step as laid out: its bucket and ``config.padded_num_reqs`` of it
    when ``pad`` (a step above every bucket keeps its own token count), else its own sizes."""
    if not pad:
        return num_tokens, num_reqs
    bucket = bucket_for(num_tokens, config.buckets)
    t_pad = num_tokens if bucket is None else bucket
    return t_pad, config.padded_num_reqs(t_pad)


def bucket_for(num_tokens: int, buckets: Sequence[int]) -> int | None:
    """Smallest bucket >= num_tokens, or None when the step is larger than every bucket."""
    i = bisect.bisect_left(buckets, num_tokens)
    return buckets[i] if i < len(buckets) else None


def array_shapes(num_tokens: int, num_reqs: int, max_blocks_per_seq: int,
                 fields: FieldTable = CORE_FIELDS) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shape and dtype of each plan array for T tokens and R requests (the static buffers hold the maxima)."""
    return fields.shapes(num_tokens, num_reqs, max_blocks_per_seq)
