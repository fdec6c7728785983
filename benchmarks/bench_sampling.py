"""How much does in-graph sampling add to a step?

    python benchmarks/bench_sampling.py [--out bench_sampling.json] [--skip-reference] [--zones] [--passes] [--sweep]

GPU script: prints a table, writes JSON only with ``--out``, never asserts on time. For V = 128256
and batches of 1/32/64 it times ``fullgraph.sampling.sample`` (the Triton kernel),
``sample_reference`` (plain PyTorch with a full sort) and a bare ``argmax`` as the floor, each as a
CUDA graph of back-to-back calls on fresh logits per call (so every call reads HBM, as a step's
sampler does). Settings: greedy, temperature 1 alone, top-p 0.9 and 0.5, top-k 50 + top-p 0.95, min-p 0.1
(temperature 1).
Logits: "peaked" (bf16-rounded, a Gaussian bulk of std 2.5 and 20 dominant tokens, like a
language model's) and "flat" (std-1 Gaussian: top-p keeps most of the vocabulary, the hard case).
``--zones`` prints how many undecided tokens reach the select pass, ``--passes`` times each kernel
launch alone at batch 32, ``--sweep`` the row passes' block size and programs per row.
"""
from __future__ import annotations

import argparse
import json

import torch

from fullgraph.kernels import sampling as kernel
from fullgraph.sampling import sample, sample_reference

VOCAB = 128_256
BATCHES = (1, 32, 64)
SETTINGS = {  # name: (temperature, top_k, top_p, min_p)
    "greedy": (0.0, 0, 1.0, 0.0), "temperature=1": (1.0, 0, 1.0, 0.0), "top_p=0.9": (1.0, 0, 0.9, 0.0),
    "top_p=0.5": (1.0, 0, 0.5, 0.0),
    "top_k=50,top_p=0.95": (1.0, 50, 0.95, 0.0), "min_p=0.1": (1.0, 0, 1.0, 0.1),
}
COPIES = 8  # logits buffers cycled through (>= 32 MB at batch 64: beyond what L2 keeps)


def make_logits(kind: str, rows: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "flat":
        return torch.randn(rows, VOCAB, generator=gen, device="cuda")
    x = torch.randn(rows, VOCAB, generator=gen, device="cuda") * 2.5
    top = torch.randint(0, VOCAB, (rows, 20), generator=gen, device="cuda")
    x.scatter_add_(1, top, torch.linspace(5.0, 12.0, 20, device="cuda").expand(rows, -1))
    return x.bfloat16().float()


def params(rows: int, setting) -> list[torch.Tensor]:
    t, k, p, m = setting
    full = lambda v, dt: torch.full((rows,), v, dtype=dt, device="cuda")
    return [full(t, torch.float32), full(k, torch.int32), full(p, torch.float32), full(m, torch.float32),
            torch.arange(rows, device="cuda", dtype=torch.int64), full(0, torch.int64)]


def time_calls(fn, inputs: list[torch.Tensor], reps: int = 4) -> float:
    """Median microseconds per call of ``fn(x)`` over the inputs, replayed as one CUDA graph."""
    for x in inputs:
        fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for x in inputs:
                fn(x)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(7):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (reps * len(inputs)))
    return sorted(times)[len(times) // 2]


def print_zones(gen: torch.Generator, batch: int = 64) -> None:
    """Undecided tokens per row (the select pass's work): median, max, rows past CAND_BLOCK."""
    for kind in ("peaked", "flat"):
        x = make_logits(kind, batch, gen)
        for name, setting in SETTINGS.items():
            ws: dict = {}
            kernel.launch(x, *params(batch, setting), workspace=ws)
            n = ws["part_i"][..., 2].sum(-1).float().cpu() if setting[0] > 0 else torch.zeros(batch)
            state = ws["zones"][:, 8].cpu()
            print(f"zones {kind:7s} {name:22s} undecided median {n.median():7.0f} max {n.max():7.0f} "
                  f"rows over {kernel.CAND_BLOCK}: {int((n > kernel.CAND_BLOCK).sum())}/{batch}; rows decided "
                  f"in level 1 (the chain, short top-k lists) {int((state == 1).sum())}, fallen back to the histograms "
                  f"{int((state == 2).sum())}")


def print_passes(gen: torch.Generator, batch: int = 32) -> None:
    """Microseconds of each of the kernel's launches, replayed alone as a CUDA graph."""
    names = ("_scan_kernel", "_hist_kernel", "_tail_kernel", "_select_kernel")
    for kind in ("peaked", "flat"):
        x = make_logits(kind, batch, gen)
        for name, setting in SETTINGS.items():
            calls: list = []
            saved = {n: getattr(kernel, n) for n in names}
            for n in names:
                setattr(kernel, n, _Recorder(saved[n], n, calls))
            try:
                kernel.launch(x, *params(batch, setting))
            finally:
                for n in names:
                    setattr(kernel, n, saved[n])
            # Replayed alone, a histogram pass keeps adding to the counts and the scan resets the
            # zones: time select and the tail (level 2 + compact) first, then the scan, then level 1.
            order = [3, 2, 0, 1]                         # calls: scan, level 1, tail, select
            us = {i: time_calls(lambda _: calls[i][1](), [None], reps=10) for i in order}
            labels = ("scan", "hist1", "tail", "select")
            print(f"passes {kind:7s} {name:22s} " + "  ".join(f"{labels[i]} {us[i]:6.1f}" for i in range(4)) + " us",
                  flush=True)


class _Recorder:
    def __init__(self, kern, name, calls):
        self.kern, self.name, self.calls = kern, name, calls

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            launch = lambda: self.kern[grid](*args, **kwargs)
            launch()
            self.calls.append((self.name, launch))
        return run


def print_sweep(gen: torch.Generator) -> list[dict]:
    """The row passes' launch shape: tokens per loop step (``block``) and programs per row
    (``num_chunks``: the default aims at 2 programs per SM), top-p rows at batch 32 and 64."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for kind in ("peaked", "flat"):
        for batch in (32, 64):
            inputs = [make_logits(kind, batch, gen) for _ in range(COPIES)]
            for name in ("top_p=0.9", "top_k=50,top_p=0.95"):
                ps = params(batch, SETTINGS[name])
                for block in (1024, 2048, 4096):
                    for per_sm in (2, 4, 8):
                        chunks = max(1, min(-(-VOCAB // block), -(-per_sm * sms // batch)))
                        us = time_calls(lambda x: kernel.launch(x, *ps, block=block, num_chunks=chunks), inputs)
                        rows.append({"logits": kind, "setting": name, "batch": batch, "block": block,
                                     "programs_per_sm": per_sm, "num_chunks": chunks, "sample_us": us})
                        print(f"sweep {kind:7s} {name:22s} batch {batch:3d} block {block:5d} chunks {chunks:4d} "
                              f"({per_sm}/SM) {us:8.1f} us", flush=True)
            del inputs
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--skip-reference", action="store_true", help="skip the (slow) sort-based reference")
    p.add_argument("--zones", action="store_true", help="also print how many tokens the select pass decides")
    p.add_argument("--passes", action="store_true", help="also time each kernel pass at batch 32")
    p.add_argument("--sweep", action="store_true", help="also sweep the row passes' block and programs per row")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.zones:
        print_zones(gen)
    if args.passes:
        print_passes(gen)
    sweep = print_sweep(gen) if args.sweep else []
    rows = []
    print(f"{'logits':7s} {'setting':22s} {'batch':>5s} {'sample us':>10s} {'reference us':>13s} {'argmax us':>10s}")
    for kind in ("peaked", "flat"):
        for batch in BATCHES:
            # the table's logits depend only on (kind, batch), not on what ran before (--zones and the
            # rest draw from ``gen``): two trees or two flag sets time the same rows
            table_gen = torch.Generator(device="cuda").manual_seed(2 * batch + (kind == "flat"))
            inputs = [make_logits(kind, batch, table_gen) for _ in range(COPIES)]
            argmax_us = time_calls(lambda x: x.argmax(-1), inputs)
            for name, setting in SETTINGS.items():
                ps = params(batch, setting)
                row = {"logits": kind, "setting": name, "batch": batch, "vocab": VOCAB, "argmax_us": argmax_us,
                       "sample_us": time_calls(lambda x: sample(x, *ps), inputs)}
                if not args.skip_reference:
                    row["reference_us"] = time_calls(lambda x: sample_reference(x, *ps), inputs, reps=1)
                rows.append(row)
                ref = f"{row['reference_us']:13.1f}" if "reference_us" in row else f"{'-':>13s}"
                print(f"{kind:7s} {name:22s} {batch:5d} {row['sample_us']:10.1f} {ref} {argmax_us:10.1f}", flush=True)
            del inputs
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
                       "sweep": sweep}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
