"""The one place fullgraph calls ``torch.compile``: the model step, whole, dynamic in its sizes.

``torch.compile(fullgraph=True, dynamic=True)`` over the runner's step function (model forward +
logits): no graph breaks (attention and KV writes are plain PyTorch or registered custom ops with
fake implementations), one graph per step kind serving every bucket. Dynamo still specialises
size-1 dimensions, so a runner compiles a handful of graphs (decode with one request, decode,
mixed), all during warm-up. Inductor's own CUDA graphs stay off: the runner captures.

After warm-up a recompilation is a bug (some host value leaked into a guard): in strict mode it
raises, otherwise it is logged once with dynamo's guard-failure reason. Inductor's on-disk caches
(FX graph / autotune) make a second process start much faster than the first.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import _compat

logger = logging.getLogger("fullgraph")


class RecompileError(RuntimeError):
    """A compiled step recompiled after warm-up (strict mode)."""


@dataclass
class CompileStats:
    graphs: int = 0                 # graphs handed to Inductor
    seconds: float = 0.0            # wall time of the calls that compiled
    recompiles_after_warmup: int = 0
    reasons: list[str] = field(default_factory=list)


def _own_code(fn: Callable) -> Callable:
    """``fn`` with a private copy of its code object. Dynamo keeps one cache (and one recompile
    limit) per code object; without this, every runner in a process would share the cache of
    ``FullGraphRunner._model_forward`` and guard on each other's ``self``."""
    func = fn.__func__ if inspect.ismethod(fn) else fn
    clone = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__,
                               func.__defaults__, func.__closure__)
    return types.MethodType(clone, fn.__self__) if inspect.ismethod(fn) else clone


class CompiledStep:
    """``fn`` compiled once per step kind; counts compilations and guards against recompiles."""

    def __init__(self, fn: Callable, *, strict: bool) -> None:
        self.stats = CompileStats()
        self.strict = strict
        self._warm = False
        self._fn = _own_code(fn)
        self._compiled = torch.compile(self._fn, fullgraph=True, dynamic=True, backend=self._backend)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs):
        compile_fx = _compat.inductor_compile_fx()
        self.stats.graphs += 1
        if self._warm:
            self.stats.recompiles_after_warmup += 1
        return compile_fx(gm, example_inputs)

    def mark_warm(self) -> None:
        """Every graph this runner needs has been compiled; from now on a compile is a bug."""
        self._warm = True

    def __call__(self, *args):
        before = self.stats.graphs
        start = time.perf_counter()
        guard = _compat.error_on_recompile() if self._warm and self.strict else contextlib.nullcontext()
        try:
            with guard:
                out = self._compiled(*args)
        except _compat.dynamo_recompile_error() as err:
            raise RecompileError(f"fullgraph: the compiled step recompiled after warm-up: {err}") from err
        if self.stats.graphs != before:
            self.stats.seconds += time.perf_counter() - start
            if self._warm:
                reason = self._last_guard_failure()
                self.stats.reasons.append(reason)
                logger.warning("fullgraph: compiled step recompiled after warm-up: %s", reason)
        return out

    def _last_guard_failure(self) -> str:
        code = self._fn.__func__.__code__ if inspect.ismethod(self._fn) else self._fn.__code__
        return _compat.last_guard_failure(code) or "unknown (run with TORCH_LOGS=recompiles)"
