"""The regression scenarios (``SCENARIOS.md``) as data-driven checks over the public API.

Each scenario is a function of a :class:`~fullgraph.testing.harness.Case` that raises
``ScenarioFailure`` saying what broke, registered with its number, a title and the rule of when it
applies (``None``: it applies; a string: why it is skipped for this case). Scenarios 1-16 apply to
every dense backend; 17-20 to models with block-sparse layers (``scenarios_sparse``); 21-22 to
models with sliding-window layers.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .. import padding
from ..graphs import AddressMovedError
from ..invariants import PlanInvariantError
from ..plan import SeqChunk, plan_step
from .harness import Case, ScenarioFailure, Twin, check, compare, kv_bytes


@dataclass(frozen=True)
class Scenario:
    id: int
    title: str
    run: Callable[[Case], None]
    applies: Callable[[Case], str | None]


SCENARIOS: dict[int, Scenario] = {}


def always(case: Case) -> str | None:
    return None


def scenario(id: int, title: str, applies: Callable[[Case], str | None] = always):
    def register(fn: Callable[[Case], None]) -> Callable[[Case], None]:
        SCENARIOS[id] = Scenario(id, title, fn, applies)
        return fn
    return register


def _cached_context(case: Case) -> str | None:
    """Backends that refuse steps with cached context (FlashAttention without paging) run the
    prompt-only scenarios only."""
    for cls in case.backend_classes():
        if not cls.supports_context():
            return f"backend {cls.name!r} serves prompts without cached context only"
    return None


@scenario(1, "padded cu_seqlens tails repeat the last real value (3 requests in graphs of 4 and 8)", _cached_context)
def s01(case: Case) -> None:
    for sizes, bucket in [((4, 8, 16, 128), 4), ((8, 16, 128), 8)]:
        twin = Twin(case, capture_sizes=sizes)
        reqs = [twin.new_request(64) for _ in range(3)]
        twin.step([twin.chunk(r, n) for r, n in zip(reqs, (5, 7, 3))], "prefill")
        _, got = twin.step([twin.chunk(r, 1) for r in reqs], f"decode of 3 in bucket {bucket}")
        check(got.num_tokens_padded == bucket, f"3 decode tokens ran in bucket {got.num_tokens_padded}, not {bucket}")
        rows = twin.test.config.padded_num_reqs(bucket) + 1
        for name in ("query_start_loc", "seq_start_loc"):
            cu = twin.test.buffers.tensors[name][:rows].cpu().tolist()
            bad = [i for i in range(4, rows) if cu[i] != cu[3]]
            check(not bad, f"{name}[{bad[0] if bad else 0}] = {cu[bad[0]] if bad else 0}: a padded tail must repeat "
                           f"the last real value {cu[3]} (non-decreasing cu_seqlens), got {cu}")


@scenario(2, "the declared padding policy holds on random compositions (padding.check), and they match eager")
def s02(case: Case) -> None:
    twin = Twin(case)
    rng = np.random.default_rng(case.seed + 2)
    cfg, policy = twin.test.config, twin.test.policy
    context = _cached_context(case) is None
    for trial in range(24):
        n = int(rng.integers(1, cfg.max_num_seqs + 1))
        lens = rng.integers(1, 3 if trial % 2 else 24, n)
        starts = rng.integers(0, 60, n) if context else np.zeros(n, np.int64)
        if lens.sum() > cfg.max_num_tokens:
            continue
        chunks = [SeqChunk(twin.tokens(int(q)), int(s), list(range(1 + 8 * i, 1 + 8 * i + -(-(int(s + q)) // 16))))
                  for i, (q, s) in enumerate(zip(lens, starts))]
        plan = plan_step(chunks, cfg, policy, fields=twin.test.fields)
        try:
            padding.check(plan, policy)
        except PlanInvariantError as err:
            raise ScenarioFailure(f"composition {trial} ({n} chunks, lengths {lens.tolist()}): {err}") from None
    reqs = [twin.new_request(96) for _ in range(4)]
    for step in range(4):  # and run a few: mixed, ragged, then decode
        lens = [int(x) for x in rng.integers(1, 20, 4)] if step < 2 else [1] * 4
        twin.step([twin.chunk(r, q) for r, q in zip(reqs, lens)], f"random step {step} (lengths {lens})")


@scenario(3, "padded token rows: the last real token's logits equal eager, no NaN")
def s03(case: Case) -> None:
    twin = Twin(case)
    for n in (1, 3, 13, 17, 31, 100):
        _, got = twin.step([twin.chunk(twin.new_request(128), n)], f"a {n}-token prompt")
        check(got.num_tokens_padded >= n, f"{n} tokens ran in bucket {got.num_tokens_padded}")


def poison(runner) -> None:
    """NaN in the outputs, the null block and every unallocated page; garbage past the planned
    sizes of the integer buffers (a step rewrites only its own bucket)."""
    for out in runner.buffers.outputs.values():
        out.fill_(float("nan") if out.is_floating_point() else -1)
    unused = [b for b in range(runner.config.num_blocks) if not runner.blocks.is_allocated(b)]
    for cache in runner.kv_caches:
        cache[:, unused] = float("nan")
    for name, buf in runner.buffers.tensors.items():
        if buf.is_floating_point():
            buf.fill_(float("nan"))
        else:
            buf.fill_(-(2**30) if name != "block_table" else 2**30)


@scenario(4, "poisoned tails, outputs, null block and free pages never reach real logits", _cached_context)
def s04(case: Case) -> None:
    twin = Twin(case)
    a, b = twin.new_request(100), twin.new_request(100)
    twin.step([twin.chunk(a, 9), twin.chunk(b, 20)], "prefill")
    for step in range(3):
        poison(twin.test)
        twin.step([twin.chunk(a, 1), twin.chunk(b, 5 if step == 1 else 1)], f"step {step} after poisoning")


@scenario(5, "KV canary: only the real tokens' slots change (null block, last slot untouched)", _cached_context)
def s05(case: Case) -> None:
    twin = Twin(case, validate=False)  # validate mode resets the null block; this checks it stays
    runner = twin.test
    gen = torch.Generator(device=runner.device).manual_seed(case.seed)
    for cache in runner.kv_caches:  # random bytes everywhere: any stray write shows
        cache.copy_(torch.randn(cache.shape, generator=gen, device=cache.device, dtype=torch.float32))
    before = kv_bytes(runner)
    reqs = [twin.new_request(64) for _ in range(3)]
    real: set[int] = set()
    for lens in [(16, 5, 31), (1, 3, 1), (1, 1, 1)]:  # a prompt ending on a page, a mixed step, a decode step
        chunks = [twin.chunk(r, n) for r, n in zip(reqs, lens)]
        plan = plan_step(chunks, runner.config, runner.policy, fields=runner.fields)
        real |= set(plan.slot_mapping[: plan.num_tokens].tolist())
        runner.step(chunks)
    slots = runner.config.num_blocks * runner.config.block_size
    for layer, (old, new) in enumerate(zip(before, kv_bytes(runner))):
        changed = (old != new).reshape(2, slots, -1).any(-1).any(0)
        stray = sorted(set(torch.nonzero(changed).flatten().tolist()) - real)
        check(not stray, f"layer {layer}: KV slot {stray[0] if stray else 0} (block "
                         f"{(stray[0] if stray else 0) // runner.config.block_size}) changed but belongs to no real "
                         "token (a KV write ignored slot_mapping = -1?)")


@scenario(6, "shrinking batch (8 requests, then 3): padded rows point at the null block", _cached_context)
def s06(case: Case) -> None:
    twin = Twin(case)
    reqs = [twin.new_request(48) for _ in range(8)]
    twin.step([twin.chunk(r, 4 + i) for i, r in enumerate(reqs)], "prefill of 8")
    twin.step([twin.chunk(r, 1) for r in reqs], "decode of 8")
    _, got = twin.step([twin.chunk(r, 1) for r in reqs[5:]], "decode of 3")
    table = twin.test.buffers.tensors["block_table"][: twin.test.config.padded_num_reqs(got.num_tokens_padded)].cpu()
    check(got.num_tokens_padded == 4 and not table[3:].any(),
          f"padded block_table rows {table[3:].tolist()} must be the null block 0 (bucket {got.num_tokens_padded})")


@scenario(7, "same bucket, different contents (A, B, A): no host value baked in at capture", _cached_context)
def s07(case: Case) -> None:
    twin = Twin(case)
    group_a = [twin.new_request(64) for _ in range(3)]
    group_b = [twin.new_request(200) for _ in range(3)]
    twin.step([twin.chunk(r, n) for r, n in zip(group_a, (3, 9, 30))], "prefill A")
    twin.step([twin.chunk(r, n) for r, n in zip(group_b, (60, 20, 40))], "prefill B")
    for i, group in enumerate((group_a, group_b, group_a, group_b)):
        _, got = twin.step([twin.chunk(r, 1) for r in group], f"decode {'AB'[i % 2]} ({i})")
        check(got.num_tokens_padded == 4, f"decode of 3 ran in bucket {got.num_tokens_padded}")


@scenario(8, "context growth across page boundaries (15 -> 19, 31 -> 35) and kernel thresholds", _cached_context)
def s08(case: Case) -> None:
    twin = Twin(case)
    a, b = twin.new_request(256), twin.new_request(256)
    twin.step([twin.chunk(a, 14), twin.chunk(b, 30)], "prefill")
    for i in range(5):
        twin.step([twin.chunk(a, 1), twin.chunk(b, 1)], f"decode {i} (a at {a.pos}, b at {b.pos})")
    twin.step([twin.chunk(b, 100), twin.chunk(a, 1)], "a 100-token chunk beside a decode")
    for i in range(3):
        twin.step([twin.chunk(a, 1), twin.chunk(b, 1)], f"long decode {i} (b at {b.pos})")


@scenario(9, "capture at tiny lengths, replay near max_model_len", _cached_context)
def s09(case: Case) -> None:
    twin = Twin(case)
    req = twin.new_request(256)
    for n in (120, 120, 10):
        twin.step([twin.chunk(req, n)], f"chunk of {n} at {req.pos}")
    while req.pos < 256:
        twin.step([twin.chunk(req, 1)], f"decode at {req.pos}")


@scenario(10, "mixed step: decode, chunked prefill with context ending on a page, 1-token prefill, new prompt",
          _cached_context)
def s10(case: Case) -> None:
    twin = Twin(case)
    a, b, c, d = (twin.new_request(128) for _ in range(4))
    twin.step([twin.chunk(a, 20), twin.chunk(b, 16)], "prefill")
    twin.step([twin.chunk(a, 1), twin.chunk(b, 16), twin.chunk(c, 1), twin.chunk(d, 7)], "mixed")
    twin.step([twin.chunk(r, 1) for r in (a, b, c, d)], "decode")


@scenario(11, "off-stride sizes: 17 tokens, off-stride max_num_seqs, the largest bucket and largest + 1")
def s11(case: Case) -> None:
    twin = Twin(case, max_num_seqs=6, capture_sizes=(1, 2, 4, 8, 16, 32))
    reqs = [twin.new_request(64) for _ in range(6)]
    _, got = twin.step([twin.chunk(reqs[0], 17)], "17 tokens")
    check(got.num_tokens_padded == 32, f"17 tokens ran in bucket {got.num_tokens_padded}, not 32")
    if _cached_context(case) is None:
        _, got = twin.step([twin.chunk(r, 1) for r in reqs], "decode of max_num_seqs = 6")
        check(got.num_tokens_padded == 6, f"6 decode tokens ran in bucket {got.num_tokens_padded}: max_num_seqs "
                                          "must be a bucket of its own")
    before = dict(twin.test.stats()["eager_fallbacks"])
    for n in (32, 33, 40):  # the largest size, then above it twice: padded-eager, counted
        _, got = twin.step([twin.chunk(twin.new_request(64), n)], f"{n} tokens (largest bucket 32)")
    check(got.num_tokens_padded == 40 and got.mode == "padded", f"40 tokens ran {got.mode} in {got.num_tokens_padded}")
    if twin.test.config.cudagraph == "full":
        after = twin.test.stats()["eager_fallbacks"]
        check(sum(after.values()) - sum(before.values()) == 2, f"eager fallbacks {after} (expected 2 more)")


@scenario(12, "a buffer re-allocated after capture is detected (address guard)",
          lambda case: None if case.mode == "full" else "needs captured graphs (full mode)")
def s12(case: Case) -> None:
    twin = Twin(case)
    runner = twin.test
    req = twin.new_request(32)
    twin.step([twin.chunk(req, 3)], "prefill")
    moved = runner.kv_caches[0]
    runner.kv_caches[0] = moved.clone()
    try:
        runner.step([twin.chunk(req, 1)])
    except AddressMovedError as err:
        check("kv_caches" in str(err), f"the address guard fired without naming the cache: {err}")
    else:
        raise ScenarioFailure("a KV cache re-allocated after capture was not detected")
    finally:
        runner.kv_caches[0] = moved


@scenario(13, "neighbour isolation: request 0's logits do not change with the other requests' tokens",
          _cached_context)
def s13(case: Case) -> None:
    outs = []
    for seed in (1, 2):
        twin = Twin(case)
        rng = np.random.default_rng(seed)
        reqs = [twin.new_request(64) for _ in range(3)]
        chunks = [twin.chunk(reqs[0], 10, list(range(10)))]
        chunks += [twin.chunk(r, 6, rng.integers(0, twin.vocab, 6).tolist()) for r in reqs[1:]]
        _, got = twin.step(chunks, "prefill")
        decode = [twin.chunk(reqs[0], 1, [7])] + [twin.chunk(r, 1, [int(rng.integers(twin.vocab))]) for r in reqs[1:]]
        _, got2 = twin.step(decode, "decode")
        outs.append((got.logits[0].clone(), got2.logits[0].clone()))
    for i, what in enumerate(("prefill", "decode")):
        a, b = outs[0][i], outs[1][i]
        d = torch.where(a == b, 0.0, (a - b).abs()).max().item()   # -inf (masked ids) in both is equal
        check(torch.equal(a, b), f"{what}: request 0's logits changed by {d:.3g} when only its neighbours' tokens changed")


@scenario(14, "returned logits survive the next step (no aliasing of the output buffer)", _cached_context)
def s14(case: Case) -> None:
    twin = Twin(case)
    a = twin.new_request(64)
    _, first = twin.step([twin.chunk(a, 5)], "prefill")
    kept = first.logits.clone()
    for i in range(2):
        twin.step([twin.chunk(a, 1)], f"decode {i}")
    check(torch.equal(first.logits, kept), "logits returned by a step were overwritten by a later step")


@scenario(15, "zero recompiles: every bucket, growing lengths, after warm-up",
          lambda case: None if case.mode == "compile" else "compile mode only")
def s15(case: Case) -> None:
    runner = case.runner(True)
    runner.warmup()
    before = runner.stats()["compiled_graphs"]
    for size in runner.config.buckets[::2] + runner.config.buckets[-1:]:
        batch = runner.config.padded_num_reqs(size)
        per = size // batch
        blocks = [runner.blocks.allocate(-(-3 * (per + 1) // 16)) for _ in range(batch)]
        for i in range(3):
            runner.step([SeqChunk([5] * per, i * (per + 1), b) for b in blocks])
            runner.step([SeqChunk([7], i * (per + 1) + per, b) for b in blocks])
        for b in blocks:
            runner.blocks.free(b)
    stats = runner.stats()
    check(stats["compiled_graphs"] == before and stats["recompiles_after_warmup"] == 0,
          f"recompiled after warm-up: {stats['compiled_graphs'] - before} new graphs, "
          f"{stats['recompiles_after_warmup']} recompiles")


from . import scenarios_more  # noqa: E402,F401  (registers 16-22)

__all__ = ["SCENARIOS", "Scenario", "compare", "poison", "scenario"]
