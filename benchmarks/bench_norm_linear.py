"""RMSNorm fused into the one-row linear (``kernels.rms_norm_linear``) against the two launches it
would replace (``kernels.add_rms_norm`` then ``kernels.linear``), at the decode shapes that a norm
feeds: each model's QKV projection and its gate/up projection with SwiGLU.

    PYTHONPATH=. python benchmarks/bench_norm_linear.py [--out bench_norm_linear.json]

GPU script: prints a table, writes JSON, never asserts on time. bf16, one row. Each timing is a
CUDA graph of back-to-back calls cycling over enough weight copies (>= 256 MB) that every call
reads HBM, as in a real step, with programmatic dependent launch as the runner uses it; the
difference is what the fusion would save per norm in a captured decode step. It also checks
that both give the same outputs (to bf16 rounding).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_linear import HBM_BYTES, time_calls  # noqa: E402
from fullgraph import kernels  # noqa: E402
from fullgraph.kernels.norm_linear import rms_norm_linear  # noqa: E402

SHAPES = {  # name: (N, K, activation): what a norm feeds, per model
    "smollm2.qkv": (960, 576, "none"), "smollm2.gate_up": (3072, 576, "silu_and_mul"),
    "llama1b.qkv": (3072, 2048, "none"), "llama1b.gate_up": (16384, 2048, "silu_and_mul"),
    "llama8b.qkv": (6144, 4096, "none"), "llama8b.gate_up": (28672, 4096, "silu_and_mul"),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench_norm_linear.json")
    args = p.parse_args()
    dev, dt, rows = torch.device("cuda"), torch.bfloat16, []
    for name, (n, k, activation) in SHAPES.items():
        copies = max(2, -(-HBM_BYTES // (n * k * 2)))
        weights = [torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5 for _ in range(copies)]
        x, r = torch.randn(1, k, device=dev, dtype=dt), torch.randn(1, k, device=dev, dtype=dt)
        g = 1 + 0.1 * torch.randn(k, device=dev, dtype=dt)

        def unfused(w):
            y, h = kernels.add_rms_norm(x, r, g, 1e-5)
            return kernels.linear(y, w, None, activation), h

        def fused(w):
            return rms_norm_linear(x, g, 1e-5, w, residual=r, activation=activation)

        (a, ha), (b, hb) = unfused(weights[0]), fused(weights[0])
        err = ((a.float() - b.float()).abs().max() / a.float().abs().max().clamp_min(1e-6)).item()
        row = {"shape": name, "N": n, "K": k, "activation": activation,
               "unfused_us": 1e3 * time_calls(unfused, weights), "fused_us": 1e3 * time_calls(fused, weights),
               "max_rel_diff": err, "h_equal": bool(torch.equal(ha, hb))}
        row["saved_us"] = row["unfused_us"] - row["fused_us"]
        rows.append(row)
        print(f"{name:16s} N={n:6d} K={k:5d} unfused {row['unfused_us']:7.2f} us  fused {row['fused_us']:7.2f} us  "
              f"saved {row['saved_us']:6.2f} us  max rel diff {err:.1e}  h equal {row['h_equal']}", flush=True)
        del weights
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
