"""Our weight-streaming linear (``fullgraph.kernels.linear``) against cuBLAS at decode shapes.

    PYTHONPATH=. python benchmarks/sweep_linear.py [--rows 1 16] [--norm] [--skinny] [--out sweep_linear.json]

GPU script: prints, per weight shape (llama-1b, SmolLM2-135M, Llama-8B and Phi-3-Small layers) and
per row count, cuBLAS (``F.linear``) and every launch configuration of ours (BLOCK_N x BLOCK_K,
warps, weight tiles prefetched before the PDL wait, pipeline stages), best first; writes JSON; never
asserts on time. ``--norm``: the product of the RMS-normalised input, ours with the norm on load
against the norm kernel + cuBLAS (``kernels.linear_choice.unfused``, what a runner measures it
against). ``--skinny``: the split-K kernel (``kernels.skinny_linear``) instead, over BLOCK_N x BLOCK_K
x SPLIT_K x warps x stages and its own default (``default``); one row also times the one-row kernel. Each timing is a CUDA graph of back-to-back calls cycling over weight copies (>= 256 MB,
so every call reads HBM, as in a real step). TB/s = weight bytes / time.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

import bench_linear  # this directory is on sys.path when run as a script
from bench_linear import HBM_BYTES
from fullgraph.kernels import skinny_linear
from fullgraph.kernels.linear import NO_LIMIT, launch
from fullgraph.kernels.linear_choice import unfused

SHAPES = {  # name: (N, K, bias)
    **bench_linear.SHAPES,
    "smollm2.qkv": (960, 576, False), "smollm2.o": (576, 576, False),
    "smollm2.gate_up": (3072, 576, False), "smollm2.down": (576, 1536, False),
    "llama8b.qkv": (6144, 4096, False), "llama8b.o": (4096, 4096, False),
    "llama8b.gate_up": (28672, 4096, False), "llama8b.down": (4096, 14336, False),
}


def time_calls(fn, weights) -> float:
    """Microseconds per ``fn(w, b)``, over ``weights`` as (w, b) pairs (``bench_linear``'s timing)."""
    return 1e3 * bench_linear.time_calls(lambda wb: fn(*wb), weights, reps=3)


def configs(m: int, args) -> list[tuple[int, ...]]:
    if args.skinny:
        grid = itertools.product(args.skinny_block_n, args.skinny_block_k, args.skinny_split, args.warps_rows,
                                 args.stages)
        return [None] + list(grid)   # None: the kernel's own launch_config
    if m == 1:
        grid = itertools.product(args.block_n, args.block_k, args.warps, args.prefetch, [1])
        return [c for c in grid if c[0] * c[1] <= 32768]
    grid = itertools.product(args.block_n_rows, args.block_k_rows, args.warps_rows, [1], args.stages)
    return list(grid)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), help="names from SHAPES")
    p.add_argument("--block-n", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--block-k", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--prefetch", type=int, nargs="+", default=[1, 2])
    p.add_argument("--block-n-rows", type=int, nargs="+", default=[16, 32, 64], help="for more than one row")
    p.add_argument("--block-k-rows", type=int, nargs="+", default=[128, 256])
    p.add_argument("--warps-rows", type=int, nargs="+", default=[4])
    p.add_argument("--stages", type=int, nargs="+", default=[3, 4])
    p.add_argument("--norm", action="store_true", help="time the RMSNorm-on-load forms instead")
    p.add_argument("--skinny", action="store_true", help="more than one row: the split-K kernel's configurations")
    p.add_argument("--skinny-block-n", type=int, nargs="+", default=[64, 128])
    p.add_argument("--skinny-block-k", type=int, nargs="+", default=[64, 128])
    p.add_argument("--skinny-split", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--out", default="sweep_linear.json")
    args = p.parse_args()
    dev, rows = torch.device("cuda"), []
    for name in args.shapes:
        n, k, has_bias = SHAPES[name]
        copies = max(2, -(-HBM_BYTES // (n * k * 2)))
        weights = [(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5,
                    torch.randn(n, device=dev, dtype=torch.bfloat16) if has_bias else None) for _ in range(copies)]
        g = (1 + 0.1 * torch.randn(k, device=dev)).bfloat16() if args.norm else None
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            xn = x if g is None else (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5) * g.float())
            w0, b0 = weights[0]
            ref = F.linear(xn.float(), w0.float(), None if b0 is None else b0.float())
            results = [("cublas", time_calls(lambda w, b: F.linear(x, w, b), weights))]
            if g is not None:
                results.append(("norm+cublas", time_calls(lambda w, b: unfused(x, w, b, "none", NO_LIMIT, g, 1e-5, None),
                                                          weights)))
            ours = skinny_linear.launch if args.skinny else launch
            if args.skinny and m == 1:  # the one-row kernel's own choice, beside the split-K kernel's
                results.append(("one-row default", time_calls(lambda w, b: launch(x, w, b, norm_weight=g, eps=1e-5),
                                                              weights)))
            for cfg in configs(m, args):
                try:
                    got = ours(x, w0, b0, config=cfg, norm_weight=g, eps=1e-5)
                except OutOfResources as e:  # e.g. 64 rows x 4 stages of shared memory
                    print(f"  {name} m={m} {cfg}: {e}, skipped")
                    continue
                err = (got.float() - ref).abs().max().item()
                if err > 0.05:
                    print(f"  {name} m={m} {cfg}: max error {err:.3g}, skipped")
                    continue
                us = time_calls(lambda w, b: ours(x, w, b, config=cfg, norm_weight=g, eps=1e-5), weights)
                label = "default " + "x".join(map(str, skinny_linear.launch_config(m, n, k, torch.cuda.get_device_properties(
                    dev).multi_processor_count, g is not None))) if cfg is None else "x".join(map(str, cfg))
                results.append((label, us))
            results.sort(key=lambda r: r[1])
            mb = n * k * 2 / 1e6
            base = dict(results)["norm+cublas" if g is not None else "cublas"]
            line = "  ".join(f"{c} {t:.1f}" for c, t in results[:4])
            print(f"{name:16s} m={m:2d} {mb:6.1f}MB {'norm+' if g is not None else ''}cublas {base:6.1f}us "
                  f"({mb / base:.2f} TB/s) | best: {line}", flush=True)
            rows.append({"shape": name, "rows": m, "norm": g is not None, "mbytes": mb, "us": dict(results)})
        del weights
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
