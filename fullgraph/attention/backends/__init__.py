"""Attention backends. Importing this package registers every backend and its padding policy."""
from __future__ import annotations

import logging

from .base import AttentionBackend, BackendLimits, available_backends, get_backend_class, register_backend
from . import blocksparse, flash, sdpa, triton  # noqa: F401  (registers the backends)

logger = logging.getLogger("fullgraph")

# Fastest first, by the measurements in BENCHMARKS.md; "auto" takes the first that can serve.
DENSE_PREFERENCE = ("triton", "flash", "sdpa")
KIND_DEFAULTS = {"blocksparse": "blocksparse"}


def _pick_dense(name: str, layers, limits: BackendLimits) -> str:
    if name != "auto":
        reason = get_backend_class(name).unsupported_reason(limits.device, limits.dtype, layers)
        if reason:
            raise ValueError(f"attention backend {name!r} cannot serve this model here: {reason}")
        return name
    if limits.device.type != "cuda":
        return "sdpa"  # the kernels only run interpreted off CUDA: correct, but not fast
    reasons = {}
    for candidate in DENSE_PREFERENCE:
        if candidate not in available_backends() or not get_backend_class(candidate).supports_context():
            continue
        reasons[candidate] = get_backend_class(candidate).unsupported_reason(limits.device, limits.dtype, layers)
        if reasons[candidate] is None:
            logger.info("fullgraph: attention='auto' picked %r (%s, %s)", candidate, limits.device, limits.dtype)
            return candidate
    raise ValueError(f"no dense attention backend can serve this model: {reasons}")


def resolve_backends(dense: str, layers, limits: BackendLimits) -> tuple[dict[str, AttentionBackend], str]:
    """One backend instance per layer kind; returns (kind -> backend, resolved dense name)."""
    by_kind: dict[str, list] = {}
    for layer in layers:
        by_kind.setdefault(layer.kind, []).append(layer)
    dense_name = _pick_dense(dense, by_kind.get("dense", layers), limits)
    out: dict[str, AttentionBackend] = {}
    for kind, kind_layers in by_kind.items():
        name = dense_name if kind == "dense" else KIND_DEFAULTS.get(kind, kind)
        cls = get_backend_class(name)
        if kind not in cls.kinds:
            raise ValueError(f"attention backend {name!r} serves {sorted(cls.kinds)} layers, not {kind!r}")
        reason = cls.unsupported_reason(limits.device, limits.dtype, kind_layers)
        if reason:
            raise ValueError(f"attention backend {name!r} cannot serve the {kind} layers here: {reason}")
        out[kind] = cls(limits, kind_layers)
    return out, dense_name


__all__ = ["AttentionBackend", "BackendLimits", "available_backends", "get_backend_class",
           "register_backend", "resolve_backends"]
