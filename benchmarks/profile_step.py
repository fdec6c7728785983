"""Where a decode step's GPU time goes: the kernels of one replayed graph, grouped and counted.

    PYTHONPATH=. python benchmarks/profile_step.py --preset llama-1b --batch 1 32 --context 1024
Captures the decode step of each batch size in ``"full"`` mode, fills it with a real decode step,
then profiles ``--replays`` replays of the graph alone (no host work). Per kernel and per kind
(linears, LM head, attention, norms, ...): launches per step and per decoder layer, device
time, the bytes the kind must move (weights, KV; "-" for the small kernels, whose bytes are
activations) and the bandwidth that makes, and the sum of the kernels against the replay's own
time (the difference is the gaps between launches; with programmatic dependent launch on, a
kernel's time includes its wait for the one ahead, so run with ``FULLGRAPH_PDL=0`` for times
that add up). ``--mode padded`` profiles the same step run
eagerly over the padded buffers instead (host launches included in the gaps). Prints tables and
writes JSON; a script, not a test.
"""
from __future__ import annotations

import argparse
import gc
import json
import re
from collections import defaultdict

import torch

# kernel name (a regular expression, first match wins) -> kind; the LM head is told apart by
# order: the step's last matrix kernel
KINDS = (
    ("stage-in", r"_stage_in_kernel"),   # the step's staged fields, read from pinned host memory (the graph's first node)
    # a linear with the norm on load, or with RoPE and the KV write in its epilogue (the one-row kernel's or the
    # split-K one's): a linear (it reads the weights)
    ("linear", r"_norm_linear_kernel|_linear_rope_kv_kernel|_skinny_rope_kv_kernel|_skinny_kernel"),
    ("attention", r"paged_attention|blocksparse_decode|blocksparse_prefill|flash|fmha|sdpa|attention"),
    ("split-KV reduce", r"split_kv_reduce|blocksparse_reduce"),
    ("rope + KV write", r"rope|kv_write"),
    ("norm", r"_norm_kernel|norm"),
    ("activation", r"_gated_kernel|silu|gelu"),
    ("sampling + output", r"_select_kernel|_scan_kernel|_max_kernel|_hist_kernel|_tail_kernel|argmax|topk|sort|softmax|"
                          r"distribution|exponential|multinomial"),
    ("linear", r"_linear_kernel|_norm_linear_kernel|gemm|gemv|nvjet|cutlass|xmma|splitK|splitk|matmul|sm90"),
    ("copy / fill", r"Memcpy|Memset|copy|fill|index|gather|scatter|elementwise|reduce_kernel|cat"),
)
LAYER_KINDS = ("linear", "attention", "split-KV reduce", "rope + KV write", "norm", "activation")


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


def summarize(launches: list[tuple[str, float]], steps: int, num_layers: int, replay_ms: float,
              bytes_by_kind: dict[str, int]) -> dict:
    """``launches``: (kernel name, device ms) of ``steps`` replays in launch order. Returns the
    per-kernel and per-kind rows (per step) and the totals."""
    if steps < 1 or len(launches) % steps:
        raise ValueError(f"{len(launches)} launches do not split into {steps} equal steps")
    per_step = len(launches) // steps
    kinds = []
    for s in range(steps):
        step = launches[s * per_step:(s + 1) * per_step]
        names = [n for n, _ in launches[:per_step]]
        if [n for n, _ in step] != names:
            raise ValueError(f"replay {s} launched other kernels than replay 0: not one graph")
        ks = [kind_of(n) for n, _ in step]
        last = max((i for i, k in enumerate(ks) if k == "linear"), default=None)
        if last is not None:
            ks[last] = "LM head"
        kinds.append(ks)
    by_kernel, by_kind = defaultdict(lambda: [0.0, 0]), defaultdict(lambda: [0.0, 0])
    for s in range(steps):
        for (name, ms), kind in zip(launches[s * per_step:(s + 1) * per_step], kinds[s]):
            for table, key in ((by_kernel, (kind, name)), (by_kind, kind)):
                table[key][0] += ms / steps
                table[key][1] += 1
    total = sum(ms for ms, _ in by_kind.values())
    kind_rows = []
    for kind, (ms, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        launches_per_step = n // steps
        moved = bytes_by_kind.get(kind)
        kind_rows.append({"kind": kind, "ms": ms, "launches": launches_per_step,
                          "per_layer": launches_per_step / num_layers if kind in LAYER_KINDS else None,
                          "bytes": moved, "TBps": moved / (ms * 1e-3) / 1e12 if moved and ms > 0 else None,
                          "share": ms / total if total else 0.0})
    kernel_rows = [{"kind": kind, "kernel": name[:100], "ms": ms, "launches": n // steps,
                    "us_each": ms * 1e3 / (n // steps)}
                   for (kind, name), (ms, n) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])]
    layer_launches = sum(r["launches"] for r in kind_rows if r["kind"] in LAYER_KINDS)
    return {"kernels_ms": total, "replay_ms": replay_ms, "gaps_ms": replay_ms - total, "launches": per_step,
            "launches_per_layer": layer_launches / num_layers, "kinds": kind_rows, "kernels": kernel_rows}


def bytes_by_kind(model, runner, batch: int, context: int) -> dict[str, int]:
    """What each kind must read at least: the layers' weights, the LM head, the KV of the context."""
    from fullgraph.bench import kv_bytes, weight_bytes_read

    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    head_bytes = head.numel() * head.element_size()
    norms = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)
    weights = weight_bytes_read(model)
    return {"linear": weights - head_bytes - norms, "LM head": head_bytes,
            "attention": kv_bytes(model, runner.kv_caches, batch, context)[0]}


def profile_batch(model, args, batch: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from fullgraph import FullGraphRunner, SeqChunk
    from fullgraph.bench import replay_ms, time_decode

    max_len = -(-(args.context + 64) // 256) * 256
    runner = FullGraphRunner(model, max_num_seqs=batch, max_num_tokens=max(batch, 16), max_model_len=max_len,
                             cudagraph=args.mode, attention=args.attention, capture_sizes=(batch,),
                             sampling=args.sampling)
    runner.warmup()
    time_decode(runner, batch, args.context, steps=3, warmup=2)   # the buffers now hold a real decode step
    key = (batch, True)
    full = args.mode == "full"
    replay = replay_ms(runner, key) if full else float("nan")
    if full:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.replays):
                runner._graphs.replay(key)   # measurement only: the graph alone, as replay_ms times it
            torch.cuda.synchronize()
        steps = args.replays
    else:   # eager steps over the padded buffers, at the context time_decode left random
        bs = runner.config.block_size
        blocks = [runner.blocks.allocate(-(-(args.context + args.replays + 1) // bs)) for _ in range(batch)]
        for ids in blocks:
            runner.blocks.mark_written(ids, args.context, bs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(args.replays):
                runner.step([SeqChunk([(7 * r + i) % 1000], args.context + i, blocks[r]) for r in range(batch)])
            torch.cuda.synchronize()
        for ids in blocks:
            runner.blocks.free(ids)
        steps = args.replays
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    launches = [(e.name, e.device_time / 1e3) for e in events]
    result = summarize(launches, steps, len(model.attention_layers()), replay, bytes_by_kind(model, runner, batch,
                                                                                           args.context))
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    from fullgraph.kernels import pdl
    return {"preset": args.preset, "batch": batch, "context": args.context, "mode": args.mode,
            "attention": args.attention, "sampling": args.sampling, "pdl": pdl._enabled(torch.cuda.current_device()), **result}


def print_result(r: dict) -> None:
    print(f"\n{r['preset']} batch {r['batch']} context {r['context']} {r['mode']} ({r['attention']}"
          f"{', sampling in the graph' if r.get('sampling') else ''}): "
          f"{r['launches']} launches a step, {r['launches_per_layer']:.1f} a decoder layer; kernels "
          f"{r['kernels_ms']:.3f} ms, replay {r['replay_ms']:.3f} ms, gaps {r['gaps_ms']:.3f} ms")
    if r.get("pdl"):
        print("programmatic dependent launch is on: a kernel starts before the one ahead ends and its time "
              "includes that wait (FULLGRAPH_PDL=0 for times that add up to the replay)")
    print(f"{'kind':18s} {'ms':>8s} {'share':>6s} {'launches':>8s} {'/layer':>6s} {'MB':>9s} {'TB/s':>6s}")
    for k in r["kinds"]:
        per_layer = f"{k['per_layer']:.1f}" if k["per_layer"] is not None else "-"
        mb = f"{k['bytes'] / 1e6:.1f}" if k["bytes"] else "-"
        tbps = f"{k['TBps']:.2f}" if k["TBps"] else "-"
        print(f"{k['kind']:18s} {k['ms']:8.4f} {k['share']:6.1%} {k['launches']:8d} {per_layer:>6s} {mb:>9s} {tbps:>6s}")
    print(f"{'us each':>8s} {'x':>4s}  kernel")
    for k in r["kernels"][:args_top]:
        print(f"{k['us_each']:8.2f} {k['launches']:4d}  [{k['kind']}] {k['kernel']}")


args_top = 20


def main() -> None:
    global args_top
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--attention", default="triton")
    p.add_argument("--mode", choices=("full", "padded"), default="full")
    p.add_argument("--replays", type=int, default=10, help="replays (or eager steps) profiled")
    p.add_argument("--sampling", action="store_true",
                   help="the engine's step: ids fed back on the device and sampled in the graph (greedy rows)")
    p.add_argument("--top", type=int, default=20, help="kernels printed per batch")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args_top = args.top
    if not torch.cuda.is_available():
        raise SystemExit("profile_step.py profiles GPU kernels: it needs a CUDA GPU")
    from fullgraph.models import presets

    model = presets.build(args.preset, dtype=torch.bfloat16, device=torch.device("cuda"), seed=0)
    results = []
    for batch in args.batch:
        results.append(profile_batch(model, args, batch))
        print_result(results[-1])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
