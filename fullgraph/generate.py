"""A minimal greedy generation loop over a runner: chunked prefill, then batched decode.

Not a scheduler (no preemption, no admission control): enough to drive the runner the way a
serving engine does, for the demo, the examples and the benchmarks.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

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


def greedy(runner: FullGraphRunner, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> GenerateResult:
    """Greedy-decode every prompt for ``max_new_tokens`` tokens; frees the pages afterwards.

    Prefill packs the prompts' chunks into steps of at most ``max_num_tokens`` tokens and
    ``max_num_seqs`` chunks (a long prompt spans several steps: chunked prefill); decode runs
    all requests together, one token each per step.
    """
    cfg = runner.config
    if len(prompts) > cfg.max_num_seqs:
        raise ValueError(f"{len(prompts)} prompts: more than max_num_seqs = {cfg.max_num_seqs}")
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
            logits = _timed(runner, chunks, result.prefill_seconds, result.modes)
            for row, i in enumerate(owners):
                if done[i] == len(prompts[i]):
                    last[i] = int(logits[row].argmax())
        for i, tok in enumerate(last):
            result.tokens[i].append(tok)
        for step in range(max_new_tokens - 1):
            chunks = [SeqChunk([result.tokens[i][-1]], len(p) + step, blocks[i], request_id=i)
                      for i, p in enumerate(prompts)]
            logits = _timed(runner, chunks, result.decode_seconds, result.modes)
            for i, tok in enumerate(logits.argmax(-1).tolist()):
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
