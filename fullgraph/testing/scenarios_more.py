"""Scenarios 16-22: bad input, block-sparse layers (17-20), sliding-window layers (21-22)."""
from __future__ import annotations

import torch

from ..attention.backends.sdpa import SdpaBackend
from ..plan import SeqChunk
from .harness import Case, ScenarioFailure, Twin, check, kv_bytes
from .scenarios import _cached_context, scenario

# case -> (chunks from (a request, a valid chunk, vocab), what the error must name)
BAD = {
    "empty chunk": (lambda r, ok, v: [ok, SeqChunk([], 0, [5])], "chunk 1: token_ids"),
    "position past max_model_len": (lambda r, ok, v: [SeqChunk([1], 256, r.blocks)], "chunk 0: start_pos"),
    "too few blocks": (lambda r, ok, v: [SeqChunk(list(range(40)), 0, r.blocks[:2])], "chunk 0: block_ids"),
    "block out of range": (lambda r, ok, v: [ok, SeqChunk([1], 0, [10**6])], "chunk 1: block_ids"),
    "null block": (lambda r, ok, v: [ok, SeqChunk([1], 0, [0])], "chunk 1: block_ids"),
    "block in two requests": (lambda r, ok, v: [ok, SeqChunk([1], 0, [r.blocks[0]])], "chunk 1: block_ids"),
    "too many tokens": (lambda r, ok, v: [SeqChunk(list(range(129)), 0, r.blocks)], "max_num_tokens"),
    "too many requests": (lambda r, ok, v: [SeqChunk([1], 0, [100 + i]) for i in range(9)], "max_num_seqs"),
    "token outside vocabulary": (lambda r, ok, v: [ok, SeqChunk([v], 0, [100])], "chunk 1: token_ids"),
}


@scenario(16, "bad input is a ValueError naming chunk and field, raised before anything changes")
def s16(case: Case) -> None:
    twin = Twin(case)
    r = twin.new_request(256)
    twin.step([twin.chunk(r, 12)], "prefill")
    runner = twin.test
    for name, (make, expected) in BAD.items():
        before, free = kv_bytes(runner), runner.blocks.num_free
        try:
            runner.step(make(r, SeqChunk([3], r.pos, r.blocks), twin.vocab))
        except ValueError as err:
            check(expected in str(err), f"{name}: the error does not name {expected!r}: {err}")
        else:
            raise ScenarioFailure(f"{name}: accepted (expected a ValueError naming {expected!r})")
        same = all(torch.equal(x, y) for x, y in zip(before, kv_bytes(runner)))
        check(same and runner.blocks.num_free == free, f"{name}: the refused step changed the KV cache or pages")
    if _cached_context(case) is None:
        twin.step([twin.chunk(r, 1)], "the next good step")


# ---- block-sparse layers (Phi-3-Small) --------------------------------------------------------------
def _sparse(case: Case) -> str | None:
    return None if "blocksparse" in case.layer_kinds else "the model has no block-sparse layers"


def _window_tokens(case: Case) -> int:
    sparse = next(l.sparse for l in case.model.attention_layers() if l.kind == "blocksparse")
    return sparse.local_blocks * sparse.block_size


@scenario(17, "block-sparse decode crossing the local window onto vertical-stride blocks equals eager", _sparse)
def s17(case: Case) -> None:
    twin = Twin(case)
    window = _window_tokens(case)
    req = twin.new_request(window + 24)
    twin.step([twin.chunk(req, window - 4)], f"prefill just short of the {window}-token window")
    for _ in range(12):
        twin.step([twin.chunk(req, 1)], f"decode at {req.pos} (window {window})")


class DenseForSparse(SdpaBackend):
    """Dense causal attention serving block-sparse layers: what a silent dense fallback computes."""

    name = "dense_for_sparse"
    kinds = frozenset({"dense", "blocksparse"})


@scenario(18, "block-sparse prompts within the window equal dense causal; beyond it they differ", _sparse)
def s18(case: Case) -> None:
    window = _window_tokens(case)
    sparse_case = Case(case.attention, case.model, case.mode, case.seed)
    dense_case = Case({**_as_mapping(case.attention), "blocksparse": DenseForSparse}, case.model, case.mode, case.seed)
    outs = {}
    for name, c in (("sparse", sparse_case), ("dense", dense_case)):
        twin = Twin(c)
        tokens = twin.tokens(window + 40)
        rows = []
        for n in (window, window + 40):
            _, got = twin.step([twin.chunk(twin.new_request(n), n, tokens[:n])], f"{name}: a prompt of {n}")
            rows.append(got.logits[0])
        outs[name] = torch.stack(rows)
    finite = torch.isfinite(outs["dense"])
    scale = outs["dense"][finite].abs().max().clamp(min=1.0)
    delta = torch.where(finite, outs["sparse"] - outs["dense"], 0.0).abs().amax(-1) / scale   # (2,)
    inside, beyond = delta.tolist()
    check(inside <= case.tolerance, f"a {window}-token prompt (within the local window) differs from dense by {inside:.3g}")
    check(beyond > 1e-3, f"a {window + 40}-token prompt equals dense attention ({beyond:.3g}): silent dense fallback?")


def _as_mapping(attention) -> dict:
    return dict(attention) if isinstance(attention, dict) else {"dense": attention}


@scenario(19, "block-sparse chunked prefill whose chunks start mid sparse block equals eager", _sparse)
def s19(case: Case) -> None:
    twin = Twin(case)
    block = next(l.sparse for l in case.model.attention_layers() if l.kind == "blocksparse").block_size
    req = twin.new_request(200)
    for cut in (block // 2 + 5, 2 * block + 3, 3 * block + 7, 150):
        twin.step([twin.chunk(req, cut - req.pos)], f"chunk ending at {cut} (sparse block {block})")
    twin.step([twin.chunk(req, 1)], "decode")


@scenario(20, "block-sparse decode graphs never need seq_start_loc; a padded zero-length request is harmless", _sparse)
def s20(case: Case) -> None:
    twin = Twin(case)
    reqs = [twin.new_request(64) for _ in range(3)]
    twin.step([twin.chunk(r, n) for r, n in zip(reqs, (9, 30, 2))], "prefill of 3 (padded to 4 requests)")
    for i in range(3):
        twin.step([twin.chunk(r, 1) for r in reqs], f"decode {i} of 3 in a bucket of 4")


# ---- sliding-window layers (Mistral, Qwen2) --------------------------------------------------------------
def _windowed(case: Case) -> str | None:
    return None if case.windows else "the model has no sliding-window layers"


@scenario(21, "sliding-window decode across the window edge equals eager", _windowed)
def s21(case: Case) -> None:
    window = min(case.windows)
    twin = Twin(case)
    a, b = twin.new_request(3 * window + 8), twin.new_request(3 * window + 8)
    twin.step([twin.chunk(a, window - 2), twin.chunk(b, 2 * window + 1)], f"prefill around the {window}-token window")
    for i in range(6):
        twin.step([twin.chunk(a, 1), twin.chunk(b, 1)], f"decode {i} (a at {a.pos}, b at {b.pos}, window {window})")


@scenario(22, "sliding-window chunked prefill across the window edge (cached context) equals eager",
          lambda case: _windowed(case) or _cached_context(case))
def s22(case: Case) -> None:
    window = min(case.windows)
    twin = Twin(case)
    req = twin.new_request(4 * window)
    for n in (window // 2 + 3, window, window + 5, 3):
        twin.step([twin.chunk(req, n)], f"chunk of {n} at {req.pos} (window {window})")
