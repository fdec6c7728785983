"""The registry of attention backends by name: the one place that knows which exist.

``fullgraph.attention.interface.register_backend`` adds to it; ``fullgraph.padding`` reads each
backend's padding policy from it (a policy is a backend attribute, so there is no second
registry). Plain Python, no project imports, so both can use it without an import cycle.
"""
from __future__ import annotations

from typing import Any

_BACKENDS: dict[str, Any] = {}


def add(name: str, backend: Any, *, replace: bool = False) -> None:
    """Register ``backend`` (a class) under ``name``; a taken name needs ``replace=True``."""
    if name in _BACKENDS and _BACKENDS[name] is not backend and not replace:
        raise ValueError(f"an attention backend named {name!r} is already registered "
                         f"({_BACKENDS[name].__module__}.{_BACKENDS[name].__qualname__}); "
                         "pass replace=True to override it, or pick another name")
    _BACKENDS[name] = backend


def remove(name: str) -> None:
    """Unregister a backend (tests register planted backends and remove them afterwards)."""
    _BACKENDS.pop(name, None)


def get(name: str) -> Any:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"no attention backend named {name!r}; registered: {names()}") from None


def names() -> list[str]:
    return sorted(_BACKENDS)
