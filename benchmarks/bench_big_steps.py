"""A large mixed step in a captured graph against the same step run eagerly over the padded buffers.

    PYTHONPATH=. python benchmarks/bench_big_steps.py [--preset llama-1b] [--sizes 512 768 1024 1536 2048]

The engine captures graphs up to a size and runs a larger step padded-eager. Is eager slower up
there? For each size S: a step of one prefill chunk of S - D tokens and D decode tokens at
``--context`` (an engine's mixed step), ``sampling=True`` as the engine runs it, timed
synchronised (median of ``--iters``) in a ``"full"`` runner that captured S and in a ``"padded"``
runner (the same buckets, eager). Also the full runner's capture time and the graph pool's
memory with and without the sizes above 512, and the same for the whole default capture schedule
(``RunnerConfig.buckets``) up to 512 tokens and up to the largest size. Prints a table and, given
``--out``, writes JSON.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch


def build(model, mode: str, sizes: tuple[int, ...] | None, args, max_num_tokens: int | None = None):
    """A runner capturing ``sizes`` (None: the default schedule up to ``max_num_tokens``), the
    seconds its construction and warmup took and the MiB it reserved."""
    from fullgraph import FullGraphRunner

    torch.cuda.synchronize()
    base = torch.cuda.memory_reserved()
    start = time.perf_counter()
    top = max_num_tokens or max(sizes)
    runner = FullGraphRunner(model, sampling=True, max_num_seqs=args.decode + 1, max_num_tokens=top,
                             max_model_len=top + args.context + 256, cudagraph=mode, attention="triton",
                             capture_sizes=sizes)
    runner.warmup()
    torch.cuda.synchronize()
    return runner, time.perf_counter() - start, (torch.cuda.memory_reserved() - base) / 2**20


def time_step(runner, size: int, args) -> float:
    from fullgraph import SeqChunk

    bs = runner.config.block_size
    decode = [runner.blocks.allocate(-(-(args.context + args.iters + 8) // bs)) for _ in range(args.decode)]
    for ids in decode:
        runner.blocks.mark_written(ids, args.context, bs)
    times = []
    for i in range(args.iters + 3):
        prefill = runner.blocks.allocate(-(-(size - args.decode) // bs))
        chunks = [SeqChunk([(5 * j + i) % 1000 + 1 for j in range(size - args.decode)], 0, prefill)]
        chunks += [SeqChunk([(7 * r + i) % 1000 + 1], args.context + i, ids) for r, ids in enumerate(decode)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        runner.step(chunks)
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - start)
        runner.blocks.free(prefill)
    for ids in decode:
        runner.blocks.free(ids)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--sizes", type=int, nargs="+", default=[512, 768, 1024, 1536, 2048])
    p.add_argument("--decode", type=int, default=63, help="decode tokens in each step")
    p.add_argument("--context", type=int, default=512, help="context of the decode tokens")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_big_steps.py compares CUDA graphs with eager steps: it needs a CUDA GPU")
    from fullgraph.models import presets

    model = presets.build(args.preset, dtype=torch.bfloat16, device=torch.device("cuda"), seed=0)
    sizes = tuple(sorted(args.sizes))
    rows = []
    small = tuple(s for s in sizes if s <= 512) or sizes[:1]
    runner, small_s, small_mib = build(model, "full", small, args)
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    full, full_s, full_mib = build(model, "full", sizes, args)
    print(f"capture of {small}: {small_s:.2f} s, {small_mib:.0f} MiB; of {sizes}: {full_s:.2f} s, {full_mib:.0f} MiB "
          f"(memory reserved by the runner: KV cache, buffers, graph pool)")
    graph = {s: time_step(full, s, args) for s in sizes}
    del full
    gc.collect()
    torch.cuda.empty_cache()
    schedules = {}
    for top in (512, max(sizes)):       # the whole default schedule up to 512 tokens, and up to the largest size
        runner, secs, mib = build(model, "full", None, args, max_num_tokens=top)
        del runner
        schedules[top] = (secs, mib)
        print(f"default schedule up to {top} tokens: capture {secs:.2f} s, {mib:.0f} MiB", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    gc.collect()
    torch.cuda.empty_cache()
    padded, _, _ = build(model, "padded", sizes, args)
    eager = {s: time_step(padded, s, args) for s in sizes}
    print(f"{'tokens':>7s} {'graph ms':>9s} {'eager ms':>9s} {'eager / graph':>13s}")
    for s in sizes:
        rows.append({"tokens": s, "graph_ms": graph[s], "eager_ms": eager[s]})
        print(f"{s:7d} {graph[s]:9.3f} {eager[s]:9.3f} {eager[s] / graph[s]:13.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "capture": {"small": [small, small_s, small_mib], "all": [sizes, full_s, full_mib]},
                       "default_schedule": {str(k): v for k, v in schedules.items()}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
