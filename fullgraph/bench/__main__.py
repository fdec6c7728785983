"""``python -m fullgraph.bench``: the benchmark CLI (see ``fullgraph.bench``)."""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from ..models import presets
from . import bench_capture, bench_compile, bench_decode, bench_host, bench_plan


def main(argv: list[str] | None = None, attention=None) -> None:
    """The CLI; ``attention``: an ``AttentionBackend`` class to use instead of ``--attention``'s name."""
    parser = argparse.ArgumentParser(prog="python -m fullgraph.bench", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add = sub.add_parser

    def add_parser(name, **kw):  # every subcommand shows its defaults in --help
        return _add(name, formatter_class=argparse.ArgumentDefaultsHelpFormatter, **kw)
    sub.add_parser = add_parser
    d = sub.add_parser("decode", help="decode-step latency per mode, against the bandwidth floor")
    d.add_argument("--preset", default="toy", choices=presets.names(), help="model shape (random weights)")
    d.add_argument("--batch", type=int, nargs="+", default=[1, 32], help="decode batch sizes")
    d.add_argument("--context", type=int, nargs="+", default=[1024], help="tokens already in each request's cache")
    d.add_argument("--modes", nargs="+", default=["none", "padded", "full"], choices=["none", "padded", "full"], help="runner modes")
    d.add_argument("--attention", default="auto", help="dense attention backend")
    d.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="weights and cache")
    d.add_argument("--steps", type=int, default=50, help="timed steps")
    d.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    d.add_argument("--compile", action="store_true", help="compile=True")
    d.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over this many processes (torchrun --nproc-per-node N; rank 0 reports)")
    d.add_argument("--peers", action="store_true", help="also time the peers of the same shape (CUDA): a plain "
                   "whole-model CUDA graph, its torch.compile(mode='reduce-overhead'), and transformers' "
                   "StaticCache + torch.compile (Llama family)")
    d.add_argument("--loop", nargs="+", default=["sync"], choices=["sync", "overlap"],
                   help="sync: each step synchronised; overlap: each step launched before the previous "
                        "step's tokens are read (ids handed over on the device), step_ms is then the time "
                        "between two steps' tokens")
    c = sub.add_parser("capture", help="capture every default size (CUDA)")
    c.add_argument("--preset", default="llama-1b", choices=presets.names(), help="model shape")
    c.add_argument("--attention", default="auto", help="dense attention backend")
    c.add_argument("--compile", action="store_true", help="compile=True")
    k = sub.add_parser("compile", help="compile time of a compile=True runner (run twice: first and cached)")
    k.add_argument("--preset", default="toy", choices=presets.names(), help="model shape")
    sub.add_parser("plan", help="host planning cost of decode batches")
    h = sub.add_parser("host", help="host cost of a decode step: plan, copy_in, up to the launch, each stage")
    h.add_argument("--preset", default="toy", choices=presets.names(), help="model shape")
    h.add_argument("--attention", default="auto", help="dense attention backend")
    h.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256], help="decode batch sizes")
    h.add_argument("--blocks", type=int, default=68, help="KV pages passed per chunk")
    h.add_argument("--iters", type=int, default=400, help="timed iterations")
    e = sub.add_parser("engine-host", help="host cost of an engine step once every request decodes, by phase")
    e.add_argument("--preset", default="toy", choices=presets.names(), help="model shape")
    e.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256], help="requests decoding at once")
    e.add_argument("--output-kind", nargs="+", default=["cumulative", "delta", "final_only"],
                   choices=["cumulative", "delta", "final_only"], help="SamplingParams.output_kind of the requests")
    e.add_argument("--context", type=int, default=1000, help="prompt tokens of each request")
    e.add_argument("--steps", type=int, default=200, help="decode steps timed (the median is reported)")
    s = sub.add_parser("serve", help="a serving workload through fg.Engine: throughput, TTFT and TPOT")
    s.add_argument("--preset", default="toy", choices=presets.names(), help="model shape")
    s.add_argument("--requests", type=int, default=64, help="number of requests")
    s.add_argument("--input-len", type=int, default=256, help="mean prompt length (lengths uniform in [L/2, 3L/2])")
    s.add_argument("--output-len", type=int, default=64, help="new tokens per request (eos ignored)")
    s.add_argument("--rate", type=float, default=0.0, help="requests per second (Poisson); 0: all at once")
    s.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once")
    s.add_argument("--max-num-tokens", type=int, default=1024, help="token budget of a step")
    s.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    s.add_argument("--seed", type=int, default=0, help="seed of the workload and the sampler")
    s.add_argument("--peer-hf", action="store_true", help="also run transformers' continuous batching (generate_batch)")
    s.add_argument("--shared-prefix", type=int, default=0, help="tokens of one system prompt every prompt starts with")
    s.add_argument("--prefix-caching", nargs="+", choices=["on", "off"], default=None,
                   help="engine runs to report (default: on and off with --shared-prefix, else on)")
    g = sub.add_parser("plot", help="figures of bench decode (step time vs batch) or bench serve (throughput, "
                                    "latency) --out files")
    g.add_argument("--inputs", nargs="+", required=True, help="bench decode or bench serve JSON files (one kind)")
    g.add_argument("--context", type=int, default=1024, help="decode: the context of the rows to draw")
    g.add_argument("--out", default="bench.png", help="image to write")
    for p in (d, c, k, sub.choices["plan"], h, e, s):
        p.add_argument("--out", default=None, help="write the rows as JSON to this path (none: print the table only)")
    args = parser.parse_args(argv)
    if attention is not None:
        args.attention = attention
    from .engine_host import bench_engine_host
    from .plot import bench_plot
    from .serve import bench_serve

    run = {"decode": bench_decode, "capture": bench_capture, "compile": bench_compile, "plan": bench_plan,
           "host": bench_host, "engine-host": bench_engine_host, "serve": bench_serve, "plot": bench_plot}[args.command]
    try:
        rows = run(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.out and args.command != "plot" and int(os.environ.get("RANK", 0)) == 0:
        with open(args.out, "w") as f:
            json.dump({"command": args.command, "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                       else "cpu", "torch": torch.__version__, "rows": rows,
                       "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("FULLGRAPH_")},
                       **{k: getattr(args, k) for k in ("preset", "rate") if hasattr(args, k)}}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
