"""Decode attention at small batch, as a model step sees it: launch options A/B'd per shape.

    PYTHONPATH=. python benchmarks/sweep_decode_attention.py [--out sweep_decode_attention.json]

GPU script: prints a table, writes JSON, never asserts on time. Each variant runs as a CUDA graph
of one call per layer over 16 distinct KV caches (so the keys come from HBM, not L2, as in a
step) and reports microseconds per call, split-KV merge included. Variants: the split count, the
key tile, warps and pipeline stages. Shapes are the llama-1b and Phi-3-Small decode layers at
the benches' contexts.
"""
from __future__ import annotations

import argparse
import json

import torch

from fullgraph.attention.blocksparse import BlockSparseConfig, build_group_layout, build_layout
from fullgraph.kernels import KernelConfig, num_kv_splits, paged_attention
from fullgraph.kernels.paged_attention import default_config
from fullgraph.kernels.blocksparse_decode import blocksparse_decode, decode_num_splits

DEV = torch.device("cuda")
LAYERS = 16


def graph_us(calls, reps: int = 10) -> float:
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps / len(calls) * 1e3


def caches(batch, context, kvh, d, page):
    pages = -(-context // page)
    nb = batch * pages + 1
    out = []
    layers = LAYERS if batch * context <= 65536 else 2  # long contexts read far more than L2 anyway
    for _ in range(layers):
        out.append(torch.randn(2, nb, page, kvh, d, device=DEV, dtype=torch.bfloat16))
    table = (torch.randperm(nb - 1, device=DEV)[: batch * pages] + 1).view(batch, pages).int()
    return out, table


def dense_rows(name, batch, context, h, kvh, d, page, max_model_len):
    kv, table = caches(batch, context, kvh, d, page)
    q = torch.randn(batch, h, d, device=DEV, dtype=torch.bfloat16)
    qsl = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
    seq_lens = torch.full((batch,), context, device=DEV, dtype=torch.int32)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    default = num_kv_splits(batch, kvh, max_model_len, sms)
    rows, base = [], default_config(d, torch.bfloat16, True, -(-max_model_len // default),
                                    batch * kvh * default / sms)   # the model's config at the default split
    variants = [(s, base) for s in sorted({1, max(1, default // 4), max(1, default // 2), default})]
    variants += [(default, c) for c in (KernelConfig(16, 64, 2, 2), KernelConfig(16, 64, 2, 1), KernelConfig(16, 32, 4, 2),
                                        KernelConfig(16, 32, 2, 2), KernelConfig(16, 128, 4, 2),
                                        KernelConfig(16, 64, 4, 1), KernelConfig(16, 64, 8, 2),
                                        # long programs (unsplit from a full GPU on): deeper pipelines, wider tiles
                                        KernelConfig(16, 64, 2, 3), KernelConfig(16, 64, 2, 4), KernelConfig(16, 64, 4, 3),
                                        KernelConfig(16, 128, 2, 2), KernelConfig(16, 128, 4, 3),
                                        KernelConfig(16, 128, 8, 3))]
    for splits, cfg in variants:
        part_out = torch.empty(batch * splits * h * d, device=DEV)
        part_lse = torch.empty(batch * splits * h, device=DEV)
        calls = [lambda c=c: paged_attention(q, c, qsl, seq_lens, table, scale=d ** -0.5, decode_only=True,
                                             num_splits=splits, part_out=part_out, part_lse=part_lse,
                                             config=cfg) for c in kv]
        try:
            us = graph_us(calls)
        except Exception as exc:  # a config that does not compile: report, go on
            us = float("nan")
            print(f"  {name} splits {splits} {cfg}: {type(exc).__name__}: {str(exc)[:80]}")
        rows.append({"shape": name, "batch": batch, "context": context, "splits": splits, "default_splits": default,
                     "block_n": cfg.block_n, "warps": cfg.num_warps, "stages": cfg.num_stages,
                     "us": us})
        print(f"{name:14s} b{batch:<3d} ctx {context:5d} splits {splits:3d}{'*' if splits == default else ' '} "
              f"n{cfg.block_n:<3d} w{cfg.num_warps} s{cfg.num_stages}: {us:7.2f} us", flush=True)
    return rows


def blocksparse_rows(batch, context, max_model_len, options=((64, 32, 512), (128, 32, 512), (256, 32, 512))):
    """``options``: (min_keys_per_split, max_splits, target_programs) given to ``decode_num_splits``."""
    h, kvh, d, page = 32, 8, 128, 64
    cfg = BlockSparseConfig()
    layout = build_group_layout(build_layout(cfg, h, max_model_len, DEV), kvh)
    kv, table = caches(batch, context, kvh, d, page)
    q = torch.randn(batch, h, d, device=DEV, dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), context, device=DEV, dtype=torch.int32)
    rows = []
    for min_keys, max_splits, programs in options:
        splits = decode_num_splits(batch, kvh, layout.width, cfg.block_size, min_keys_per_split=min_keys,
                                   max_splits=max_splits, target_programs=programs)
        part_out = torch.empty(batch * h * splits, d, device=DEV)
        part_ml = torch.empty(batch * h * splits, 2, device=DEV)
        calls = [lambda c=c: blocksparse_decode(q, c, seq_lens, table, layout.counts, layout.entries, part_out,
                                                part_ml, sm_scale=d ** -0.5, sparse_block_size=64,
                                                num_splits=splits) for c in kv]
        us = graph_us(calls)
        rows.append({"shape": "phi3-blocksparse", "batch": batch, "context": context, "splits": splits,
                     "min_keys": min_keys, "max_splits": max_splits, "target_programs": programs, "us": us})
        print(f"phi3-blocksparse b{batch:<3d} ctx {context:6d} min_keys {min_keys:3d} max_splits {max_splits:3d} "
              f"programs {programs:4d} splits {splits:3d}: {us:8.2f} us", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="sweep_decode_attention.json")
    p.add_argument("--long", action="store_true", help="only the block-sparse decode at 32K / 128K")
    args = p.parse_args()
    rows = []
    for batch in () if args.long else (1, 32, 64):
        rows += dense_rows("llama-1b", batch, 1024, 32, 8, 64, 16, 1280)
    for batch in () if args.long else (32, 64):
        rows += dense_rows("smollm2-135m", batch, 1024, 9, 3, 64, 16, 1280)
    for batch in () if args.long else (1, 16):
        rows += dense_rows("phi3-dense", batch, 2048, 32, 8, 128, 64, 2304)
        rows += blocksparse_rows(batch, 2048, 2304)
    for context in (32768, 131072) if args.long else ():
        for batch, options in ((1, ((128, 32, 512), (128, 64, 512), (128, 128, 1024))),
                               (16, ((128, 32, 512), (128, 32, 1024), (128, 32, 2048)))):
            rows += blocksparse_rows(batch, context, 131072, options=options)
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
