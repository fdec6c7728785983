"""Automatic prefix caching (``engine.pages`` over the allocator's ownership ledger): outputs equal
with caching on and off, eviction and preemption in a tiny page pool, shared pages never written
(a KV canary, and planted bugs each defence must catch), hash chaining, block-sparse and
sliding-window models, and ``bench serve --shared-prefix``."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import fullgraph as fg
from fullgraph.engine.pages import PrefixCache
from fullgraph.engine.params import RequestMetrics
from fullgraph.engine.scheduler import Request
from fullgraph.kv_cache import BlockAllocator
from harness import HAS_CUDA, BlockSparseTorch, kv_bytes, toy_model

MODE = "full" if HAS_CUDA else "padded"
DEVICE = "cuda" if HAS_CUDA else "cpu"
BS = 16
LIMITS = dict(max_num_seqs=8, max_model_len=256, max_num_tokens=64, block_size=BS)
GREEDY = fg.SamplingParams(temperature=0, max_tokens=8)


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 500, n).tolist()


SYSTEM = tokens(100, 0)  # six full pages and a partial one


def make_llm(model=None, **kw) -> fg.LLM:
    return fg.LLM(model if model is not None else toy_model(), **{**LIMITS, "cudagraph": MODE, **kw})


def run(llm: fg.LLM, schedule) -> dict[str, fg.RequestOutput]:
    """``schedule``: (step, request id, prompt, params), each added just before that engine step;
    every request's final output."""
    pending, finals, step = sorted(schedule, key=lambda s: s[0]), {}, 0
    while pending or llm.engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            llm.engine.add_request(rid, prompt, params)
        finals.update((o.request_id, o) for o in llm.engine.step() if o.finished)
        step += 1
    return finals


def out_tokens(outs: dict[str, fg.RequestOutput]) -> dict[str, list[int]]:
    return {rid: o.outputs[0].token_ids for rid, o in outs.items()}


def workload(params) -> list[tuple]:
    """Requests that share the long system prompt, share 40 tokens of it, or share nothing, some
    arriving while the system prompt's first owner is still prefilling it (64 tokens a step)."""
    sched = [(step, f"sys-{i}", SYSTEM + tokens(5 + 7 * i, 10 + i)) for i, step in enumerate((0, 1, 2, 6, 12))]
    sched += [(step, f"part-{i}", SYSTEM[:40] + tokens(20, 20 + i)) for i, step in enumerate((1, 3, 8))]
    sched += [(step, f"none-{i}", tokens(20 + 20 * i, 30 + i)) for i, step in enumerate((0, 2, 4))]
    sched += [(3, "aligned-a", SYSTEM[:64]), (10, "aligned-b", SYSTEM[:64])]  # a prompt of exactly four pages
    return [(step, rid, prompt, params(k)) for k, (step, rid, prompt) in enumerate(sched)]


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_outputs_equal_with_caching_on_and_off(sampling):
    def params(k):
        if sampling == "greedy":
            return GREEDY
        return fg.SamplingParams(temperature=0.9, top_p=0.95, seed=100 + k, max_tokens=8)

    off_llm, on_llm = make_llm(enable_prefix_caching=False), make_llm(validate=True)
    off, on = run(off_llm, workload(params)), run(on_llm, workload(params))
    assert out_tokens(on) == out_tokens(off)
    cached = {rid: o.num_cached_tokens for rid, o in on.items()}
    assert cached["sys-0"] == 0 and cached["sys-4"] == 96 and 0 < cached["sys-1"] < 96  # sys-1: mid-prefill
    assert cached["part-2"] == 32 and cached["none-2"] == 0
    assert cached["aligned-b"] == 48  # its last token sits in page 3: page 3 is computed again, privately
    assert all(o.num_cached_tokens == 0 for o in off.values())
    s_on, s_off = on_llm.engine.stats(), off_llm.engine.stats()
    assert s_off["prefill_tokens"] == sum(len(p) for _, _, p, _ in workload(params)) and not s_off["cached_pages"]
    assert s_on["prefill_tokens"] == s_off["prefill_tokens"] - sum(cached.values())
    assert 0 < s_on["prefix_cache_hit_rate"] < 1 and s_on["prefix_cache_hits"] == sum(cached.values())
    assert s_on["kv_pages_in_use"] == 0 and s_on["cached_pages"] == s_on["evictable_pages"] > 0


def test_a_tiny_page_pool_evicts_and_preempts_and_changes_no_output():
    sched = [(0, f"sys-{i}", SYSTEM + tokens(10 + 5 * i, 40 + i), fg.SamplingParams(temperature=0, max_tokens=12))
             for i in range(5)]
    sched += [(2 * i, f"none-{i}", tokens(60, 50 + i), fg.SamplingParams(temperature=0, max_tokens=12))
              for i in range(4)]
    want = out_tokens(run(make_llm(enable_prefix_caching=False), sched))
    small = make_llm(num_blocks=14)  # 13 pages: each request needs up to 9 of its own at the end
    got = run(small, sched)
    assert out_tokens(got) == want
    stats, blocks = small.engine.stats(), small.runner.blocks
    assert stats["evictions"] > 0 and sum(o.metrics.num_preemptions for o in got.values()) > 0
    assert stats["prefix_cache_hits"] > 0
    assert blocks.num_free == 13 and stats["kv_pages_in_use"] == 0 and blocks.num_evictable == blocks.num_cached


def test_abort_of_the_prefix_owner_keeps_the_pages_its_sharer_holds():
    sharer = SYSTEM + [3, 4, 5]
    want = out_tokens(run(make_llm(enable_prefix_caching=False), [(0, "sharer", sharer, GREEDY)]))["sharer"]
    llm = make_llm(validate=True)
    llm.engine.add_request("owner", SYSTEM + [1, 2], fg.SamplingParams(temperature=0, max_tokens=30))
    for _ in range(3):
        llm.engine.step()
    llm.engine.add_request("sharer", sharer, GREEDY)
    outs = llm.engine.step()                                 # the sharer takes six of the owner's pages
    pages = llm.engine.scheduler.running[-1].blocks[:6]
    assert llm.runner.blocks.owners(pages).tolist() == [2] * 6
    llm.engine.abort("owner")
    assert llm.runner.blocks.owners(pages).tolist() == [1] * 6
    while llm.engine.has_unfinished():
        outs += llm.engine.step()
    final = [o for o in outs if o.finished and o.request_id == "sharer"][0]
    assert final.outputs[0].token_ids == want and final.num_cached_tokens == 96
    assert llm.runner.blocks.num_free == llm.runner.config.num_blocks - 1


# ---- a shared page is never written -------------------------------------------------------------------
def canary_holds(llm: fg.LLM) -> bool:
    """The owner of a 40-token prompt prefills it; then requests share its pages, decode past their
    page boundaries and finish. Whether the pages cached after that first step are still cached,
    byte for byte, at the end (nothing is evicted: the pool is large)."""
    llm.engine.add_request("owner", SYSTEM[:40], fg.SamplingParams(temperature=0, max_tokens=20))
    llm.engine.step()
    pages = torch.from_numpy(np.flatnonzero(llm.runner.blocks.cached))
    before = [c[:, pages] for c in kv_bytes(llm.runner)]
    outs = run(llm, [(0, "b", SYSTEM[:40] + [1, 2, 3], GREEDY), (1, "c", SYSTEM[:70], GREEDY),
                     (4, "d", SYSTEM[:33], fg.SamplingParams(temperature=0, max_tokens=20))])
    assert outs["b"].num_cached_tokens == 32 and outs["d"].num_cached_tokens == 32
    assert len(pages) >= 2 and llm.runner.blocks.cached[pages.numpy()].all()
    return all(torch.equal(a, c[:, pages]) for a, c in zip(before, kv_bytes(llm.runner)))


def test_shared_pages_are_byte_identical_after_other_requests_ran():
    assert canary_holds(make_llm())


def _seal_unchecked(self, ids, block_size):
    self.cached[list(ids)] = True
    self.num_cached += len(ids)


@pytest.mark.parametrize("defence", ["seal", "write check", "canary"])
def test_a_planted_bug_sharing_the_partial_last_page_is_caught(monkeypatch, defence):
    """The bug: the cache counts a partial page as full, so it seals the owner's last prompt page,
    which the owner then decodes into. Each defence is shown alone, the ones before it removed."""
    monkeypatch.setattr(PrefixCache, "full_pages", lambda self, n: -(-n // self.block_size))
    if defence != "seal":
        monkeypatch.setattr(BlockAllocator, "seal", _seal_unchecked)
    if defence == "canary":
        monkeypatch.setattr(BlockAllocator, "_check_writes", lambda self, plan, who: None)
        assert not canary_holds(make_llm())
        return
    match = (r"cannot seal block \d+: it has 8 of 16 positions written" if defence == "seal" else
             r"request 'owner'\): slot_mapping: token 0 writes position 40 into block \d+, "
             r"which has 1 owner and is cached")
    with pytest.raises(ValueError, match=match):
        canary_holds(make_llm())


def test_a_step_writing_a_shared_page_is_refused_before_anything_is_written():
    runner = fg.FullGraphRunner(toy_model(), cudagraph=MODE, validate=True, **LIMITS)
    blocks = runner.blocks
    own = blocks.allocate(2)
    runner.step([fg.SeqChunk(tokens(20, 1), 0, own, request_id="X")])
    with pytest.raises(ValueError, match="has 4 of 16 positions written"):
        blocks.seal(own[1:], BS)
    blocks.seal(own[:1], BS)
    with pytest.raises(ValueError, match="only cached pages"):
        blocks.share(own[1:])
    blocks.share(own[:1])                                        # request Y shares X's first page
    mine = own[:1] + blocks.allocate(1)
    assert blocks.owners(own).tolist() == [2, 1]
    # both name the shared page in one step (reads only): allowed
    runner.step([fg.SeqChunk([7], 20, own, request_id="X"), fg.SeqChunk(tokens(4, 2), 16, mine, request_id="Y")])
    before = kv_bytes(runner)
    with pytest.raises(ValueError, match=rf"request 'Y'\): slot_mapping: token 0 writes position 8 into block "
                                         rf"{own[0]}, which has 2 owners and is cached"):
        runner.step([fg.SeqChunk(tokens(8, 3), 8, mine, request_id="Y")])  # the planted bug: rewrite a shared page
    assert all(torch.equal(a, b) for a, b in zip(before, kv_bytes(runner)))
    with pytest.raises(ValueError, match=f"block {own[1]} is also used by"):   # a private page in two chunks
        runner.step([fg.SeqChunk([7], 21, own, request_id="X"), fg.SeqChunk([7], 21, own, request_id="Z")])
    with pytest.raises(ValueError, match="2 owners"):
        blocks.free(own[:1])
    blocks.release(own[::-1])
    blocks.release(mine[::-1])
    assert blocks.num_free == runner.config.num_blocks - 1 and blocks.num_evictable == 1


def test_the_ledger_counts_owners_and_evicts_the_least_recently_released_page():
    blocks, evicted = BlockAllocator(5), []
    blocks.on_evict = evicted.append
    a, b, c = blocks.allocate(3)
    blocks.mark_written([a, b, c], 3 * BS, BS)
    blocks.seal([a, b], BS)
    blocks.release([b, a, c])                          # b first: the first to go
    assert blocks.num_free == 4 and blocks.num_evictable == 2 and blocks.owners([a, b, c]).tolist() == [0, 0, 0]
    assert not blocks.is_allocated(a) and blocks.cached[a]
    blocks.share([a])                                  # a hit revives a
    assert blocks.num_free == 3 and blocks.owners([a]).tolist() == [1]
    assert sorted(blocks.allocate(2)) == sorted([c, 4]) and not evicted   # plain free pages first
    assert blocks.allocate(1) == [b] and evicted == [b] and not blocks.cached[b] and blocks.written[b] == 0
    with pytest.raises(ValueError, match="only 0 of 4 are free"):
        blocks.allocate(1)
    copy = BlockAllocator(5)
    copy.copy_from(blocks)
    assert copy.owners(range(1, 5)).tolist() == blocks.owners(range(1, 5)).tolist() and copy.num_cached == 1


# ---- hashing ---------------------------------------------------------------------------------------------
def _request(ids: list[int]) -> Request:
    return Request("r", None, ids, GREEDY, 0, None, RequestMetrics(0.0), 256)


def test_equal_token_blocks_under_different_prefixes_are_different_pages():
    cache = PrefixCache(BlockAllocator(8), BS, "model a")
    a, b, c = tokens(BS, 1), tokens(BS, 2), tokens(BS, 3)
    on_a, on_b = cache.hashes(_request(a + c)), cache.hashes(_request(b + c))
    assert len(on_a) == 2 and on_a[0] != on_b[0] and on_a[1] != on_b[1]
    assert cache.hashes(_request(a + c + [1, 2])) == on_a     # the same full pages; a partial one has no name
    assert PrefixCache(BlockAllocator(8), BS, "model b").hashes(_request(a + c)) != on_a
    llm = make_llm()
    outs = run(llm, [(0, "ac", a + c + [5], GREEDY), (4, "bc", b + c + [5], GREEDY), (8, "ac2", a + c + [6], GREEDY)])
    assert [outs[r].num_cached_tokens for r in ("ac", "bc", "ac2")] == [0, 0, 32]


def test_prefix_caching_off_computes_every_prompt_in_full():
    llm = make_llm(enable_prefix_caching=False)
    outs = run(llm, [(0, "a", SYSTEM, GREEDY), (3, "b", SYSTEM, GREEDY)])
    stats = llm.engine.stats()
    assert llm.engine.prefix_cache is None and not stats["prefix_caching"] and stats["prefill_tokens"] == 200
    assert outs["b"].num_cached_tokens == 0 and not llm.runner.blocks.num_cached


# ---- block-sparse and sliding-window models ---------------------------------------------------------------
@pytest.mark.parametrize("model_name", ["phi3-small-toy", "toy-mistral"])
def test_block_sparse_and_sliding_window_models_cache_correctly(model_name):
    """Prompts far past the local window (Phi-3-Small toy: 64 tokens) and the sliding window (16)."""
    if model_name == "toy-mistral":
        model, kw = fg.models.Llama(fg.models.LlamaConfig.toy_mistral(), seed=0, device=DEVICE), {}
    else:
        model = fg.models.Phi3Small(fg.models.Phi3SmallConfig.toy(), seed=0, device=DEVICE)
        kw = {} if HAS_CUDA else {"attention": {"dense": "sdpa", "blocksparse": BlockSparseTorch}}
    prefix = tokens(150, 9)
    sched = [(s, f"r{i}", prefix[:n] + tokens(5 + i, 60 + i), GREEDY)
             for i, (s, n) in enumerate(((0, 150), (1, 150), (5, 150), (6, 97), (9, 150)))]
    want = out_tokens(run(make_llm(model, enable_prefix_caching=False, max_num_tokens=128, **kw), sched))
    outs = run(make_llm(model, max_num_tokens=128, **kw), sched)
    assert out_tokens(outs) == want
    assert outs["r2"].num_cached_tokens == 144 and outs["r3"].num_cached_tokens == 96


def test_bench_serve_with_a_shared_prefix_computes_it_once(tmp_path, capsys):
    from fullgraph.bench.__main__ import main

    out = tmp_path / "serve.json"
    main(["serve", "--preset", "toy", "--requests", "6", "--input-len", "8", "--output-len", "2", "--shared-prefix",
          "64", "--max-num-seqs", "4", "--max-num-tokens", "64", "--out", str(out)])
    on, off = json.loads(out.read_text())["rows"][:2]
    assert "caching on" in on["system"] and "caching off" in off["system"]
    assert "prefill_tokens" in capsys.readouterr().out
    assert off["prefill_tokens"] - on["prefill_tokens"] == 5 * 64 == on["cached_tokens"] and off["hit_rate"] == 0
