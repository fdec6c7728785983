"""Where the time of ``runner.capture()`` goes: Triton JIT compilation per kernel against the rest
(eager warm-up runs and graph capture).

    python benchmarks/capture_breakdown.py --preset phi3-small-8k [--profile] [--out capture_breakdown.json]

GPU script: prints a table, writes JSON, never asserts on time. Every Triton compilation in the
process (ours and, with ``--compile``, Inductor's) is timed by wrapping Triton's JIT compile
entry point, and every first load of a compiled kernel (module load, launcher) by wrapping
``CompiledKernel._init_handles``; run it in a fresh process so the in-memory kernel caches are
cold (the on-disk cache is not cleared: point ``TRITON_CACHE_DIR`` at an empty directory for a
cold start). With kernels compiled ahead (``fullgraph.kernels.compile_ahead``, on by default) the
compile column is the serial part only (submitting); ``compile ahead`` in the report is the
parallel pass's wall time. ``FULLGRAPH_COMPILE_WORKERS=0`` switches it off for an A/B.
``--profile`` prints the capture's top functions under cProfile (which slows Python-heavy parts).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from collections import defaultdict

import torch
import triton.compiler.compiler as triton_compiler
import triton.runtime.jit as triton_jit

from fullgraph import FullGraphRunner, RunnerConfig
from fullgraph.bench import _table
from fullgraph.kernels import compile_ahead
from fullgraph.models import presets


def _timed_compiles() -> tuple[dict[str, list[float]], list[float]]:
    """Record the seconds of every Triton compile, by kernel name, and of every first load."""
    seconds: dict[str, list[float]] = defaultdict(list)
    loads: list[float] = []
    original = triton_jit.JITFunction._do_compile
    original_load = triton_compiler.CompiledKernel._init_handles

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            seconds[getattr(self, "__name__", repr(self))].append(time.perf_counter() - start)

    def timed_load(self):
        if self.module is not None:
            return original_load(self)
        start = time.perf_counter()
        try:
            return original_load(self)
        finally:
            loads.append(time.perf_counter() - start)

    triton_jit.JITFunction._do_compile = timed
    triton_compiler.CompiledKernel._init_handles = timed_load
    return seconds, loads


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="phi3-small-8k", choices=presets.names())
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default="capture_breakdown.json")
    args = parser.parse_args()

    seconds, loads = _timed_compiles()
    model = presets.build(args.preset, dtype=torch.bfloat16, device="cuda", seed=0)
    runner = FullGraphRunner(model, RunnerConfig(cudagraph="full", attention=args.attention, compile=args.compile))
    profile = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profile:
        profile.enable()
    report = runner.capture()
    total = time.perf_counter() - start
    if profile:
        profile.disable()
        stats = pstats.Stats(profile).sort_stats("cumulative")
        stats.print_stats(30)
        stats.sort_stats("tottime").print_stats(25)
    rows = sorted(({"kernel": name, "variants": len(s), "compile_s": sum(s)} for name, s in seconds.items()),
                  key=lambda r: -r["compile_s"])
    _table(rows, ["kernel", "variants", "compile_s"])
    jit = sum(r["compile_s"] for r in rows)
    print(f"{args.preset}: {report.num_graphs} graphs in {total:.2f} s: Triton JIT {jit:.2f} s "
          f"({sum(r['variants'] for r in rows)} variants, serial part), first loads {sum(loads):.2f} s "
          f"({len(loads)}), the rest {total - jit - sum(loads):.2f} s")
    print(report)
    ahead = {k: v for k, v in compile_ahead.last.items() if k != "t0"}
    jobs = ahead.get("jobs", [])
    if jobs:  # how much the pool's compilations overlapped: summed job seconds over their wall span
        span = max(s + c + l for _, s, c, l in jobs) - min(s for _, s, _, _ in jobs)
        busy = sum(c + l for _, _, c, l in jobs)
        print(f"compiled ahead: {ahead['variants']} submissions, {len(jobs)} compile jobs; the runs "
              f"{ahead['runs_s']:.2f} s, then waiting {ahead['wait_s']:.2f} s; jobs {busy:.2f} s of compile + "
              f"launcher over a {span:.2f} s span (overlap {busy / max(span, 1e-9):.1f}x); first job at "
              f"{min(s for _, s, _, _ in jobs):.2f} s, last done at {max(s + c + l for _, s, c, l in jobs):.2f} s")
        _table([{"kernel": n, "start_s": s, "compile_s": c, "launcher_s": l} for n, s, c, l in sorted(jobs, key=lambda j: j[1])],
               ["kernel", "start_s", "compile_s", "launcher_s"])
    with open(args.out, "w") as f:
        json.dump({"preset": args.preset, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "graphs": report.num_graphs, "capture_s": total, "jit_s": jit, "load_s": sum(loads),
                   "loads": len(loads), "compile_ahead_s": report.compile_seconds,
                   "warmup_s": report.warmup_seconds, "record_s": report.record_seconds,
                   "instantiate_s": report.instantiate_seconds,
                   "graph_MiB": report.graph_bytes / 2**20, "rows": rows, "ahead": ahead}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
