"""Hugging Face checkpoints of the Llama family -> ``LlamaConfig`` and our tensor names, strictly.

Every ``config.json`` key is accounted for: it is read (and its value checked), or known not to
change the forward pass at inference (dropout rates, token ids, bookkeeping), or the checkpoint is
refused with a ``ValueError`` naming the key and value. A key this module does not know is refused
too: an unknown key may change the math, and a checkpoint is never run approximately. Missing keys
take transformers' default for that architecture (they differ: Qwen3's ``head_dim`` is 128,
Mistral's ``sliding_window`` 4096, Phi-3's ``rms_norm_eps`` 1e-5).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from .llama import LlamaConfig
from .loading import fuse
from .rope import rope_from_hf

# Keys that never change the forward pass at inference (transformers' own bookkeeping, token ids,
# dropout, training-only settings).
HARMLESS = frozenset({
    "_name_or_path", "architectures", "model_type", "dtype", "torch_dtype", "transformers_version", "use_cache",
    "id2label", "label2id", "problem_type", "return_dict", "output_attentions", "output_hidden_states",
    "chunk_size_feed_forward", "is_encoder_decoder", "bos_token_id", "eos_token_id", "pad_token_id",
    "initializer_range", "attention_dropout", "pretraining_tp", "embd_pdrop", "resid_pdrop", "auto_map",
    "tokenizer_class", "tie_encoder_decoder", "use_bfloat16", "bad_words_ids", "keys_to_ignore_at_inference",
    "_model_name_or_path", "unk_token_id", "sep_token_id", "cls_token_id", "mask_token_id",
    "decoder_start_token_id", "quantization_config",  # checked below
})
COMMON = frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "hidden_act", "rms_norm_eps", "max_position_embeddings",
                    "tie_word_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "head_dim"})
ARCHITECTURES = {  # architecture -> (model_type, extra keys read, transformers' defaults of missing keys)
    "LlamaForCausalLM": ("llama", {"attention_bias", "mlp_bias"}, {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048}),
    "MistralForCausalLM": ("mistral", {"sliding_window"},
                           {"rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "sliding_window": 4096,
                            "num_key_value_heads": 8}),
    "Qwen2ForCausalLM": ("qwen2", {"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"},
                         {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "max_window_layers": 28,
                          "sliding_window": 4096, "num_key_value_heads": 32}),
    "Qwen3ForCausalLM": ("qwen3", {"attention_bias", "sliding_window", "use_sliding_window", "max_window_layers",
                                   "layer_types"},
                         {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "max_window_layers": 28,
                          "head_dim": 128, "sliding_window": 4096, "num_key_value_heads": 32}),
    "Phi3ForCausalLM": ("phi3", {"sliding_window", "original_max_position_embeddings", "partial_rotary_factor"},
                        {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096}),
}
# Keys whose explicit null means something (no window; as many KV heads as heads; hidden / heads),
# unlike a missing key, which takes the default above (Mistral-7B v0.2 stores "sliding_window": null).
NULLABLE = frozenset({"sliding_window", "num_key_value_heads", "head_dim"})
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def architecture_of(hf: Mapping, source: str = "config.json", default: str | None = None) -> str:
    """The supported architecture a config names (``architectures``, else ``model_type``, else
    ``default`` when given)."""
    names = list(hf.get("architectures") or [])
    if not names and not hf.get("model_type") and default:
        return default
    by_type = {t: a for a, (t, _, _) in ARCHITECTURES.items()}
    for name in names:
        if name in ARCHITECTURES:
            return name
    if not names and hf.get("model_type") in by_type:
        return by_type[hf["model_type"]]
    raise ValueError(f"{source}: architecture {names or hf.get('model_type')!r} is not a supported Llama-family "
                     f"architecture (supported: {sorted(ARCHITECTURES)})")


def llama_config(hf: Mapping, source: str = "config.json", default: str | None = None) -> LlamaConfig:
    """The strict translation (see the module docstring); ``default``: the architecture of a
    config that names none."""
    arch = architecture_of(hf, source, default)
    model_type, extra, defaults = ARCHITECTURES[arch]
    unknown = sorted(set(hf) - HARMLESS - COMMON - extra)
    if unknown:
        raise ValueError(f"{source}: {arch} keys {unknown} (= {[hf[k] for k in unknown][:4]}) are not implemented "
                         "by fullgraph and may change the model's math; refusing to run it approximately")
    quant = hf.get("quantization_config") or {}
    method = str(getattr(quant.get("quant_method"), "value", quant.get("quant_method")))
    if quant and method != "gguf":  # transformers dequantizes GGUF weights as it loads them
        raise ValueError(f"{source}: quantization_config with quant_method {method!r}: quantized checkpoints are not "
                         "supported (load full-precision weights, or a GGUF file)")
    missing = [k for k in REQUIRED if hf.get(k) is None]
    if missing:
        raise ValueError(f"{source}: {arch} config lacks {missing}")
    cfg = {**defaults, **{k: v for k, v in hf.items() if v is not None or k in NULLABLE}}
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    theta, scaling = rope_from_hf(hf, head_dim, source)
    window, layers = _sliding(arch, cfg, source)
    return LlamaConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"], num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim, rms_norm_eps=float(cfg["rms_norm_eps"]), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=cfg["max_position_embeddings"], tie_word_embeddings=bool(cfg.get("tie_word_embeddings")),
        attention_bias=bool(cfg.get("attention_bias")) and arch != "Qwen2ForCausalLM",
        qkv_bias=arch == "Qwen2ForCausalLM", mlp_bias=bool(cfg.get("mlp_bias")),
        qk_norm=arch == "Qwen3ForCausalLM", sliding_window=window, sliding_layers=layers,
        hidden_act=_act(cfg.get("hidden_act", "silu"), source))


def _act(name: str, source: str) -> str:
    if name not in ("silu", "swish"):
        raise ValueError(f"{source}: hidden_act={name!r} is not supported (supported: 'silu')")
    return name


def _sliding(arch: str, cfg: Mapping, source: str) -> tuple[int | None, tuple[int, ...] | None]:
    """(window, the layers that use it: None = all) as transformers decides it per architecture."""
    n = cfg["num_hidden_layers"]
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        window = cfg.get("sliding_window")
        return (int(window) if window else None), None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        types = cfg.get("layer_types")
        if types is not None:
            bad = sorted(set(types) - {"full_attention", "sliding_attention"})
            if bad or len(types) != n:
                raise ValueError(f"{source}: layer_types {types}: expected {n} entries of 'full_attention' / "
                                 "'sliding_attention'")
            layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
            if layers and window is None:
                raise ValueError(f"{source}: layer_types has sliding layers but use_sliding_window is false")
            return (window if layers else None), layers
        if window is None:
            return None, None
        layers = tuple(range(cfg["max_window_layers"], n))
        return (int(window) if layers else None), layers
    return None, None


def llama_state(hf: Mapping[str, torch.Tensor], config: LlamaConfig, sliced: bool = False) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors (Hugging Face names) under ``Llama``'s names: ``model.`` dropped,
    q/k/v and gate/up fused (Phi-3 stores them fused already), a tied ``lm_head`` dropped.
    Missing parts raise ``ValueError`` naming the checkpoint tensor. ``sliced``: the tensors are a
    tensor-parallel rank's cuts, their full shapes checked as they were read."""
    sd = {k.removeprefix("model."): v for k, v in hf.items() if "rotary_emb" not in k}
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    kinds = ("weight", "bias") if config.attention_bias or config.qkv_bias else ("weight",)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    d, ffn = config.hidden_size, config.intermediate_size
    for i in range(config.num_layers):
        p = f"layers.{i}."
        if p + "self_attn.qkv_proj.weight" not in sd:
            for kind in kinds:
                fuse(sd, p + f"self_attn.qkv_proj.{kind}", [p + f"self_attn.{n}_proj.{kind}" for n in "qkv"],
                     None if sliced else [(rows, d)[:2 if kind == "weight" else 1] for rows in (q, kv, kv)])
        if p + "mlp.gate_up_proj.weight" not in sd:
            for kind in ("weight", "bias") if config.mlp_bias else ("weight",):
                fuse(sd, p + f"mlp.gate_up_proj.{kind}", [p + f"mlp.{n}_proj.{kind}" for n in ("gate", "up")],
                     None if sliced else [(ffn, d)[:2 if kind == "weight" else 1]] * 2)
    return sd

