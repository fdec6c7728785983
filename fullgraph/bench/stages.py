"""A step's host work stage by stage: ``runner._step``'s stages, each wrapped in a timer."""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from .. import runner as runner_module


def step_stages(runner, chunks: Sequence, iters: int, warmup: int = 20) -> dict[str, float]:
    """Median host microseconds per stage of ``runner.step(chunks)``, in a pass of its own with
    each stage wrapped in a timer (about 0.3 us each): ``plan`` (``plan_with_cache``: the checks,
    the layout, the block ids), ``ledger`` (the page-ledger check), ``upload``, ``launch`` (the
    replay call, or the padded forward), ``outputs`` (the output copies), ``record`` (the
    ledger's record of the writes), and ``other``, the rest of the step. Keys ``phase_<stage>_us``.
    The runner is left as it was found (a caller's own stand-in for a stage included)."""
    launch = (runner._graphs, "replay") if runner._graphs is not None else (runner, "_run_static")
    stages = (("plan", runner_module, "plan_with_cache"), ("ledger", runner.blocks, "check"),
              ("upload", runner.buffers, "upload"), ("launch", *launch),
              ("outputs", runner.buffers, "output_copy"), ("record", runner.blocks, "record_writes"))
    spent: dict[str, float] = {}
    undo = []
    for name, owner, attr in stages:
        inner = getattr(owner, attr)
        undo.append((owner, attr, inner, owner is runner_module or attr in vars(owner)))

        def timed(*args, _inner=inner, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - start
        setattr(owner, attr, timed)
    samples: dict[str, list[float]] = {name: [] for name, _, _ in stages + (("other", None, None),)}
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    try:
        for i in range(warmup + iters):
            spent.clear()
            sync()
            start = time.perf_counter()
            runner.step(chunks)
            total = time.perf_counter() - start
            if i >= warmup:
                for name, _, _ in stages:
                    samples[name].append(spent.get(name, 0.0))
                samples["other"].append(total - sum(spent.values()))
    finally:
        for owner, attr, inner, own in reversed(undo):
            if own:
                setattr(owner, attr, inner)   # a module function, or the caller's stand-in on the instance
            else:
                delattr(owner, attr)          # the method of its class again
    return {f"phase_{name}_us": statistics.median(v) * 1e6 for name, v in samples.items()}
