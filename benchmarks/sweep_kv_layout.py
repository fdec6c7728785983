"""Decode attention over two KV-cache layouts: does the page's order of heads and tokens matter?

    PYTHONPATH=. python benchmarks/sweep_kv_layout.py [--out sweep_kv_layout.json]

GPU script: prints a table, writes JSON, never asserts on time. The cache's layout today is
``(2, num_blocks, page, KVH, D)`` (token-major, "NHD"): one program (a request and a KV head)
reads 128-256 bytes of every token's row, a row of ``KVH * D`` elements apart. The head-major
page (``(2, num_blocks, KVH, page, D)``, "HND") puts a head's tokens of a page next to each
other. The decode kernel takes strides, so the same kernel runs over both (a permuted view of
head-major storage). Each variant runs as a CUDA graph of one call per layer over 16 distinct
caches (the keys come from HBM), with the model's launch configuration; pages are handed out in
order or shuffled. The KV bandwidth column is the bytes the calls read over their time, beside a
device-to-device copy of one cache's size (read + write counted, as the decode floor does).
"""
from __future__ import annotations

import argparse
import json

import torch

from fullgraph.kernels import num_kv_splits, paged_attention
from fullgraph.kernels.paged_attention import default_config
from sweep_decode_attention import graph_us  # this directory is on sys.path when run as a script

DEV = torch.device("cuda")
LAYERS = 16  # distinct caches, one call each in a graph (as sweep_decode_attention's)


def copy_tbs(nbytes: int) -> float:
    """Device copy bandwidth over a buffer of this size, read + write counted."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=DEV)
    dst = [torch.empty_like(src) for _ in range(4)]
    us = graph_us([lambda d=d: d.copy_(src) for d in dst])
    return 2 * nbytes / us / 1e6


def cache(layout: str, nb: int, page: int, kvh: int, d: int) -> torch.Tensor:
    if layout == "NHD":
        return torch.randn(2, nb, page, kvh, d, device=DEV, dtype=torch.bfloat16)
    return torch.randn(2, nb, kvh, page, d, device=DEV, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)


def rows_for(name, batch, context, h, kvh, d, page, max_model_len):
    pages = -(-context // page)
    nb = batch * pages + 1
    q = torch.randn(batch, h, d, device=DEV, dtype=torch.bfloat16)
    qsl = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
    seq_lens = torch.full((batch,), context, device=DEV, dtype=torch.int32)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    splits = num_kv_splits(batch, kvh, max_model_len, sms)
    cfg = default_config(d, torch.bfloat16, True, -(-max_model_len // splits), batch * kvh * splits / sms)
    part_out = torch.empty(batch * splits * h * d, device=DEV)
    part_lse = torch.empty(batch * splits * h, device=DEV)
    nbytes = batch * context * kvh * d * 2 * 2
    rows = []
    orders = {"in order": torch.arange(1, nb, device=DEV),
              "shuffled": torch.randperm(nb - 1, device=DEV) + 1}
    for order, ids in orders.items():
        table = ids[: batch * pages].view(batch, pages).int()
        nhd = [cache("NHD", nb, page, kvh, d) for _ in range(LAYERS)]
        ref = None
        for layout in ("NHD", "HND"):
            kv = nhd if layout == "NHD" else [cache("HND", nb, page, kvh, d).copy_(c) for c in nhd]
            calls = [lambda c=c: paged_attention(q, c, qsl, seq_lens, table, scale=d ** -0.5, decode_only=True,
                                                 num_splits=splits, part_out=part_out, part_lse=part_lse,
                                                 config=cfg) for c in kv]
            out = calls[0]().float()
            ref = out if ref is None else ref
            err = (out - ref).abs().max().item()   # the same values in both layouts: the same outputs
            us = graph_us(calls)
            rows.append({"shape": name, "batch": batch, "context": context, "page": page, "layout": layout,
                         "pages": order, "splits": splits, "block_n": cfg.block_n, "warps": cfg.num_warps,
                         "stages": cfg.num_stages, "us": us, "kv_tbs": nbytes / us / 1e6, "max_diff_vs_nhd": err})
            print(f"{name:13s} b{batch:<3d} ctx {context:5d} page {page:3d} {order:8s} {layout}: {us:7.2f} us "
                  f"({nbytes / us / 1e6:4.2f} TB/s KV; splits {splits}, n{cfg.block_n} w{cfg.num_warps} "
                  f"s{cfg.num_stages}; max |diff| vs NHD {err:.1e})", flush=True)
        del kv, nhd
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="sweep_kv_layout.json")
    args = p.parse_args()
    rows = []
    for batch in (32, 64):
        for page in (16, 64):
            rows += rows_for("llama-1b", batch, 1024, 32, 8, 64, page, 1280)
    rows += rows_for("llama-1b", 64, 640, 32, 8, 64, 16, 1024)     # the serving bench's contexts
    rows += rows_for("smollm2-135m", 64, 1024, 9, 3, 64, 16, 1280)
    rows += rows_for("phi3-dense", 16, 2048, 32, 8, 128, 64, 2304)
    rows += rows_for("llama-8b", 32, 1024, 32, 8, 128, 16, 1280)
    tbs = copy_tbs(64 * 1024 * 8 * 64 * 2 * 2)
    print(f"device copy of one llama-1b batch-64 cache: {tbs:.2f} TB/s (read + write)")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_tbs": tbs, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
