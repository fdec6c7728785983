"""Reading a GGUF checkpoint (llama.cpp's file format) as a Hugging Face style config + state dict.

Why: many small quantized checkpoints ship only as GGUF. Producing what a Hugging Face directory
gives lets each model's existing ``from_hf`` path load it, with no GGUF knowledge anywhere else.

1. Metadata -> config. The ``{arch}.*`` keys llama.cpp's converter writes become the names
   transformers' config classes use. Every ``{arch}.*`` key is mapped, checked to be a no-op, or
   refused with ``ValueError``: a key that changes the math is never dropped silently.
   ``vocab_size`` is the token embedding's row count, not the tokenizer's length: the rows are what
   the embedding lookup and the logits use (tokenizers may be padded or have fewer entries).
2. Tensors -> state dict. Each tensor is dequantized with ``gguf.quants.dequantize`` (float32; the
   reader's numpy arrays are already ``(rows, cols)``, i.e. ggml's ``ne = [cols, rows]`` reversed),
   renamed to the HF name, checked against the shape the config implies, and cast to ``dtype``.
   For ``llama`` (Llama, Mistral, SmolLM, ...) llama.cpp's converter interleaves each head's rotary
   halves in the q/k rows; that permutation is undone. ``qwen2``/``qwen3``/``phi3`` are converted
   without it, so their tensors are copied as they are (phi3's fused ``attn_qkv``/``ffn_up`` are
   HF's ``qkv_proj``/``gate_up_proj`` row for row).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger("fullgraph")

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3")
# Types gguf's numpy dequantizers decode and that llama.cpp writes for these models.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_LOG_EVERY_S = 5.0

_HF_CLASS = {"llama": ("LlamaForCausalLM", "llama"), "mistral": ("MistralForCausalLM", "mistral"),
             "qwen2": ("Qwen2ForCausalLM", "qwen2"), "qwen3": ("Qwen3ForCausalLM", "qwen3"),
             "phi3": ("Phi3ForCausalLM", "phi3")}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_COMMON = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
           "attn_output.weight": "self_attn.o_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}
_SPLIT = {"attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
          "attn_v.weight": "self_attn.v_proj.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
          "ffn_up.weight": "mlp.up_proj.weight"}
_LAYER = {
    "llama": {**_COMMON, **_SPLIT},
    "qwen2": {**_COMMON, **_SPLIT, "attn_q.bias": "self_attn.q_proj.bias",
              "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias"},
    "qwen3": {**_COMMON, **_SPLIT, "attn_q_norm.weight": "self_attn.q_norm.weight",
              "attn_k_norm.weight": "self_attn.k_norm.weight"},
    "phi3": {**_COMMON, "attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
}
_ROW_PERMUTED = ("llama",)  # archs whose converter interleaves the rotary halves of attn_q/attn_k rows
_TENSOR_HINTS = {"rope_freqs.weight": "per-frequency rope factors (Llama 3 style rope scaling)",
                 "rope_factors_long.weight": "Phi-3 longrope factors",
                 "rope_factors_short.weight": "Phi-3 longrope factors"}
# Every {arch}.* key read below; any other one is refused (it may change the math).
_ARCH_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "attention.sliding_window", "expert_count",
    "expert_used_count", "rope.freq_base", "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "rope.scaling.finetuned", "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow"})
_MISSING = object()


@dataclasses.dataclass(frozen=True)
class GGUFCheckpoint:
    """A GGUF file read as Hugging Face ``config.json`` dict + state dict (CPU tensors).

    ``metadata`` holds the file's raw key/values except the tokenizer's arrays, e.g.
    ``tokenizer.chat_template`` and ``tokenizer.ggml.eot_token_id``.
    """

    config: dict
    state_dict: dict[str, torch.Tensor]
    metadata: dict
    path: Path

    @property
    def chat_template(self) -> str | None:
        return self.metadata.get("tokenizer.chat_template")


def read_gguf(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> GGUFCheckpoint:
    """Read ``path`` into a :class:`GGUFCheckpoint`, every tensor dequantized to ``dtype`` on the CPU."""
    gguf = _import_gguf()
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file (expected a .gguf checkpoint)")
    start = time.perf_counter()
    reader = gguf.GGUFReader(path)  # parses every key (the tokenizer's arrays too): seconds for big vocabularies
    log.info("gguf: opened %s: %d tensors, %d keys, %.1f s", path.name, len(reader.tensors),
             len(reader.fields), time.perf_counter() - start)
    kv = _read_kv(reader)
    arch = _architecture(kv, path)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: no token_embd.weight tensor (got {len(tensors)} tensors)")
    vocab_rows = int(tensors["token_embd.weight"].shape[-1])  # ggml ne = [hidden, vocab]
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else None
    config = _config(kv, arch, vocab_rows, "output.weight" in tensors, n_tokens)
    state_dict = _state_dict(list(tensors.values()), config, arch, dtype, gguf)
    log.info("gguf: read %s (%s, %d tensors) in %.1f s", path.name, config["architectures"][0],
             len(state_dict), time.perf_counter() - start)
    return GGUFCheckpoint(config=config, state_dict=state_dict, metadata=kv, path=path)


def _import_gguf() -> Any:
    try:
        import gguf  # optional dependency: only GGUF checkpoints need it
    except ImportError as e:
        raise ImportError("reading GGUF files needs the gguf package (pip install gguf)") from e
    return gguf


def _read_kv(reader: Any) -> dict[str, Any]:
    """Every key/value as Python values except the tokenizer's arrays (vocabulary, merges, scores: big)."""
    from gguf import GGUFValueType

    return {key: field.contents() for key, field in reader.fields.items()
            if not (key.startswith("tokenizer.ggml.") and field.types[:1] == [GGUFValueType.ARRAY])}


def _architecture(kv: dict, path: Path) -> str:
    arch = kv.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path.name}: general.architecture = {arch!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if kv.get("general.type", "model") != "model":
        raise ValueError(f"{path.name}: general.type = {kv['general.type']!r}, expected 'model' (not an adapter)")
    if kv.get("split.count", 1) > 1:
        raise ValueError(f"{path.name}: split.count = {kv['split.count']}, expected 1 (merge the shards first)")
    for key, value in kv.items():
        if key.startswith(arch + ".") and key[len(arch) + 1:] not in _ARCH_KEYS:
            raise ValueError(f"GGUF key {key} = {value!r} is not mapped to a Hugging Face config and may "
                             "change the model's math; refusing to ignore it")
    return arch


def _get(kv: dict, arch: str, key: str, default: Any = _MISSING) -> Any:
    """``{arch}.{key}`` as a scalar: llama.cpp's per-layer arrays have no HF counterpart here."""
    full = f"{arch}.{key}"
    if full not in kv:
        if default is _MISSING:
            raise ValueError(f"GGUF key {full} is missing (needed for the Hugging Face config)")
        return default
    value = kv[full]
    if isinstance(value, list):
        raise ValueError(f"GGUF key {full} = {value!r}: expected one value for all layers, got a list")
    return value


def _config(kv: dict, arch: str, vocab_rows: int, has_output: bool, n_tokens: int | None) -> dict:
    hidden, heads = _get(kv, arch, "embedding_length"), _get(kv, arch, "attention.head_count")
    head_dim = _get(kv, arch, "attention.key_length", hidden // heads)
    for key, want, why in (("attention.value_length", head_dim, "HF has one head_dim for k and v"),
                           ("rope.dimension_count", head_dim, "partial rotary embeddings are not mapped"),
                           ("vocab_size", vocab_rows, "token_embd.weight has that many rows"),
                           ("expert_count", 0, "mixture-of-experts is not mapped"),
                           ("expert_used_count", 0, "mixture-of-experts is not mapped")):
        if (got := _get(kv, arch, key, want)) != want:
            raise ValueError(f"GGUF key {arch}.{key} = {got!r}, expected {want!r} ({why})")
    if n_tokens is not None and n_tokens != vocab_rows:
        (log.warning if n_tokens > vocab_rows else log.info)(
            "gguf: tokenizer has %d tokens, token_embd.weight %d rows; vocab_size = %d (the rows)",
            n_tokens, vocab_rows, vocab_rows)
    architecture, model_type = _HF_CLASS[_hf_family(kv, arch)]
    return {
        "architectures": [architecture], "model_type": model_type, "vocab_size": vocab_rows,
        "hidden_size": hidden, "intermediate_size": _get(kv, arch, "feed_forward_length"),
        "num_hidden_layers": _get(kv, arch, "block_count"), "num_attention_heads": heads,
        "num_key_value_heads": _get(kv, arch, "attention.head_count_kv", heads), "head_dim": head_dim,
        "hidden_act": "silu", "rms_norm_eps": _get(kv, arch, "attention.layer_norm_rms_epsilon"),
        "rope_theta": _get(kv, arch, "rope.freq_base", 10000.0), "rope_scaling": _rope_scaling(kv, arch),
        "max_position_embeddings": _get(kv, arch, "context_length"), "tie_word_embeddings": not has_output,
        "bos_token_id": kv.get("tokenizer.ggml.bos_token_id"), "eos_token_id": kv.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": kv.get("tokenizer.ggml.padding_token_id"), **_family_keys(kv, arch, model_type),
    }


def _hf_family(kv: dict, arch: str) -> str:
    """llama.cpp writes Mistral models as ``llama``; only the model's name tells them apart."""
    names = f"{kv.get('general.name', '')} {kv.get('general.basename', '')}".lower()
    return "mistral" if arch == "llama" and "mistral" in names else arch


def _family_keys(kv: dict, arch: str, model_type: str) -> dict:
    window = _get(kv, arch, "attention.sliding_window", 0) or None
    if model_type == "mistral":  # MistralConfig defaults to a 4096 window: say "none" explicitly
        return {"sliding_window": window}
    if model_type == "phi3":
        return {"sliding_window": window, "original_max_position_embeddings": _get(
            kv, arch, "rope.scaling.original_context_length", _get(kv, arch, "context_length"))}
    if window is not None:
        raise ValueError(f"GGUF key {arch}.attention.sliding_window = {window}: sliding-window attention is "
                         f"not mapped for {model_type}")
    extra = {"attention_bias": False} if model_type in ("llama", "qwen3") else {}
    return {**extra, "use_sliding_window": False} if model_type.startswith("qwen") else extra


def _rope_scaling(kv: dict, arch: str) -> dict | None:
    kind = _get(kv, arch, "rope.scaling.type", "none")
    if kind not in ("none", "linear", "yarn"):
        raise ValueError(f"GGUF key {arch}.rope.scaling.type = {kind!r} is not mapped (supported: none, linear, yarn)")
    factor = _get(kv, arch, "rope.scaling.factor", 1.0 if kind == "none" else _MISSING)
    if kind == "none":
        if factor not in (0.0, 1.0):
            raise ValueError(f"GGUF key {arch}.rope.scaling.factor = {factor} without a rope.scaling.type")
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    scaling = {"rope_type": "yarn", "factor": factor,
               "original_max_position_embeddings": _get(kv, arch, "rope.scaling.original_context_length")}
    for key, hf_key in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
        if (value := _get(kv, arch, key, None)) is not None:
            scaling[hf_key] = value
    return scaling


def _state_dict(tensors: list, config: dict, arch: str, dtype: torch.dtype, gguf: Any) -> dict[str, torch.Tensor]:
    names = {t.name: _hf_name(t.name, arch, config["num_hidden_layers"]) for t in tensors}
    shapes = _expected_shapes(arch, config)
    out: dict[str, torch.Tensor] = {}
    start = last = time.perf_counter()
    for i, t in enumerate(tensors):
        out[names[t.name]] = _tensor(t, arch, config, shapes, dtype, gguf)
        if time.perf_counter() - last > _LOG_EVERY_S:
            last = time.perf_counter()
            log.info("gguf: %d/%d tensors dequantized, %.1f s", i + 1, len(tensors), last - start)
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{hf}" for i in range(config["num_hidden_layers"]) for hf in _LAYER[arch].values()}
    if missing := sorted(expected - out.keys()):
        raise ValueError(f"GGUF file lacks {len(missing)} tensors the {arch} model needs, e.g. {missing[:4]}")
    return out


def _hf_name(name: str, arch: str, n_layers: int) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m and int(m[1]) < n_layers and m[2] in _LAYER[arch]:
        return f"model.layers.{m[1]}.{_LAYER[arch][m[2]]}"
    hint = f": {_TENSOR_HINTS[name]}" if name in _TENSOR_HINTS else ""
    raise ValueError(f"GGUF tensor {name} is not mapped for architecture {arch} with {n_layers} layers{hint}; "
                     f"expected one of {sorted(_GLOBAL)} or blk.<i>.{{{', '.join(_LAYER[arch])}}}")


def _expected_shapes(arch: str, c: dict) -> dict[str, tuple[int, ...]]:
    """numpy/torch shapes (rows first) implied by the config, keyed by the name without ``blk.<i>.``."""
    h, f, d, v = c["hidden_size"], c["intermediate_size"], c["head_dim"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return {"token_embd.weight": (v, h), "output.weight": (v, h), "output_norm.weight": (h,),
            "attn_norm.weight": (h,), "ffn_norm.weight": (h,), "attn_q.weight": (q, h), "attn_k.weight": (kv, h),
            "attn_v.weight": (kv, h), "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
            "attn_q_norm.weight": (d,), "attn_k_norm.weight": (d,), "attn_output.weight": (h, q),
            "attn_qkv.weight": (q + 2 * kv, h), "ffn_gate.weight": (f, h),
            "ffn_up.weight": (2 * f if arch == "phi3" else f, h), "ffn_down.weight": (h, f)}


def _tensor(t: Any, arch: str, config: dict, shapes: dict, dtype: torch.dtype, gguf: Any) -> torch.Tensor:
    kind = t.tensor_type.name
    if kind not in SUPPORTED_TENSOR_TYPES:
        raise ValueError(f"GGUF tensor {t.name} has type {kind}, not supported "
                         f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})")
    values = gguf.quants.dequantize(t.data, t.tensor_type)  # float32, (rows, cols)
    # F32 comes back as a view of the read-only memory map: copy so torch owns writable memory.
    w = torch.from_numpy(np.require(values, np.float32, ["C", "W"]))
    local = t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name
    if tuple(w.shape) != shapes[local]:
        raise ValueError(f"GGUF tensor {t.name}: shape {tuple(w.shape)} (ggml ne {list(map(int, t.shape))}), "
                         f"expected {shapes[local]} from the metadata")
    if arch in _ROW_PERMUTED and local in ("attn_q.weight", "attn_k.weight"):
        w = _unpermute_rows(w, config["num_attention_heads" if local == "attn_q.weight" else "num_key_value_heads"])
    return w.to(dtype)


def _unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute``: per head, GGUF row ``2*j + h`` is HF row ``h*dim/2 + j``."""
    rows = w.shape[0]
    # (n_heads, dim/2, 2, cols) -> (n_heads, 2, dim/2, cols): rotary pairs back to rotate_half halves
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()
