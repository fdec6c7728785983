"""The peers a decode benchmark measures beside fullgraph, over the same weights and shapes.

``naive-graph``: ``NaiveDecoder``, the whole model's decode step written the way a careful PyTorch
user writes it (the new key and value ``index_copy_``-ed into a static ``(batch, kv_heads, max_len,
head_dim)`` cache per layer, one mask per step, ``F.scaled_dot_product_attention`` over the cache;
no fused kernel of ours, no paging), every request at the same position, captured whole as one
CUDA graph: what anyone gets from "put the model in a CUDA graph". ``reduce-overhead``: the same
step under ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (Inductor's kernels and its
own CUDA graphs). ``hf-static-compile``: transformers' documented fast path, ``LlamaForCausalLM``
with a ``StaticCache`` and its forward under the same ``torch.compile`` mode (Llama family only).
All attend densely (for Phi-3-Small that is the dense shape; for a sliding window the whole cache):
the peers' floor.
"""
from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..models import Llama, Phi3Small

PEERS = ("naive-graph", "reduce-overhead", "hf-static-compile")


class NoPeer(ValueError):
    """This peer cannot run this model here (its architecture, or a missing optional package)."""


class NaiveDecoder(nn.Module):
    """One decode step of ``model`` (a ``Llama`` or ``Phi3Small``) for ``batch`` requests, all at
    position ``pos``. Capture-safe: the tokens, the position and the caches are buffers (so CUDA-graph
    replays and ``torch.compile``'s CUDA graphs read and write them in place); no host syncs."""

    def __init__(self, model, batch: int, max_len: int) -> None:
        super().__init__()
        if not isinstance(model, (Llama, Phi3Small)):
            raise NoPeer(f"no naive peer for {type(model).__name__}")
        self.model, self.phi3 = model, isinstance(model, Phi3Small)
        attn = model.attention_layers()[0]
        self.heads, self.kv_heads, self.head_dim, self.scale = attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale
        p = next(model.parameters())
        shape = (batch, self.kv_heads, max_len, self.head_dim)
        for i in range(len(model.layers)):
            self.register_buffer(f"k{i}", torch.randn(shape, dtype=p.dtype, device=p.device))
            self.register_buffer(f"v{i}", torch.randn(shape, dtype=p.dtype, device=p.device))
        self.register_buffer("tokens", torch.zeros(batch, dtype=torch.long, device=p.device))
        self.register_buffer("pos", torch.zeros(1, dtype=torch.long, device=p.device))   # every request's position
        self.register_buffer("keys", torch.arange(max_len, device=p.device))

    def _norm(self, module, x):
        """The norm as a careful user writes it today: one PyTorch call (``F.rms_norm`` runs one
        fused CUDA kernel, where the hand-written float32 form ran five or six)."""
        if self.phi3:
            return F.layer_norm(x, x.shape[-1:], module.weight, module.bias, module.eps)
        return F.rms_norm(x, x.shape[-1:], module.weight, module.eps)

    @staticmethod
    def _rope(x, cos, sin):  # rotate-half in float32, as the model does; cos, sin: (1, D/2)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    def _qkv(self, a, x):
        """q (B, KVH, G, D) grouped by KV head, k and v (B, KVH, D)."""
        b, kvh, g, d = x.shape[0], self.kv_heads, self.heads // self.kv_heads, self.head_dim
        if self.phi3:  # head-major fused rows: per KV group [q_g.., k_g, v_g]
            qkv = F.linear(x, a.query_key_value.weight, a.query_key_value.bias).view(b, kvh, g + 2, d)
            return qkv[:, :, :g], qkv[:, :, g], qkv[:, :, g + 1]
        q, k, v = F.linear(x, a.qkv_proj.weight, a.qkv_proj.bias).split((kvh * g * d, kvh * d, kvh * d), dim=-1)
        q, k, v = q.view(b, kvh, g, d), k.view(b, kvh, d), v.view(b, kvh, d)
        if hasattr(a, "q_norm"):  # per head, before RoPE (Qwen3)
            q, k = self._norm(a.q_norm, q), self._norm(a.k_norm, k)
        return q, k, v

    def _attention(self, i: int, layer, x, cos, sin, mask):
        a = layer.self_attn
        q, k, v = self._qkv(a, x)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        cache_k, cache_v = getattr(self, f"k{i}"), getattr(self, f"v{i}")
        cache_k.index_copy_(2, self.pos, k.unsqueeze(2))                             # (B, KVH, L, D)
        cache_v.index_copy_(2, self.pos, v.unsqueeze(2))
        # A KV head's G query heads ride as G query rows of one attention over that head's keys: GQA
        # without copying the cache (enable_gqa=True with a mask falls back to the math backend,
        # which repeats every key and value G times).
        out = F.scaled_dot_product_attention(q, cache_k, cache_v, attn_mask=mask, scale=self.scale)  # (B, KVH, G, D)
        dense = a.dense if self.phi3 else a.o_proj
        return F.linear(out.reshape(x.shape[0], -1), dense.weight, dense.bias)

    def _mlp(self, layer, x):
        m = layer.mlp
        if self.phi3:
            u = F.linear(x, m.up_proj.weight, m.up_proj.bias)
            a, g = u[..., 0::2], u[..., 1::2]
            lim = m.limit if m.limit is not None else math.inf
            y = a.clamp(max=lim) * torch.sigmoid(1.702 * a.clamp(max=lim)) * (g.clamp(-lim, lim) + 1)
            return F.linear(y, m.down_proj.weight, m.down_proj.bias)
        gate, up = F.linear(x, m.gate_up_proj.weight, m.gate_up_proj.bias).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, m.down_proj.weight, m.down_proj.bias)

    def forward(self) -> torch.Tensor:
        """Logits (B, vocab) of one decode step at ``self.pos``; writes the new keys and values."""
        m = self.model
        x = F.embedding(self.tokens, m.embed_tokens.weight)                          # (B, hidden)
        if self.phi3:
            x = x * m.config.mup_embedding_multiplier
        cos, sin = m.rotary.cos[self.pos], m.rotary.sin[self.pos]                    # (1, D/2) float32
        # additive, in the activations' dtype: SDPA would convert a boolean mask again in every layer
        mask = torch.where(self.keys <= self.pos, 0.0, -math.inf).to(x.dtype).view(1, 1, 1, -1)   # (1, 1, 1, L)
        for i, layer in enumerate(m.layers):
            x = x + self._attention(i, layer, self._norm(layer.input_layernorm, x), cos, sin, mask)
            x = x + self._mlp(layer, self._norm(layer.post_attention_layernorm, x))
        x = self._norm(m.final_norm(), x)
        weight = m.embed_tokens.weight if m.lm_head is None else m.lm_head.weight
        return m.scale_logits(F.linear(x, weight).float())


def hf_llama(model: Llama):
    """transformers' ``LlamaForCausalLM`` of ``model``'s shape, dtype and device, holding a copy of
    ``model``'s weights (the fused q/k/v and gate/up rows split back into transformers' tensors), so
    it computes the same logits. Dense attention (a sliding window is dropped, as in the other peers),
    transformers' SDPA attention. ``NoPeer`` (a ``ValueError``) for a model ``LlamaForCausalLM``
    cannot express (Phi-3-Small, Qwen2's q/k/v-only biases, Qwen3's q/k norms) or when transformers
    is missing."""
    if not isinstance(model, Llama):
        raise NoPeer(f"no transformers peer for {type(model).__name__} (Llama-family presets only)")
    c = model.config
    if c.qkv_bias or c.qk_norm:
        raise NoPeer("no transformers peer for Qwen2's q/k/v-only biases or Qwen3's q/k norms "
                     "(LlamaForCausalLM has neither)")
    try:
        import transformers
    except ImportError:
        raise NoPeer("the hf-static-compile peer needs transformers (pip install 'fullgraph[hf]')") from None
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
        rope_parameters={"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": c.rope_theta},
        tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias, mlp_bias=c.mlp_bias)
    p = next(model.parameters())
    with torch.device(p.device):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=p.dtype, attn_implementation="sdpa")
    hf.load_state_dict(_hf_state(model), strict=True)
    return hf.eval()


def _hf_state(model: Llama) -> dict[str, torch.Tensor]:
    """``model``'s tensors under transformers' names: the inverse of ``models.hf.llama_state``."""
    c, sd = model.config, {}
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for name, t in model.state_dict().items():
        prefix, _, kind = name.rpartition(".")
        if prefix.endswith("self_attn.qkv_proj"):
            for part, chunk in zip("qkv", t.split((q, kv, kv))):
                sd[f"model.{prefix[:-len('qkv_proj')]}{part}_proj.{kind}"] = chunk
        elif prefix.endswith("mlp.gate_up_proj"):
            for part, chunk in zip(("gate", "up"), t.chunk(2)):
                sd[f"model.{prefix[:-len('gate_up_proj')]}{part}_proj.{kind}"] = chunk
        else:
            sd[name if name.startswith("lm_head") else "model." + name] = t
    if c.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


class HFStaticDecoder:
    """transformers' documented decode fast path over ``hf_llama(model)``: a ``StaticCache`` of
    ``max_len`` tokens, ``batch`` requests whose first ``context`` positions are filled by an
    uncompiled prefill of random tokens (``prompt[:, :context]``; untimed, in chunks of about
    ``prefill_tokens`` tokens to bound its activations), then
    ``model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`` for
    the decode steps. ``step()`` decodes (B, 1) tokens at ``positions``; ``advance()`` moves the
    positions on (the cache counts its own length)."""

    def __init__(self, model, batch: int, context: int, max_len: int, prefill_tokens: int = 8192) -> None:
        self.hf = hf_llama(model)   # first: it says why there is no peer
        import transformers

        c, p = self.hf.config, next(self.hf.parameters())
        self.cache = transformers.StaticCache(config=c, max_cache_len=max_len)
        self.cache.early_initialization(batch, c.num_key_value_heads, c.head_dim, p.dtype, p.device)
        names = inspect.signature(type(self.hf).forward).parameters
        self.cache_arg = "cache" if "cache" in names else "past_key_values"   # renamed in transformers 5.x
        self.cache_position = "cache_position" in names                         # earlier 5.x: positions given
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.prompt = torch.randint(0, c.vocab_size, (batch, context + 1), generator=gen)   # + the decoded token
        chunk = max(1, prefill_tokens // batch)
        for start in range(0, context, chunk):
            ids = self.prompt[:, start:min(start + chunk, context)].to(p.device)              # (B, chunk)
            self._forward(ids, torch.arange(start, start + ids.shape[1], device=p.device).expand(batch, -1))
        self.tokens = self.prompt[:, context:].contiguous().to(p.device)                    # (B, 1)
        self.positions = torch.full((batch, 1), context, dtype=torch.long, device=p.device)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        kwargs = {self.cache_arg: self.cache, "use_cache": True, "logits_to_keep": 1}
        if self.cache_position:
            kwargs["cache_position"] = positions[0]
        return self.hf(input_ids=ids, position_ids=positions, **kwargs).logits[:, -1]

    def compile(self) -> None:
        self.hf.forward = torch.compile(self.hf.forward, mode="reduce-overhead", fullgraph=True)

    def step(self) -> torch.Tensor:
        """Logits (B, vocab) of one decode step."""
        return self._forward(self.tokens, self.positions)

    def advance(self) -> None:
        self.positions.add_(1)


def _peer(model, kind: str, batch: int, context: int, max_len: int) -> tuple[Callable, Callable]:
    """(one decode step, move the position on) of peer ``kind``, compiled or captured and warm."""
    if kind not in PEERS:
        raise ValueError(f"peer {kind!r}: expected one of {PEERS}")
    if kind != "naive-graph":  # each shape compiles afresh: never against Dynamo's recompile limit
        torch._dynamo.reset()
    if kind == "hf-static-compile":
        dec = HFStaticDecoder(model, batch, context, max_len)
        dec.compile()
        for _ in range(3):   # warm-up, CUDA-graph recording, first replay
            dec.step()
            dec.advance()
        return dec.step, dec.advance
    dec = NaiveDecoder(model, batch, max_len)
    dec.pos.fill_(context)
    if kind == "naive-graph":
        for _ in range(2):
            dec()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dec()
        return graph.replay, lambda: dec.pos.add_(1)
    compiled = torch.compile(dec, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        compiled()
    return compiled, lambda: dec.pos.add_(1)


def time_peer(model, kind: str, batch: int, context: int, steps: int = 30, warmup: int = 5) -> dict:
    """Median synchronised step wall time (``step_ms``) and device time per step over back-to-back
    calls (``replay_ms``) of peer ``kind`` (one of ``PEERS``), ``batch`` requests at ``context``."""
    max_len = -(-(context + 2 * steps + warmup + 8) // 256) * 256   # every step below fits the cache
    with torch.inference_mode():
        run, advance = _peer(model, kind, batch, context, max_len)
        times = []
        for i in range(warmup + steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            advance()
            torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - start)
        start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_ev.record()
        for _ in range(steps):
            run()
        end_ev.record()
        end_ev.synchronize()
    times.sort()
    return {"step_ms": times[len(times) // 2] * 1e3, "replay_ms": start_ev.elapsed_time(end_ev) / steps}
