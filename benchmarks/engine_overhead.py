"""What the engine and in-graph sampling add on top of the runner (CUDA): prints a table, writes JSON with --out.

1. Engine decode at batch 1 and 64 (llama-1b shape, context ~1024): median time between two
   token-producing steps through ``fg.Engine`` once every request decodes (overlapped loop,
   greedy), against the runner's own overlapped decode step (``bench.time_decode_overlapped``) at
   the same batch in the same process.
2. Sampling inside the graph at batch 32: graph replay time of a sampling runner (top-p 0.9,
   temperature 1; and greedy) against a runner returning logits.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import fullgraph as fg
from fullgraph.bench import _table, replay_ms, time_decode_overlapped
from fullgraph.models import presets


def engine_rows(model, context: int, tokens: int, batch: int = 1) -> list[dict]:
    """``batch`` requests of ``context`` prompt tokens added at once, each generating ``tokens``
    (greedy): the median time between two engine steps that produce tokens once every request
    decodes (the last half of the run), against the runner's overlapped decode step at that batch."""
    runner = fg.FullGraphRunner(model, sampling=True, max_num_seqs=batch, max_num_tokens=2048, max_model_len=2048)
    runner.warmup()
    engine = fg.Engine(runner)
    for r in range(batch):
        engine.add_request(f"r{r}", torch.randint(0, min(1000, runner.vocab_size), (context,)).tolist(),
                           fg.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    stamps = []
    while engine.has_unfinished():
        if engine.step():
            stamps.append(time.perf_counter())
    steady = stamps[-(tokens // 2):]
    gaps = [b - a for a, b in zip(steady, steady[1:])]
    del engine, runner
    torch.cuda.empty_cache()
    base = fg.FullGraphRunner(model, max_num_seqs=batch, max_num_tokens=max(16, batch), max_model_len=2048,
                              capture_sizes=(batch,))
    base.warmup()
    runner_ms = statistics.median(time_decode_overlapped(base, batch, context, tokens, 10)) * 1e3
    engine_ms = statistics.median(gaps) * 1e3
    del base
    torch.cuda.empty_cache()
    return [{"what": f"engine decode, batch {batch} (per step)", "ms": engine_ms, "vs": runner_ms,
             "overhead_pct": 100 * (engine_ms / runner_ms - 1)}]


def sampling_rows(model, batch: int, context: int) -> list[dict]:
    rows, base_ms = [], None
    for name, sampling, params in (("logits (no sampling)", False, None), ("greedy in graph", True, dict(temperature=0.0)),
                                   ("top-p 0.9, T=1 in graph", True, dict(temperature=1.0, top_p=0.9))):
        runner = fg.FullGraphRunner(model, sampling=sampling, max_num_seqs=batch, max_num_tokens=batch,
                                    max_model_len=2048, capture_sizes=(batch,))
        runner.warmup()
        blocks = [runner.blocks.allocate(-(-(context + 1) // 16)) for _ in range(batch)]
        for ids in blocks:
            runner.blocks.mark_written(ids, context, 16)
        values = None if params is None else {k: [v] * batch for k, v in params.items()}
        runner.step([fg.SeqChunk([7], context, b) for b in blocks], values=values)
        ms = replay_ms(runner, (batch, True))
        base_ms = ms if base_ms is None else base_ms
        rows.append({"what": f"batch {batch} step: {name}", "ms": ms, "vs": base_ms, "overhead_pct": 100 * (ms / base_ms - 1),
                     "added_us": (ms - base_ms) * 1e3})
        del runner
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64], help="engine decode batch sizes")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = presets.build(args.preset, dtype=torch.bfloat16, device="cuda")
    rows = [row for batch in args.batch for row in engine_rows(model, args.context, 200, batch)]
    rows += sampling_rows(model, 32, args.context)
    _table(rows, ["what", "ms", "vs", "overhead_pct"])
    if args.out:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, open(args.out, "w"),
                  indent=1)


if __name__ == "__main__":
    main()
