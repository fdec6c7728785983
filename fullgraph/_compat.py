"""The private PyTorch APIs fullgraph uses, in one place, each with why and a fallback.

Everything here is a leading-underscore API of torch that may change between releases; when one
moves, this is the file to fix. Public APIs are used directly elsewhere.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch


def custom_op(name: str, *, mutates_args: tuple[str, ...] | str = ()) -> Callable[[Callable], Callable]:
    """``torch.library.custom_op(name, mutates_args=...)`` for our kernels and reference paths, with
    plain eager calls going straight to the function.

    Under ``torch.compile`` (or any dispatch mode: fake tensors, tracing) a call is the registered
    op, so the compiler sees one opaque launch; everywhere else (eager, padded, CUDA-graph
    capture) it calls the function itself. The op's own eager path costs ~6 us of host time a call
    (its dispatcher round trip) and, at the first call of a process, imports ``torch._dynamo``
    (1.3 s with compiled bytecode, ~4 s without: a cold capture paid it). The decorated function
    keeps ``register_fake`` and has the registered op as ``.op``.
    """
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    def wrap(fn: Callable) -> Callable:
        registered = torch.library.custom_op(name, mutates_args=mutates_args)(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
                return registered(*args, **kwargs)
            return fn(*args, **kwargs)

        call.op, call.register_fake = registered, registered.register_fake
        return call

    return wrap


def inference_mode() -> contextlib.AbstractContextManager:
    """``torch.inference_mode()``'s core: the decorator form builds a context manager per call
    (~2 us a step), this is the guard it enters."""
    return torch._C._InferenceMode(True)


class CurrentStream:
    """``CurrentStream(device)()``: ``torch.cuda.current_stream(device)``, rebuilt only when the
    current stream changes: building a ``torch.cuda.Stream`` costs ~4 us of host time a call, and
    the id it is looked up by (``torch._C._cuda_getCurrentStream``) almost nothing."""

    def __init__(self, device: torch.device) -> None:
        self._index = torch.cuda.current_device() if device.index is None else device.index
        self._key, self._stream = None, None

    def __call__(self) -> torch.cuda.Stream:
        key = torch._C._cuda_getCurrentStream(self._index)
        if key != self._key:
            self._key, self._stream = key, torch.cuda.current_stream(self._index)
        return self._stream


@functools.lru_cache(maxsize=1)
def torch_has_paged_flash() -> bool:
    """Whether ``aten._flash_attention_forward`` takes a ``block_table`` (paged FA, torch 2.13+)."""
    schema = torch.ops.aten._flash_attention_forward.default._schema
    return any(arg.name == "block_table" for arg in schema.arguments)


def flash_attention_forward(*args, **kwargs) -> torch.Tensor:
    """PyTorch's own FlashAttention-2 varlen forward; returns the attention output only."""
    return torch.ops.aten._flash_attention_forward(*args, **kwargs)[0]


def inductor_compile_fx() -> Callable:
    """Inductor's graph compiler, for a ``torch.compile`` backend that wraps it."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx


def error_on_recompile() -> contextlib.AbstractContextManager:
    """Within it, a Dynamo recompilation raises ``RecompileError`` instead of compiling."""
    return torch._dynamo.config.patch(error_on_recompile=True)


def dynamo_recompile_error() -> type[BaseException]:
    return torch._dynamo.exc.RecompileError


def last_guard_failure(code) -> str | None:
    """The reason Dynamo gave for the last guard failure of ``code`` (a code object), if it kept one."""
    failures = getattr(torch._dynamo.utils, "guard_failures", {})
    reasons = failures.get(code) or []
    return str(reasons[-1]) if reasons else None


def dynamo_compile_seconds() -> dict[str, float]:
    """Seconds Dynamo spent per phase so far in this process (``compile_inner`` = Dynamo total,
    ``call_user_compiler`` = the backend's part)."""
    phases = torch._dynamo.utils.compile_times(repr="csv")  # (names, values), one value list per phase
    if not isinstance(phases, tuple):
        return {}
    return {name: sum(float(v) for v in str(val).split(",") if v.strip()) for name, val in zip(*phases)}
