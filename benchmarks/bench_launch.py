"""What launching a CUDA graph costs as it grows: host time of ``replay()``, and wall time of one
replay on an idle GPU against the device time of back-to-back replays.

    python benchmarks/bench_launch.py [--out bench_launch.json]

GPU script: prints a table, writes JSON, never asserts on time. Each graph is a chain of N tiny
kernels (a one-element add, so device time is launch latency only), captured whole or as P
graphs of N/P kernels replayed one after another (the host launches piece 2 while the GPU runs
piece 1). ``idle_us - busy_us`` is what a synchronised step pays on top of the device time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _bump(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)


KERNELS = {
    "torch": lambda x: x.add_(1.0),
    "triton": lambda x: _bump[(1,)](x, x.numel(), BLOCK=16),
}


def capture(fn, x, n: int) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn(x)
    return g


def measure(graphs: list[torch.cuda.CUDAGraph], iters: int = 50) -> dict:
    for g in graphs:  # first launch uploads
        g.replay()
    torch.cuda.synchronize()
    launch, idle = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        time.sleep(2e-4)  # let the device go idle, as between two synchronised steps
        start = time.perf_counter()
        for g in graphs:
            g.replay()
        launched = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        launch.append(launched - start)
        idle.append(done - start)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        for g in graphs:
            g.replay()
    end.record()
    end.synchronize()
    return {"launch_us": statistics.median(launch) * 1e6, "idle_us": statistics.median(idle) * 1e6,
            "busy_us": start.elapsed_time(end) / iters * 1e3}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench_launch.json")
    args = p.parse_args()
    x = torch.zeros(16, device="cuda")
    rows = []
    for kind, fn in KERNELS.items():
        fn(x)
        for n in (1, 64, 256, 512, 1024):
            for pieces in ((1, 4, 16) if n >= 256 else (1,)):
                graphs = [capture(fn, x, n // pieces) for _ in range(pieces)]
                row = {"kernel": kind, "nodes": n, "pieces": pieces, **measure(graphs)}
                row["idle_minus_busy_us"] = row["idle_us"] - row["busy_us"]
                rows.append(row)
                print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
                del graphs
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
