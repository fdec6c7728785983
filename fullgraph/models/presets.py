"""Named model shapes (random weights): the one registry the CLI, the benchmarks and the tests use.

``build(name, dtype=..., device=..., seed=...)`` makes the model; ``names()`` lists them. Shapes
follow the published checkpoints (Llama-3.2-1B, Llama-3.1-8B, SmolLM2-135M, Phi-3-Small), so a
benchmark of a preset reads the bytes the real model reads.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from .llama import Llama, LlamaConfig
from .phi3_small import Phi3Small, Phi3SmallConfig

_PRESETS: dict[str, Callable[..., nn.Module]] = {
    "toy": lambda **kw: Llama(LlamaConfig.toy(), **kw),
    "llama-1b": lambda **kw: Llama(LlamaConfig.llama_1b(), **kw),
    "llama-8b": lambda **kw: Llama(LlamaConfig.llama_8b(), **kw),
    "smollm2-135m": lambda **kw: Llama(LlamaConfig.smollm2_135m(), **kw),
    "mistral-7b": lambda **kw: Llama(LlamaConfig.mistral_7b(), **kw),
    "mistral-7b-dense": lambda **kw: Llama(LlamaConfig.mistral_7b(window=None), **kw),
    "toy-mistral": lambda **kw: Llama(LlamaConfig.toy_mistral(), **kw),
    "phi3-toy": lambda **kw: Phi3Small(Phi3SmallConfig.toy(), **kw),
    "phi3-small-8k": lambda **kw: Phi3Small(Phi3SmallConfig.phi3_small_8k(), **kw),
    "phi3-small-128k": lambda **kw: Phi3Small(Phi3SmallConfig.phi3_small_128k(), **kw),
    "phi3-small-8k-dense": lambda **kw: Phi3Small(
        dataclasses.replace(Phi3SmallConfig.phi3_small_8k(), dense_attention_every_n_layers=1), **kw),
}


def names() -> list[str]:
    return sorted(_PRESETS)


def build(name: str, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
          seed: int | None = 0) -> nn.Module:
    """The preset ``name`` with random weights from ``seed``."""
    if name not in _PRESETS:
        raise ValueError(f"no model preset named {name!r}; presets: {names()}")
    return _PRESETS[name](dtype=dtype, device=device, seed=seed)
