"""Benchmarks (scripts, not tests: they print a table and, given ``--out``, write JSON; they never
assert on time). ``python -m fullgraph.bench COMMAND --help``:

    decode --preset llama-1b --batch 1 32 --context 1024 [--loop sync overlap] [--peers]
    serve --preset llama-1b --requests 256 --input-len 512 --output-len 128 [--rate 16] [--peer-hf]
    capture --preset llama-1b          compile --preset llama-1b (twice: first and cached start)
    plan                                host --batch 1 32 256 --blocks 68
    engine-host --batch 1 64 256 [--output-kind cumulative delta final_only]
    plot --inputs decode.json ... --out decode.png
"""
from __future__ import annotations

import gc
import os
import statistics
import sys
import time

import numpy as np
import torch

from .. import FullGraphRunner, RunnerConfig, SeqChunk, padding, parallel, plan_step
from ..models import presets
from ..generate import decode_overlapped
from .stages import step_stages


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (bytes read + written)."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(2**28, dtype=torch.float32, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * 4 * 10 / (start.elapsed_time(end) / 1e3)


def weight_bytes_read(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads (the model's ``step_weight_bytes`` where it has one,
    else every parameter)."""
    if hasattr(model, "step_weight_bytes"):
        return int(model.step_weight_bytes())
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_decode(runner: FullGraphRunner, batch: int, context: int, steps: int, warmup: int) -> list[float]:
    """Wall time of each decode step (synchronised), batch requests at ``context`` tokens."""
    bs = runner.config.block_size
    blocks = [runner.blocks.allocate(-(-(context + steps + warmup + 1) // bs)) for _ in range(batch)]
    gen = torch.Generator(device=runner.device).manual_seed(0)
    for cache in runner.kv_caches:  # the context's KV: random, as if a prefill had written it
        cache.normal_(generator=gen)
    for ids in blocks:
        runner.blocks.mark_written(ids, context, bs)
    times = []
    for i in range(warmup + steps):
        chunks = [SeqChunk([(7 * r + i) % 1000], context + i, blocks[r]) for r in range(batch)]
        _sync(runner.device)
        start = time.perf_counter()
        runner.step(chunks)
        _sync(runner.device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    for ids in blocks:
        runner.blocks.free(ids)
    return times


def time_decode_overlapped(runner: FullGraphRunner, batch: int, context: int, steps: int,
                           warmup: int) -> list[float]:
    """Time between successive steps' tokens reaching the host in ``generate.decode_overlapped``
    (each step launched before the previous step's tokens are read, its ids handed over on the
    device), batch requests at ``context`` tokens."""
    bs = runner.config.block_size
    blocks = [runner.blocks.allocate(-(-(context + steps + warmup + 1) // bs)) for _ in range(batch)]
    gen = torch.Generator(device=runner.device).manual_seed(0)
    for cache in runner.kv_caches:
        cache.normal_(generator=gen)
    for ids in blocks:
        runner.blocks.mark_written(ids, context, bs)
    placeholder = [0]
    ids = torch.arange(batch, device=runner.device) * 7 % 1000
    times = []
    _sync(runner.device)
    last = time.perf_counter()
    for i, _ in enumerate(decode_overlapped(runner, lambda step: [SeqChunk(placeholder, context + step, blocks[r])
                                                                  for r in range(batch)], ids, warmup + steps)):
        now = time.perf_counter()
        if i >= warmup:
            times.append(now - last)
        last = now
    for ids_ in blocks:
        runner.blocks.free(ids_)
    return times


def replay_ms(runner: FullGraphRunner, key, iters: int = 50) -> float:
    """Device time of one graph replay (no host work): the step's GPU cost alone."""
    graphs = runner._graphs  # measurement only: replays whatever the buffers hold (the last step)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graphs.replay(key)
    start.record()
    for _ in range(iters):
        graphs.replay(key)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def isolated_replay_ms(runner: FullGraphRunner, key, iters: int = 30) -> tuple[float, float]:
    """Wall time of one replay launched on an idle GPU and synchronised, as a step sees it
    without the host work (``step_ms - this`` is the host's share, ``this - replay_ms`` the cost
    of launching a graph cold and waiting for it), and the host time of the launch call alone."""
    graphs, times, launch = runner._graphs, [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        time.sleep(2e-4)  # idle, as between two synchronised steps
        start = time.perf_counter()
        graphs.replay(key)
        launch.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, statistics.median(launch) * 1e3


def bench_decode(args) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    tp = _tensor_parallel(getattr(args, "tensor_parallel_size", 1))
    model = presets.build(args.preset, dtype=dtype, device=device, seed=0)
    if tp is not None:  # every rank builds the same weights, keeps its shard; rank 0 reports
        model = parallel.shard_model(model, tp)
    bandwidth = copy_bandwidth(device)
    w_bytes = weight_bytes_read(model)
    rows = []
    for context in args.context:
        for batch in args.batch:
            for mode in args.modes:
                if mode == "full" and device.type != "cuda":
                    continue
                for row in _decode_rows(args, model, device, w_bytes, bandwidth, context, batch, mode):
                    rows.append(row)
                    print(f"  {args.preset} context {context} batch {batch} {mode} {row['loop']}: "
                          f"{row['step_ms']:.3f} ms", flush=True)
            if getattr(args, "peers", False) and device.type == "cuda":
                rows += _peer_rows(args, model, w_bytes, bandwidth, context, batch, rows[-1])
    _table(rows, DECODE_COLUMNS)
    eager = {(r["context"], r["batch"]): r["step_ms"] for r in rows if r["mode"] == "none" and r["loop"] == "sync"}
    for r in rows:
        if r["mode"] == "full" and r["loop"] == "sync":
            speedup = f"{eager[r['context'], r['batch']] / r['step_ms']:.2f}x faster than eager, " \
                if (r["context"], r["batch"]) in eager else ""
            print(f"context {r['context']} batch {r['batch']}: full is {speedup}"
                  f"{r['step_ms'] / r['floor_ms']:.2f}x the bandwidth floor")
    return rows


def _tensor_parallel(size: int):
    """The group of ``size`` torchrun processes (None for one); ranks other than 0 print nothing."""
    if size == 1:
        return None
    tp = parallel.init_tensor_parallel()
    if tp.world_size != size:
        raise ValueError(f"--tensor-parallel-size {size}, but torchrun started {tp.world_size} processes")
    if tp.rank:
        sys.stdout = open(os.devnull, "w")
    return tp


def _decode_rows(args, model, device, w_bytes, bandwidth, context, batch, mode) -> list[dict]:
    """One runner; a row per decode loop in ``args.loop`` (the device-time columns are shared)."""
    max_len = -(-(context + args.steps + args.warmup + 1) // 256) * 256
    runner = FullGraphRunner(model, max_num_seqs=max(batch, 1), max_num_tokens=max(batch, 16),
                             max_model_len=max_len, cudagraph=mode, attention=args.attention,
                             capture_sizes=(batch,), compile=args.compile)
    runner.warmup()
    kv_read, kv_dense = kv_bytes(model, runner.kv_caches, batch, context)
    floor = (w_bytes + kv_read) / bandwidth * 1e3 if bandwidth == bandwidth else float("nan")
    loops = {"sync": time_decode, "overlap": time_decode_overlapped}
    timed = {loop: loops[loop](runner, batch, context, args.steps, args.warmup) for loop in args.loop}
    full = mode == "full"
    replay = replay_ms(runner, (batch, True)) if full else float("nan")
    replay1, launch = isolated_replay_ms(runner, (batch, True)) if full else (float("nan"),) * 2
    stats = runner.stats()
    rows = [{"preset": args.preset, "batch": batch, "context": context, "mode": mode,
             "tensor_parallel": getattr(args, "tensor_parallel_size", 1), "attention": runner.config.attention, "compile": args.compile, "loop": loop, "dtype": args.dtype,
             "step_ms": statistics.median(t) * 1e3, "p10_ms": np.percentile(t, 10) * 1e3,
             "p90_ms": np.percentile(t, 90) * 1e3, "floor_ms": floor, "weight_bytes": w_bytes,
             "kv_bytes": kv_read, "kv_MB": kv_read / 1e6, "kv_dense_MB": kv_dense / 1e6, "copy_TBps": bandwidth / 1e12, "compile_s": stats["compile_seconds"],
             "capture_s": stats["capture_seconds"], "replay_ms": replay, "replay1_ms": replay1,
             "launch_ms": launch, "linear_form": stats["forms"].get((batch, True), "-"),
             "form_ms": list(stats["form_ms"].get((batch, True), ()))} for loop, t in timed.items()]
    del runner
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def kv_bytes(model, kv_caches, batch: int, context: int) -> tuple[int, int]:
    """(bytes of keys and values one decode step reads, what dense attention would read): a
    sliding-window layer reads only its window."""
    read = dense = 0
    for layer, cache in zip(model.attention_layers(), kv_caches):
        per_token = 2 * cache.shape[3] * cache.shape[4] * cache.element_size()
        dense += batch * context * per_token
        read += batch * min(context, layer.sliding_window or context) * per_token
    return read, dense


DECODE_COLUMNS = ["preset", "batch", "context", "mode", "tensor_parallel", "attention", "loop", "step_ms", "replay1_ms",
                  "replay_ms", "launch_ms", "p90_ms", "floor_ms", "kv_MB", "kv_dense_MB", "compile_s", "linear_form"]


def _peer_rows(args, model, w_bytes, bandwidth, context, batch, like: dict) -> list[dict]:
    """The naive whole-model graph, reduce-overhead and transformers static-cache peers at this
    shape (``bench.peers``); a peer that cannot serve this model prints why and makes no row."""
    from .peers import PEERS, NoPeer, time_peer

    rows = []
    for kind in PEERS:
        try:
            t = time_peer(model, kind, batch, context, steps=args.steps, warmup=args.warmup)
        except NoPeer as err:  # no such peer for this model (or transformers is missing)
            print(f"  peer {kind} skipped: {err}", flush=True)
            continue
        except Exception as err:  # noqa: BLE001 (a peer that cannot run is a line saying why, not a crash)
            print(f"  peer {kind} failed: {type(err).__name__}: {err}", flush=True)
            continue
        size = next(model.parameters()).element_size()
        dense = batch * context * sum(2 * l.num_kv_heads * l.head_dim * size for l in model.attention_layers())
        rows.append({**{k: like[k] for k in ("preset", "batch", "context", "dtype", "weight_bytes", "copy_TBps",
                                             "tensor_parallel")},
                     "mode": kind, "attention": "hf-sdpa" if kind == "hf-static-compile" else "naive",
                     "compile": kind != "naive-graph", "loop": "sync",
                     "step_ms": t["step_ms"], "replay_ms": t["replay_ms"], "replay1_ms": float("nan"),
                     "launch_ms": float("nan"), "p10_ms": float("nan"), "p90_ms": float("nan"),
                     "floor_ms": (w_bytes + dense) / bandwidth * 1e3, "kv_bytes": dense, "kv_MB": dense / 1e6,
                     "kv_dense_MB": dense / 1e6, "compile_s": float("nan"), "capture_s": float("nan"),
                     "linear_form": "-"})
        print(f"  {args.preset} context {context} batch {batch} {kind}: {t['step_ms']:.3f} ms", flush=True)
    return rows


def bench_capture(args) -> list[dict]:
    if not torch.cuda.is_available():
        raise ValueError("bench capture measures CUDA-graph capture and needs a CUDA device (this machine has none)")
    device = torch.device("cuda")
    model = presets.build(args.preset, dtype=torch.bfloat16, device=device, seed=0)
    runner = FullGraphRunner(model, RunnerConfig(cudagraph="full", attention=args.attention, compile=args.compile))
    report = runner.capture()
    row = {"preset": args.preset, "attention": runner.config.attention, "graphs": report.num_graphs,
           "seconds": report.seconds, "ahead_s": report.compile_seconds, "warmup_s": report.warmup_seconds, "record_s": report.record_seconds,
           "instantiate_s": report.instantiate_seconds, "graph_MiB": report.graph_bytes / 2**20,
           "max_num_tokens": runner.config.max_num_tokens, "max_num_seqs": runner.config.max_num_seqs}
    _table([row], list(row))
    return [row]


def bench_compile(args) -> list[dict]:
    """Compile time of a ``compile=True`` runner's warm-up (decode and mixed graphs), split into
    Dynamo's total and the backend (Inductor) part; run it in two fresh processes to see what
    Inductor's on-disk caches save on the second start."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = presets.build(args.preset, dtype=torch.bfloat16 if cuda else torch.float32, device=device, seed=0)
    runner = FullGraphRunner(model, max_num_seqs=1, max_num_tokens=16, max_model_len=2304,
                             cudagraph="full" if cuda else "padded", capture_sizes=(1,), compile=True)
    start = time.perf_counter()
    runner.warmup()
    total = time.perf_counter() - start
    stats = runner.stats()
    phases = torch._dynamo.utils.compile_times(repr="csv")  # (names, values), one value list per phase
    seconds = {name: sum(float(v) for v in str(val).split(",") if v.strip())
               for name, val in zip(*phases)} if isinstance(phases, tuple) else {}
    row = {"preset": args.preset, "graphs": stats["compiled_graphs"], "compile_s": stats["compile_seconds"],
           "warmup_s": total, "dynamo_s": seconds.get("_compile.compile_inner", float("nan")),
           "backend_s": seconds.get("OutputGraph.call_user_compiler", float("nan"))}
    _table([row], list(row))
    return [row]


def _median_us(fn, iters: int, warmup: int = 20) -> tuple[float, float]:
    """Median and p90 wall time of ``fn()`` in microseconds."""
    for _ in range(warmup):
        fn()
    t = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        t.append(time.perf_counter() - start)
    return statistics.median(t) * 1e6, float(np.percentile(t, 90)) * 1e6


def bench_plan(args) -> list[dict]:
    cfg = RunnerConfig(max_num_seqs=256, max_num_tokens=2048, max_model_len=4096, num_blocks=256 * 256 + 1)
    policy = padding.get_policy("sdpa")
    rows = []
    for n in (1, 32, 256):
        chunks = [SeqChunk([i % 100], 1000 + i, list(range(1 + 256 * i, 1 + 256 * i + 80))) for i in range(n)]
        median, p90 = _median_us(lambda: plan_step(chunks, cfg, policy, vocab_size=1000), 200)
        rows.append({"decode_chunks": n, "plan_us_median": median, "plan_us_p90": p90})
    _table(rows, list(rows[0]))
    return rows


def bench_host(args) -> list[dict]:
    """Host time of a decode step: ``plan_step`` alone, ``copy_in`` alone, and ``runner.step``
    split at the launch. On CUDA the graph replays for real (``step_us`` is host time: nothing
    waits for the device); on CPU the padded forward is replaced by a no-op, as cheap as a launch.
    """
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = presets.build(args.preset, dtype=torch.bfloat16 if cuda else torch.float32, device=device, seed=0)
    max_batch, bs = max(args.batch), 16
    runner = FullGraphRunner(model, max_num_seqs=max_batch, max_num_tokens=max(max_batch, 16),
                             max_model_len=-(-(args.blocks * bs + 1) // 256) * 256, block_size=bs,
                             cudagraph="full" if cuda else "padded", attention=args.attention,
                             capture_sizes=tuple(args.batch))
    runner.warmup()
    cfg, launched = runner.config, []
    # measurement only: note when the step reaches its launch
    if cuda:
        replay = runner._graphs.replay
        runner._graphs.replay = lambda key: (launched.append(time.perf_counter()), replay(key))
    else:
        runner._run_static = lambda key, num_reqs: launched.append(time.perf_counter())
    blocks = [runner.blocks.allocate(args.blocks) for _ in range(max_batch)]
    context = (args.blocks - 1) * bs  # the new token lands on the last page
    for ids in blocks:
        runner.blocks.mark_written(ids, context, bs)
    rows = []
    for batch in args.batch:
        chunks = [SeqChunk([(7 * r) % 500], context, blocks[r]) for r in range(batch)]

        def plan():
            return plan_step(chunks, cfg, runner.policy, num_blocks=cfg.num_blocks, vocab_size=runner.vocab_size)

        plan_us, plan_p90 = _median_us(plan, args.iters)
        planned = plan()
        copy_us, _ = _median_us(lambda: runner.buffers.copy_in(planned), args.iters)
        pre, step = [], []
        for i in range(args.iters + 20):
            _sync(device)
            start = time.perf_counter()
            runner.step(chunks)
            end = time.perf_counter()
            if i >= 20:
                pre.append(launched[-1] - start)
                step.append(end - start)
        rows.append({"batch": batch, "blocks": args.blocks, "mode": cfg.cudagraph, "plan_us": plan_us,
                     "plan_p90_us": plan_p90, "copy_in_us": copy_us, "pre_launch_us": statistics.median(pre) * 1e6,
                     "pre_launch_p90_us": float(np.percentile(pre, 90)) * 1e6, "step_us": statistics.median(step) * 1e6,
                     **step_stages(runner, chunks, args.iters)})
    _table(rows, list(rows[0]))
    return rows


def _table(rows: list[dict], cols: list[str]) -> None:
    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)
    widths = [max(len(c), *(len(fmt(r[c])) for r in rows)) for c in cols]
    print(" | ".join(c.rjust(w) for c, w in zip(cols, widths)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(fmt(r[c]).rjust(w) for c, w in zip(cols, widths)))
