"""The attention backend interface and its registry.

A backend declares, as data, its name, the layer kinds it serves and a :class:`PaddingPolicy`
(the metadata fields it reads, the tail value of each, the step kinds it may run inside a graph).
``register_backend`` puts the policy in the padding registry; the runner does the rest.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ... import padding
from ..metadata import AttentionMetadata

if TYPE_CHECKING:
    from ...plan import StepPlan
    from ..layer import Attention, Rotary


@dataclass(frozen=True)
class BackendLimits:
    """Static sizes a backend may allocate persistent workspaces from (never per step)."""

    max_num_seqs: int
    max_num_tokens: int
    max_model_len: int
    block_size: int
    num_blocks: int
    device: torch.device
    dtype: torch.dtype


class AttentionBackend:
    """Base class. Subclasses set ``name``, ``policy`` and ``kinds`` and implement ``forward``.

    ``forward`` must be capture-safe: no ``.item()``/``.cpu()``/``.tolist()``, no host branching
    on tensor values, no allocation whose size depends on tensor values. It may branch on
    ``metadata.decode_only`` and on tensor *shapes*, which are fixed per graph key.

    ``fuses_rope``: the backend applies RoPE inside its KV write. ``Attention`` then calls
    ``forward`` with ``rope`` and ``positions`` and unrotated q (maybe grouped, (T, KVH, G, D)) and
    k; ``forward`` must rotate q, and store rotated keys, exactly as ``rope`` would have. Without
    it (the default) ``forward`` always gets rotated (T, H, D) q and k, and no ``rope``.
    """

    name: ClassVar[str]
    policy: ClassVar[padding.PaddingPolicy]
    kinds: ClassVar[frozenset[str]] = frozenset({"dense"})
    fuses_rope: bool = False

    def __init__(self, limits: BackendLimits, layers: list[Attention]) -> None:
        self.limits = limits

    @classmethod
    def unsupported_reason(cls, device: torch.device, dtype: torch.dtype, layers: list[Attention]) -> str | None:
        """Why this backend cannot serve these layers here (None when it can)."""
        return None

    @classmethod
    def supports_context(cls) -> bool:
        """Whether every step kind can run (False: only prompts without cached context)."""
        return True

    def step_unsupported_reason(self, plan: StepPlan) -> str | None:
        """Why this backend cannot run a planned step (e.g. one with cached context); None if it can.

        Called on the host before anything is written, so a refusal leaves all state untouched."""
        return None

    def forward(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata, *, rope: Rotary | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Class decorator: registers the backend and its padding policy under ``cls.name``."""
    if cls.policy.name != cls.name:
        raise ValueError(f"backend {cls.name!r} declares a policy named {cls.policy.name!r}")
    padding.register_policy(cls.policy)
    _BACKENDS[cls.name] = cls
    return cls


def get_backend_class(name: str) -> type[AttentionBackend]:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"no attention backend named {name!r}; available: {available_backends()}") from None


def available_backends() -> list[str]:
    return sorted(_BACKENDS)
