"""Dense paged attention (the ``triton`` backend's kernels) vs PyTorch's FlashAttention-2.

    python benchmarks/bench_attention.py [--quick] [--page 16] [--tune] [--out bench_attention.json]

GPU script: prints one table, writes JSON, never asserts on time. Shapes: 32 query heads, 8 KV
heads, head_dim 128, bf16, scale 1/sqrt(128).
- prefill (one causal sequence of 4K / 16K tokens): ours reads K/V from the paged cache (``--page``
  tokens per page, pages shuffled) vs ``aten._flash_attention_forward`` over contiguous K/V (GQA
  native). TFLOP/s counts the causal half: 2 * T^2 * H * D.
- decode (one query token per sequence; batch 1/16/64 x context 1K/8K/32K/128K, combos over 40 GB
  of KV skipped): ours (split-KV count from ``num_kv_splits`` with max_model_len = the context)
  vs FA2 over contiguous KV. Both run inside CUDA graphs of ``INNER`` back-to-back calls, so launch
  overhead does not hide the kernels; TB/s = K+V bytes of the batch / time. Rows whose KV fits in
  L2 twice over say so (the repeated calls then read from L2, not HBM).
- ``--tune``: also sweep a few launch configs (prefill 4K, decode batch 16 x 8K) and print the
  best, to pick the fixed defaults in ``fullgraph/kernels/paged_attention.py``.
Column ours/FA2 = FA2 ms / ours ms: our throughput as a fraction of FA2's (> 1: ours is faster).
Targets (issue 3, not asserted): prefill >= 70% of FA2 TFLOP/s; decode >= 80% of FA2 at batch >= 16.
"""
from __future__ import annotations

import argparse
import json

import torch
import triton

from fullgraph.kernels import KernelConfig, kv_write, num_kv_splits, paged_attention, split_workspace_rows
from fullgraph.kernels.paged_attention import default_config

H, KVH, D = 32, 8, 128
SCALE = D ** -0.5
DTYPE = torch.bfloat16
DEV = torch.device("cuda")
INNER = 20
MAX_KV_BYTES = 40e9


def fa2(q, k, v, causal: bool) -> torch.Tensor:
    """FlashAttention-2 as PyTorch ships it; q (B, S, H, D), k/v (B, L, KVH, D)."""
    return torch.ops.aten._flash_attention_forward(q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal,
                                                   False, scale=SCALE)[0]


def graph_ms(fn, quick: bool) -> tuple[float, str]:
    """Median ms of one ``fn`` call, timed as CUDA-graph replays of INNER back-to-back calls
    (eager ``do_bench`` if ``fn`` cannot be captured); returns (ms, "graph" | "eager")."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    rep = dict(warmup=5, rep=30) if quick else dict(warmup=10, rep=100)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(INNER):
                fn()
    except RuntimeError:
        torch.cuda.synchronize()
        return float(triton.testing.do_bench(fn, return_mode="median", **rep)), "eager"
    return float(triton.testing.do_bench(graph.replay, return_mode="median", **rep)) / INNER, "graph"


def paged_cache(k: torch.Tensor, v: torch.Tensor, page: int, gen: torch.Generator):
    """(B, L, KVH, D) K/V -> a paged cache (pages shuffled, null block 0 kept) and its block table."""
    batch, length = k.shape[:2]
    per_seq = length // page
    num_blocks = batch * per_seq + 1
    table = (torch.randperm(num_blocks - 1, device=DEV, generator=gen) + 1).to(torch.int32).view(batch, per_seq)
    cache = torch.zeros(2, num_blocks, page, KVH, D, device=DEV, dtype=DTYPE)
    slots = (table.long()[:, :, None] * page + torch.arange(page, device=DEV)).view(-1)   # (B * L,)
    kv_write(key=k.view(-1, KVH, D), value=v.view(-1, KVH, D), kv_cache=cache, slot_mapping=slots)
    return cache, table


def bench_prefill(tokens: int, page: int, quick: bool, config: KernelConfig | None = None) -> dict:
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    q, k, v = (torch.randn(1, tokens, h, D, device=DEV, dtype=DTYPE, generator=gen) for h in (H, KVH, KVH))
    cache, table = paged_cache(k, v, page, gen)
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device=DEV)

    def ours():
        return paged_attention(q[0], cache, qsl, seq_lens, table, scale=SCALE, decode_only=False, config=config)
    diff = (ours().float() - fa2(q, k, v, True)[0].float()).abs().max().item()
    rep = dict(warmup=10, rep=50) if quick else dict(warmup=25, rep=200)
    ours_ms = float(triton.testing.do_bench(ours, return_mode="median", **rep))
    fa2_ms = float(triton.testing.do_bench(lambda: fa2(q, k, v, True), return_mode="median", **rep))
    flops = 2.0 * tokens * tokens * H * D
    return {"kind": "prefill", "tokens": tokens, "page": page, "ours_ms": ours_ms, "fa2_ms": fa2_ms,
            "ours_tflops": flops / ours_ms * 1e-9, "fa2_tflops": flops / fa2_ms * 1e-9,
            "ratio": fa2_ms / ours_ms, "max_abs_diff_vs_fa2": diff,
            "config": vars(config or default_config(D, DTYPE, False))}


def bench_decode(batch: int, context: int, page: int, quick: bool, config: KernelConfig | None = None,
                 splits: int | None = None) -> dict:
    gen = torch.Generator(device=DEV).manual_seed(batch * context)
    q = torch.randn(batch, 1, H, D, device=DEV, dtype=DTYPE, generator=gen)
    k, v = (torch.randn(batch, context, KVH, D, device=DEV, dtype=DTYPE, generator=gen) for _ in range(2))
    cache, table = paged_cache(k, v, page, gen)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEV)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    splits = splits or num_kv_splits(batch, KVH, context, sms)
    rows = max(split_workspace_rows(batch, KVH, context, sms), batch * splits) * H
    part_out = torch.empty(rows * D, device=DEV, dtype=torch.float32)
    part_lse = torch.empty(rows, device=DEV, dtype=torch.float32)

    def ours():
        return paged_attention(q[:, 0], cache, qsl, seq_lens, table, scale=SCALE, decode_only=True,
                               num_splits=splits, part_out=part_out, part_lse=part_lse, config=config)
    diff = (ours().float() - fa2(q, k, v, False)[:, 0].float()).abs().max().item()
    ours_ms, ours_timing = graph_ms(ours, quick)
    fa2_ms, fa2_timing = graph_ms(lambda: fa2(q, k, v, False), quick)
    kv_bytes = 2 * k.numel() * k.element_size()
    l2 = getattr(torch.cuda.get_device_properties(DEV), "L2_cache_size", 50 << 20)
    return {"kind": "decode", "batch": batch, "context": context, "page": page, "splits": splits,
            "ours_ms": ours_ms, "fa2_ms": fa2_ms, "ours_tbps": kv_bytes / ours_ms * 1e-9,
            "fa2_tbps": kv_bytes / fa2_ms * 1e-9, "ratio": fa2_ms / ours_ms, "kv_gb": kv_bytes / 1e9,
            "l2_resident": kv_bytes < 2 * l2, "max_abs_diff_vs_fa2": diff, "timing": f"{ours_timing}/{fa2_timing}",
            "config": vars(config or default_config(D, DTYPE, True, keys_per_split=-(-table.shape[1] * page // splits)))}


def tune(page: int, quick: bool) -> list[dict]:
    """A small sweep around the defaults (launch configs, then decode split counts); the table
    shows every candidate, nothing is changed."""
    prefill = [KernelConfig(m, n, w, s) for m, n, w, s in
               [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3),
                (128, 32, 4, 3), (64, 128, 4, 2)]]
    decode = [KernelConfig(16, n, w, s) for n, w, s in
              [(64, 4, 3), (64, 4, 2), (128, 4, 2), (32, 4, 4), (64, 8, 3), (128, 8, 3)]]
    out = []
    for cfg in prefill:
        out.append(_try(lambda: bench_prefill(4096, page, True, cfg), cfg, "prefill"))
    for cfg in decode:
        out.append(_try(lambda: bench_decode(16, 8192, page, True, cfg), cfg, "decode"))
    for batch, context in ((1, 32768), (16, 8192), (64, 8192)):
        for splits in (1, 2, 4, 8, 16, 32):
            out.append(_try(lambda: bench_decode(batch, context, page, True, splits=splits), None, "decode"))
    return out


def _try(fn, cfg: KernelConfig | None, kind: str) -> dict:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a config that does not fit (shared memory) is reported
        torch.cuda.synchronize()
        return {"kind": kind, "config": vars(cfg) if cfg else {}, "error": f"{type(exc).__name__}: {str(exc)[:100]}"}


def print_table(rows: list[dict]) -> None:
    print(f"{'kind':8} {'shape':22} {'ours ms':>9} {'FA2 ms':>9} {'ours':>15} {'FA2':>15} {'ours/FA2':>8}  note")
    for r in rows:
        if "error" in r:
            print(f"{r['kind']:8} {str(r['config']):22} error: {r['error']}")
            continue
        if r["kind"] == "prefill":
            shape, unit, a, b = f"T={r['tokens']} page={r['page']}", "TFLOP/s", r["ours_tflops"], r["fa2_tflops"]
            note = ""
        else:
            shape, unit, a, b = f"B={r['batch']} L={r['context']} page={r['page']}", "TB/s", r["ours_tbps"], r["fa2_tbps"]
            note = f"splits={r['splits']}" + (" L2-resident" if r["l2_resident"] else "") \
                + ("" if r["timing"] == "graph/graph" else f" timing={r['timing']}")
        cfg = r["config"]
        note += f" cfg={cfg['block_m']}/{cfg['block_n']}/{cfg['num_warps']}w/{cfg['num_stages']}s" \
                f" diff={r['max_abs_diff_vs_fa2']:.1e}"
        print(f"{r['kind']:8} {shape:22} {r['ours_ms']:9.3f} {r['fa2_ms']:9.3f} {a:9.1f} {unit:>5} "
              f"{b:9.1f} {unit:>5} {r['ratio']:8.2f}  {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="prefill 4K, decode batch 1/16 x 1K/8K")
    parser.add_argument("--page", type=int, default=16, help="KV-cache page size of ours (default 16)")
    parser.add_argument("--tune", action="store_true", help="also sweep a few launch configs")
    parser.add_argument("--out", default="bench_attention.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py needs a CUDA GPU")
    prefill_sizes = (4096,) if args.quick else (4096, 16384)
    batches, contexts = ((1, 16), (1024, 8192)) if args.quick else ((1, 16, 64), (1024, 8192, 32768, 131072))
    rows = [bench_prefill(n, args.page, args.quick) for n in prefill_sizes]
    skipped = []
    for batch in batches:
        for context in contexts:
            if 2 * batch * context * KVH * D * 2 > MAX_KV_BYTES:
                skipped.append({"batch": batch, "context": context})
                continue
            rows.append(bench_decode(batch, context, args.page, args.quick))
            torch.cuda.empty_cache()
    if args.tune:
        rows += tune(args.page, args.quick)
    print_table(rows)
    meta = {"device": torch.cuda.get_device_name(DEV), "torch": torch.__version__, "triton": triton.__version__,
            "heads": H, "kv_heads": KVH, "head_dim": D, "dtype": str(DTYPE), "inner_calls_per_graph": INNER,
            "skipped_over_40GB": skipped}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
