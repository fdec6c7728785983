"""Layers shared by the models: norms, rotary embeddings, activations, random initialisation.

On CUDA the hot small ops run as single fused Triton launches (``fullgraph.kernels``): in a
captured decode step each tiny kernel costs microseconds, and eager PyTorch needs about eight
for a norm and twenty for RoPE. They are registered ops with fake implementations, so
``torch.compile`` traces them as single opaque launches and fuses only the glue between them:
measured on an H200, that beats letting Inductor generate the norms, RoPE and activations itself
(llama-1b batch 1 replay 0.900 vs 0.934 ms, Phi-3-Small 4.306 vs 4.380 ms; BENCHMARKS.md). On
the CPU the plain-PyTorch formulas run: they are the reference.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from .. import env
from .rope import llama3_inv_freq, rope_inv_freq  # noqa: F401  (re-exported: the models' RoPE tables)

try:
    from .. import kernels
except ImportError:  # no Triton (e.g. macOS): the PyTorch formulas everywhere
    kernels = None


def use_kernels(x: torch.Tensor) -> bool:
    """Fused Triton kernels for this tensor: whenever it is on CUDA (compiled or not)."""
    return kernels is not None and x.is_cuda


def kernel_path(x: torch.Tensor, fuse_rows: int) -> bool:
    """Whether ``x`` is a half-precision activation on CUDA whose projections run our kernels
    (``Linear.uses_kernel``) and whose layers fuse: one row (batch-1 decode, the one-row kernel), or
    2 to ``fuse_rows`` rows (:func:`fused_max_rows`: the split-K kernel, which fuses as the one-row
    one does), unless a captured candidate form says otherwise (``kernels.linear_fused_rows``)."""
    if not (use_kernels(x) and x.dim() == 2 and x.stride(-1) == 1 and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    return x.shape[0] <= kernels.linear_fused_rows(fuse_rows)  # >= 1


def fused_max_rows() -> int:
    """The most rows whose steps take the kernel path (``kernels.linear_choice.max_skinny_rows``:
    32 by default, 64 with ``FULLGRAPH_LINEAR=skinny``, 1 with ``cublas`` or ``triton``); read by
    the layers at construction, so a compiled forward never reads the environment."""
    return kernels.linear_skinny_rows() if kernels is not None else 1


class Linear(nn.Linear):
    """``nn.Linear`` that can normalise its input first and add a residual after: ``forward(x, norm,
    residual)`` is ``F.linear(norm(x)) + residual``, the shape of every projection in a pre-norm
    decoder layer.

    Its steps of one to 32 rows on CUDA in half precision (decode; ``kernel_path``) run
    ``kernels.linear``: the one-row weight-streaming kernel or, for 2-32 rows, the split-K one, each
    faster than cuBLAS there in one launch (measured in ``benchmarks/sweep_linear.py`` and the
    decode step), with an RMSNorm applied on load (each program sums the squares
    of the row it streams anyway), the residual added in its epilogue and a gated ``activation``
    (``kernels.linear``'s names; its reference is the caller's) fused; a LayerNorm runs as its own
    kernel first, or on load in one-row steps with the ``layernorm`` fusion (``FULLGRAPH_FUSE``),
    the weight rows' LayerNorm constants (``kernels.layer_norm_sums``) derived from the weights
    ahead of the step (:meth:`refresh_layer_norm_sums`). Every other call is the plain PyTorch ops
    (cuBLAS for more rows, where it is faster than our kernel), the reference. Being a registered op, the kernel is used under ``torch.compile`` too.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fuse_rows = fused_max_rows()
        self.layer_norm_on_load = "layernorm" in env.fused()   # read once, at construction
        self._layer_norm_sums: torch.Tensor | None = None       # (N, 2) float32, for a LayerNorm on load
        self._sums_of: tuple = ()                               # what they were computed from

    def uses_kernel(self, x: torch.Tensor) -> bool:
        return kernel_path(x, self.fuse_rows) and self.weight.dtype == x.dtype and self.weight.is_contiguous()

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None, residual: torch.Tensor | None = None,
                activation: str = "none", limit: float | None = None) -> torch.Tensor:
        # x: (T, in_features), residual: (T, out_features) -> (T, out_features), or (T, out_features // 2) gated
        if self.uses_kernel(x):
            x, norm_weight, sums, eps = self._norm_on_load(x, norm)
            return kernels.linear(x, self.weight, self.bias, activation, kernels.linear_no_limit if limit is None
                                  else limit, norm_weight, eps, residual, sums)
        if activation != "none":
            raise ValueError(f"Linear: a fused activation ({activation!r}) needs the kernel path (uses_kernel); "
                             "apply it to the output instead")
        y = F.linear(x if norm is None else norm(x), self.weight, self.bias)
        return y if residual is None else y + residual

    def rope_kv_write(self, x: torch.Tensor, norm: nn.Module | None, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      positions: torch.Tensor, rope: RotaryEmbedding, num_heads: int, num_kv_heads: int,
                      layout: str) -> torch.Tensor:
        """The fused QKV projection of an attention layer on the kernel path (``uses_kernel``):
        ``norm(x) @ W.T + b`` split into heads by ``layout`` ("llama": [q | k | v], "grouped": per
        KV head its queries, then k and v), q and k rotated, k and v written into ``kv_cache`` at
        ``slot_mapping``, in one launch. Returns the rotated q, (T, num_heads, head_dim)."""
        x, norm_weight, sums, eps = self._norm_on_load(x, norm)
        return kernels.linear_rope_kv_write(x, self.weight, self.bias, norm_weight, eps, kv_cache, slot_mapping,
                                            positions, rope.cos, rope.sin, num_heads, num_kv_heads, layout, sums)

    def _norm_on_load(self, x: torch.Tensor, norm: nn.Module | None
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, float]:
        """(input, norm weight, LayerNorm sums, eps) for a kernel that applies the norm on load: an
        RMSNorm, or with ``layer_norm_on_load`` a LayerNorm of one row; any other norm runs first."""
        if isinstance(norm, RMSNorm):
            return x, norm.weight, None, norm.eps
        if self.layer_norm_on_load and isinstance(norm, LayerNorm) and x.shape[0] == 1:
            return x, norm.weight, self.layer_norm_sums(norm), norm.eps
        return (x if norm is None else norm(x)), None, None, 0.0

    def layer_norm_sums(self, norm: LayerNorm) -> torch.Tensor:
        """The (N, 2) float32 ``(W @ norm.weight, W @ norm.bias)`` a LayerNorm on load needs, refreshed
        here when the weights changed, except while compiling or capturing (a graph reads the same
        tensor, refreshed in place: the runner refreshes every layer before it compiles or captures)."""
        if not (torch.compiler.is_compiling() or (self.weight.is_cuda and torch.cuda.is_current_stream_capturing())):
            self.refresh_layer_norm_sums(norm)
        if self._layer_norm_sums is None:
            raise RuntimeError("Linear: a LayerNorm on load needs its sums computed before a compile or a capture: "
                               "call fullgraph.models.layers.refresh_norms_on_load(model) first")
        return self._layer_norm_sums

    def refresh_layer_norm_sums(self, norm: LayerNorm) -> None:
        """Compute the LayerNorm-on-load sums of this weight and ``norm`` unless they are of the same
        tensors at the same versions already; in place where the sums exist on the right device, so
        captured graphs and compiled code keep reading the same tensor."""
        tensors = (norm, self.weight, norm.weight, norm.bias)
        stamp = tuple((t, t.data_ptr(), t._version) if isinstance(t, torch.Tensor) else (t,) for t in tensors)
        if len(self._sums_of) == len(stamp) and all(
                old[0]() is new[0] and old[1:] == new[1:] for old, new in zip(self._sums_of, stamp)):
            return
        with torch.inference_mode(False), torch.no_grad():   # a plain tensor, refreshable in or out of a step
            sums = self._layer_norm_sums
            if sums is None or sums.device != self.weight.device or sums.shape != (self.weight.shape[0], 2):
                sums = self._layer_norm_sums = torch.empty((self.weight.shape[0], 2), dtype=torch.float32,
                                                           device=self.weight.device)
            kernels.layer_norm_sums(self.weight, norm.weight, norm.bias, out=sums)
        self._sums_of = tuple((weakref.ref(s[0]), *s[1:]) for s in stamp)


def refresh_norms_on_load(model: nn.Module) -> None:
    """Derive, from the current weights, what every projection applying a LayerNorm on load reads
    (``Linear.refresh_layer_norm_sums``; nothing where that fusion is off): before a compile or a
    capture, and again after weights change in place under captured graphs."""
    if kernels is None:  # no kernels, no fusion
        return
    for layer in model.modules():
        if isinstance(layer, PreNormDecoderLayer):
            for norm, projection in layer.projections_after_norms():
                if isinstance(norm, LayerNorm) and projection.layer_norm_on_load:
                    projection.refresh_layer_norm_sums(norm)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, returned in the input dtype.

    ``forward(x)`` returns the norm; ``forward(x, residual)`` first adds the residual and returns
    ``(norm(x + residual), x + residual)``, the fused form decoder layers use.
    """

    def __init__(self, hidden_size: int, eps: float, **factory) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, **factory))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if use_kernels(x):
            if residual is None:
                return kernels.rms_norm(x, self.weight, self.eps)
            return kernels.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        xf = x.float()
        y = self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return y if residual is None else (y, x)


class LayerNorm(nn.Module):
    """LayerNorm (weight and bias) in float32, returned in the input dtype, with the fused
    residual form of :class:`RMSNorm`: ``forward(x, residual)`` returns ``(norm(x + residual), x + residual)``."""

    def __init__(self, hidden_size: int, eps: float, **factory) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, **factory))
        self.bias = nn.Parameter(torch.zeros(hidden_size, **factory))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if use_kernels(x):
            if residual is None:
                return kernels.layer_norm(x, self.weight, self.bias, self.eps)
            return kernels.add_layer_norm(x, residual, self.weight, self.bias, self.eps)
        if residual is not None:
            x = x + residual
        y = F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        return y if residual is None else (y, x)


class PreNormDecoderLayer(nn.Module):
    """A pre-norm decoder layer over the residual stream: subclasses set ``input_layernorm``,
    ``self_attn``, ``post_attention_layernorm`` and ``mlp``.

    ``forward(x, residual)`` returns ``(output, residual)``, unsummed: each norm takes ``(x,
    residual)`` and adds before normalising (one fused launch on CUDA), so the next norm (the next
    layer's, or the final one) adds them. ``residual`` None: ``x`` is the whole stream.

    In a step on the kernel path (decode of 1-32 rows on CUDA; ``fuses``), with the ``layer``
    fusion on (``FULLGRAPH_FUSE``, on by default), the attention and the MLP take ``(x, norm,
    residual)`` instead: their first projection normalises its input on load and their last adds
    the stream back in its epilogue (``Linear``), so the layer has no norm or add kernels; it then
    returns ``(stream, None)``. More rows take cuBLAS, where a separate norm and add would be
    extra kernels: they keep the fused add + norm launch (``kernel_path``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fuse = "layer" in env.fused()  # read once, at construction
        self.fuse_rows = fused_max_rows()

    def projections_after_norms(self) -> list[tuple[nn.Module, Linear]]:
        """(norm, the projection that applies it on load in the fused flow): what
        :func:`refresh_norms_on_load` prepares. Layers whose norms are LayerNorms name theirs."""
        return []

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether this step's layer runs the fused flow: switched on, and ``x`` on the kernel path
        (its projections' rule: elsewhere the fused flow would run its norms and adds as kernels of
        their own)."""
        return self.fuse and kernel_path(x, self.fuse_rows)

    def forward(self, x, residual, positions, rope, kv_cache, metadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.fuses(x if residual is None else residual):
            h = x if residual is None else x + residual
            h = self.self_attn(h, positions, rope, kv_cache, metadata, norm=self.input_layernorm, residual=h)
            return self.mlp(h, norm=self.post_attention_layernorm, residual=h), None
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, kv_cache, metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class RotaryEmbedding(nn.Module):
    """Rotate-half (NeoX) RoPE over the whole head, from a precomputed float32 cos/sin table.

    ``mscale`` multiplies both cos and sin (LongRoPE's attention scaling); positions index the
    table on the device, so the layer is capture-safe. Models hand it to their ``Attention``
    layer, which calls it, or, when ``fusable``, lets a backend fold it into the KV-cache write.
    """

    def __init__(self, inv_freq: torch.Tensor, max_position: int, mscale: float = 1.0,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq.to(torch.float64))                 # (max_position, D/2)
        self.register_buffer("cos", (freqs.cos() * mscale).float().to(device), persistent=False)
        self.register_buffer("sin", (freqs.sin() * mscale).float().to(device), persistent=False)

    def fusable(self, x: torch.Tensor) -> bool:
        """Whether a fused kernel may apply the rotation for ``x``: the rule of every kernel here."""
        return use_kernels(x)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: (T,); q: (T, H, D) or grouped (T, KVH, G, D), k: (T, KVH, D) -> (T, H, D), (T, KVH, D)
        if use_kernels(q):
            return kernels.rope(q, k, positions, self.cos, self.sin)
        q = q.reshape(q.shape[0], -1, q.shape[-1])
        cos = self.cos[positions][:, None, :]                                # (T, 1, D/2)
        sin = self.sin[positions][:, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [gate | up] projection: (T, 2I) -> (T, I)."""
    if use_kernels(x):
        return kernels.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@torch.no_grad()
def init_random_(module: nn.Module, seed: int, embedding_std: float = 1.0) -> None:
    """Reproducible random weights, scaled to keep activations O(1) at any depth or width.

    Linear weights ~ N(0, 1/fan_in), biases ~ N(0, 0.02), embeddings and an untied LM head
    ~ N(0, embedding_std) (peaked logits, so greedy decoding is not a coin toss),
    norm weights ~ 1 + N(0, 0.1) (not exactly 1, so a missing norm weight shows up in tests).
    Drawn on the parameters' own device, so large models initialise fast on a GPU.
    """
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in module.named_parameters():
        gen = gens.setdefault(p.device, torch.Generator(p.device).manual_seed(seed))
        leaf = name.rsplit(".", 2)
        if "norm" in name or "layernorm" in name:
            p.normal_(1.0 if leaf[-1] == "weight" else 0.0, 0.1, generator=gen)
        elif p.dim() == 1:
            p.normal_(0.0, 0.02, generator=gen)
        elif "embed" in name or "lm_head" in name:
            p.normal_(0.0, embedding_std, generator=gen)
        else:
            p.normal_(0.0, p.shape[1] ** -0.5, generator=gen)
