"""The Llama family: Llama 2/3/3.1/3.2, Mistral, Qwen2, Qwen3 and Phi-3 (mini/medium) in one model.

RMSNorm, RoPE (any static variant, ``models.rope``), GQA, SwiGLU, optional tied embeddings; the
variants differ only in data: biases (Llama's ``attention_bias`` on q, k, v and o; Qwen2's on q, k, v
only; ``mlp_bias``), Qwen3's per-head q/k RMSNorm before RoPE, per-layer sliding windows (Mistral,
Qwen2/Qwen3 above ``max_window_layers``, Phi-3), LongRoPE (Phi-3 128K). q/k/v and gate/up are one
fused projection each, as Phi-3 checkpoints store them; ``hf.py`` turns any checkpoint's tensors
into these names. ``LlamaConfig.toy()`` is toy-llama, the regression-suite model.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..attention import Attention
from .base import DecoderLM
from .layers import Linear, PreNormDecoderLayer, RMSNorm, RotaryEmbedding, init_random_, silu_and_mul
from .rope import SUPPORTED as ROPE_TYPES
from .rope import rope_tables


@dataclass(frozen=True)
class LlamaConfig:
    """The architecture. ``sliding_window`` applies to the layers in ``sliding_layers`` (None: all);
    ``rope_scaling`` is a normalised dict (``{"rope_type": ..., ...}``, see ``models.rope``)."""

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
    attention_bias: bool = False          # bias on q, k, v and o (Llama)
    qkv_bias: bool = False                # bias on q, k, v only (Qwen2)
    mlp_bias: bool = False
    qk_norm: bool = False                 # per-head RMSNorm of q and k before RoPE (Qwen3)
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported (supported: 'silu', the SwiGLU "
                             "gate of every Llama-family checkpoint)")
        kind = (self.rope_scaling or {}).get("rope_type", "default")
        if kind not in ROPE_TYPES:
            raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive int or None, got {self.sliding_window}")
        if self.sliding_layers is not None:
            layers = tuple(sorted(set(self.sliding_layers)))
            if layers and not 0 <= layers[0] <= layers[-1] < self.num_layers:
                raise ValueError(f"sliding_layers {layers} must be layer indices in [0, {self.num_layers})")
            object.__setattr__(self, "sliding_layers", layers)

    def window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: full attention)."""
        if self.sliding_window is None or (self.sliding_layers is not None and layer not in self.sliding_layers):
            return None
        return self.sliding_window

    @classmethod
    def toy(cls) -> LlamaConfig:
        """toy-llama: 2 layers, hidden 64, 4 heads / 2 KV heads of 16, vocab 512, untied head."""
        return cls(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, max_position_embeddings=4096)

    @classmethod
    def toy_mistral(cls, window: int = 16) -> LlamaConfig:
        """toy-llama with a ``window``-token sliding window on every layer (Mistral-style)."""
        return dataclasses.replace(cls.toy(), sliding_window=window)

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
    def mistral_7b(cls, window: int | None = 4096) -> LlamaConfig:
        """The Mistral-7B shape, with its sliding window (v0.1: 4096)."""
        return cls(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                   num_kv_heads=8, head_dim=128, max_position_embeddings=32768, sliding_window=window)

    @classmethod
    def smollm2_135m(cls) -> LlamaConfig:
        """The SmolLM2-135M shape: 30 thin layers (hidden 576, 9 heads / 3 KV heads of 64), tied."""
        return cls(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                   num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                   max_position_embeddings=8192, tie_word_embeddings=True)

    @classmethod
    def from_hf(cls, hf: dict) -> LlamaConfig:
        """From a Hugging Face ``config.json`` dict, validated strictly (``models.hf``); a dict
        naming no architecture is read as ``LlamaForCausalLM``."""
        from .hf import llama_config

        return llama_config(hf, default="LlamaForCausalLM")

    def replace(self, **changes) -> LlamaConfig:
        return dataclasses.replace(self, **changes)


class LlamaAttention(nn.Module):
    def __init__(self, c: LlamaConfig, layer: int, **factory) -> None:
        super().__init__()
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.qkv_proj = Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.attention_bias or c.qkv_bias,
                               **factory)
        self.o_proj = Linear(self.q_size, c.hidden_size, bias=c.attention_bias, **factory)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, **factory)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, **factory)
        self.attn = Attention(c.num_heads, c.num_kv_heads, c.head_dim, scale=c.head_dim ** -0.5,
                              sliding_window=c.window(layer))

    def forward(self, x, positions, rope: RotaryEmbedding, kv_cache, metadata, norm=None, residual=None) -> torch.Tensor:
        a = self.attn
        if not hasattr(self, "q_norm") and self.qkv_proj.uses_kernel(x) and a.projection_writes(metadata, rope, x):
            # one launch: the norm, the projection, RoPE on q and k, and k and v into the cache
            q = self.qkv_proj.rope_kv_write(x, norm, kv_cache, metadata.require("slot_mapping", "qkv_proj"), positions,
                                            rope, a.num_heads, a.num_kv_heads, "llama")
            return self.o_proj(a(q, None, None, kv_cache, metadata, written=True), residual=residual)
        q, k, v = self.qkv_proj(x, norm).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(-1, a.num_heads, a.head_dim)          # (T, H, D)
        k = k.view(-1, a.num_kv_heads, a.head_dim)       # (T, KVH, D)
        v = v.view(-1, a.num_kv_heads, a.head_dim)
        if hasattr(self, "q_norm"):                      # per head, before RoPE (Qwen3)
            q = self.q_norm(q.reshape(-1, a.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, a.head_dim)).view(k.shape)
        # Attention rotates q and k (in the KV-write kernel where the writer can fuse it).
        return self.o_proj(a(q, k, v, kv_cache, metadata, rope=rope, positions=positions), residual=residual)


class LlamaMLP(nn.Module):
    def __init__(self, c: LlamaConfig, **factory) -> None:
        super().__init__()
        self.gate_up_proj = Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias, **factory)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias, **factory)

    def forward(self, x: torch.Tensor, norm=None, residual=None) -> torch.Tensor:
        up = self.gate_up_proj
        if up.uses_kernel(x):  # the norm, the projection and SwiGLU in one launch
            return self.down_proj(up(x, norm, activation="silu_and_mul"), residual=residual)
        return self.down_proj(silu_and_mul(up(x, norm)), residual=residual)


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, c: LlamaConfig, layer: int, **factory) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)
        self.self_attn = LlamaAttention(c, layer, **factory)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)
        self.mlp = LlamaMLP(c, **factory)


class Llama(DecoderLM):
    """A Llama-family causal LM following the model protocol (see ``fullgraph.models.base``).

    Args:
        config: the architecture.
        dtype, device: where the weights live (float32 on the CPU by default).
        seed: random weights drawn from this seed (``init_random_``); ``None`` leaves PyTorch's
            default initialisation (use it before loading a checkpoint).
        max_model_len: the longest sequence this instance serves (default and maximum:
            ``max_position_embeddings``): the RoPE table's length, and, for LongRoPE, the choice of
            its long or short factors (long iff above ``original_max_position_embeddings``).
    """

    def __init__(self, config: LlamaConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, seed: int | None = 0,
                 max_model_len: int | None = None) -> None:
        super().__init__()
        c, factory = config, {"dtype": dtype, "device": device}
        self.config = config
        self.vocab_size = c.vocab_size
        self.max_model_len = max_model_len or c.max_position_embeddings
        if not 1 <= self.max_model_len <= c.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} not in [1, max_position_embeddings = "
                             f"{c.max_position_embeddings}]")
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, **factory)
        self.layers = nn.ModuleList(LlamaDecoderLayer(c, i, **factory) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False, **factory)
        self.build_buffers(device)
        if seed is not None:
            init_random_(self, seed)

    def build_buffers(self, device: torch.device | str | None) -> None:
        """The RoPE tables (``rope_factors``: which LongRoPE list they use, else None)."""
        c = self.config
        inv_freq, mscale, self.rope_factors = rope_tables(c.head_dim, c.rope_theta, c.rope_scaling,
                                                          c.max_position_embeddings, self.max_model_len)
        self.rotary = RotaryEmbedding(inv_freq, self.max_model_len, mscale, device=device)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32,
                        device: torch.device | str | None = None, max_model_len: int | None = None) -> Llama:
        """A Hugging Face checkpoint directory or a ``.gguf`` file of a Llama-family architecture
        (``fullgraph.models.from_pretrained``, which also serves the other architectures)."""
        from .registry import from_pretrained

        model = from_pretrained(path, dtype=dtype, device=device, max_model_len=max_model_len)
        if not isinstance(model, cls):
            raise ValueError(f"{path}: a {type(model).__name__} checkpoint, not a Llama-family one")
        return model

    def load_hf_state_dict(self, hf: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face state dict of this architecture in (strict: a missing, unknown or
        misshapen tensor raises ``ValueError`` naming it)."""
        from .hf import llama_state

        self.load_own_state(llama_state(hf, self.config), source="checkpoint", prefix="model.")
