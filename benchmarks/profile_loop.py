"""What a decode loop's device timeline holds besides the graph: the ops each step launches
outside its captured graph and the device's idle time, per step.

    PYTHONPATH=. python benchmarks/profile_loop.py --preset llama-1b --batch 1 32 --context 1024

An overlapped decode step (``bench decode --loop overlap``) is longer than the graph's replay
(H200, llama-1b batch 1: 0.884 against 0.839 ms). Per batch and loop this profiles ``--steps``
steps of the loop and as many replays of the graph alone (CUPTI, ``torch.profiler``) and prints,
per step: the loop's span, the device's busy and idle time (and which ops the idle time
preceded), and each op the loop runs that the replays do not (by kernel name: the upload, the
ids' clamp, the logits' copy, the greedy pick, the ids' copy back, ...). Loops: ``logits`` (the
runner returns logits, the loop picks the greedy tokens: ``bench decode``'s overlapped loop,
``generate.decode_overlapped``) and ``sampled`` (greedy sampling inside the graph, each step taking
the last step's ids on the device through ``prev_token_row``: the engine's decode step).
Prints tables and writes JSON; a script, not a test.
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import statistics
import time
from collections import Counter

import torch


def timeline(events: list[tuple[str, float, float]], steps: int, replay_counts: Counter | None = None) -> dict:
    """``events``: (name, start us, end us) of the device work of ``steps`` steps. Per step: the
    span (first start to last end), busy (the union of the intervals), idle, and the ops beyond
    ``replay_counts`` (name -> launches of one replay): name -> (launches, us) a step."""
    if not events:
        raise ValueError("no device events: nothing was profiled")
    events = sorted(events, key=lambda e: e[1])
    span = events[-1][2] - events[0][1]
    busy, cur_start, cur_end = 0.0, events[0][1], events[0][2]
    idle_before = Counter()   # name -> the device's idle time just before such an op started
    for name, start, end in events[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            idle_before[name] += start - cur_end
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    counts, times = Counter(), Counter()
    for name, start, end in events:
        counts[name] += 1
        times[name] += end - start
    extra = {}
    for name, n in counts.items():
        beyond = n - steps * (replay_counts or {}).get(name, 0)
        if beyond > 0:
            extra[name] = (beyond / steps, times[name] / n * beyond / steps)
    return {"span_us": span / steps, "busy_us": busy / steps, "idle_us": (span - busy) / steps,
            "outside": dict(sorted(extra.items(), key=lambda kv: -kv[1][1])),
            "idle_before": {name: us / steps for name, us in idle_before.most_common(8)}}


def _device_events(prof) -> list[tuple[str, float, float]]:
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def _loop(runner, batch: int, context: int, sampled: bool):
    """A function running one more step of the loop (blocks allocated and written up to ``context``)."""
    from fullgraph import SeqChunk, sampling
    try:
        from fullgraph.fetch import HostFetch
    except ImportError:   # a tree before it (loop-ab runs this script over older trees)
        from fullgraph.generate import TokenFetch

        class HostFetch(TokenFetch):
            def __init__(self, shapes, device):
                super().__init__(device, shapes["ids"][0][0])

            def start(self, outputs):
                return super().start(outputs["ids"])

    bs = runner.config.block_size
    blocks = [runner.blocks.allocate(-(-(context + 400) // bs)) for _ in range(batch)]
    for ids in blocks:
        runner.blocks.mark_written(ids, context, bs)
    fetch = HostFetch({"ids": ((batch,), torch.int64)}, runner.device)
    state = {"step": 0, "ids": torch.arange(batch, device=runner.device) * 7 % 1000, "pending": None}
    placeholder = [0]
    values = {"temperature": [0.0] * batch, "prev_token_row": list(range(batch))} if sampled else None
    pick = getattr(sampling, "greedy", lambda logits: logits.argmax(-1))   # as generate.decode_overlapped
    views = {"copy_outputs": False} if "copy_outputs" in inspect.signature(runner.step).parameters else {}

    def step():
        i = state["step"]
        chunks = [SeqChunk(placeholder, context + i, blocks[r]) for r in range(batch)]
        if sampled:   # step 0 reads ids from its chunks; later steps the last step's samples
            out = runner.step(chunks, values=values if i else {"temperature": values["temperature"]})
            ids = out.token_ids
        else:
            out = runner.step(chunks, token_ids=state["ids"], **views)   # the logits read right here, as there
            ids = state["ids"] = pick(out.logits)
        handle = fetch.start({"ids": ids})
        if state["pending"] is not None:
            fetch.wait(state["pending"])
        state["pending"], state["step"] = handle, i + 1
    return step


def profile_loop(model, args, batch: int, sampled: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from fullgraph import FullGraphRunner

    max_len = -(-(args.context + 512) // 256) * 256
    runner = FullGraphRunner(model, max_num_seqs=batch, max_num_tokens=max(batch, 16), max_model_len=max_len,
                             capture_sizes=(batch,), sampling=sampled)
    runner.warmup()
    step = _loop(runner, batch, args.context, sampled)
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    timed = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        timed.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    step_ms = statistics.median(timed) * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    loop_events = _device_events(prof)
    key = (batch, True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            runner._graphs.replay(key)   # measurement only: the graph alone
        torch.cuda.synchronize()
    replay_events = _device_events(prof)
    replay_counts = Counter(name for name, _, _ in replay_events)
    replay_counts = Counter({name: n // args.steps for name, n in replay_counts.items()})
    loop = timeline(loop_events, args.steps, replay_counts)
    replay = timeline(replay_events, args.steps)
    del runner, step
    gc.collect()
    torch.cuda.empty_cache()
    return {"preset": args.preset, "batch": batch, "context": args.context, "loop": "sampled" if sampled else "logits",
            "step_ms": step_ms, "wall_ms": (time.perf_counter() - start) * 1e3, "loop_span_us": loop["span_us"],
            "loop_busy_us": loop["busy_us"], "loop_idle_us": loop["idle_us"], "replay_span_us": replay["span_us"],
            "replay_busy_us": replay["busy_us"], "replay_idle_us": replay["idle_us"],
            "outside": {name: {"launches": n, "us": us} for name, (n, us) in loop["outside"].items()},
            "loop_idle_before": loop["idle_before"], "replay_idle_before": replay["idle_before"]}


def print_row(r: dict) -> None:
    print(f"\n{r['preset']} batch {r['batch']} context {r['context']}, loop {r['loop']}: step {r['step_ms']:.3f} ms "
          f"(timed, no profiler); per step under the profiler: loop span {r['loop_span_us']:.1f} us "
          f"(busy {r['loop_busy_us']:.1f}, idle {r['loop_idle_us']:.1f}); replay alone span "
          f"{r['replay_span_us']:.1f} (busy {r['replay_busy_us']:.1f}, idle {r['replay_idle_us']:.1f})")
    print(f"{'us a step':>9s} {'x':>5s}  outside the graph")
    for name, v in r["outside"].items():
        print(f"{v['us']:9.2f} {v['launches']:5.2f}  {name[:110]}")
    for which in ("loop", "replay"):
        print(f"{'us a step':>9s}  the {which}'s idle time, by the op it preceded")
        for name, us in r[f"{which}_idle_before"].items():
            print(f"{us:9.2f}  {name[:110]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50, help="steps profiled (and replays)")
    p.add_argument("--loops", nargs="+", choices=("logits", "sampled"), default=["logits", "sampled"])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_loop.py profiles the device timeline: it needs a CUDA GPU")
    from fullgraph.models import presets

    model = presets.build(args.preset, dtype=torch.bfloat16, device=torch.device("cuda"), seed=0)
    rows = []
    for batch in args.batch:
        for loop in args.loops:
            rows.append(profile_loop(model, args, batch, loop == "sampled"))
            print_row(rows[-1])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
