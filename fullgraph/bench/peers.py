"""The peers a decode benchmark measures beside fullgraph, over the same weights and shapes.

``NaiveDecoder``: the whole model's decode step written plainly in PyTorch (no fused kernel of
ours, no paging) over a static KV cache of ``(batch, kv_heads, max_len, head_dim)`` per layer,
every request at the same position, captured whole as one CUDA graph: what anyone gets from
"put the model in a CUDA graph". ``reduce-overhead``: the same step under
``torch.compile(mode="reduce-overhead", fullgraph=True)`` (Inductor's kernels and its own CUDA
graphs). Both attend densely (for Phi-3-Small that is the dense shape: the peers' floor).
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from ..models import Llama, Phi3Small


class NaiveDecoder(nn.Module):
    """One decode step of ``model`` (a ``Llama`` or ``Phi3Small``) for ``batch`` requests. The
    caches and positions are buffers, so ``torch.compile``'s CUDA graphs may write them in place."""

    def __init__(self, model, batch: int, max_len: int) -> None:
        super().__init__()
        self.model, self.phi3 = model, isinstance(model, Phi3Small)
        if not isinstance(model, (Llama, Phi3Small)):
            raise ValueError(f"no naive peer for {type(model).__name__}")
        attn = model.attention_layers()[0]
        self.heads, self.kv_heads, self.head_dim, self.scale = attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale
        p = next(model.parameters())
        shape = (batch, self.kv_heads, max_len, self.head_dim)
        for i in range(len(model.layers)):
            self.register_buffer(f"k{i}", torch.randn(shape, dtype=p.dtype, device=p.device))
            self.register_buffer(f"v{i}", torch.randn(shape, dtype=p.dtype, device=p.device))
        self.register_buffer("tokens", torch.zeros(batch, dtype=torch.long, device=p.device))
        self.register_buffer("pos", torch.zeros(batch, dtype=torch.long, device=p.device))
        self.register_buffer("batch", torch.arange(batch, device=p.device))
        self.register_buffer("keys", torch.arange(max_len, device=p.device))

    def _norm(self, module, x):
        if self.phi3:
            return F.layer_norm(x, x.shape[-1:], module.weight, module.bias, module.eps)
        xf = x.float()
        return module.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps)).to(x.dtype)

    def _rope(self, x):  # (B, heads, D), rotate-half
        cos = self.model.rotary.cos[self.pos][:, None].to(x.dtype)                 # (B, 1, D/2)
        sin = self.model.rotary.sin[self.pos][:, None].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def _attention(self, i: int, layer, x):
        a = layer.self_attn
        b, h, kvh, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        if self.phi3:  # head-major fused rows: per KV group [q_g.., k_g, v_g]
            qkv = F.linear(x, a.query_key_value.weight, a.query_key_value.bias).view(b, kvh, h // kvh + 2, d)
            q, k, v = qkv[:, :, :-2].reshape(b, h, d), qkv[:, :, -2], qkv[:, :, -1]
        else:
            q, k, v = F.linear(x, a.qkv_proj.weight, a.qkv_proj.bias).split((h * d, kvh * d, kvh * d), dim=-1)
            q, k, v = q.view(b, h, d), k.view(b, kvh, d), v.view(b, kvh, d)
        q, k = self._rope(q), self._rope(k)
        cache_k, cache_v = getattr(self, f"k{i}"), getattr(self, f"v{i}")
        cache_k[self.batch, :, self.pos] = k
        cache_v[self.batch, :, self.pos] = v
        mask = torch.where(self.keys[None, :] <= self.pos[:, None], 0.0, -math.inf).to(x.dtype)  # (B, L)
        qg = q.view(b, kvh, h // kvh, d)
        scores = torch.matmul(qg, cache_k.transpose(-1, -2)) * self.scale + mask[:, None, None]   # (B, KVH, G, L)
        out = torch.matmul(scores.float().softmax(-1).to(x.dtype), cache_v).reshape(b, h * d)
        dense = a.dense if self.phi3 else a.o_proj
        return F.linear(out, dense.weight, dense.bias)

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
        x = F.embedding(self.tokens, m.embed_tokens.weight)
        if self.phi3:
            x = x * m.config.mup_embedding_multiplier
        for i, layer in enumerate(m.layers):
            x = x + self._attention(i, layer, self._norm(layer.input_layernorm, x))
            x = x + self._mlp(layer, self._norm(layer.post_attention_layernorm, x))
        x = self._norm(m.final_norm(), x)
        weight = m.embed_tokens.weight if m.lm_head is None else m.lm_head.weight
        return m.scale_logits(F.linear(x, weight).float())


def time_peer(model, kind: str, batch: int, context: int, steps: int = 30, warmup: int = 5) -> dict:
    """Median synchronised step wall time and graph-replay device time (ms) of a peer: ``kind``
    "naive-graph" (one captured CUDA graph) or "reduce-overhead" (torch.compile's mode)."""
    dec = NaiveDecoder(model, batch, context + steps + warmup + 1)
    dec.pos.fill_(context)
    with torch.inference_mode():
        if kind == "naive-graph":
            for _ in range(2):
                dec()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                dec()
            run = graph.replay
        elif kind == "reduce-overhead":
            compiled = torch.compile(dec, mode="reduce-overhead", fullgraph=True)
            for _ in range(3):
                compiled()
            run = compiled
        else:
            raise ValueError(f"peer {kind!r}: expected 'naive-graph' or 'reduce-overhead'")
        times = []
        for i in range(warmup + steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            dec.pos.add_(1)
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
