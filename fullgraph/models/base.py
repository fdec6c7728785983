"""The model protocol (everything the runner reads of a model) and the base class our models share.

Any ``nn.Module`` following :class:`CausalLM` can be wrapped by ``FullGraphRunner``:

- ``vocab_size: int``; ``max_model_len: int``: the longest sequence it serves (the runner refuses
  a bigger ``RunnerConfig.max_model_len``; e.g. the RoPE table's length, LongRoPE's choice).
- ``attention_layers() -> list[Attention]``: its attention layers in the order of ``kv_caches``
  (the runner allocates one cache per entry, shaped from the layer's heads and head size, and maps
  each layer's ``kind`` to a backend).
- ``forward(input_ids, positions, kv_caches, metadata) -> hidden``: ``input_ids`` and
  ``positions`` are (T,) int64, ``kv_caches`` a list of per-layer caches, ``metadata`` an
  ``AttentionMetadata``; returns (T, hidden_size). Capture-safe: no host syncs, no
  data-dependent shapes; everything per step comes in through these arguments.
- ``compute_logits(hidden) -> logits``: (N, hidden_size) -> (N, vocab_size) float32, including
  any final scaling or masking the model defines.

Optional: ``layers``, an ``nn.ModuleList`` of decoder layers, each returning its hidden state (or
``(output, residual)`` whose sum is it): ``fullgraph.debug.compare`` hooks them; and
``step_weight_bytes() -> int``, the bytes of weights one decode step reads (benchmark floors).

The model never sees the runner, the planner or the static buffers.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from .. import env
from ..attention import Attention, AttentionMetadata


@runtime_checkable
class CausalLM(Protocol):
    vocab_size: int
    max_model_len: int

    def attention_layers(self) -> list[Attention]: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metadata: AttentionMetadata) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def check_model(model: nn.Module) -> list[Attention]:
    """Validate the protocol; returns the attention layers."""
    missing = [name for name in ("vocab_size", "max_model_len", "attention_layers", "forward", "compute_logits")
               if not hasattr(model, name)]
    if missing:
        hint = ""
        if type(model).__module__.startswith("transformers"):
            hint = " (a transformers model: wrap it with fullgraph.models.from_hf(model), or pass it to FullGraphRunner)"
        raise ValueError(f"{type(model).__name__} does not follow the model protocol: missing {missing} "
                         f"(see fullgraph.models.base){hint}")
    layers = list(model.attention_layers())
    if not layers or not all(isinstance(layer, Attention) for layer in layers):
        raise ValueError(f"{type(model).__name__}.attention_layers() must return a non-empty list of Attention layers")
    return layers


class DecoderLM(nn.Module):
    """The decoder-only LM our models are: embedding, pre-norm decoder layers over one residual
    stream (each ``layers[i]`` a ``PreNormDecoderLayer`` whose ``self_attn.attn`` is its attention),
    a final norm and an LM head (``lm_head``, or the embedding when tied: ``lm_head is None``).

    Subclasses build ``embed_tokens``, ``layers``, the final norm, ``rotary`` and ``lm_head``, and
    may override ``embed`` (input scaling), ``final_norm`` and ``scale_logits``.
    """

    vocab_size: int
    max_model_len: int
    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    lm_head: nn.Module | None

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)                                  # (T, hidden)

    def final_norm(self) -> nn.Module:
        return self.norm

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metadata: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed(input_ids), None                          # (T, hidden)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, self.rotary, kv_cache, metadata)
        return self.final_norm()(x) if residual is None else self.final_norm()(x, residual)[0]

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Any final scaling / masking of the float32 logits (none by default)."""
        return logits

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head
        if head is None or isinstance(head, nn.Linear):
            weight = self.embed_tokens.weight if head is None else head.weight
            if hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16) and "head32" in env.fused():
                # float32 logits from the GEMM itself (cuBLAS accumulates in float32 anyway): no bf16
                # rounding of the logits, and no cast kernel reading them back
                return self.scale_logits(torch.mm(hidden, weight.t(), out_dtype=torch.float32))
            logits = hidden @ weight.t()
        else:  # a head module of its own (the vocabulary-parallel one): hidden -> full logits
            logits = head(hidden)
        return self.scale_logits(logits.float())                              # (N, vocab) float32

    def step_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every parameter except the embedding table,
        which contributes a few rows (unless tied, when it is the LM head and is read whole)."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        if self.lm_head is not None and self.lm_head.weight is not self.embed_tokens.weight:
            total -= self.embed_tokens.weight.numel() * self.embed_tokens.weight.element_size()
        return total

    def load_own_state(self, state: Mapping[str, torch.Tensor], *, source: str, share: bool = False,
                       prefix: str = "") -> None:
        """Load tensors named as ``self.state_dict()`` names them, strictly: a missing, unknown or
        misshapen tensor raises ``ValueError`` naming it (and both shapes) before anything is
        copied. ``share``: the parameters become the given tensors (same storage, no copy; dtype
        and device must already match), else values are copied into the existing parameters.
        ``prefix``: what the checkpoint puts before these names (errors name its tensors).
        Buffers (RoPE tables, masks) are the model's own, never loaded."""
        own = dict(self.named_parameters(remove_duplicate=False))

        def named(k: str) -> str:  # the checkpoint's name of one of ours
            return k if k.startswith("lm_head") else prefix + k
        missing = [named(k) for k in sorted(set(own) - set(state))]
        unknown = [named(k) for k in sorted(set(state) - set(own))]
        if missing or unknown:
            raise ValueError(f"{source} does not match {type(self).__name__}: missing tensors {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}, unexpected tensors {unknown[:8]}"
                             f"{' ...' if len(unknown) > 8 else ''}")
        bad = [f"{named(k)}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}" for k, v in state.items()
               if tuple(v.shape) != tuple(own[k].shape)]
        if bad:
            raise ValueError(f"{source}: tensors of the wrong shape: {bad[:8]}{' ...' if len(bad) > 8 else ''}")
        if share:
            self._share(state, source)
        else:
            with torch.no_grad():
                for name, param in own.items():
                    param.copy_(state[name])

    def _share(self, state: Mapping[str, torch.Tensor], source: str) -> None:
        """Every parameter becomes a Parameter over the given tensor's storage (no copy). A model
        built on the ``meta`` device takes the tensors' device; otherwise they must match."""
        for name, param in list(self.named_parameters(remove_duplicate=False)):
            t = state[name]
            if t.dtype != param.dtype or (param.device.type != "meta" and t.device != param.device):
                raise ValueError(f"{source}: {name} is {t.dtype} on {t.device}, the model {param.dtype} on "
                                 f"{param.device}: build the model with that dtype and device to share storage")
            owner, _, leaf = name.rpartition(".")
            self.get_submodule(owner)._parameters[leaf] = nn.Parameter(t.detach(), requires_grad=False)
