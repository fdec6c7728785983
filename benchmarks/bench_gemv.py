"""Decode-size linear layers: our skinny kernel (``fullgraph.kernels.gemv``) vs cuBLAS (``F.linear``).

    python benchmarks/bench_gemv.py [--sweep] [--rows 1 4 8] [--out bench_gemv.json]

GPU script: prints a table, writes JSON, never asserts on time. Shapes are the weight matrices of
the llama-1b shape and of Phi-3-Small, bf16. Each timing is a CUDA graph of back-to-back calls
cycling over enough weight copies (>= 256 MB) that every call reads its weight from HBM, as in a
real step (one layer's matrix would otherwise sit in the 50 MB L2). TB/s = weight bytes / time.
``--sweep`` also times a grid of launch configs per shape and prints the best (to pick the
defaults in ``default_gemv_config``).
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from fullgraph.kernels.gemv import GemvConfig, default_gemv_config, gemv

SHAPES = {  # name: (N, K, bias)
    "llama1b.qkv": (3072, 2048, False), "llama1b.o": (2048, 2048, False),
    "llama1b.gate_up": (16384, 2048, False), "llama1b.down": (2048, 8192, False),
    "llama1b.lm_head": (128256, 2048, False),
    "phi3.qkv": (6144, 4096, True), "phi3.dense": (4096, 4096, True),
    "phi3.up": (28672, 4096, True), "phi3.down": (4096, 14336, True), "phi3.lm_head": (100352, 4096, False),
}
DEV, DTYPE = torch.device("cuda"), torch.bfloat16
HBM_BYTES = 256 * 2**20


def time_calls(fn, weights, reps: int = 5) -> float:
    """ms per call of ``fn(w)`` over ``weights`` in a CUDA graph (reps passes over all copies)."""
    for w in weights:
        fn(w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for w in weights:
                fn(w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (reps * len(weights)))
    return sorted(times)[len(times) // 2]


def sweep_configs(m: int):
    for bn, bk, warps, stages in itertools.product((4, 8, 16, 32), (128, 256, 512, 1024), (4, 8), (1, 3)):
        if m * bn * bk <= 16384 and bn * bk >= 1024:  # registers of the (M, N, K) product tile
            yield GemvConfig(bn, bk, warps, stages)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--out", default="bench_gemv.json")
    args = p.parse_args()
    rows = []
    for name in args.shapes:
        n, k, has_bias = SHAPES[name]
        nbytes = n * k * 2
        copies = max(2, -(-HBM_BYTES // nbytes))
        weights = [torch.randn(n, k, device=DEV, dtype=DTYPE) * k ** -0.5 for _ in range(copies)]
        bias = torch.randn(n, device=DEV, dtype=DTYPE) if has_bias else None
        for m in args.rows:
            x = torch.randn(m, k, device=DEV, dtype=DTYPE)
            ref = (x.double() @ weights[0].double().t() + (bias.double() if has_bias else 0)).float()
            err = (gemv(x, weights[0], bias).float() - ref).abs().max().item()
            cublas = time_calls(lambda w: F.linear(x, w, bias), weights)
            ours_cfg = default_gemv_config(m, n, k)
            ours = time_calls(lambda w: gemv(x, w, bias, ours_cfg), weights)
            row = {"shape": name, "M": m, "N": n, "K": k, "cublas_us": cublas * 1e3, "ours_us": ours * 1e3,
                   "cublas_TBps": nbytes / cublas / 1e9, "ours_TBps": nbytes / ours / 1e9, "max_err": err,
                   "config": vars(ours_cfg) if hasattr(ours_cfg, "__dict__") else str(ours_cfg)}
            if args.sweep:
                best = None
                for cfg in sweep_configs(m):
                    try:
                        t = time_calls(lambda w: gemv(x, w, bias, cfg), weights, reps=2)
                    except Exception as e:  # a config the compiler rejects (e.g. out of resources)
                        print(f"   {name} M={m} {cfg}: {type(e).__name__}")
                        continue
                    if best is None or t < best[0]:
                        best = (t, cfg)
                row["best_us"], row["best_TBps"] = best[0] * 1e3, nbytes / best[0] / 1e9
                row["best_config"] = str(best[1])
            rows.append(row)
            print(f"{name:16s} M={m:2d} cuBLAS {row['cublas_us']:8.2f} us {row['cublas_TBps']:5.2f} TB/s | ours "
                  f"{row['ours_us']:8.2f} us {row['ours_TBps']:5.2f} TB/s | err {err:.2e}"
                  + (f" | best {row['best_us']:8.2f} us {row['best_TBps']:5.2f} TB/s {row['best_config']}"
                     if args.sweep else ""), flush=True)
        del weights
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
