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


@dataclass(frozen=True)
class Cut:
    """One rank's part of a tensor: the slices ``ranges`` along ``dim``, concatenated in order."""

    dim: int
    ranges: tuple[range, ...]

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``t`` (a new tensor; on ``meta`` a shape only)."""
        parts = [t.narrow(self.dim, r.start, len(r)) for r in self.ranges]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, self.dim)).contiguous().clone()

    def within(self, offset: int, size: int) -> Cut | None:
        """This cut of a tensor fused along ``dim`` from parts, restricted to the part at ``offset``
        of ``size`` and relative to it (None: it keeps nothing of that part)."""
        kept = tuple(range(max(r.start, offset) - offset, min(r.stop, offset + size) - offset) for r in self.ranges)
        kept = tuple(r for r in kept if len(r))
        return Cut(self.dim, kept) if kept else None


def shard_plan(model: nn.Module, tp: TensorParallel) -> dict[str, Cut]:
    """What rank ``tp.rank`` keeps of each parameter of an unsharded ``Llama`` or ``Phi3Small``, by
    parameter name; a parameter not named is kept whole. The one source of the shard's indices:
    ``shard_model`` slices a built model with it, ``checkpoint_cuts`` a checkpoint as it is read."""
    if isinstance(model, Llama):
        plan = _llama_plan(model, tp)
    elif isinstance(model, Phi3Small):
        plan = _phi3_small_plan(model, tp)
    else:
        raise ValueError(f"tensor parallelism supports Llama-family and Phi-3-Small models, not {type(model).__name__}")
    vocab = Cut(0, (_part(model.vocab_size, tp, "the vocabulary size"),))
    plan["embed_tokens.weight"] = vocab
    if model.lm_head is not None:
        plan["lm_head.weight"] = vocab
    return plan


def shard_model(model: nn.Module, tp: TensorParallel) -> nn.Module:
    """Keep this rank's shard of every layer of ``model`` (a ``Llama`` or ``Phi3Small``), in place;
    returns the model. Every rank must pass the same model (same weights). On the ``meta`` device
    it gives the sharded model's shapes (what ``from_pretrained(..., tensor_parallel=tp)`` fills)."""
    if getattr(model, "tensor_parallel", None) is not None:
        raise ValueError("shard_model: this model is already sharded")
    plan = shard_plan(model, tp)
    for name, cut in plan.items():
        owner, _, leaf = name.rpartition(".")
        if leaf != "weight" or owner in ("embed_tokens", "lm_head"):
            continue
        lin = model.get_submodule(owner)
        parent, _, attr = owner.rpartition(".")
        if cut.dim == 0:   # column-parallel: its output features (and their biases)
            setattr(model.get_submodule(parent), attr, _column(lin, cut))
        else:              # row-parallel: its input features, one all-reduce
            setattr(model.get_submodule(parent), attr, _row(lin, cut, tp))
    for layer in model.layers:
        attn = layer.self_attn.attn
        heads = split_heads(attn.num_heads, attn.num_kv_heads, tp)
        layer.self_attn.attn = _attention(attn, heads)
        if isinstance(model, Llama):
            d = attn.head_dim
            layer.self_attn.q_size, layer.self_attn.kv_size = len(heads.q) * d, len(heads.kv) * d
    _shard_vocab(model, plan["embed_tokens.weight"], tp)
    model.tensor_parallel = tp
    return model


def _part(size: int, tp: TensorParallel, what: str) -> range:
    if size % tp.world_size:
        raise ValueError(f"tensor_parallel_size {tp.world_size} must divide {what} ({size})")
    per = size // tp.world_size
    return range(tp.rank * per, (tp.rank + 1) * per)


def _rows(heads: range, head_dim: int, base: int = 0) -> range:
    """The rows (or columns) of consecutive heads ``heads`` in a tensor whose heads start at ``base``."""
    return range(base + heads.start * head_dim, base + heads.stop * head_dim)


def _column(lin: nn.Linear, cut: Cut) -> Linear:
    """The output features ``cut`` keeps of ``lin`` (with their bias)."""
    weight = cut.take(lin.weight.detach())
    out = Linear(lin.in_features, weight.shape[0], bias=lin.bias is not None, device="meta")
    out.weight = nn.Parameter(weight, requires_grad=False)
    if lin.bias is not None:
        out.bias = nn.Parameter(cut.take(lin.bias.detach()), requires_grad=False)
    return out


def _row(lin: nn.Linear, cut: Cut, tp: TensorParallel) -> RowParallelLinear:
    """The input features ``cut`` keeps of ``lin``, summed over ranks; the bias whole, added once."""
    bias = None if lin.bias is None else lin.bias.detach().clone()
    return RowParallelLinear(cut.take(lin.weight.detach()), bias, tp)


def _attention(attn: Attention, heads: HeadSplit) -> Attention:
    sparse = attn.sparse and dataclasses.replace(attn.sparse, head_offset=heads.q.start)
    return Attention(len(heads.q), len(heads.kv), attn.head_dim, attn.scale, kind=attn.kind, sparse=sparse,
                     sliding_window=attn.sliding_window)


def _llama_plan(model: Llama, tp: TensorParallel) -> dict[str, Cut]:
    c = model.config
    d, heads = c.head_dim, split_heads(c.num_heads, c.num_kv_heads, tp)
    q_size, kv_size = c.num_heads * d, c.num_kv_heads * d
    ffn = _part(c.intermediate_size, tp, "intermediate_size")
    qkv = Cut(0, (_rows(heads.q, d), _rows(heads.kv, d, q_size), _rows(heads.kv, d, q_size + kv_size)))
    gate_up = Cut(0, (ffn, range(c.intermediate_size + ffn.start, c.intermediate_size + ffn.stop)))
    return _layers(model, c.num_layers, {"self_attn.qkv_proj": qkv, "mlp.gate_up_proj": gate_up},
                   {"self_attn.o_proj": Cut(1, (_rows(heads.q, d),)), "mlp.down_proj": Cut(1, (ffn,))})


def _phi3_small_plan(model: Phi3Small, tp: TensorParallel) -> dict[str, Cut]:
    c = model.config
    d = c.head_dim
    heads = split_heads(c.num_attention_heads, c.num_key_value_heads, tp)
    group = c.num_attention_heads // c.num_key_value_heads
    ffn = _part(c.ff_intermediate_size, tp, "ff_intermediate_size")
    rows = []  # per kept KV group, head-major as the checkpoint: its kept q heads, then its k and v
    for g in heads.kv:
        base = g * (group + 2) * d
        mine = [h - g * group for h in heads.q if h // group == g]
        rows += [_rows(range(mine[0], mine[-1] + 1), d, base), _rows(range(group, group + 2), d, base)]
    qkv = Cut(0, tuple(rows))
    up = Cut(0, (range(2 * ffn.start, 2 * ffn.stop),))   # GeGeLU's interleaved (gelu, linear) row pairs
    return _layers(model, c.num_hidden_layers, {"self_attn.query_key_value": qkv, "mlp.up_proj": up},
                   {"self_attn.dense": Cut(1, (_rows(heads.q, d),)), "mlp.down_proj": Cut(1, (ffn,))})


def _layers(model: nn.Module, num_layers: int, columns: dict[str, Cut], rows: dict[str, Cut]) -> dict[str, Cut]:
    """Every layer's cuts: column-parallel linears (weight and bias cut alike) and row-parallel ones
    (the weight's columns; the bias stays whole), for the parameters the model has."""
    plan = {}
    for i in range(num_layers):
        for name, cut in columns.items():
            plan[f"layers.{i}.{name}.weight"] = plan[f"layers.{i}.{name}.bias"] = cut
        for name, cut in rows.items():
            plan[f"layers.{i}.{name}.weight"] = cut
    names = dict(model.named_parameters())
    return {k: v for k, v in plan.items() if k in names}


def _shard_vocab(model: Llama | Phi3Small, cut: Cut, tp: TensorParallel) -> None:
    embed = VocabParallelEmbedding(cut.take(model.embed_tokens.weight.detach()), cut.ranges[0].start, tp)
    head = embed.weight if model.lm_head is None else nn.Parameter(cut.take(model.lm_head.weight.detach()),
                                                                   requires_grad=False)
    model.embed_tokens, model.lm_head = embed, VocabParallelHead(head, tp)


def checkpoint_cuts(model: nn.Module, tp: TensorParallel) -> dict[str, tuple[Cut, tuple[int, ...]]]:
    """What rank ``tp.rank`` reads of each tensor of a Hugging Face checkpoint of ``model`` (built
    unsharded, on ``meta`` will do): checkpoint name -> (its cut, the tensor's full shape, which the
    reader checks first). Llama-family checkpoints store q / k / v and gate / up apart or fused
    (Phi-3): both namings are listed, a fused tensor's cut split over its parts."""
    params = dict(model.named_parameters())
    out = {}
    for name, cut in shard_plan(model, tp).items():
        shape = tuple(params[name].shape)
        out[name if name.startswith("lm_head") else "model." + name] = (cut, shape)
        if not isinstance(model, Llama):
            continue
        owner, _, kind = name.rpartition(".")        # layers.{i}.self_attn.qkv_proj, weight
        c = model.config
        q, kv, ffn = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        fused = {"self_attn.qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
                 "mlp.gate_up_proj": (("gate_proj", ffn), ("up_proj", ffn))}
        parts = fused.get(owner.split(".", 2)[-1])
        offset = 0
        for part, size in parts or ():
            piece = cut.within(offset, size)
            if piece is not None:
                module = owner.rpartition(".")[0]
                out[f"model.{module}.{part}.{kind}"] = (piece, (size, *shape[1:]))
            offset += size
    return out
