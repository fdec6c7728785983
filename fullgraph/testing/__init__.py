"""The regression suite as a conformance tool for anyone's attention backend or model.

    from fullgraph import testing
    report = testing.conformance(backend=MyBackend)      # a class (registered or not) or a registered name
    print(report.table()); assert report.ok

Every scenario of ``SCENARIOS.md`` that applies (``fullgraph.testing.scenarios``) runs in each mode
("padded": the padded static buffers, eagerly; "full": captured CUDA graphs; "compile":
``torch.compile`` over the padded step, with graphs on CUDA) against the unpadded eager run of the
*same* backend, so a backend is judged against itself. A failing row's detail says what broke:
the request, the field and index, the layer. ``python -m fullgraph conformance`` is the CLI.
"""
from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..attention import Attention
from ..attention.backends import backend_class
from .harness import Case, ScenarioFailure
from .scenarios import SCENARIOS

MODES = ("padded", "full", "compile")


@dataclass(frozen=True)
class Row:
    scenario: int
    title: str
    mode: str
    ok: bool | None           # None: skipped (``detail`` says why)
    detail: str
    seconds: float


@dataclass(frozen=True)
class ConformanceReport:
    backend: str
    model: str
    device: str
    dtype: str
    rows: tuple[Row, ...]

    @property
    def ok(self) -> bool:
        """Every scenario that ran passed (and at least one ran)."""
        ran = [r for r in self.rows if r.ok is not None]
        return bool(ran) and all(r.ok for r in ran)

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if r.ok is False]

    def table(self) -> str:
        lines = [f"conformance: backend {self.backend}, model {self.model}, {self.device} {self.dtype}",
                 f"{'#':>3} {'mode':<8} {'result':<6} {'s':>6}  scenario / detail"]
        for r in self.rows:
            result = "skip" if r.ok is None else ("ok" if r.ok else "FAIL")
            lines.append(f"{r.scenario:>3} {r.mode:<8} {result:<6} {r.seconds:>6.2f}  {r.title}")
            if r.ok is not True and r.detail:
                lines.append(f"{'':>27}-> {r.detail}")
        ran = [r for r in self.rows if r.ok is not None]
        lines.append(f"{sum(bool(r.ok) for r in ran)}/{len(ran)} passed, {len(self.rows) - len(ran)} skipped: "
                     + ("CONFORMS" if self.ok else "DOES NOT CONFORM"))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def default_model(kinds: frozenset[str], device: torch.device, dtype: torch.dtype) -> nn.Module:
    """toy-llama for dense backends; toy Phi-3-Small (block-sparse and dense layers) for a
    backend that serves block-sparse layers only."""
    from ..models import Llama, LlamaConfig, Phi3Small, Phi3SmallConfig

    if "dense" not in kinds and "blocksparse" in kinds:
        return Phi3Small(Phi3SmallConfig.toy(), dtype=dtype, device=device, seed=0)
    return Llama(LlamaConfig.toy(), dtype=dtype, device=device, seed=0)


def available_modes(device: torch.device) -> tuple[str, ...]:
    return MODES if device.type == "cuda" else ("padded", "compile")


def conformance(backend="sdpa", model: nn.Module | Callable[..., nn.Module] | None = None, device: str = "cpu",
                modes: Sequence[str] | None = None, scenarios: Sequence[int] | None = None, seed: int = 0,
                dtype: torch.dtype | None = None) -> ConformanceReport:
    """Run the conformance scenarios for ``backend`` (a class, a registered name, or a mapping
    layer kind -> backend) on ``model`` (a module, a factory ``f(device=, dtype=)``, or None:
    toy-llama, or toy Phi-3-Small for a block-sparse backend) in each of ``modes`` (None: every
    mode ``device`` has). ``dtype`` None: float32, or bfloat16 for a backend that refuses float32."""
    device = torch.device(device)
    attention, cls = _attention(backend)
    dtype = dtype or _default_dtype(cls, device)
    if model is None:
        model = default_model(cls.kinds, device, dtype)
    elif not isinstance(model, nn.Module):
        model = model(device=device, dtype=dtype)
    modes = tuple(modes) if modes is not None else available_modes(device)
    bad = [m for m in modes if m not in MODES]
    if bad or (device.type != "cuda" and "full" in modes):
        raise ValueError(f"modes {list(modes)}: each must be one of {MODES} ('full' needs a CUDA device)")
    wanted = sorted(SCENARIOS) if scenarios is None else sorted(scenarios)
    unknown = [s for s in wanted if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"scenarios {unknown} do not exist; there are {sorted(SCENARIOS)}")
    rows = []
    for mode in modes:
        case = Case(attention, model, mode, seed)
        rows += [_run(case, SCENARIOS[i]) for i in wanted]
    return ConformanceReport(getattr(cls, "name", str(backend)), type(model).__name__, str(device),
                             str(dtype).removeprefix("torch."), tuple(rows))


def _attention(backend):
    """(the runner's ``attention=`` value, the class under test)."""
    if isinstance(backend, dict):
        cls = [backend_class(v) for k, v in backend.items() if k != "dense"] or [backend_class(backend["dense"])]
        return backend, cls[0]
    cls = backend_class(backend)
    if "dense" not in cls.kinds:
        return {kind: cls for kind in cls.kinds}, cls
    return backend, cls


def _default_dtype(cls, device: torch.device) -> torch.dtype:
    probe = [Attention(4, 2, 16, 0.25)]  # toy-llama's shape
    if cls.unsupported_reason(device, torch.float32, probe) is None:
        return torch.float32
    return torch.bfloat16


def make_case(backend="sdpa", mode: str = "padded", model: nn.Module | None = None, device: str = "cpu",
              seed: int = 0, dtype: torch.dtype | None = None) -> Case:
    """One (backend, model, mode) to run scenarios on with :func:`run_scenario`: its runners are
    built once per configuration and reused (reset) by every scenario."""
    device = torch.device(device)
    attention, cls = _attention(backend)
    dtype = dtype or _default_dtype(cls, device)
    model = default_model(cls.kinds, device, dtype) if model is None else model
    return Case(attention, model, mode, seed)


def run_scenario(case: Case, scenario: int) -> Row:
    """Run one scenario on ``case``: a ``Row`` (``ok`` None when it does not apply)."""
    return _run(case, SCENARIOS[scenario])


def _run(case: Case, scenario) -> Row:
    reason = scenario.applies(case)
    if reason:
        return Row(scenario.id, scenario.title, case.mode, None, reason, 0.0)
    start = time.perf_counter()
    try:
        scenario.run(case)
        ok, detail = True, ""
    except ScenarioFailure as err:
        ok, detail = False, str(err)
    except Exception as err:  # noqa: BLE001 (a crash is a failure of the scenario, reported with where)
        frame = traceback.extract_tb(err.__traceback__)[-1]
        ok, detail = False, f"{type(err).__name__}: {err} (at {frame.filename}:{frame.lineno})"
    return Row(scenario.id, scenario.title, case.mode, ok, detail, time.perf_counter() - start)


__all__ = ["Case", "ConformanceReport", "MODES", "Row", "SCENARIOS", "conformance", "make_case", "run_scenario"]
