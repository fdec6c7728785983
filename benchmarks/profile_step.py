"""Where a decode step's GPU time goes: kernels of one padded-eager step, grouped by name.

    PYTHONPATH=. python benchmarks/profile_step.py --preset llama-1b --batch 1 --context 1024
Prints a table (total ms and count per kernel) and writes JSON. A script, not a test.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from fullgraph import FullGraphRunner
from fullgraph.bench import time_decode
from fullgraph.models import presets


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--attention", default="triton")
    p.add_argument("--out", default="profile_step.json")
    args = p.parse_args()
    model = presets.build(args.preset, dtype=torch.bfloat16, device=torch.device("cuda"), seed=0)
    runner = FullGraphRunner(model, max_num_seqs=args.batch, max_num_tokens=max(args.batch, 16),
                             max_model_len=args.context + 256, cudagraph="padded", attention=args.attention,
                             capture_sizes=(args.batch,))
    time_decode(runner, args.batch, args.context, steps=3, warmup=3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        time_decode(runner, args.batch, args.context, steps=2, warmup=0)
    totals, counts = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name] += e.device_time / 1e3 / 2  # per step
            counts[e.name] += 1
    rows = sorted(({"kernel": k[:90], "ms_per_step": v, "launches_per_step": counts[k] // 2} for k, v in totals.items()),
                  key=lambda r: -r["ms_per_step"])
    total = sum(r["ms_per_step"] for r in rows)
    print(f"{args.preset} batch {args.batch} context {args.context} attention {args.attention}: "
          f"{total:.3f} ms of kernels per step, {sum(r['launches_per_step'] for r in rows)} launches")
    for r in rows[:25]:
        print(f"{r['ms_per_step']:8.4f} ms {r['launches_per_step']:5d}x  {r['kernel']}")
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "total_ms": total, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
