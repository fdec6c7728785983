"""The attention backend interface: everything a backend is written against, in one file.

- :class:`AttentionBackend`: the base class (name, layer kinds, padding policy, host hook
  ``prepare``, workspaces, ``forward``), and ``register_backend`` / ``get_backend_class``.
- :class:`AttentionMetadata`: the per-step device tensors every attention layer receives; its
  fields are the metadata fields of the runner's field table (``fullgraph.fields``).
- :class:`BackendLimits`: the static sizes a backend may allocate workspaces from.
- :class:`Rotary`: what the layer and the KV writer need of a rotary embedding.

The KV-cache write (with RoPE fused into it where the kernels run) is not a backend's job: the
``Attention`` layer does it once, through the backend's :class:`~fullgraph.attention.kv_writer.KVWriter`,
before calling ``forward``; ``forward`` then reads every key from the cache.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from .. import registry
from ..fields import CORE_FIELDS, StepPlan
from ..padding import PaddingPolicy
from .kv_writer import KVWriter

if TYPE_CHECKING:  # annotations only: the layer imports this module
    from .layer import Attention

__all__ = ["AttentionBackend", "AttentionMetadata", "BackendLimits", "Rotary", "available_backends",
           "get_backend_class", "register_backend", "unregister_backend"]


class Rotary(Protocol):
    """What attention needs of a rotary embedding (``models.layers.RotaryEmbedding`` owns the tables)."""

    cos: torch.Tensor  # (P, D/2) float32
    sin: torch.Tensor

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (q (T, H, D), k (T, KVH, D)); q may be the grouped view (T, KVH, G, D)."""

    def fusable(self, x: torch.Tensor) -> bool:
        """Whether fused kernels may apply the rotation for ``x`` (CUDA, kernels on)."""


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


class AttentionMetadata:
    """Metadata of one step: one attribute per metadata field of the step's field table
    (``fullgraph.fields``; the core ones are ``query_start_loc``, ``seq_start_loc``, ``seq_lens``,
    ``block_table``, ``slot_mapping``), views of the static buffers in padded/graph modes.

    A field no active backend reads is ``None``: a backend reading a field it did not declare fails
    loudly (``require``) instead of reading stale memory. Shapes follow the field axes: T tokens
    and R requests (padded), MB = max blocks per sequence.

    Attributes:
        decode_only: every real request has exactly one new token (a static property of the graph
            key, so backends may branch on it on the host).
        backends: attention kind ("dense", "blocksparse", ...) -> the backend serving it.
        cache: tensors derived from this step's metadata alone, built in the first layer and reused
            by the others (see :meth:`per_step`). Valid for one step: build a new metadata per step.
    """

    def __init__(self, *, decode_only: bool, backends: Mapping[str, AttentionBackend] | None = None,
                 **fields: torch.Tensor | None) -> None:
        self.decode_only = decode_only
        self.backends = backends or {}
        self.cache: dict[Hashable, Any] = {}
        for name in CORE_FIELDS.metadata:
            setattr(self, name, None)
        for name, value in fields.items():
            setattr(self, name, value)

    @classmethod
    def from_step(cls, tensors: Mapping[str, torch.Tensor], names: tuple[str, ...], reads: frozenset[str],
                  decode_only: bool, backends: Mapping[str, AttentionBackend]) -> AttentionMetadata:
        """The metadata of a step whose fields are ``tensors``: every name of ``names`` (the
        table's metadata fields), ``None`` unless some backend ``reads`` it."""
        return cls(decode_only=decode_only, backends=backends,
                   **{name: tensors[name] if name in reads else None for name in names})

    def require(self, name: str, backend: str) -> torch.Tensor:
        value = getattr(self, name, None)
        if value is None:
            raise RuntimeError(
                f"attention backend {backend!r} read metadata field {name!r}, which it does not "
                "declare in its padding policy's reads, so the runner did not build it")
        return value

    def per_step(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """``build()`` once per step under ``key`` (name it by everything ``build`` reads besides
        this metadata, e.g. block size and dtype); later layers get the same tensors.

        Under ``torch.compile`` the dict lives only while the step is traced, so the graph computes
        the value once and feeds it to every layer; inside a CUDA graph it is recomputed on each
        replay like any other op of the step."""
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]

    def __repr__(self) -> str:
        shown = {n: tuple(v.shape) for n, v in vars(self).items() if isinstance(v, torch.Tensor)}
        return f"AttentionMetadata(decode_only={self.decode_only}, {shown})"


class AttentionBackend:
    """Base class. Subclasses set ``name``, ``policy`` and ``kinds`` and implement ``forward``.

    ``forward(layer, q, k, v, kv_cache, metadata)`` attends the step's new tokens over the cache,
    into which the layer has already written them: q is rotated, (T, H, D); k and v are the new
    rotated keys and values (T, KVH, D) when the backend sets ``reads_new_kv``, else ``None`` where
    the write fused RoPE (the rotated keys then exist only in the cache). Returns (T, H, D); rows of
    padded tokens must be finite. It must be capture-safe: no ``.item()``/``.cpu()``/
    ``.tolist()``, no host branching on tensor values, no allocation whose size depends on tensor
    values. It may branch on ``metadata.decode_only`` and on tensor *shapes* (fixed per graph key).

    Class attributes:
        policy: the padding policy (reads, tails, graph steps, extra step fields).
        kinds: the attention layer kinds served ("dense", "blocksparse").
        kv_write: "kernel" (our Triton write, RoPE fused where ``rope.fusable``), "reference"
            (plain PyTorch) or "auto" (kernel on CUDA, else reference).
        reads_new_kv: ``forward`` needs the new k, v as tensors (the write then never fuses RoPE).
    """

    name: ClassVar[str]
    policy: ClassVar[PaddingPolicy]
    kinds: ClassVar[frozenset[str]] = frozenset({"dense"})
    kv_write: ClassVar[str] = "auto"
    reads_new_kv: bool = False

    def __init__(self, limits: BackendLimits, layers: list[Attention]) -> None:
        self.limits = limits
        self.kv_writer = KVWriter.for_backend(self.kv_write, limits.device)

    @classmethod
    def unsupported_reason(cls, device: torch.device, dtype: torch.dtype, layers: list[Attention]) -> str | None:
        """Why this backend cannot serve these layers here (None when it can)."""
        return None

    @classmethod
    def supports_context(cls) -> bool:
        """Whether every step kind can run (False: only prompts without cached context)."""
        return True

    def prepare(self, plan: StepPlan) -> str | None:
        """The host hook, called once per step with the padded plan before it is uploaded: fill the
        real rows of the backend's own step fields (``policy.fields``, views of the staging area)
        and whatever else it plans on the host. Return a reason to refuse the step (it raises
        ``ValueError`` before anything is written), or None. Not called under capture."""
        return None

    def workspaces(self) -> Mapping[str, torch.Tensor]:
        """Device tensors the backend's kernels write before they read them (split-KV partials,
        ...), allocated once: the runner's validate mode poisons them each step and the address
        guard checks they never move."""
        return {}

    def forward(self, layer: Attention, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError


def register_backend(cls: type[AttentionBackend] | None = None, *, replace: bool = False):
    """Class decorator: registers the backend (and so its padding policy) under ``cls.name``.
    ``@register_backend(replace=True)`` overrides a registered backend of the same name."""
    def register(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        policy = getattr(cls, "policy", None)
        if not isinstance(policy, PaddingPolicy):
            raise ValueError(f"backend {cls.__qualname__} declares no PaddingPolicy (class attribute `policy`)")
        if policy.name != cls.name:
            raise ValueError(f"backend {cls.name!r} declares a policy named {policy.name!r}")
        if cls.kv_write not in KVWriter.IMPLS:
            raise ValueError(f"backend {cls.name!r}: kv_write must be one of {KVWriter.IMPLS}, got {cls.kv_write!r}")
        registry.add(cls.name, cls, replace=replace)
        return cls
    return register if cls is None else register(cls)


def unregister_backend(name: str) -> None:
    registry.remove(name)


def get_backend_class(name: str) -> type[AttentionBackend]:
    return registry.get(name)


def available_backends() -> list[str]:
    return registry.names()
