"""Attention backends. Importing this package registers every built-in backend."""
from __future__ import annotations

import logging

from ..interface import (AttentionBackend, BackendLimits, available_backends, get_backend_class, register_backend,
                         unregister_backend)
from . import blocksparse, flash, sdpa, triton  # noqa: F401  (registers the backends)

logger = logging.getLogger("fullgraph")

# Fastest first, by the measurements in BENCHMARKS.md; "auto" takes the first that can serve.
DENSE_PREFERENCE = ("triton", "flash", "sdpa")
KIND_DEFAULTS = {"blocksparse": "blocksparse"}



def backend_class(choice: str | type[AttentionBackend]) -> type[AttentionBackend]:
    """A registered backend's class by name, or a backend class itself (registered or not)."""
    if isinstance(choice, type):
        if not issubclass(choice, AttentionBackend):
            raise ValueError(f"attention={choice.__qualname__}: not a subclass of AttentionBackend")
        return choice
    return get_backend_class(choice)


def _pick_dense(choice: str | type[AttentionBackend], layers, limits: BackendLimits) -> type[AttentionBackend]:
    if choice != "auto":
        cls = backend_class(choice)
        reason = cls.unsupported_reason(limits.device, limits.dtype, layers)
        if reason:
            raise ValueError(f"attention backend {cls.name!r} cannot serve this model here: {reason}")
        return cls
    if limits.device.type != "cuda":
        return get_backend_class("sdpa")  # the kernels only run interpreted off CUDA: correct, but not fast
    reasons = {}
    for candidate in DENSE_PREFERENCE:
        if candidate not in available_backends() or not get_backend_class(candidate).supports_context():
            continue
        cls = get_backend_class(candidate)
        reasons[candidate] = cls.unsupported_reason(limits.device, limits.dtype, layers)
        if reasons[candidate] is None:
            logger.info("fullgraph: attention='auto' picked %r (%s, %s)", candidate, limits.device, limits.dtype)
            return cls
    raise ValueError(f"no dense attention backend can serve this model: {reasons}")


def resolve_backends(choice, layers, limits: BackendLimits) -> tuple[dict[str, AttentionBackend], type[AttentionBackend]]:
    """One backend instance per layer kind; returns (kind -> backend, the dense backend's class).

    ``choice``: the dense backend (a name, "auto", or a class), or a mapping layer kind -> backend
    (e.g. ``{"dense": "sdpa", "blocksparse": MyBlockSparse}``); kinds it leaves out take their
    defaults ("auto" for dense layers, the kind's own backend otherwise)."""
    by_kind: dict[str, list] = {}
    for layer in layers:
        by_kind.setdefault(layer.kind, []).append(layer)
    chosen = dict(choice) if isinstance(choice, dict) else {"dense": choice}
    unknown = set(chosen) - set(by_kind) - {"dense"}
    if unknown:
        raise ValueError(f"attention={choice!r} names layer kinds {sorted(unknown)} this model does not have "
                         f"(its kinds: {sorted(by_kind)})")
    dense_cls = _pick_dense(chosen.get("dense", "auto"), by_kind.get("dense", layers), limits)
    out: dict[str, AttentionBackend] = {}
    for kind, kind_layers in by_kind.items():
        cls = dense_cls if kind == "dense" else backend_class(chosen.get(kind, KIND_DEFAULTS.get(kind, kind)))
        if kind not in cls.kinds:
            raise ValueError(f"attention backend {cls.name!r} serves {sorted(cls.kinds)} layers, not {kind!r}")
        reason = cls.unsupported_reason(limits.device, limits.dtype, kind_layers)
        if reason:
            raise ValueError(f"attention backend {cls.name!r} cannot serve the {kind} layers here: {reason}")
        out[kind] = cls(limits, kind_layers)
    return out, dense_cls


__all__ = ["AttentionBackend", "BackendLimits", "available_backends", "backend_class", "get_backend_class",
           "register_backend", "resolve_backends", "unregister_backend"]
