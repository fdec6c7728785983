"""``python -m fullgraph.bench plot``: figures of ``bench decode --out`` or ``bench serve --out`` files
(matplotlib, an optional extra).

- decode files: step time against batch for every mode and peer, one line each, floor dashed, a
  panel per preset;
- serve files (one per run: a preset at a rate): output tokens per second of every system of the
  run, and fullgraph's time to first token and time per output token (p50 bars, p99 ticks).
"""
from __future__ import annotations

import json
import math
from collections import defaultdict

from .peers import PEERS


def bench_plot(args) -> list[dict]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("bench plot needs matplotlib (pip install 'fullgraph[plot]')") from None
    files = [json.load(open(path)) for path in args.inputs]
    kinds = {f.get("command", "decode") for f in files}
    if len(kinds) > 1:
        raise ValueError(f"bench plot: the files mix {' and '.join(sorted(kinds))} results; plot each kind alone")
    fig = (_serve if kinds == {"serve"} else _decode)(plt, files, args)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return []


def _decode(plt, files: list[dict], args):
    rows = [r for f in files for r in f["rows"]]
    presets = sorted({r["preset"] for r in rows})
    fig, axes = plt.subplots(1, len(presets), figsize=(5.5 * len(presets), 4), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        lines, floor = defaultdict(dict), {}
        for r in rows:
            if r["preset"] != preset or r["context"] != args.context:
                continue
            lines[f"{r['mode']}{' compiled' if r.get('compile') and r['mode'] == 'full' else ''} ({r['loop']})"][
                r["batch"]] = r["step_ms"]
            if r["mode"] not in PEERS:
                floor[r["batch"]] = r["floor_ms"]
        for label, points in sorted(lines.items()):
            xs = sorted(points)
            ax.plot(xs, [points[x] for x in xs], marker="o", label=label)
        if floor:
            xs = sorted(floor)
            ax.plot(xs, [floor[x] for x in xs], "k--", label="bandwidth floor")
        ax.set(title=f"{preset}, context {args.context}", xlabel="batch (requests)", ylabel="ms per decode step",
               xscale="log", yscale="log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return fig


def _serve(plt, files: list[dict], args):
    runs = [(_run_label(f), f["rows"]) for f in files]
    systems = sorted({r["system"] for _, rows in runs for r in rows}, key=lambda s: (not s.startswith("fullgraph"), s))
    fig, (thr, lat) = plt.subplots(1, 2, figsize=(6 + 2.2 * len(runs), 4.5))
    width = 0.8 / len(systems)
    for k, system in enumerate(systems):
        values = [next((r["output_tok_s"] for r in rows if r["system"] == system), math.nan) for _, rows in runs]
        thr.bar([i + (k - (len(systems) - 1) / 2) * width for i in range(len(runs))], values, width, label=system)
    thr.set(title="output tokens per second", xticks=range(len(runs)), xticklabels=[label for label, _ in runs],
            yscale="log", ylabel="tokens / s")
    thr.legend(fontsize=7, loc="upper left")
    ours = [next((r for r in rows if r["system"].startswith("fullgraph")), None) for _, rows in runs]
    for k, (metric, name) in enumerate((("ttft", "time to first token"), ("tpot", "time per output token"))):
        xs = [i + (k - 0.5) * 0.4 for i in range(len(runs))]
        p50 = [r[f"{metric}_p50_ms"] if r else math.nan for r in ours]
        lat.bar(xs, p50, 0.4, label=f"{name}, p50 (p99 tick)")
        lat.scatter(xs, [r[f"{metric}_p99_ms"] if r else math.nan for r in ours], marker="_", s=400, color="k")
    lat.set(title="fullgraph latency", xticks=range(len(runs)), xticklabels=[label for label, _ in runs],
            yscale="log", ylabel="ms")
    lat.legend(fontsize=7, loc="upper left")
    for ax in (thr, lat):
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_ylim(top=ax.get_ylim()[1] * 10)   # a decade of headroom (log scale) for the legend above the bars
    return fig


def _run_label(f: dict) -> str:
    """A run's label from what ``bench serve`` records: preset, arrival rate, device."""
    rate = f.get("rate")
    return (f"{f.get('preset', '?')}\n{'all at once' if not rate else f'{rate:g} req/s'}\n"
            f"{f.get('device', '')}")
