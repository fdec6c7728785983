"""Slicing a built model's layers for one rank (in place): which heads, rows and columns it keeps."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from ..attention import Attention
from ..models.layers import Linear
from ..models.llama import Llama
from ..models.phi3_small import Phi3Small
from .group import TensorParallel
from .layers import RowParallelLinear, VocabParallelEmbedding, VocabParallelHead


@dataclass(frozen=True)
class HeadSplit:
    """One rank's query heads and KV heads (global indices, ascending)."""

    q: range
    kv: range


def split_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadSplit:
    """Query heads split evenly; KV heads too, or, when there are fewer KV heads than ranks, each
    rank keeps (a replica of) the one KV head its query heads read."""
    w, r = tp.world_size, tp.rank
    if num_heads % w or (num_kv_heads % w and w % num_kv_heads):
        raise ValueError(f"tensor_parallel_size {w} must divide the {num_heads} query heads, and divide or be a "
                         f"multiple of the {num_kv_heads} KV heads")
    per = num_heads // w
    q = range(r * per, (r + 1) * per)
    if num_kv_heads >= w:
        kv_per = num_kv_heads // w
        return HeadSplit(q, range(r * kv_per, (r + 1) * kv_per))
    group = num_heads // num_kv_heads
    return HeadSplit(q, range(q.start // group, q.start // group + 1))


def shard_model(model: nn.Module, tp: TensorParallel) -> nn.Module:
    """Keep this rank's shard of every layer of ``model`` (a ``Llama`` or ``Phi3Small``), in place;
    returns the model. Every rank must pass the same model (same weights)."""
    if getattr(model, "tensor_parallel", None) is not None:
        raise ValueError("shard_model: this model is already sharded")
    if isinstance(model, Llama):
        _shard_llama(model, tp)
    elif isinstance(model, Phi3Small):
        _shard_phi3_small(model, tp)
    else:
        raise ValueError(f"tensor parallelism supports Llama-family and Phi-3-Small models, not {type(model).__name__}")
    _shard_vocab(model, tp)
    model.tensor_parallel = tp
    return model


def _part(size: int, tp: TensorParallel, what: str) -> range:
    if size % tp.world_size:
        raise ValueError(f"tensor_parallel_size {tp.world_size} must divide {what} ({size})")
    per = size // tp.world_size
    return range(tp.rank * per, (tp.rank + 1) * per)


def _rows(heads: range, head_dim: int, base: int = 0) -> list[int]:
    return [base + h * head_dim + i for h in heads for i in range(head_dim)]


def _column(lin: nn.Linear, rows: list[int]) -> Linear:
    """The output features ``rows`` of ``lin`` (with their bias)."""
    index = torch.tensor(rows, device=lin.weight.device)
    out = Linear(lin.in_features, len(rows), bias=lin.bias is not None, device="meta")
    out.weight = nn.Parameter(lin.weight.detach().index_select(0, index), requires_grad=False)
    if lin.bias is not None:
        out.bias = nn.Parameter(lin.bias.detach().index_select(0, index), requires_grad=False)
    return out


def _row(lin: nn.Linear, cols: list[int] | range, tp: TensorParallel) -> RowParallelLinear:
    """The input features ``cols`` of ``lin``, summed over ranks; the bias whole, added once."""
    index = torch.tensor(list(cols), device=lin.weight.device)
    bias = None if lin.bias is None else lin.bias.detach().clone()
    return RowParallelLinear(lin.weight.detach().index_select(1, index).contiguous(), bias, tp)


def _attention(attn: Attention, heads: HeadSplit) -> Attention:
    sparse = attn.sparse and dataclasses.replace(attn.sparse, head_offset=heads.q.start)
    return Attention(len(heads.q), len(heads.kv), attn.head_dim, attn.scale, kind=attn.kind, sparse=sparse,
                     sliding_window=attn.sliding_window)


def _shard_llama(model: Llama, tp: TensorParallel) -> None:
    c = model.config
    d, heads = c.head_dim, split_heads(c.num_heads, c.num_kv_heads, tp)
    q_size, kv_size = c.num_heads * d, c.num_kv_heads * d
    ffn = _part(c.intermediate_size, tp, "intermediate_size")
    for layer in model.layers:
        att, mlp = layer.self_attn, layer.mlp
        att.qkv_proj = _column(att.qkv_proj, _rows(heads.q, d) + _rows(heads.kv, d, q_size)
                               + _rows(heads.kv, d, q_size + kv_size))
        att.o_proj = _row(att.o_proj, _rows(heads.q, d), tp)
        att.q_size, att.kv_size = len(heads.q) * d, len(heads.kv) * d
        att.attn = _attention(att.attn, heads)
        mlp.gate_up_proj = _column(mlp.gate_up_proj, list(ffn) + [c.intermediate_size + i for i in ffn])
        mlp.down_proj = _row(mlp.down_proj, ffn, tp)


def _shard_phi3_small(model: Phi3Small, tp: TensorParallel) -> None:
    c = model.config
    d = c.head_dim
    heads = split_heads(c.num_attention_heads, c.num_key_value_heads, tp)
    group = c.num_attention_heads // c.num_key_value_heads
    ffn = _part(c.ff_intermediate_size, tp, "ff_intermediate_size")
    qkv_rows = []  # per kept KV group, head-major as the checkpoint: its kept q heads, then k and v
    for g in heads.kv:
        slots = [h - g * group for h in heads.q if h // group == g] + [group, group + 1]
        qkv_rows += _rows(slots, d, g * (group + 2) * d)
    for layer in model.layers:
        att, mlp = layer.self_attn, layer.mlp
        att.query_key_value = _column(att.query_key_value, qkv_rows)
        att.dense = _row(att.dense, _rows(heads.q, d), tp)
        att.attn = _attention(att.attn, heads)
        # GeGeLU reads interleaved (gelu, linear) column pairs: output i comes from rows 2i and 2i + 1
        mlp.up_proj = _column(mlp.up_proj, [2 * i + j for i in ffn for j in (0, 1)])
        mlp.down_proj = _row(mlp.down_proj, ffn, tp)


def _shard_vocab(model: Llama | Phi3Small, tp: TensorParallel) -> None:
    rows = _part(model.vocab_size, tp, "the vocabulary size")
    table = model.embed_tokens.weight.detach()
    embed = VocabParallelEmbedding(table[rows.start: rows.stop].clone(), rows.start, tp)
    head = embed.weight if model.lm_head is None else nn.Parameter(
        model.lm_head.weight.detach()[rows.start: rows.stop].clone(), requires_grad=False)
    model.embed_tokens, model.lm_head = embed, VocabParallelHead(head, tp)
