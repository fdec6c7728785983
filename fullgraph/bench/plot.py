"""``python -m fullgraph.bench plot``: step time against batch for every mode and peer of one or
more ``bench decode --out`` files (matplotlib, an optional extra), one line each, floor dashed."""
from __future__ import annotations

import json
from collections import defaultdict

from .peers import PEERS


def bench_plot(args) -> list[dict]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("bench plot needs matplotlib (pip install 'fullgraph[plot]')") from None
    rows = [r for path in args.inputs for r in json.load(open(path))["rows"]]
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
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return []
