"""Rotary-embedding frequencies for every static RoPE variant, and the strict reading of a
checkpoint's RoPE settings.

A captured graph reads one precomputed cos/sin table, so only variants whose frequencies do not
depend on the sequence length at run time can be served: ``default``, ``linear``, ``llama3``,
``yarn`` and ``longrope`` (LongRoPE, with its short or long factors chosen once, from the longest
sequence the model instance serves). ``dynamic`` NTK scaling re-derives the frequencies from each
call's length (and its history), so it is refused by name, as is any unknown type. Frequencies are
computed in float64 (transformers computes them in float32; the two agree to ~1e-7 relative).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

SUPPORTED = ("default", "linear", "llama3", "yarn", "longrope")


def rope_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """Standard RoPE inverse frequencies, (head_dim // 2,) float64."""
    return 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_max_position_embeddings: int) -> torch.Tensor:
    """Llama-3 frequency scaling: long wavelengths divided by ``factor``, short kept, smooth between."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def yarn_inv_freq(head_dim: int, base: float, params: Mapping, max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN: a per-frequency ramp between interpolated (``/ factor``) and original frequencies,
    and an attention factor on cos and sin. Returns (inv_freq, attention factor)."""
    orig = int(params.get("original_max_position_embeddings") or max_position)
    factor = float(params.get("factor") or max_position / orig)
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    attention = params.get("attention_factor")
    if attention is None:
        attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all \
            else _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction(rotations: float) -> float:
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction(beta_fast), correction(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp                                       # 1: the original frequency, 0: interpolated
    inv = rope_inv_freq(head_dim, base)
    return inv / factor * (1 - keep) + inv * keep, float(attention)


@dataclass(frozen=True)
class LongRopeScaling:
    """LongRoPE (Phi-3 128K checkpoints): ``inv_freq_i / factor_i`` and cos, sin scaled by an
    mscale. A missing mscale is ``sqrt(1 + ln(max_pos / original) / ln(original))`` (long) or 1 (short)."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    short_mscale: float | None = None
    long_mscale: float | None = None

    def __post_init__(self) -> None:
        short, long = tuple(map(float, self.short_factor)), tuple(map(float, self.long_factor))
        if not short or len(short) != len(long) or min(short + long) <= 0 or self.original_max_position_embeddings < 1:
            raise ValueError(f"LongRopeScaling needs positive factor lists of equal length (got {len(short)} and "
                             f"{len(long)}) and original_max_position_embeddings >= 1")
        object.__setattr__(self, "short_factor", short), object.__setattr__(self, "long_factor", long)

    def tables(self, head_dim: int, base: float, max_position: int, long: bool) -> tuple[torch.Tensor, float]:
        """(inv_freq (head_dim/2,) float64, mscale) of the long or the short factors."""
        orig = self.original_max_position_embeddings
        default = math.sqrt(1 + math.log(max_position / orig) / math.log(orig)) if long and max_position > orig else 1.0
        mscale = self.long_mscale if long else self.short_mscale
        factors = torch.tensor(self.long_factor if long else self.short_factor, dtype=torch.float64)
        return rope_inv_freq(head_dim, base) / factors, default if mscale is None else mscale


def rope_tables(head_dim: int, theta: float, scaling: Mapping | None, max_position: int,
                max_model_len: int) -> tuple[torch.Tensor, float, str | None]:
    """(inv_freq, attention factor on cos and sin, LongRoPE factors used: "long"/"short"/None) of a
    normalised ``scaling`` dict (``{"rope_type": ..., ...}``, None: default RoPE)."""
    kind = (scaling or {}).get("rope_type", "default")
    inv = rope_inv_freq(head_dim, theta)
    if kind == "default":
        return inv, 1.0, None
    if kind == "linear":
        return inv / float(scaling["factor"]), 1.0, None
    if kind == "llama3":
        return llama3_inv_freq(inv, scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"],
                               scaling["original_max_position_embeddings"]), 1.0, None
    if kind == "yarn":
        inv, attention = yarn_inv_freq(head_dim, theta, scaling, max_position)
        return inv, attention, None
    if kind == "longrope":
        lr = LongRopeScaling(scaling["short_factor"], scaling["long_factor"],
                             scaling["original_max_position_embeddings"], scaling.get("short_mscale"),
                             scaling.get("long_mscale"))
        long = max_model_len > lr.original_max_position_embeddings
        inv, mscale = lr.tables(head_dim, theta, max_position, long)
        if lr.short_mscale is None and lr.long_mscale is None:
            # transformers' rule (Phi3ForCausalLM): one attention factor for both factor lists, from
            # `factor` (default max_position_embeddings / original), unless given outright
            orig = lr.original_max_position_embeddings
            factor = float(scaling.get("factor") or max_position / orig)
            mscale = scaling.get("attention_factor")
            if mscale is None:
                mscale = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1 else 1.0
        return inv, float(mscale), "long" if long else "short"
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED)})")


_KEYS = {"default": set(), "linear": {"factor"},
         "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
         "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                  "mscale", "mscale_all_dim", "truncate"},
         # no short_mscale / long_mscale: transformers ignores them for these architectures, and
         # the remote code of some checkpoints applies them, so they are refused, not guessed
         "longrope": {"short_factor", "long_factor", "original_max_position_embeddings", "attention_factor",
                      "factor"}}
_REQUIRED = {"linear": {"factor"}, "llama3": {"factor", "low_freq_factor", "high_freq_factor",
                                               "original_max_position_embeddings"},
             "yarn": set(), "longrope": {"short_factor", "long_factor", "original_max_position_embeddings"}}


def rope_from_hf(hf: Mapping, head_dim: int, field: str = "config.json") -> tuple[float, dict | None]:
    """(theta, normalised scaling dict or None) from a checkpoint config, transformers 4.x
    (``rope_theta`` + ``rope_scaling``) or 5.x (``rope_parameters``) spelling. Refuses by name a
    type it cannot serve, a key it would ignore, or partial rotary embeddings."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0)
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{field}: partial_rotary_factor={partial}: only full rotary embeddings (1.0) are supported")
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    kind = {"su": "longrope"}.get(kind, kind)
    if kind == "dynamic":
        raise ValueError(f"{field}: rope_scaling type 'dynamic' is not supported: its frequencies depend on each "
                         "call's sequence length, which one captured rope table cannot represent "
                         f"(supported: {', '.join(SUPPORTED)})")
    if kind not in SUPPORTED:
        raise ValueError(f"{field}: rope_scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED)})")
    if kind in ("longrope", "yarn", "llama3") and hf.get("original_max_position_embeddings"):
        # the top-level key wins over the dict's, as in transformers (Phi-3 configs have both)
        params["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    unknown = set(params) - _KEYS[kind]
    if unknown:
        raise ValueError(f"{field}: rope_scaling {kind!r} has keys fullgraph does not implement: {sorted(unknown)} "
                         f"(it reads {sorted(_KEYS[kind])})")
    missing = _REQUIRED.get(kind, set()) - set(params)
    if missing:
        raise ValueError(f"{field}: rope_scaling {kind!r} lacks {sorted(missing)}")
    if kind == "longrope" and len(params["short_factor"]) != head_dim // 2:
        raise ValueError(f"{field}: rope_scaling longrope has {len(params['short_factor'])} factors; head_dim "
                         f"{head_dim} needs {head_dim // 2}")
    return theta, (None if kind == "default" else {"rope_type": kind, **params})
