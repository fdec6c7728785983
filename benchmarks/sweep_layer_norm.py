"""A LayerNorm applied on load against the LayerNorm kernel + the projection, one row, Phi-3-Small's shapes.

    PYTHONPATH=. python benchmarks/sweep_layer_norm.py [--out sweep_layer_norm.json]

GPU script: for the QKV projection with RoPE and the KV write (``kernels.linear_rope_kv``, 6144 x 4096)
and the GeGeLU up projection (``kernels.linear``, 28672 x 4096), the microseconds of one call of
``layer_norm`` + the projection's default launch (what a Phi-3-Small one-row step runs without the
``layernorm`` fusion), of the projection alone, and of the projection with the LayerNorm on load over
BLOCK_N x BLOCK_K x warps x prefetch, best first; writes JSON; never asserts on time. Each timing is
a CUDA graph of back-to-back calls cycling over weight copies (>= 256 MB, as ``sweep_linear.py``), so
in-graph launch gaps count as they do in a step (PDL as the environment says).
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

import bench_linear  # this directory is on sys.path when run as a script
from bench_linear import HBM_BYTES
from fullgraph.kernels import layer_norm, layer_norm_sums
from fullgraph.kernels.linear import launch as linear_launch
from fullgraph.kernels.linear_rope_kv import launch as rope_launch

K, HEADS, KV_HEADS, HEAD_DIM = 4096, 32, 8, 128
DEVICE = "cuda"
SHAPES = {"phi3.qkv_rope": (HEADS + 2 * KV_HEADS) * HEAD_DIM, "phi3.up_gegelu": 28672}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--block-n", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    p.add_argument("--block-k", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--prefetch", type=int, nargs="+", default=[1, 2])
    p.add_argument("--out", default="sweep_layer_norm.json")
    args = p.parse_args()
    dev, rows = torch.device(DEVICE), []
    gen = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(1, K, device=dev, generator=gen) + 2.0).bfloat16()
    g = (1 + 0.2 * torch.randn(K, device=dev, generator=gen)).bfloat16()
    nb = (0.1 * torch.randn(K, device=dev, generator=gen)).bfloat16()
    cache = torch.zeros(2, 64, 16, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    slots, positions = torch.tensor([37], device=dev), torch.tensor([5], device=dev)
    angles = torch.rand(64, HEAD_DIM // 2, device=dev, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    for name, n in SHAPES.items():
        copies = max(2, -(-HBM_BYTES // (n * K * 2)))
        weights = [((torch.randn(n, K, device=dev, generator=gen) * K ** -0.5).bfloat16(),
                    (0.02 * torch.randn(n, device=dev, generator=gen)).bfloat16()) for _ in range(copies)]
        sums = [layer_norm_sums(w, g, nb) for w, _ in weights]
        rope = name.endswith("rope")

        def call(i: int, xin, norm: bool, config=None):
            w, b = weights[i]
            extra = dict(norm_weight=g, layer_norm_sums=sums[i]) if norm else {}
            if rope:
                return rope_launch(xin, w, b, extra.pop("norm_weight", None), 1e-5, cache, slots, positions, cos, sin,
                                   HEADS, KV_HEADS, "grouped", config=config, **extra)
            return linear_launch(xin, w, b, "gegelu", 20.0, config=config, eps=1e-5, **extra)

        time = lambda fn: 1e3 * bench_linear.time_calls(fn, list(range(copies)), reps=3)   # noqa: E731
        want = F.linear(F.layer_norm(x.float(), (K,), g.float(), nb.float(), 1e-5), weights[0][0].float(),
                        weights[0][1].float())
        results = [("layer_norm kernel + projection", time(lambda i: call(i, layer_norm(x, g, nb, 1e-5), False))),
                   ("projection alone", time(lambda i: call(i, x, False)))]
        for cfg in itertools.product(args.block_n, args.block_k, args.warps, args.prefetch):
            if cfg[0] * cfg[1] > 32768 or (rope and cfg[0] < 2):
                continue
            if not rope:  # check against the float32 product (rope's correctness is the tests')
                got = linear_launch(x, *weights[0], "none", config=cfg, norm_weight=g, eps=1e-5,
                                    layer_norm_sums=sums[0])
                if (got.float() - want).abs().max().item() > 0.05:
                    print(f"  {name} {cfg}: wrong result, skipped")
                    continue
            results.append(("on load " + "x".join(map(str, cfg)), time(lambda i: call(i, x, True, cfg))))
        results.append(("on load, default", time(lambda i: call(i, x, True))))
        results.sort(key=lambda r: r[1])
        mb = n * K * 2 / 1e6
        print(f"{name:16s} {mb:6.1f}MB | " + "  ".join(f"{c} {t:.1f}" for c, t in results[:6]), flush=True)
        print(f"{'':16s} separate {dict(results)['layer_norm kernel + projection']:.1f}  alone "
              f"{dict(results)['projection alone']:.1f}  on-load default {dict(results)['on load, default']:.1f} us")
        rows.append({"shape": name, "mbytes": mb, "us": dict(results)})
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
