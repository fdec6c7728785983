"""Plain-PyTorch paged attention pieces: the reference path, capture-safe, CPU and GPU.

Everything here takes its shapes from static tensor sizes (padded token count T, padded request
count R, block-table width MB) and reads lengths from device tensors: no host syncs, so it runs
inside a CUDA graph and under ``torch.compile(fullgraph=True)``.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from .._compat import custom_op

# (query positions (R, Qm, 1), key positions (1, 1, L)) -> keep mask, (R, Qm, L) or (R, H, Qm, L)
KeepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def write_index(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(safe, valid) for :func:`write_kv_indexed`: -1 slots pointed at slot 0, and which are real.

    Depends only on the step, so a backend computes it once and reuses it in every layer.
    """
    return slot_mapping.clamp(min=0), slot_mapping >= 0                  # (T,) int64, (T,) bool


@custom_op("fullgraph::write_kv_indexed", mutates_args=("kv_cache",))
def write_kv_indexed(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, safe: torch.Tensor,
                     valid: torch.Tensor) -> None:
    """Write new keys/values at ``safe`` where ``valid``; elsewhere the cache stays byte-identical.

    kv_cache: (2, num_blocks, block_size, KVH, D); k, v: (T, KVH, D); safe, valid: (T,) from
    :func:`write_index`. A masked scatter would need a data-dependent shape, so skipped tokens
    are pointed at slot 0 and write back the value already there (same bytes; real tokens never
    use the null block). Three kernels: stack, select, scatter. A custom op, so
    ``torch.compile`` keeps it one in-place write instead of functionalising a scatter into the
    whole cache.
    """
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)      # (2, num_slots, KVH, D)
    new = torch.stack((k, v)).to(kv_cache.dtype)               # (2, T, KVH, D)
    flat[:, safe] = torch.where(valid[None, :, None, None], new, flat[:, :1])  # skipped: slot 0's own bytes


@write_kv_indexed.register_fake
def _(kv_cache, k, v, safe, valid):
    return None


@custom_op("fullgraph::write_kv_reference", mutates_args=("kv_cache",))
def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new keys/values at their slots; a slot of -1 leaves the cache byte-identical.

    kv_cache: (2, num_blocks, block_size, KVH, D); k, v: (T, KVH, D); slot_mapping: (T,) int64.
    :func:`write_kv_indexed` with the index derived here, for callers that do not share it.
    """
    write_kv_indexed(kv_cache, k, v, *write_index(slot_mapping))


@write_kv.register_fake
def _(kv_cache, k, v, slot_mapping):
    return None


def group_queries(q: torch.Tensor, query_start_loc: torch.Tensor, num_reqs: int, decode_only: bool):
    """Scatter packed tokens into a (R, Qm, H, D) grid by request.

    Returns (grouped, req, col, q_lens): token t sits at ``grouped[req[t], col[t]]``. For decode
    steps (one token per request, R == T) the grid is the identity. Otherwise Qm = T + 1: the
    extra column is a dump for padded tokens so they never land on a real row.
    """
    num_tokens = q.shape[0]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]          # (R,)
    if decode_only:
        idx = torch.arange(num_tokens, device=q.device)
        return q.unsqueeze(1), idx, torch.zeros_like(idx), q_lens
    tok = torch.arange(num_tokens, device=q.device, dtype=query_start_loc.dtype)
    # Binary search of query_start_loc: correct only if it is non-decreasing (the policy's job).
    req = torch.searchsorted(query_start_loc[1:], tok, right=True).clamp_(max=num_reqs - 1)
    col = tok - query_start_loc[req]
    real = tok < query_start_loc[-1]
    col = torch.where(real & (col >= 0) & (col < num_tokens), col, num_tokens)
    grouped = q.new_zeros(num_reqs, num_tokens + 1, *q.shape[1:])
    grouped[req, col] = q
    return grouped, req, col, q_lens


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_table: torch.Tensor, *, scale: float,
                    decode_only: bool, keep: KeepFn | None = None, window: int = 0) -> torch.Tensor:
    """Causal attention of packed new tokens over each request's paged sequence.

    q: (T, H, D); kv_cache: (2, NB, bs, KVH, D); query_start_loc: (R+1,); seq_lens: (R,);
    block_table: (R, MB). Returns (T, H, D); rows of padding tokens are zeros. ``keep`` adds a
    mask (e.g. block-sparse) on top of causality. Keys past ``seq_lens`` are zeroed before use, so stale or poisoned cache memory
    cannot reach a real row; a padded request (seq_len 0) attends to one zeroed key and stays finite.
    """
    num_reqs, max_blocks = block_table.shape
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    seq_len_max = max_blocks * block_size

    kv = kv_cache[:, block_table].view(2, num_reqs, seq_len_max, num_kv_heads, head_dim)
    key_pos = torch.arange(seq_len_max, device=q.device)
    key_ok = key_pos[None, :] < seq_lens[:, None]                 # (R, L)
    kv = torch.where(key_ok[None, :, :, None, None], kv, kv.new_zeros(()))

    grouped, req, col, q_lens = group_queries(q, query_start_loc, num_reqs, decode_only)
    q_max = grouped.shape[1]
    q_pos = (seq_lens - q_lens)[:, None] + torch.arange(q_max, device=q.device)[None, :]  # (R, Qm)
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & key_ok[:, None, :]           # (R, Qm, L)
    if window:  # sliding window: key k is visible to query q iff q - window < k <= q
        mask = mask & (key_pos[None, None, :] > q_pos[:, :, None] - window)
    if keep is not None:
        mask = mask.unsqueeze(1) & keep(q_pos[:, :, None], key_pos[None, None, :])     # (R, H, Qm, L)
    # Never an empty row (softmax of nothing is NaN): a row with no key (a padded request) gets
    # key 0, which is zeroed when it is not real. Rows with keys keep exactly their mask.
    mask = mask | ((key_pos == 0) & ~mask.any(-1, keepdim=True))

    # GQA without copying K/V: fold the query heads of a KV group into the query axis.
    qf = grouped.view(num_reqs, q_max, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qf = qf.reshape(num_reqs, num_kv_heads, group * q_max, head_dim)
    if mask.dim() == 3:
        mask = mask[:, None, None].expand(num_reqs, 1, group, q_max, seq_len_max)
    else:
        mask = mask.view(num_reqs, num_kv_heads, group, q_max, seq_len_max)
    mask = mask.reshape(num_reqs, -1, group * q_max, seq_len_max)
    # An additive float mask: faster than a boolean one, and the form Inductor lowers reliably.
    bias = torch.zeros((), dtype=kv.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    k = kv[0].transpose(1, 2)                                     # (R, KVH, L, D)
    v = kv[1].transpose(1, 2)
    out = F.scaled_dot_product_attention(qf.to(k.dtype), k, v, attn_mask=bias, scale=scale)
    out = out.view(num_reqs, num_kv_heads, group, q_max, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_reqs, q_max, num_heads, head_dim)[req, col]                   # (T, H, D)
    real = torch.arange(q.shape[0], device=q.device) < query_start_loc[-1]
    return torch.where(real[:, None, None], out, out.new_zeros(())).to(q.dtype)  # padding rows: zeros


@custom_op("fullgraph::paged_attention_reference", mutates_args=())
def paged_attention_op(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                       seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, decode_only: bool,
                       sparse: list[int] | None = None, window: int = 0) -> torch.Tensor:
    """``paged_attention`` as one opaque op: ``torch.compile`` runs exactly the eager reference
    (Inductor's own lowering of this gather/mask/SDPA graph diverged on CUDA). ``sparse`` is the
    block-sparse pattern as ints ``[block_size, local_blocks, vert_stride, head_step, head_offset]``
    (None: dense causal)."""
    from .blocksparse import keep_mask

    num_heads = q.shape[1]
    keep = None if sparse is None else (lambda q_pos, k_pos: keep_mask(q_pos, k_pos, sparse, num_heads))
    return paged_attention(q, kv_cache, query_start_loc, seq_lens, block_table, scale=scale,
                           decode_only=decode_only, keep=keep, window=window)


@paged_attention_op.register_fake
def _(q, kv_cache, query_start_loc, seq_lens, block_table, scale, decode_only, sparse=None, window=0):
    return torch.empty_like(q)


# ---- decode-only fast path ------------------------------------------------------------------
# A decode step (one new token per request, T == R) needs no causal mask, no query grouping and
# no zeroing of keys: per layer it is one gather of K/V plus one attention computation. Everything
# that depends only on the step (which slot each key comes from, which keys are masked) is built
# once per step by ``decode_index`` and shared by every layer.
#
# Two choices, passed to the ops by the caller (``SdpaBackend.decode_gather`` /
# ``decode_attention``: a subclass changes them, so variants can be timed against each other in
# one process; tests cover every pair).
# - gather "slots" indexes ``kv_cache.view(2 * num_slots, KVH * D)`` along its first dim with one
#   contiguous int64 index, an entry per (K or V, key, request), each copying a whole slot (all KV
#   heads of one position). That is the case CUDA's ``index`` runs as its vectorized gather (a CTA
#   per entry, 16-byte loads; slot bytes and the cache address must be multiples of 16, else it
#   falls back to the element-wise kernel). "rows" (the earlier layout) indexes
#   ``kv_cache.view(2, -1, D)[:, rows]``, an entry per (request, KV head, key): a 3-D iteration,
#   always the element-wise index kernel.
# - attention "matmul": baddbmm (bias copy + QK^T), softmax over the last dim, bmm.
#   "matmul_keys": the same with the scores laid out (R*KVH, L, G), so the softmax reduces over a
#   middle dim: CUDA's spatial kernel, a block of threads per (request, KV head), instead of a
#   warp per (request, query head). "sdpa": one ``F.scaled_dot_product_attention`` call.
# The backend's defaults are the fastest pair measured on an H200 (llama-1b batch 1, BENCHMARKS.md):
# step 1.312 ms with "slots" + "matmul", against 1.408 ("rows" + "matmul"), 1.638 ("slots" +
# "matmul_keys") and 1.711 ("rows" + "matmul_keys").
DECODE_GATHERS = ("slots", "rows")


def _key_slots(seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int, window: int) -> torch.Tensor:
    """(R, L) int64: the cache slot each key is read from, L = MB * block_size.

    Key l of the request's visible range (``[seq_len - window, seq_len)``, or ``[0, seq_len)``
    without a window) comes from its own slot. Masking alone cannot hide a key: 0 * NaN is NaN, so
    a masked key whose K or V is NaN (the validate-mode null block, a stale slot) would still poison
    the row. Every other key therefore reads the request's newest position ``seq_len - 1``, which
    this very step wrote; a padded request (seq_len 0) reads request 0's (written whenever the step
    has a real request, since padding comes last).
    """
    num_reqs, max_blocks = block_table.shape
    table = block_table.long()                                                   # int64 once
    offsets = torch.arange(block_size, device=table.device)
    slots = torch.add(offsets, table[:, :, None], alpha=block_size).view(num_reqs, -1)  # (R, L)
    newest = slots.gather(1, (seq_lens.long() - 1).clamp(min=0)[:, None])           # (R, 1)
    newest = torch.where(seq_lens[:, None] > 0, newest, newest[:1])
    pos = torch.arange(max_blocks * block_size, device=table.device, dtype=seq_lens.dtype)
    visible = pos < seq_lens[:, None]
    if window:
        visible = visible & (pos >= seq_lens[:, None] - window)
    return torch.where(visible, slots, newest)


@custom_op("fullgraph::reference_decode_index", mutates_args=())
def decode_index(seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int, num_kv_heads: int,
                 num_slots: int, dtype: torch.dtype, gather: str, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step gather index and additive bias for :func:`decode_attention_op`.

    seq_lens: (R,); block_table: (R, MB); num_slots: num_blocks * block_size of the cache.
    L = MB * block_size; keys are read from the slots of :func:`_key_slots`. Returns:

    - ``index``, int64, for ``gather`` (see ``DECODE_GATHERS``). "slots": (2, L, R), contiguous;
      entry (i, l, r) is the row of ``kv_cache.view(2 * num_slots, KVH * D)`` holding K (i = 0)
      or V (i = 1) of key l of request r. L comes before R so that the gathered K and V,
      (L, R * KVH, D) each, are strided (R * KVH, L, D) batches the matmuls take without a copy.
      "rows": (R, KVH, L), the row of ``kv_cache.view(2, -1, D)`` holding key l of head h of
      request r.
    - ``bias`` (R * KVH, L) in ``dtype``: 0 for l < max(seq_len, 1) (and, with a sliding window,
      l >= seq_len - window), -inf elsewhere. A padded request
      keeps key 0, so its softmax row is never empty: its output is finite garbage, never NaN,
      although it is not the zeros of the general path.
    """
    num_reqs, max_blocks = block_table.shape
    seq_len_max = max_blocks * block_size
    slots = _key_slots(seq_lens, block_table, block_size, window)                # (R, L)
    if gather == "slots":
        index = torch.stack((slots.t(), slots.t() + num_slots))                 # (2, L, R)
    elif gather == "rows":
        heads = torch.arange(num_kv_heads, device=slots.device)
        index = torch.add(heads[None, :, None], slots[:, None, :], alpha=num_kv_heads)  # (R, KVH, L)
    else:
        raise ValueError(f'decode_index: gather must be "slots" or "rows", got {gather!r}')
    pos = torch.arange(seq_len_max, device=slots.device, dtype=seq_lens.dtype)
    keep = pos < seq_lens.clamp(min=1)[:, None]                                   # (R, L)
    if window:
        keep = keep & (pos >= seq_lens[:, None] - window)
    keep = keep[:, None, :]                                                       # (R, 1, L)
    bias = torch.where(keep.expand(num_reqs, num_kv_heads, seq_len_max),
                       torch.zeros((), dtype=dtype, device=slots.device), float("-inf"))  # (R, KVH, L)
    return index, bias.view(num_reqs * num_kv_heads, seq_len_max)


@decode_index.register_fake
def _(seq_lens, block_table, block_size, num_kv_heads, num_slots, dtype, gather, window=0):
    num_reqs, max_blocks = block_table.shape
    seq_len_max = max_blocks * block_size
    shape = (2, seq_len_max, num_reqs) if gather == "slots" else (num_reqs, num_kv_heads, seq_len_max)
    return (block_table.new_empty(shape, dtype=torch.int64),
            block_table.new_empty((num_reqs * num_kv_heads, seq_len_max), dtype=dtype))


def _gather(kv_cache: torch.Tensor, index: torch.Tensor, gather: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every key, each (R * KVH, L, D), from :func:`decode_index`'s ``index``: one
    gather. "slots": strided views of the gathered (2, L, R * KVH, D); "rows": contiguous."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    if gather == "slots":
        _, seq_len_max, num_reqs = index.shape
        kv = kv_cache.view(-1, num_kv_heads * head_dim)[index]                   # (2, L, R, KVH*D)
        kv = kv.view(2, seq_len_max, num_reqs * num_kv_heads, head_dim).transpose(1, 2)  # (2, R*KVH, L, D)
        return kv[0], kv[1]
    if gather != "rows":
        raise ValueError(f'decode_attention_op: gather must be "slots" or "rows", got {gather!r}')
    num_reqs, _, seq_len_max = index.shape
    kv = kv_cache.view(2, -1, head_dim)[:, index]                                # (2, R, KVH, L, D)
    kv = kv.view(2, num_reqs * num_kv_heads, seq_len_max, head_dim)
    return kv[0], kv[1]


def _attend_matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Explicit math, four kernels: bias copy + QK^T (baddbmm), softmax, PV. Its grid covers
    every (request, KV head, key), where the memory-efficient SDPA kernel loops over L serially
    in only R * KVH programs. Scores are in the cache dtype (softmax accumulates in float32)."""
    scores = torch.baddbmm(bias[:, None, :], q, k.transpose(1, 2), alpha=scale)  # (R*KVH, G, L)
    return torch.bmm(scores.softmax(-1), v)                                      # (R*KVH, G, D)


def _attend_matmul_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """:func:`_attend_matmul` with the scores transposed, (R*KVH, L, G): the same four kernels,
    but the softmax reduces over dim 1 with G inner columns, which CUDA runs as one block of
    threads per (request, KV head) rather than one warp per (request, query head)."""
    scores = torch.baddbmm(bias[:, :, None], k, q.transpose(1, 2), alpha=scale)  # (R*KVH, L, G)
    return torch.bmm(scores.softmax(1).transpose(1, 2), v)                       # (R*KVH, G, D)


def _attend_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """One ``F.scaled_dot_product_attention`` call, with R * KVH as the head axis of a batch of
    one (the fused CUDA kernels take only 4-D inputs). With a float mask CUDA picks the
    memory-efficient kernel: R * KVH programs, each looping over L."""
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=bias[None, :, None], scale=scale)
    return out[0]                                                                # (R*KVH, G, D)


_DECODE_ATTENTION = {"matmul": _attend_matmul, "matmul_keys": _attend_matmul_keys, "sdpa": _attend_sdpa}
DECODE_ATTENTIONS = tuple(_DECODE_ATTENTION)


@custom_op("fullgraph::paged_decode_reference", mutates_args=())
def decode_attention_op(q: torch.Tensor, kv_cache: torch.Tensor, index: torch.Tensor, bias: torch.Tensor,
                        scale: float, gather: str, attention: str) -> torch.Tensor:
    """Decode attention (one new token per request) over the keys of :func:`decode_index`.

    q: (R, H, D); kv_cache: (2, NB, bs, KVH, D); ``index`` built for the same ``gather``. Returns
    (R, H, D). One gather of K and V, then ``attention``'s computation (see ``DECODE_ATTENTIONS``)
    with the query heads of each KV group as the query axis (GQA without copying K/V). Padded
    rows are finite garbage (see :func:`decode_index`).
    """
    num_reqs, num_heads, head_dim = q.shape
    k, v = _gather(kv_cache, index, gather)                                      # (R*KVH, L, D) each
    qg = q.reshape(k.shape[0], -1, head_dim).to(k.dtype)                         # (R*KVH, G, D)
    out = _DECODE_ATTENTION[attention](qg, k, v, bias, scale)                    # (R*KVH, G, D)
    return out.reshape(num_reqs, num_heads, head_dim).to(q.dtype)


@decode_attention_op.register_fake
def _(q, kv_cache, index, bias, scale, gather, attention):
    return torch.empty_like(q)
