"""Which cuBLAS call form is fastest for a one-row (batch-1 decode) linear layer?

    python benchmarks/bench_linear.py [--out bench_linear.json]

GPU script: prints a table, writes JSON, never asserts on time. For the weight matrices of the
llama-1b shape and Phi-3-Small (bf16, x of one row), times ``F.linear(x, w, b)``, ``addmv`` /
``mv`` on the row vector, and the transposed product ``(w @ x.T).T``, each as a CUDA graph of
back-to-back calls cycling over enough weight copies (>= 256 MB) that every call reads HBM, as in
a real step. TB/s = weight bytes / time.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

SHAPES = {  # name: (N, K, bias)
    "llama1b.qkv": (3072, 2048, False), "llama1b.o": (2048, 2048, False),
    "llama1b.gate_up": (16384, 2048, False), "llama1b.down": (2048, 8192, False),
    "phi3.qkv": (6144, 4096, True), "phi3.dense": (4096, 4096, True),
    "phi3.up": (28672, 4096, True), "phi3.down": (4096, 14336, True),
}
FORMS = {
    "linear": lambda x, w, b: F.linear(x, w, b),
    "addmv": lambda x, w, b: (torch.mv(w, x[0]) if b is None else torch.addmv(b, w, x[0]))[None],
    "w@xT": lambda x, w, b: (w @ x.t()).t() if b is None else torch.addmm(b[:, None], w, x.t()).t(),
}
HBM_BYTES = 256 * 2**20


def time_calls(fn, weights, reps: int = 5) -> float:
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench_linear.json")
    args = p.parse_args()
    dev, rows = torch.device("cuda"), []
    default_lib = torch.backends.cuda.preferred_blas_library()
    for name, (n, k, has_bias) in SHAPES.items():
        copies = max(2, -(-HBM_BYTES // (n * k * 2)))
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, device=dev, dtype=torch.bfloat16) if has_bias else None
        row = {"shape": name, "N": n, "K": k}
        for lib in ("cublaslt", "cublas"):
            torch.backends.cuda.preferred_blas_library(lib)
            for form, fn in FORMS.items():
                ms = time_calls(lambda w: fn(x, w, b), weights)
                row[f"{form}/{lib}_us"] = ms * 1e3
                row[f"{form}/{lib}_TBps"] = n * k * 2 / ms / 1e9
        torch.backends.cuda.preferred_blas_library(default_lib)
        rows.append(row)
        print(f"{name:16s} " + " ".join(f"{key[:-3]}={v:6.2f}us" for key, v in row.items() if key.endswith("_us")),
              flush=True)
        del weights
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
