"""Reading Hugging Face style checkpoint directories (``config.json`` + ``*.safetensors``)."""
from __future__ import annotations

import json
from pathlib import Path

import torch


def load_config(path: str | Path) -> dict:
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"{path}: no config.json (expected a Hugging Face style checkpoint directory)")
    return json.loads(file.read_text())


def load_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``path`` (CPU tensors)."""
    from safetensors.torch import load_file  # optional dependency: only needed to load checkpoints

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def fuse(sd: dict[str, torch.Tensor], fused: str, parts: list[str]) -> None:
    """Replace ``parts`` of a state dict by their row-wise concatenation under ``fused``."""
    missing = [p for p in parts if p not in sd]
    if missing:
        raise ValueError(f"checkpoint is missing {missing} (needed for {fused})")
    sd[fused] = torch.cat([sd.pop(p) for p in parts], dim=0)
