"""In-graph sampling: float32 logits ``(R, V)`` -> one token id per row, on the device.

Everything here is capture-safe (no ``.item()``, no host branching on tensor values, static shapes)
and traceable by ``torch.compile(fullgraph=True)``. :func:`sample` runs the Triton kernel
(``fullgraph/kernels/sampling.py``) on CUDA tensors and :func:`sample_reference` elsewhere; the two
draw the same random numbers and apply the same rules, so they return the same tokens.

Per-request parameters, each of shape ``(R,)``:
    temperature  float32   <= 0 (or NaN): greedy, the argmax of the raw logits, ties -> lowest id
    top_k        int32     <= 0 or >= V: off
    top_p        float32   in (0, 1]; >= 1 (or NaN): off
    min_p        float32   in [0, 1); 0: off
    seeds        int64     the request's RNG key
    offsets      int64     the request's output position: the RNG counter

Semantics of a sampled row (vLLM's order), with ``s = logits * (1 / temperature)`` in float32 (one
rounding more than a division, the same in both paths):
    1. top-k: keep every token with ``s >= v_k``, the k-th largest value (ties at v_k are all kept);
    2. softmax over the kept set: ``e = exp(s - s_max)``, ``Z_k`` = sum of the kept ``e``;
    3. top-p: keep every token with ``s >= v_p``, the largest value such that the kept tokens with
       ``s >= v_p`` carry mass ``>= top_p * Z_k`` (the smallest such upper set: ties at v_p are all
       kept, and the most probable token always is);
    4. min-p: keep tokens with ``e >= min_p``, i.e. ``p >= min_p * p_max`` of the *scaled* distribution;
    5. sample from the kept set renormalised: the Gumbel-max ``argmax(s + g)`` over kept tokens
       (ties -> lowest id), which draws token i with probability ``e_i / sum(kept e)``.
NaN logits count as ``-inf``; ``-inf`` tokens are never sampled. A row with nothing finite to
sample (all ``-inf``) returns its greedy argmax (0 for an all ``-inf`` row), so every id is in
``[0, V)`` whatever the row holds (padded rows included). ``+inf`` logits are outside the contract.

Randomness is counter-based: the noise of token v in row r depends only on
``(seeds[r], offsets[r], v)``, never on the batch, the row or the vocabulary size:
    (x0, x1, x2, x3) = Philox4x32-10(key = (seed & 0xffffffff, seed >> 32 & 0xffffffff),
                                     counter = (v >> 2, offset & 0xffffffff, offset >> 32 & 0xffffffff, 0))
    x = x[v & 3]                                   (one Philox block serves 4 consecutive tokens)
    u = (2 * (x >> 9) + 1) * 2**-24                (exact in float32, in [2**-24, 1 - 2**-24])
    g = -log(-log(u))                              (float32)
"""
from __future__ import annotations

import torch
from torch import Tensor

try:
    from .kernels import sampling as _kernel
    from .kernels.argmax import argmax as _argmax_kernel
    from .kernels.fed_back import fed_back_ids as _fed_back_kernel
except ImportError:  # no Triton (e.g. macOS): the reference everywhere
    _kernel = _argmax_kernel = _fed_back_kernel = None

_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_U32 = 0xFFFFFFFF


def _mulhilo(a: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """High and low 32 bits of ``a * m`` for int64 ``a`` in [0, 2**32) without int64 overflow:
    ``m`` is split into 16-bit halves so each partial product stays below 2**48."""
    x, y = a * (m >> 16), a * (m & 0xFFFF)
    return (x + (y >> 16)) >> 16, (((x & 0xFFFF) << 16) + y) & _U32


def philox4x32(counter: tuple[Tensor, Tensor, Tensor, Tensor], key: tuple[Tensor, Tensor],
               rounds: int = 10) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32 (Salmon et al. 2011, Random123) on int64 tensors holding uint32 words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(c0, _PHILOX_M[0])
        hi1, lo1 = _mulhilo(c2, _PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_W[0]) & _U32, (k1 + _PHILOX_W[1]) & _U32
    return c0, c1, c2, c3


def gumbel_noise(seeds: Tensor, offsets: Tensor, vocab: int) -> Tensor:
    """(R, V) float32 Gumbel(0, 1) noise of every token, as the module docstring defines it."""
    seeds, offsets = seeds.long()[:, None], offsets.long()[:, None]
    blocks = torch.arange((vocab + 3) // 4, device=seeds.device)[None, :]   # (1, ceil(V / 4))
    zero = torch.zeros_like(blocks)
    words = philox4x32((blocks, offsets & _U32, (offsets >> 32) & _U32, zero),
                       (seeds & _U32, (seeds >> 32) & _U32))
    bits = torch.stack(torch.broadcast_tensors(*words), dim=-1).flatten(1)[:, :vocab]  # (R, V)
    u = ((bits >> 9) * 2 + 1).float() * 2.0 ** -24
    return -torch.log(-torch.log(u))


def _check(logits: Tensor, params: dict[str, Tensor]) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"sample: logits must be a floating (R, V) tensor, got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    want = {"temperature": torch.float32, "top_k": torch.int32, "top_p": torch.float32,
            "min_p": torch.float32, "seeds": torch.int64, "offsets": torch.int64}
    for name, t in params.items():
        if t.shape != logits.shape[:1] or t.dtype != want[name] or t.device != logits.device:
            raise ValueError(f"sample: {name} must be ({logits.shape[0]},) {want[name]} on {logits.device}, "
                             f"got {tuple(t.shape)} {t.dtype} on {t.device}")


def sample_reference(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
                     seeds: Tensor, offsets: Tensor) -> Tensor:
    """The spec in plain PyTorch (a full sort; CPU and GPU): (R,) int64 token ids."""
    _check(logits, dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds,
                        offsets=offsets))
    x = logits.float()
    x = torch.where(torch.isnan(x), float("-inf"), x)
    vocab = x.shape[1]
    greedy = x.argmax(dim=-1)
    sampled = temperature > 0
    s = x * (1.0 / torch.where(sampled, temperature, 1.0))[:, None]          # (R, V)
    srt = s.sort(dim=-1, descending=True).values                              # (R, V)
    s_max = srt[:, :1]
    s_ref = torch.where(s_max > float("-inf"), s_max, 0.0)
    e = torch.exp(s - s_ref)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).long()
    v_k = srt.gather(1, k[:, None] - 1)                                       # (R, 1)
    e_kept = torch.where(srt >= v_k, torch.exp(srt - s_ref), 0.0)             # kept masses, descending
    z_k = e_kept.sum(dim=-1, keepdim=True)
    cut = (e_kept.cumsum(dim=-1) < top_p[:, None] * z_k).sum(dim=-1, keepdim=True).clamp(max=vocab - 1)
    v_p = torch.where(top_p[:, None] < 1, srt.gather(1, cut), float("-inf"))
    keep = (s >= v_k) & (s >= v_p) & (e >= min_p[:, None]) & (s > float("-inf"))
    score = torch.where(keep, s + gumbel_noise(seeds, offsets, vocab), float("-inf"))
    return torch.where(sampled & keep.any(dim=-1), score.argmax(dim=-1), greedy)


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
           seeds: Tensor, offsets: Tensor) -> Tensor:
    """(R,) int64 token ids: the Triton kernel on CUDA tensors, :func:`sample_reference` elsewhere.

    Capture-safe; the kernel's workspaces are allocated with static shapes on every call.
    """
    if logits.is_cuda and _kernel is not None:
        _check(logits, dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds,
                            offsets=offsets))
        return _kernel.sample(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    return sample_reference(logits, temperature, top_k, top_p, min_p, seeds, offsets)


def fed_back_ids(input_ids: Tensor, prev_token_row: Tensor, feedback: Tensor) -> Tensor:
    """A step's ids with the previous step's samples fed back: ``feedback[prev_token_row[t]]`` where
    that row is >= 0, else ``input_ids[t]``. One Triton launch on CUDA (four PyTorch kernels
    otherwise; under ``torch.compile`` one opaque op either way)."""
    if input_ids.is_cuda and _fed_back_kernel is not None:
        return _fed_back_kernel(input_ids, prev_token_row, feedback)
    return torch.where(prev_token_row >= 0, feedback[prev_token_row.clamp(min=0)], input_ids)


def greedy(logits: Tensor) -> Tensor:
    """(R,) int64: each row's argmax, ties -> lowest id, NaN counted as ``-inf`` (an all ``-inf``
    row gives 0), as :func:`sample` picks a greedy row. On CUDA two Triton launches
    (``kernels/argmax.py``; ``torch.argmax`` took 27 us a call at V = 128,256 on an H100): a decode
    loop that picks its tokens outside the graph uses this."""
    if logits.is_cuda and _argmax_kernel is not None:
        return _argmax_kernel(logits)
    x = logits.float()
    return torch.where(torch.isnan(x), float("-inf"), x).argmax(dim=-1)


def token_logprobs(logits: Tensor, ids: Tensor, num_top: int) -> tuple[Tensor, Tensor, Tensor]:
    """Log-softmax of the raw logits (no temperature or filters): the (R,) logprob of ``ids``
    (in ``[0, V)``), and the (R, num_top) largest logprobs with their int64 ids (order of equal
    values unspecified). NaN logits count as ``-inf``; a row with no finite logit gives ``-inf``."""
    if logits.dim() != 2 or ids.shape != logits.shape[:1] or not 0 <= num_top <= logits.shape[1]:
        raise ValueError(f"token_logprobs: logits (R, V) = {tuple(logits.shape)}, ids {tuple(ids.shape)} "
                         f"(want (R,)), num_top {num_top} (want 0 .. V)")
    x = logits.float()
    lp = torch.log_softmax(torch.where(torch.isnan(x), float("-inf"), x), dim=-1)
    lp = torch.where(torch.isnan(lp), float("-inf"), lp)                      # all -inf rows
    top_lp, top_ids = lp.topk(num_top, dim=-1)
    return lp.gather(1, ids.long()[:, None])[:, 0], top_lp, top_ids


__all__ = ["gumbel_noise", "philox4x32", "sample", "sample_reference", "token_logprobs"]


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, constrained: Tensor) -> Tensor:
    """``logits`` with every token a constrained row's bitmask forbids set to -inf (capture-safe).

    logits: (R, V) float32; bitmask: (R, W) int32 with W = ceil(V / 32), bit ``v % 32`` of word
    ``v // 32`` set where token v is allowed; constrained: (R,) int32, 0 for rows whose bitmask is
    never read (unconstrained and padded requests: their rows are left as they are). A constrained
    row that allows nothing keeps its logits (the engine ends such a request itself).
    """
    rows, vocab = logits.shape
    # Little-endian words: bit v % 32 of word v // 32 is bit v % 8 of byte v // 8. Unpacking the
    # bytes is a broadcast (no (R, V) index tensor, no gather): half the time of a gather on CPU.
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    allowed = ((bitmask.contiguous().view(torch.uint8)[:, :, None] >> shifts) & 1).bool().reshape(rows, -1)[:, :vocab]
    use = (constrained != 0)[:, None] & allowed.any(dim=1, keepdim=True)
    return torch.where(use & ~allowed, float("-inf"), logits)
