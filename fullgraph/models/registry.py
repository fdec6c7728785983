"""Checkpoints -> our models: one entry point, a small registry of architectures.

``from_pretrained(path)`` takes a Hugging Face checkpoint directory (``config.json`` +
``*.safetensors``, sharded or not) or a ``.gguf`` file; ``from_hf(model)`` converts a transformers
model object. Both dispatch on the config's ``architectures`` (else ``model_type``); an
architecture not listed in ``ARCHITECTURES`` is refused by name. Models are built on the ``meta``
device and take the loaded tensors' storage, so loading needs no second copy of the weights.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .hf import ARCHITECTURES as LLAMA_FAMILY
from .hf import architecture_of, llama_config, llama_state
from .llama import Llama
from .loading import load_config, load_generation_config, load_safetensors_dir, to_model
from .phi3_small import Phi3Small, Phi3SmallConfig, phi3_small_state

logger = logging.getLogger("fullgraph")


@dataclass(frozen=True)
class Architecture:
    """How to build one architecture: config.json dict -> our config, and HF tensors -> our names."""

    model: type[nn.Module]
    config: Callable[[Mapping, str], object]
    state: Callable[..., dict[str, torch.Tensor]]   # (tensors, config, sliced=False) -> our names


ARCHITECTURES: dict[str, Architecture] = {
    **{name: Architecture(Llama, llama_config, llama_state) for name in LLAMA_FAMILY},
    "Phi3SmallForCausalLM": Architecture(Phi3Small, lambda hf, source: Phi3SmallConfig.from_hf(hf),
                                         lambda sd, config, sliced=False: phi3_small_state(sd)),
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def _architecture(hf: Mapping, source: str) -> str:
    names = list(hf.get("architectures") or [])
    for name in names:
        if name in ARCHITECTURES:
            return name
    if hf.get("model_type") == "phi3small":
        return "Phi3SmallForCausalLM"
    try:
        return architecture_of(hf, source)
    except ValueError:
        raise ValueError(f"{source}: architecture {names or hf.get('model_type')!r} is not supported "
                         f"(supported: {supported_architectures()})") from None


def build(hf_config: Mapping, tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype,
          device: torch.device | str | None, max_model_len: int | None, source: str,
          tensor_parallel=None) -> nn.Module:
    """The model of ``hf_config`` with the given (Hugging Face named) tensors, whose storage it
    takes. ``tensor_parallel``: the tensors are that rank's cuts (``parallel.shard.checkpoint_cuts``)
    and the model is built sharded."""
    model, config = _meta_model(hf_config, dtype, max_model_len, source)
    if tensor_parallel is not None:
        from ..parallel import shard_model

        shard_model(model, tensor_parallel)   # on meta: the shard's shapes, filled below
    device = torch.device(device or "cpu")
    arch = ARCHITECTURES[_architecture(hf_config, source)]
    state = to_model(arch.state(dict(tensors), config, sliced=tensor_parallel is not None), dtype, device)
    tied = tensor_parallel is not None and model.lm_head.weight is model.embed_tokens.weight
    if tied and "embed_tokens.weight" in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]   # the sharded head is the embedding's rows
    model.load_own_state(state, source=source, share=True, prefix="model.")
    model.build_buffers(device)
    return model.eval()


def _meta_model(hf_config: Mapping, dtype: torch.dtype, max_model_len: int | None, source: str):
    """(the model of ``hf_config`` on ``meta``, unsharded; its config)."""
    arch = ARCHITECTURES[_architecture(hf_config, source)]
    config = arch.config(hf_config, source)
    return arch.model(config, dtype=dtype, device="meta", seed=None, max_model_len=max_model_len), config


def from_pretrained(path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                    max_model_len: int | None = None, tensor_parallel=None) -> nn.Module:
    """A model from a Hugging Face checkpoint directory or a ``.gguf`` file (see the module
    docstring). ``max_model_len``: the longest sequence it will serve (RoPE tables, LongRoPE's
    factors); default the checkpoint's ``max_position_embeddings``. The model's ``eos_token_ids``
    are the checkpoint's (``generation_config.json`` and ``config.json``, or the GGUF keys).
    ``tensor_parallel`` (a ``fullgraph.parallel.TensorParallel``): this rank's shard of the model;
    from safetensors it reads only the shard's slices of the sharded tensors (a ``.gguf`` file is
    read whole, then sharded)."""
    path, start = Path(path), time.perf_counter()
    if path.is_file() and path.suffix == ".gguf":
        from .gguf import read_gguf

        ckpt = read_gguf(path, dtype=dtype)
        model = build(ckpt.config, ckpt.state_dict, dtype=dtype, device=device, max_model_len=max_model_len,
                      source=path.name)
        if tensor_parallel is not None:
            from ..parallel import shard_model

            shard_model(model, tensor_parallel)
        model.eos_token_ids = _ids(ckpt.config.get("eos_token_id"), ckpt.metadata.get("tokenizer.ggml.eot_token_id"))
    elif path.is_dir():
        config, source = load_config(path), f"{path}/config.json"
        _architecture(config, source)  # refuse before reading gigabytes
        cuts = None
        if tensor_parallel is not None:
            from ..parallel.shard import checkpoint_cuts

            cuts = checkpoint_cuts(_meta_model(config, dtype, max_model_len, source)[0], tensor_parallel)
        tensors = load_safetensors_dir(path, dtype=dtype, device=device, cuts=cuts)
        model = build(config, tensors, dtype=dtype, device=device, max_model_len=max_model_len, source=source,
                      tensor_parallel=tensor_parallel)
        model.eos_token_ids = _ids(load_generation_config(path).get("eos_token_id"), config.get("eos_token_id"))
    else:
        raise ValueError(f"{path}: not a checkpoint directory (config.json + *.safetensors) nor a .gguf file")
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    logger.info("fullgraph: loaded %s (%s, %.1f MiB of weights) in %.1f s", path.name, type(model).__name__,
                size / 2**20, time.perf_counter() - start)
    return model


def _ids(*values) -> frozenset[int]:
    """The end-of-sequence ids a checkpoint declares (each value an int, a list of them, or None)."""
    out = set()
    for v in values:
        out.update([v] if isinstance(v, int) else (v or []))
    return frozenset(int(i) for i in out)


def from_hf(hf_model: nn.Module, *, max_model_len: int | None = None) -> nn.Module:
    """Our model of a transformers ``PreTrainedModel`` (a supported architecture), sharing its
    parameter storage: no copy of the weights. Separate q/k/v (and gate/up) weights are fused once
    into one tensor each, and the transformers model's parameters become views of it, so both keep
    working and afterwards share every byte (``data_ptr`` equal)."""
    config = hf_model.config.to_dict()
    arch_name = _architecture(config, f"{type(hf_model).__name__}.config")
    arch = ARCHITECTURES[arch_name]
    ours_config = arch.config(config, f"{type(hf_model).__name__}.config")
    param = next(hf_model.parameters())
    hf_params = dict(hf_model.named_parameters(remove_duplicate=False))
    state = arch.state(dict(hf_params), ours_config)
    model = arch.model(ours_config, dtype=param.dtype, device="meta", seed=None, max_model_len=max_model_len)
    model.load_own_state(state, source=type(hf_model).__name__, share=True, prefix="model.")
    _point_back(hf_model, hf_params, model)
    model.build_buffers(param.device)
    generation = getattr(hf_model, "generation_config", None)
    model.eos_token_ids = _ids(config.get("eos_token_id"), getattr(generation, "eos_token_id", None))
    return model.eval()


def _point_back(hf_model: nn.Module, hf_params: dict[str, nn.Parameter], model: nn.Module) -> None:
    """Make the transformers model's fused-away parameters views of our fused tensors."""
    ours = dict(model.named_parameters())
    for i in range(len(getattr(model, "layers", []))):
        groups = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}
        for fused, parts in groups.items():
            scope = fused.split(".")[0]
            for kind in ("weight", "bias"):
                names = [f"model.layers.{i}.{scope}.{p}.{kind}" for p in parts]
                if f"layers.{i}.{fused}.{kind}" not in ours or names[0] not in hf_params:
                    continue
                offset, whole = 0, ours[f"layers.{i}.{fused}.{kind}"]
                for name in names:
                    rows = hf_params[name].shape[0]
                    owner, _, leaf = name.rpartition(".")
                    hf_model.get_submodule(owner)._parameters[leaf] = nn.Parameter(
                        whole[offset: offset + rows], requires_grad=hf_params[name].requires_grad)
                    offset += rows
