"""Where a synchronised decode step's wall time goes beyond the graph's device time.

    PYTHONPATH=. python benchmarks/step_timeline.py --preset llama-1b --batch 1 --context 1024 [--trace T.json]

GPU script: prints a table, writes JSON, never asserts on time. Times a growing prefix of what
``runner.step`` does, each on an idle GPU and synchronised: the replay alone, upload + replay,
plan + upload + replay, the whole step; ``host_us`` is when the call returned, ``wall_us`` when
the device finished. ``--trace`` writes a profiler trace of three steps (CPU and CUDA).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fullgraph import FullGraphRunner, SeqChunk, plan_step
from fullgraph.bench import replay_ms
from fullgraph.models import presets


def timed(fn, iters: int, idle_s: float) -> tuple[float, float]:
    host, wall = [], []
    for _ in range(iters + 10):
        torch.cuda.synchronize()
        if idle_s:
            time.sleep(idle_s)
        start = time.perf_counter()
        fn()
        returned = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        host.append(returned - start)
        wall.append(done - start)
    return statistics.median(host[10:]) * 1e6, statistics.median(wall[10:]) * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--attention", default="auto")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--trace", default=None)
    p.add_argument("--out", default="step_timeline.json")
    args = p.parse_args()
    model = presets.build(args.preset, dtype=torch.bfloat16, device=torch.device("cuda"), seed=0)
    runner = FullGraphRunner(model, max_num_seqs=args.batch, max_num_tokens=max(args.batch, 16),
                             max_model_len=args.context + 256, cudagraph="full", attention=args.attention,
                             capture_sizes=(args.batch,))
    runner.warmup()
    cfg, bs, key = runner.config, runner.config.block_size, (args.batch, True)
    blocks = [runner.blocks.allocate(-(-(args.context + 1) // bs)) for _ in range(args.batch)]
    chunks = [SeqChunk([(7 * r) % 500], args.context, blocks[r]) for r in range(args.batch)]
    runner.step(chunks)
    graphs, buffers = runner._graphs, runner.buffers  # measurement only

    def plan():
        plan_step(chunks, cfg, runner.policy, pad=True, num_blocks=cfg.num_blocks, vocab_size=runner.vocab_size,
                  out=buffers.staging())

    variants = {
        "replay": lambda: graphs.replay(key),
        "upload+replay": lambda: (buffers.upload(), graphs.replay(key)),
        "plan+upload+replay": lambda: (plan(), buffers.upload(), graphs.replay(key)),
        "plan+upload+replay+clone": lambda: (plan(), buffers.upload(), graphs.replay(key),
                                             buffers.outputs["logits"][:args.batch].clone()),
        "step": lambda: runner.step(chunks),
    }
    rows = [{"variant": "replay (back-to-back)", "host_us": float("nan"), "wall_us": replay_ms(runner, key) * 1e3}]
    for idle in (2e-4, 0.0):
        for name, fn in variants.items():
            host, wall = timed(fn, args.iters, idle)
            rows.append({"variant": f"{name}{'' if idle else ' (no idle gap)'}", "host_us": host, "wall_us": wall})
    print(f"{args.preset} batch {args.batch} context {args.context} attention {runner.config.attention}")
    for r in rows:
        print(f"  {r['variant']:40s} host {r['host_us']:8.1f} us   wall {r['wall_us']:8.1f} us", flush=True)
    if args.trace:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                torch.cuda.synchronize()
                runner.step(chunks)
                torch.cuda.synchronize()
        prof.export_chrome_trace(args.trace)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
