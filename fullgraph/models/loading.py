"""Reading checkpoints from disk: Hugging Face directories (``config.json`` + ``*.safetensors``,
sharded or not, ``generation_config.json``) and the tensors' conversion to a model's dtype/device."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path

import torch

logger = logging.getLogger("fullgraph")


def load_config(path: str | Path) -> dict:
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"{path}: no config.json (expected a Hugging Face checkpoint directory or a .gguf file)")
    return json.loads(file.read_text())


def load_generation_config(path: str | Path) -> dict:
    """``generation_config.json`` (transformers reads it before config.json for eos ids), or {}."""
    file = Path(path) / "generation_config.json"
    return json.loads(file.read_text()) if file.is_file() else {}


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint's ``*.safetensors`` files: those its index names (every one must exist),
    or all of them."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ValueError(f"{path}: the shard index names files that are missing: {missing}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    return files


def load_safetensors_dir(path: str | Path, dtype: torch.dtype | None = None,
                         device: torch.device | str | None = None,
                         cuts: Mapping[str, tuple] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, converted to ``dtype`` on ``device`` as it is read (one
    shard at a time), with progress and the time it took. ``cuts``: checkpoint name -> (a
    ``parallel.shard.Cut``, the tensor's full shape): of those tensors only the cut is read from
    the file (a tensor-parallel rank's shard), after checking the full shape."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise ValueError("loading safetensors checkpoints needs the safetensors package "
                         "(pip install 'fullgraph[hf]')") from None
    files, tensors, start, read = safetensors_files(path), {}, time.perf_counter(), 0
    for i, file in enumerate(files):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                entry = (cuts or {}).get(name)
                t = f.get_tensor(name) if entry is None else _read_cut(f.get_slice(name), name, *entry, file)
                read += t.numel() * t.element_size()
                tensors[name] = t.to(device=device, dtype=dtype if t.is_floating_point() and dtype else t.dtype)
        logger.info("loading %s: shard %d/%d, %d tensors, %.1f MiB read, %.1f s", Path(path).name, i + 1, len(files),
                    len(tensors), read / 2**20, time.perf_counter() - start)
    return tensors


def _read_cut(piece, name: str, cut, shape: tuple[int, ...], file: Path) -> torch.Tensor:
    """The part ``cut`` of the tensor ``name`` that ``piece`` (a safetensors slice) reads from the file."""
    have = tuple(piece.get_shape())
    if have != tuple(shape):
        raise ValueError(f"{file}: {name} has shape {have}, the model expects {tuple(shape)}")
    lead = (slice(None),) * cut.dim
    parts = [piece[(*lead, slice(r.start, r.stop))] for r in cut.ranges]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, cut.dim)).contiguous()


def to_model(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in tensors.items()}


def fuse(sd: dict[str, torch.Tensor], fused: str, parts: list[str],
         shapes: list[tuple[int, ...]] | None = None) -> None:
    """Replace ``parts`` of a state dict by their row-wise concatenation under ``fused``;
    ``shapes``: each part's expected shape (checked first, so an error names the checkpoint's
    tensor, not the fused one)."""
    missing = [p for p in parts if p not in sd]
    if missing:
        raise ValueError(f"checkpoint lacks {['model.' + p for p in missing]} (needed for {fused})")
    bad = [f"model.{p}: checkpoint {tuple(sd[p].shape)} vs model {tuple(s)}" for p, s in zip(parts, shapes or ())
           if tuple(sd[p].shape) != tuple(s)]
    if bad:
        raise ValueError(f"checkpoint: tensors of the wrong shape: {bad}")
    sd[fused] = torch.cat([sd.pop(p) for p in parts], dim=0)
