"""Our weight-streaming linear (``fullgraph.kernels.linear``) against cuBLAS at decode shapes.

    PYTHONPATH=. python benchmarks/sweep_linear.py [--rows 1 16] [--out sweep_linear.json]

GPU script: prints, per weight shape of the llama-1b and Phi-3-Small layers and per row count,
cuBLAS (``F.linear``) and every launch configuration of ours, best first; writes JSON; never
asserts on time. Each timing is a CUDA graph of back-to-back calls cycling over weight copies
(>= 256 MB, so every call reads HBM, as in a real step). TB/s = weight bytes / time.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

import bench_linear  # this directory is on sys.path when run as a script
from bench_linear import HBM_BYTES, SHAPES
from fullgraph.kernels.linear import launch


def time_calls(fn, weights) -> float:
    """Microseconds per ``fn(w, b)``, over ``weights`` as (w, b) pairs (``bench_linear``'s timing)."""
    return 1e3 * bench_linear.time_calls(lambda wb: fn(*wb), weights, reps=3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--block-n", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--block-k", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--out", default="sweep_linear.json")
    args = p.parse_args()
    dev, rows = torch.device("cuda"), []
    for name, (n, k, has_bias) in SHAPES.items():
        copies = max(2, -(-HBM_BYTES // (n * k * 2)))
        weights = [(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5,
                    torch.randn(n, device=dev, dtype=torch.bfloat16) if has_bias else None) for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x.float(), weights[0][0].float(), None if weights[0][1] is None else weights[0][1].float())
            results = [("cublas", time_calls(lambda w, b: F.linear(x, w, b), weights))]
            for bn, bk, nw in itertools.product(args.block_n, args.block_k, args.warps):
                if bn * bk > 32768 or (m > 1 and bn < 16):  # m > 1 takes the tl.dot path
                    continue
                cfg = (bn, bk, nw)
                err = (launch(x, *weights[0], config=cfg).float() - ref).abs().max().item()
                if err > 0.05:
                    print(f"  {name} m={m} {cfg}: max error {err:.3g}, skipped")
                    continue
                results.append((f"{bn}x{bk} w{nw}", time_calls(lambda w, b: launch(x, w, b, config=cfg), weights)))
            results.sort(key=lambda r: r[1])
            mb = n * k * 2 / 1e6
            cub = dict(results)["cublas"]
            line = "  ".join(f"{c} {t:.1f}" for c, t in results[:4])
            print(f"{name:16s} m={m:2d} {mb:6.1f}MB cublas {cub:6.1f}us ({mb / cub:.2f} TB/s) | best: {line}",
                  flush=True)
            rows.append({"shape": name, "rows": m, "mbytes": mb, "us": dict(results)})
        del weights
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
