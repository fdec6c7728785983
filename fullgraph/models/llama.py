"""Llama (RMSNorm, RoPE with optional Llama-3 scaling, GQA, SwiGLU, optional tied embeddings).

``LlamaConfig.toy()`` is toy-llama, the regression-suite model; ``LlamaConfig.llama_1b()`` is the
Llama-3.2-1B shape. Hugging Face names are kept where they exist; q/k/v and gate/up are fused
into one projection each (``from_pretrained`` concatenates the checkpoint's tensors).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..attention import Attention
from .base import DecoderLM
from .layers import (Linear, PreNormDecoderLayer, RMSNorm, RotaryEmbedding, init_random_, kernels, llama3_inv_freq,
                     rope_inv_freq, silu_and_mul)
from .loading import fuse, load_config, load_safetensors_dir


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type", "default") not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_scaling {self.rope_scaling!r} (supported: llama3)")

    @classmethod
    def toy(cls) -> LlamaConfig:
        """toy-llama: 2 layers, hidden 64, 4 heads / 2 KV heads of 16, vocab 512, untied head."""
        return cls(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, max_position_embeddings=4096)

    @classmethod
    def llama_1b(cls) -> LlamaConfig:
        """The Llama-3.2-1B shape (random weights unless loaded)."""
        return cls(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                   num_kv_heads=8, head_dim=64, rope_theta=500000.0, max_position_embeddings=131072,
                   tie_word_embeddings=True,
                   rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})

    @classmethod
    def llama_8b(cls) -> LlamaConfig:
        """The Llama-3.1-8B shape (random weights unless loaded)."""
        return cls(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                   num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=131072,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})

    @classmethod
    def smollm2_135m(cls) -> LlamaConfig:
        """The SmolLM2-135M shape: 30 thin layers (hidden 576, 9 heads / 3 KV heads of 64), tied."""
        return cls(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                   num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                   max_position_embeddings=8192, tie_word_embeddings=True)

    @classmethod
    def from_hf(cls, hf: dict) -> LlamaConfig:
        """From a Hugging Face ``config.json`` dict (transformers 4.x and 5.x spellings)."""
        rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
        theta = hf.get("rope_theta", rope.pop("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        return cls(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                   intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
                   num_heads=hf["num_attention_heads"],
                   num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                   head_dim=hf.get("head_dim"), rms_norm_eps=hf.get("rms_norm_eps", 1e-5), rope_theta=theta,
                   rope_scaling={**rope, "rope_type": rope_type} if rope_type != "default" else None,
                   max_position_embeddings=hf.get("max_position_embeddings", 4096),
                   tie_word_embeddings=hf.get("tie_word_embeddings", False),
                   attention_bias=hf.get("attention_bias", False))

    def replace(self, **changes) -> LlamaConfig:
        return dataclasses.replace(self, **changes)


class LlamaAttention(nn.Module):
    def __init__(self, c: LlamaConfig, **factory) -> None:
        super().__init__()
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.qkv_proj = Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.attention_bias, **factory)
        self.o_proj = Linear(self.q_size, c.hidden_size, bias=c.attention_bias, **factory)
        self.attn = Attention(c.num_heads, c.num_kv_heads, c.head_dim, scale=c.head_dim ** -0.5)

    def forward(self, x, positions, rope: RotaryEmbedding, kv_cache, metadata) -> torch.Tensor:
        a = self.attn
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(-1, a.num_heads, a.head_dim)          # (T, H, D)
        k = k.view(-1, a.num_kv_heads, a.head_dim)       # (T, KVH, D)
        v = v.view(-1, a.num_kv_heads, a.head_dim)
        # Attention rotates q and k (in the KV-write kernel where the backend can fuse it).
        return self.o_proj(a(q, k, v, kv_cache, metadata, rope=rope, positions=positions))


class LlamaMLP(nn.Module):
    def __init__(self, c: LlamaConfig, **factory) -> None:
        super().__init__()
        self.gate_up_proj = Linear(c.hidden_size, 2 * c.intermediate_size, bias=False, **factory)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.gate_up_proj
        if up.uses_kernel(x):  # projection and SwiGLU in one launch
            return self.down_proj(kernels.linear(x, up.weight, up.bias, "silu_and_mul"))
        return self.down_proj(silu_and_mul(up(x)))


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, c: LlamaConfig, **factory) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)
        self.self_attn = LlamaAttention(c, **factory)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)
        self.mlp = LlamaMLP(c, **factory)


class Llama(DecoderLM):
    """Llama causal LM following the model protocol (see ``fullgraph.models.base``).

    Args:
        config: the architecture.
        dtype, device: where the weights live (float32 on the CPU by default).
        seed: random weights drawn from this seed (``init_random_``); ``None`` leaves PyTorch's
            default initialisation (use it before loading a checkpoint).
    """

    def __init__(self, config: LlamaConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, seed: int | None = 0) -> None:
        super().__init__()
        c, factory = config, {"dtype": dtype, "device": device}
        self.config = config
        self.vocab_size, self.max_model_len = c.vocab_size, c.max_position_embeddings
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, **factory)
        self.layers = nn.ModuleList(LlamaDecoderLayer(c, **factory) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False, **factory)
        inv_freq = rope_inv_freq(c.head_dim, c.rope_theta)
        if c.rope_scaling is not None and c.rope_scaling.get("rope_type") == "llama3":
            s = c.rope_scaling
            inv_freq = llama3_inv_freq(inv_freq, s["factor"], s["low_freq_factor"], s["high_freq_factor"],
                                       s["original_max_position_embeddings"])
        self.rotary = RotaryEmbedding(inv_freq, c.max_position_embeddings, device=device)
        if seed is not None:
            init_random_(self, seed)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32,
                        device: torch.device | str | None = None) -> Llama:
        """Load ``config.json`` + ``*.safetensors`` (Hugging Face tensor names) from a directory."""
        config = LlamaConfig.from_hf(load_config(path))
        model = cls(config, dtype=dtype, device=device, seed=None)
        model.load_hf_state_dict(load_safetensors_dir(path))
        return model

    def load_hf_state_dict(self, hf: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face Llama state dict in (strict: a missing, unknown or misshapen tensor
        raises ``ValueError`` naming it)."""
        sd = {k.removeprefix("model."): v for k, v in hf.items() if "rotary_emb" not in k}
        if self.lm_head is None:
            sd.pop("lm_head.weight", None)
        for i in range(self.config.num_layers):
            p = f"layers.{i}."
            for kind in ("weight", "bias") if self.config.attention_bias else ("weight",):
                fuse(sd, p + f"self_attn.qkv_proj.{kind}", [p + f"self_attn.{n}_proj.{kind}" for n in "qkv"])
            fuse(sd, p + "mlp.gate_up_proj.weight", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
        self.load_own_state(sd, source="checkpoint", prefix="model.")
