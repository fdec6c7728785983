"""Phi-3-Small (``phi3small``): LayerNorm, GQA with head-major fused QKV, RoPE base 1e6 (LongRoPE
for 128K), muP scalings, GeGeLU, tied embeddings, alternating block-sparse and dense layers.
Module names are the checkpoint's tensor names without ``model.``, so loading is a rename."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..attention import Attention, BlockSparseConfig
from .base import DecoderLM
from .layers import (LayerNorm, Linear, PreNormDecoderLayer, RotaryEmbedding, init_random_, kernels, rope_inv_freq,
                     use_kernels)
from .rope import LongRopeScaling

# <|dummy_id_k|>, the FIM ids 100258-100260 and <|endofprompt|> 100276: masked in the logits.
PHI3_SMALL_DUMMY_IDS = (100256, 100258, 100259, 100260, 100264, 100265, *range(100267, 100352))


@dataclass(frozen=True)
class Phi3SmallConfig:
    """The architecture; fields are named as the ``config.json`` keys, plus ``dummy_token_ids`` (masked
    to -inf in the logits). Layer ``l`` is dense iff ``(l + 1) % dense_attention_every_n_layers == 0``
    (never when None), else block-sparse. ``up_proj`` has ``2 * ff_intermediate_size`` rows."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    ff_intermediate_size: int
    gegelu_limit: float | None = 20.0
    layer_norm_epsilon: float = 1e-5
    rope_embedding_base: float = 1e6
    max_position_embeddings: int = 8192
    rope_scaling: LongRopeScaling | None = None
    mup_use_scaling: bool = True
    mup_attn_multiplier: float = 1.0
    mup_embedding_multiplier: float = 10.0
    mup_width_multiplier: float = 8.0
    dense_attention_every_n_layers: int | None = 2
    blocksparse_block_size: int = 64
    blocksparse_num_local_blocks: int = 16
    blocksparse_vert_stride: int = 8
    blocksparse_homo_head_pattern: bool = False
    dummy_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in _REQUIRED + ("max_position_embeddings",):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"Phi3SmallConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        h, kvh = self.num_attention_heads, self.num_key_value_heads
        if self.hidden_size % h or h % kvh or self.head_dim % 2:
            raise ValueError(f"hidden_size {self.hidden_size} must be a multiple of num_attention_heads {h} with "
                             f"an even head_dim (got {self.hidden_size / h}), and {h} a multiple of "
                             f"num_key_value_heads {kvh}")
        if (self.gegelu_limit is not None and self.gegelu_limit <= 0) or (self.dense_attention_every_n_layers or 1) < 1:
            raise ValueError(f"gegelu_limit ({self.gegelu_limit}) must be > 0 and dense_attention_every_n_layers "
                             f"({self.dense_attention_every_n_layers}) >= 1, or None")
        if self.rope_scaling is not None and len(self.rope_scaling.short_factor) != self.head_dim // 2:
            raise ValueError(f"rope_scaling has {len(self.rope_scaling.short_factor)} factors per list; "
                             f"head_dim {self.head_dim} needs {self.head_dim // 2}")
        ids = tuple(sorted({int(i) for i in self.dummy_token_ids}))
        if len(ids) != len(self.dummy_token_ids) or (ids and not 0 <= ids[0] <= ids[-1] < self.vocab_size):
            raise ValueError(f"dummy_token_ids must be unique ids in [0, {self.vocab_size}), got {ids[:3]}..{ids[-3:]}")
        object.__setattr__(self, "dummy_token_ids", ids)
        self.sparse_config()  # validates the block-sparse fields

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def attn_scale(self) -> float:  # 1/128 for Phi-3-Small under muP, NOT 1/sqrt(head_dim)
        return self.mup_attn_multiplier / self.head_dim if self.mup_use_scaling else self.head_dim ** -0.5

    def sparse_config(self) -> BlockSparseConfig:  # global head index: this model holds every head
        return BlockSparseConfig(block_size=self.blocksparse_block_size, local_blocks=self.blocksparse_num_local_blocks,
                                 vert_stride=self.blocksparse_vert_stride, homo_head=self.blocksparse_homo_head_pattern,
                                 num_heads_total=self.num_attention_heads, head_offset=0)

    @classmethod
    def phi3_small_8k(cls) -> Phi3SmallConfig:
        """Phi-3-Small-8K (random weights unless loaded)."""
        return cls(vocab_size=100352, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, ff_intermediate_size=14336, dummy_token_ids=PHI3_SMALL_DUMMY_IDS)

    @classmethod
    def phi3_small_128k(cls) -> Phi3SmallConfig:
        """Phi-3-Small-128K shape. Its LongRoPE factors are made up (short all 1.0, long rising
        quadratically from 1 to 20, mscales defaulted); ``from_hf`` reads a checkpoint's real ones."""
        long = tuple(round(1.0 + 19.0 * (i / 63) ** 2, 4) for i in range(64))
        return dataclasses.replace(cls.phi3_small_8k(), max_position_embeddings=131072,
                                   rope_scaling=LongRopeScaling((1.0,) * 64, long, 8192))

    @classmethod
    def toy(cls) -> Phi3SmallConfig:
        """4 layers (sparse, dense, sparse, dense), hidden 128, 8 heads / 2 KV heads of 16, vocab 512
        with 5 dummy ids, sparse block 16 / 4 local / stride 4 (a 64-token local window), and
        gegelu_limit 2.0 so that random weights actually hit the clamp."""
        return cls(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                   ff_intermediate_size=128, gegelu_limit=2.0, max_position_embeddings=4096, blocksparse_block_size=16,
                   blocksparse_num_local_blocks=4, blocksparse_vert_stride=4, dummy_token_ids=(3, 500, 505, 510, 511))

    @classmethod
    def from_hf(cls, hf: Mapping) -> Phi3SmallConfig:
        """From a checkpoint's ``config.json`` dict. Dummy ids come from ``dummy_token_indices`` when
        present, else the Phi-3-Small tokenizer's 91 ids when the vocabulary holds them."""
        for key, ok in (("hidden_act", "gegelu"), ("tie_word_embeddings", True), ("rope_position_scale", 1.0)):
            if hf.get(key, ok) != ok:
                raise ValueError(f"config.json {key}={hf[key]!r}: only {ok!r} is supported (as in every Phi-3-Small)")
        kw = {f.name: hf[f.name] for f in dataclasses.fields(cls) if hf.get(f.name) is not None}
        if "ff_intermediate_size" not in kw and "ff_dim_multiplier" in hf:
            inter = hf["ff_dim_multiplier"] * (hf["hidden_size"] // 3) * 2
            kw["ff_intermediate_size"] = -(-inter // 256) * 256 if hf.get("gegelu_pad_to_256", True) else inter
        missing = [key for key in _REQUIRED if key not in kw]
        if missing:
            raise ValueError(f"config.json lacks {missing} (expected a Phi-3-Small config, model_type phi3small)")
        dummy, phi3_ids = hf.get("dummy_token_indices"), PHI3_SMALL_DUMMY_IDS
        dummy = (phi3_ids if kw["vocab_size"] > phi3_ids[-1] else ()) if dummy is None else dummy
        rs = hf.get("rope_scaling")
        return cls(**{**kw, "rope_scaling": _longrope_from_hf(rs) if rs else None, "dummy_token_ids": tuple(dummy),
                      "gegelu_limit": hf.get("gegelu_limit", 20.0),
                      "dense_attention_every_n_layers": hf.get("dense_attention_every_n_layers", 2)})


_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "ff_intermediate_size")


def _longrope_from_hf(rs: Mapping) -> LongRopeScaling:
    kind = rs.get("type", rs.get("rope_type"))
    if kind not in ("su", "longrope") or "original_max_position_embeddings" not in rs:
        raise ValueError("rope_scaling must be LongRoPE (type 'su' or 'longrope', with "
                         f"original_max_position_embeddings), got type {kind!r} with keys {sorted(rs)}")
    return LongRopeScaling(rs["short_factor"], rs["long_factor"], rs["original_max_position_embeddings"],
                           rs.get("short_mscale"), rs.get("long_mscale"))


def gegelu(u: torch.Tensor, limit: float | None) -> torch.Tensor:
    """(..., 2I) -> (..., I): ``a * sigmoid(1.702 a) * (b + 1)`` with ``a = min(u[..., 0::2], limit)``,
    ``b = clamp(u[..., 1::2], -limit, limit)``; infinities pass unchanged (``clamp`` would cap them)."""
    if use_kernels(u):
        return kernels.gegelu(u, math.inf if limit is None else limit)
    a, b = u[..., 0::2], u[..., 1::2]
    if limit is not None:
        a = torch.where(torch.isinf(a), a, a.clamp(max=limit))
        b = torch.where(torch.isinf(b), b, b.clamp(-limit, limit))
    return a * torch.sigmoid(1.702 * a) * (b + 1)


class Phi3SmallAttention(nn.Module):
    def __init__(self, c: Phi3SmallConfig, layer: int, **factory) -> None:
        super().__init__()
        h, kvh, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.query_key_value = Linear(c.hidden_size, (h + 2 * kvh) * d, bias=True, **factory)
        self.dense = Linear(h * d, c.hidden_size, bias=True, **factory)
        n = c.dense_attention_every_n_layers
        dense = n is not None and (layer + 1) % n == 0
        self.attn = Attention(h, kvh, d, scale=c.attn_scale, kind="dense" if dense else "blocksparse",
                              sparse=None if dense else c.sparse_config())

    def forward(self, x, positions, rope: RotaryEmbedding, kv_cache, metadata, norm=None, residual=None) -> torch.Tensor:
        a = self.attn
        if self.query_key_value.uses_kernel(x) and a.projection_writes(metadata, rope, x):
            # one launch: the norm, the projection, RoPE on q and k, and k and v into the cache
            q = self.query_key_value.rope_kv_write(x, norm, kv_cache, metadata.require("slot_mapping", "query_key_value"),
                                                   positions, rope, a.num_heads, a.num_kv_heads, "grouped")
            return self.dense(a(q, None, None, kv_cache, metadata, written=True), residual=residual)
        group = a.num_heads // a.num_kv_heads
        # Head-major rows: per KV group g, [q_{g*G} .. q_{g*G+G-1}, k_g, v_g] of head_dim each.
        # All three stay views: RoPE (fused into the KV write where the backend can) reads the
        # grouped q and writes (T, H, D); the KV write reads k and v.
        qkv = self.query_key_value(x, norm).view(-1, a.num_kv_heads, group + 2, a.head_dim)   # (T, KVH, G+2, D)
        q, k, v = qkv[:, :, :group], qkv[:, :, group], qkv[:, :, group + 1]              # (T, KVH, G|-, D)
        return self.dense(a(q, k, v, kv_cache, metadata, rope=rope, positions=positions), residual=residual)


class Phi3SmallMLP(nn.Module):
    def __init__(self, c: Phi3SmallConfig, **factory) -> None:
        super().__init__()
        self.limit = c.gegelu_limit
        self.up_proj = Linear(c.hidden_size, 2 * c.ff_intermediate_size, bias=True, **factory)
        self.down_proj = Linear(c.ff_intermediate_size, c.hidden_size, bias=True, **factory)

    def forward(self, x: torch.Tensor, norm=None, residual=None) -> torch.Tensor:
        up = self.up_proj
        if up.uses_kernel(x):  # (the norm,) the projection and GeGeLU in one launch
            return self.down_proj(up(x, norm, activation="gegelu", limit=self.limit), residual=residual)
        return self.down_proj(gegelu(up(x, norm), self.limit), residual=residual)


class Phi3SmallDecoderLayer(PreNormDecoderLayer):
    def __init__(self, c: Phi3SmallConfig, layer: int, **factory) -> None:
        super().__init__()
        self.input_layernorm = LayerNorm(c.hidden_size, c.layer_norm_epsilon, **factory)
        self.self_attn = Phi3SmallAttention(c, layer, **factory)
        self.post_attention_layernorm = LayerNorm(c.hidden_size, c.layer_norm_epsilon, **factory)
        self.mlp = Phi3SmallMLP(c, **factory)

    def projections_after_norms(self) -> list[tuple[nn.Module, Linear]]:
        return [(self.input_layernorm, self.self_attn.query_key_value),
                (self.post_attention_layernorm, self.mlp.up_proj)]


class Phi3Small(DecoderLM):
    """Phi-3-Small causal LM following the model protocol (see ``fullgraph.models.base``). ``seed``:
    random weights (``init_random_``; embeddings ~ N(0, 1/mup_embedding_multiplier)), None before loading.

    LongRoPE policy: the original code re-picks long or short factors on every forward from the
    current length, so cached keys and later queries could be rotated differently. Here the choice
    is made once, at construction, from ``max_model_len`` (the longest sequence this instance serves,
    default ``max_position_embeddings``) and kept for the model's lifetime: long factors and
    long_mscale iff ``max_model_len > original_max_position_embeddings`` (8192), else short
    (``rope_factors`` says which). Every key and query share one rotation; an instance built for > 8K
    rotates short prompts with long factors too, so build with ``max_model_len <= 8192`` to match the
    original on short sequences. Never serve sequences longer than ``max_model_len``.
    """

    def __init__(self, config: Phi3SmallConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, seed: int | None = 0,
                 max_model_len: int | None = None) -> None:
        super().__init__()
        c, factory = config, {"dtype": dtype, "device": device}
        self.config, self.vocab_size = config, c.vocab_size
        self.max_model_len = max_model_len or c.max_position_embeddings
        if not 1 <= self.max_model_len <= c.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} not in [1, {c.max_position_embeddings}]")
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, **factory)
        self.layers = nn.ModuleList(Phi3SmallDecoderLayer(c, i, **factory) for i in range(c.num_hidden_layers))
        self.final_layernorm = LayerNorm(c.hidden_size, c.layer_norm_epsilon, **factory)
        self.lm_head = None  # tied: the embedding is the LM head
        self.build_buffers(device)
        if seed is not None:
            init_random_(self, seed, embedding_std=1.0 / c.mup_embedding_multiplier)

    def build_buffers(self, device: torch.device | str | None) -> None:
        """The RoPE tables and the mask of dummy token ids."""
        c = self.config
        inv_freq, mscale, self.rope_factors = rope_inv_freq(c.head_dim, c.rope_embedding_base), 1.0, None
        if c.rope_scaling is not None:
            long = self.max_model_len > c.rope_scaling.original_max_position_embeddings
            inv_freq, mscale = c.rope_scaling.tables(c.head_dim, c.rope_embedding_base, c.max_position_embeddings, long)
            self.rope_factors = "long" if long else "short"
        self.rotary = RotaryEmbedding(inv_freq, c.max_position_embeddings, mscale, device=device)
        dummy = torch.isin(torch.arange(c.vocab_size), torch.tensor(c.dummy_token_ids, dtype=torch.long))
        self.register_buffer("dummy_mask", dummy.to(device), persistent=False)          # (vocab,) bool

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.config.mup_embedding_multiplier   # (T, hidden)

    def final_norm(self) -> nn.Module:
        return self.final_layernorm

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return (logits / self.config.mup_width_multiplier).masked_fill(self.dummy_mask, float("-inf"))

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32,
                        device: torch.device | str | None = None, max_model_len: int | None = None) -> Phi3Small:
        """Load ``config.json`` + ``*.safetensors`` (checkpoint tensor names) from a directory."""
        from .registry import from_pretrained

        model = from_pretrained(path, dtype=dtype, device=device, max_model_len=max_model_len)
        if not isinstance(model, cls):
            raise ValueError(f"{path}: a {type(model).__name__} checkpoint, not Phi-3-Small")
        return model

    def load_hf_state_dict(self, hf: Mapping[str, torch.Tensor]) -> None:
        """Copy a checkpoint state dict in. Strict: a missing, unknown or misshapen tensor raises
        ``ValueError`` naming it. ``lm_head.weight`` is ignored (tied to ``embed_tokens``)."""
        self.load_own_state(phi3_small_state(hf), source="checkpoint", prefix="model.")


def phi3_small_state(hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors under ``Phi3Small``'s names (its module names are the checkpoint's)."""
    return {k.removeprefix("model."): v for k, v in hf.items() if "rotary_emb" not in k and k != "lm_head.weight"}
