"""Split-KV decode with the splits merged in the attention launch against a second launch.

    PYTHONPATH=. python benchmarks/bench_split_merge.py [--preset llama-1b smollm2-135m] [--batch 1 32]

For each preset and batch: the same model, two runners in ``"full"`` mode (``TritonBackend
.fuse_split_reduce`` off, then on, twice in turn), a decode step at ``--context`` tokens: the
graph replay's device time, the overlapped step (tokens to the host), the kernels a step
launches, and the largest difference between the two runners' logits on one identical step
(the merge does the same float32 arithmetic in the same order either way: expected 0). Prints a
table and, given ``--out``, writes JSON; a script, not a test.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics

import torch


def launches_per_step(runner, key) -> int:
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner._graphs.replay(key)   # measurement only: the graph alone
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def measure(model, batch: int, context: int, fuse: bool, steps: int) -> dict:
    from fullgraph import FullGraphRunner, SeqChunk
    from fullgraph.attention.backends.triton import TritonBackend
    from fullgraph.bench import replay_ms, time_decode_overlapped

    TritonBackend.fuse_split_reduce = fuse
    max_len = -(-(context + 2 * steps + 64) // 256) * 256
    runner = FullGraphRunner(model, max_num_seqs=batch, max_num_tokens=max(batch, 16), max_model_len=max_len,
                             cudagraph="full", attention="triton", capture_sizes=(batch,))
    runner.warmup()
    overlap = time_decode_overlapped(runner, batch, context, steps=steps, warmup=5)
    key = (batch, True)
    replay = statistics.median(replay_ms(runner, key) for _ in range(3))
    launches = launches_per_step(runner, key)
    # one identical step for the logits: the KV cache from one seed, the same tokens and positions
    gen = torch.Generator(device=runner.device).manual_seed(1)
    for cache in runner.kv_caches:
        cache.normal_(generator=gen)
    bs = runner.config.block_size
    blocks = [runner.blocks.allocate(-(-(context + 1) // bs)) for _ in range(batch)]
    for ids in blocks:
        runner.blocks.mark_written(ids, context, bs)
    logits = runner.step([SeqChunk([(11 * r) % 1000 + 1], context, blocks[r]) for r in range(batch)]).logits
    logits = logits.float().cpu().clone()
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return {"fuse": fuse, "replay_ms": replay, "overlap_ms": statistics.median(overlap) * 1e3,
            "launches": launches, "logits": logits}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", nargs="+", default=["llama-1b", "smollm2-135m", "llama-8b"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_split_merge.py times CUDA graphs: it needs a CUDA GPU")
    from fullgraph.attention.backends.triton import TritonBackend
    from fullgraph.models import presets

    default = TritonBackend.fuse_split_reduce
    rows = []
    print(f"{'preset':14s} {'batch':>5s} {'merge':>9s} {'replay ms':>10s} {'overlap ms':>10s} {'launches':>8s}")
    for preset in args.preset:
        model = presets.build(preset, dtype=torch.bfloat16, device=torch.device("cuda"), seed=0)
        for batch in args.batch:
            runs = [measure(model, batch, args.context, fuse, args.steps) for fuse in (False, True, False, True)]
            diff = (runs[0]["logits"] - runs[1]["logits"]).abs().max().item()
            for fuse in (False, True):
                mine = [r for r in runs if r["fuse"] == fuse]
                row = {"preset": preset, "batch": batch, "context": args.context,
                       "merge": "in launch" if fuse else "2nd launch",
                       "replay_ms": min(r["replay_ms"] for r in mine), "overlap_ms": min(r["overlap_ms"] for r in mine),
                       "launches": mine[0]["launches"], "logits_max_diff": diff}
                rows.append(row)
                print(f"{preset:14s} {batch:5d} {row['merge']:>10s} {row['replay_ms']:10.3f} {row['overlap_ms']:10.3f} "
                      f"{row['launches']:8d}" + (f"   logits max |diff| {diff:.3g}" if fuse else ""))
        del model
        gc.collect()
        torch.cuda.empty_cache()
    TritonBackend.fuse_split_reduce = default
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
