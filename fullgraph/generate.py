"""A minimal greedy generation loop over a runner: chunked prefill, then batched decode.

Not a scheduler (no preemption, no admission control): enough to drive the runner the way a
serving engine does, for the demo, the examples and the benchmarks.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from . import sampling
from .fetch import HostFetch
from .plan import SeqChunk
from .runner import FullGraphRunner


@dataclass
class GenerateResult:
    tokens: list[list[int]]                                     # generated ids per prompt
    prefill_seconds: list[float] = field(default_factory=list)  # wall time of each prefill step
    decode_seconds: list[float] = field(default_factory=list)   # wall time of each decode step
    modes: list[str] = field(default_factory=list)              # how each step ran


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def greedy(runner: FullGraphRunner, prompts: Sequence[Sequence[int]], max_new_tokens: int,
           overlap: bool = False) -> GenerateResult:
    """Greedy-decode every prompt for ``max_new_tokens`` tokens; frees the pages afterwards.

    Prefill packs the prompts' chunks into steps of at most ``max_num_tokens`` tokens and
    ``max_num_seqs`` chunks (a long prompt spans several steps: chunked prefill); decode runs
    all requests together, one token each per step.

    ``overlap``: each decode step is planned and launched while the one before it still runs;
    its token ids are the previous step's argmax (``sampling.greedy``, as every step's), handed
    over on the device (``runner.step(..., token_ids=...)``), and the host reads each step's tokens while the next
    one runs. Same tokens; the host's work per step then hides behind the device's. Each
    ``decode_seconds`` entry is then the time between two steps' tokens reaching the host (what
    a client streaming them sees) instead of one synchronised step.
    """
    cfg = runner.config
    if len(prompts) > cfg.max_num_seqs:
        raise ValueError(f"{len(prompts)} prompts: more than max_num_seqs = {cfg.max_num_seqs}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i}: empty (a request needs at least one token)")
        if len(p) + max_new_tokens > cfg.max_model_len:
            raise ValueError(f"prompt {i}: {len(p)} tokens + max_new_tokens {max_new_tokens} = "
                             f"{len(p) + max_new_tokens} exceeds max_model_len = {cfg.max_model_len}")
    blocks = [runner.blocks.allocate(-(-(len(p) + max_new_tokens) // cfg.block_size)) for p in prompts]
    result = GenerateResult(tokens=[[] for _ in prompts])
    try:
        done = [0] * len(prompts)
        last: list[int | None] = [None] * len(prompts)
        while any(d < len(p) for d, p in zip(done, prompts)):
            budget, chunks, owners = cfg.max_num_tokens, [], []
            for i, p in enumerate(prompts):
                n = min(len(p) - done[i], budget)
                if n > 0 and len(chunks) < cfg.max_num_seqs:
                    chunks.append(SeqChunk(list(p[done[i]: done[i] + n]), done[i], blocks[i], request_id=i))
                    owners.append(i)
                    done[i] += n
                    budget -= n
            picked = sampling.greedy(_timed(runner, chunks, result.prefill_seconds, result.modes)).tolist()
            for row, i in enumerate(owners):
                if done[i] == len(prompts[i]):
                    last[i] = picked[row]
        for i, tok in enumerate(last):
            result.tokens[i].append(tok)
        if overlap:
            _decode_overlapped(runner, prompts, blocks, max_new_tokens - 1, result)
        for step in range(0 if overlap else max_new_tokens - 1):
            chunks = [SeqChunk([result.tokens[i][-1]], len(p) + step, blocks[i], request_id=i)
                      for i, p in enumerate(prompts)]
            logits = _timed(runner, chunks, result.decode_seconds, result.modes)
            for i, tok in enumerate(sampling.greedy(logits).tolist()):
                result.tokens[i].append(tok)
    finally:
        for ids in blocks:
            runner.blocks.free(ids)
    return result


def _timed(runner: FullGraphRunner, chunks: list[SeqChunk], times: list[float], modes: list[str]) -> torch.Tensor:
    _sync(runner.device)
    start = time.perf_counter()
    out = runner.step(chunks)
    _sync(runner.device)
    times.append(time.perf_counter() - start)
    modes.append(out.mode)
    return out.logits


def decode_overlapped(runner: FullGraphRunner, chunks_for: Callable[[int], list[SeqChunk]], ids: torch.Tensor,
                      num_steps: int) -> Iterator[tuple[list[int], str]]:
    """Run ``num_steps`` decode steps, each launched before the previous step's tokens are read;
    yields each step's greedy tokens and mode as they reach the host (the host's work for step N+1
    happens while step N runs).

    ``chunks_for(step)``: that step's chunks, one token each (their ids are ignored: each step's
    ids are the previous step's argmax, handed over on the device); ``ids``: the first step's ids,
    a (num_chunks,) int64 tensor on the runner's device."""
    fetch = HostFetch({"ids": ((len(ids),), torch.int64)}, runner.device)
    pending = None
    for step in range(num_steps):
        out = runner.step(chunks_for(step), token_ids=ids, copy_outputs=False)  # logits read right here
        ids = sampling.greedy(out.logits)   # two launches; torch.argmax took 27 us at V = 128,256 (H100)
        handle = fetch.start({"ids": ids})
        if pending is not None:  # the step before this one: read while this one runs
            yield fetch.wait(pending[0])["ids"].tolist(), pending[1]
        pending = handle, out.mode
    if pending is not None:
        yield fetch.wait(pending[0])["ids"].tolist(), pending[1]


def _decode_overlapped(runner: FullGraphRunner, prompts: Sequence[Sequence[int]], blocks: list[list[int]],
                       num_steps: int, result: GenerateResult) -> None:
    placeholder = [0]  # the chunks give lengths only
    ids = torch.tensor([t[-1] for t in result.tokens], dtype=torch.int64, device=runner.device)
    last = time.perf_counter()
    steps = decode_overlapped(runner, lambda step: [SeqChunk(placeholder, len(p) + step, blocks[i], request_id=i)
                                                    for i, p in enumerate(prompts)], ids, num_steps)
    for tokens, mode in steps:
        for i, tok in enumerate(tokens):
            result.tokens[i].append(tok)
        now = time.perf_counter()
        result.decode_seconds.append(now - last)
        result.modes.append(mode)
        last = now
