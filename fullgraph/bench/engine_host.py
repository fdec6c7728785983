"""``python -m fullgraph.bench engine-host``: the host work of one ``fg.Engine`` step once every
request decodes, by phase, for each batch and output kind.

``batch`` requests of ``context`` random prompt tokens are added at once (greedy, eos ignored)
and generate long enough that all of them decode together for ``steps`` steps after the last
prompt is in; the median over those steps (``steps_timed``) is reported: ``step_us`` (the whole
``engine.step``), ``schedule_us`` (``Scheduler.schedule``), ``runner_us`` (``runner.step``: plan, page ledger,
upload, launch), ``collect_us`` (the previous step's tokens into ``RequestOutput`` objects) and
``other_us`` (the rest: the step's chunks and sampling fields, the output fetch, prefix-cache
bookkeeping). Prompts of equal length are admitted over several prefill steps, so their page
boundaries are staggered, as in serving: a few block lists grow every step.

On CPU the runner is padded and its forward a no-op, so the numbers are host work alone; on CUDA
the graph replays for real and ``collect_us`` includes waiting for the previous step's tokens.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..engine import Engine, SamplingParams
from ..models import presets
from ..runner import FullGraphRunner


def _timed(owner, attr: str, name: str, spent: dict[str, float]) -> None:
    inner = getattr(owner, attr)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
    setattr(owner, attr, timed)  # on the instance: the benchmark's own engine and runner only


def engine_host_row(model, batch: int, kind: str, context: int, steps: int, cuda: bool) -> dict:
    budget = 2048
    # prompts are admitted over about batch * context / budget prefill steps: every request generates
    # through them and ``steps`` more, so all ``batch`` of them decode together for ``steps`` steps
    admission = -(-batch * context // budget) + 2
    max_tokens = admission + steps + 16
    max_model_len = -(-(context + max_tokens + 64) // 256) * 256
    # (on CUDA only the decode step's size is captured: the prefill steps before it run eagerly)
    runner = FullGraphRunner(model, sampling=True, max_num_seqs=batch, max_num_tokens=min(budget, batch * max_model_len),
                             max_model_len=max_model_len, cudagraph="full" if cuda else "padded",
                             **({"capture_sizes": (batch,)} if cuda else {}))
    if not cuda:  # host work only: the padded forward is skipped (its warm-up over every bucket too)
        runner._run_static = lambda key, num_reqs: None
    runner.warmup()
    engine = Engine(runner)
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind)
    for r in range(batch):
        engine.add_request(f"r{r}", torch.randint(0, min(1000, runner.vocab_size), (context,), generator=gen).tolist(),
                           params)
    names, spent = ("schedule", "runner", "collect"), {}
    _timed(engine.scheduler, "schedule", "schedule", spent)
    _timed(runner, "step", "runner", spent)
    _timed(engine, "_collect", "collect", spent)
    planned: list[list] = []   # each step's slots (counted after the loop, not inside the timed step)
    schedule = engine.scheduler.schedule

    def kept():
        slots = schedule()
        planned.append(slots)
        return slots
    engine.scheduler.schedule = kept
    samples: list[tuple[float, ...]] = []
    while engine.has_unfinished():
        spent.clear()
        start = time.perf_counter()
        engine.step()
        samples.append((time.perf_counter() - start, *(spent.get(n, 0.0) for n in names)))
    decodes = [len(slots) if all(s[2] == 1 for s in slots) else -1 for slots in planned]   # s[2]: its token count
    # the steps that planned ``batch`` decode tokens and collected a step of ``batch`` rows (the
    # overlapped loop collects the step before): the last ``steps`` of them
    full = [i for i in range(1, len(samples)) if decodes[i] == batch and decodes[i - 1] == batch][-steps:]
    if not full:
        raise RuntimeError(f"engine-host: no step with all {batch} requests decoding (raise --steps)")
    row = {"batch": batch, "output_kind": kind, "context": context, "steps_timed": len(full)}
    for i, name in enumerate(("step", *names)):
        row[f"{name}_us"] = statistics.median(samples[j][i] for j in full) * 1e6
    row["other_us"] = row["step_us"] - sum(row[f"{n}_us"] for n in names)
    del engine, runner
    return row


def bench_engine_host(args) -> list[dict]:
    from . import _table

    cuda = torch.cuda.is_available()
    model = presets.build(args.preset, dtype=torch.bfloat16 if cuda else torch.float32,
                          device="cuda" if cuda else "cpu", seed=0)
    rows = [engine_host_row(model, batch, kind, args.context, args.steps, cuda)
            for batch in args.batch for kind in args.output_kind]
    _table(rows, list(rows[0]))
    return rows
