"""fg.LLM / fg.Engine: continuous batching, sampling inside the graph, stops, preemption, aborts."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import fullgraph as fg
from fullgraph.engine.text import RequestText
from fullgraph.generate import greedy
from harness import HAS_CUDA, toy_model

MODE = "full" if HAS_CUDA else "padded"
LIMITS = dict(max_num_seqs=8, max_model_len=256, max_num_tokens=128, block_size=16)
PROMPTS = [[5, 9, 2, 7, 1], list(range(10, 50)), [300] * 3, list(range(100, 230))]
GREEDY = fg.SamplingParams(temperature=0, max_tokens=12)


def make_llm(**kw) -> fg.LLM:
    return fg.LLM(toy_model(), **{**LIMITS, "cudagraph": MODE, **kw})


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llm() -> fg.LLM:
    return make_llm()


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """The old fixed greedy loop (eager), the baseline the engine must reproduce."""
    runner = fg.FullGraphRunner(toy_model(), cudagraph="none", **LIMITS)
    return greedy(runner, PROMPTS, 12).tokens


def test_greedy_equals_the_old_greedy_loop(llm, reference):
    outs = llm.generate(PROMPTS, GREEDY)
    assert tokens(outs) == reference
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert [o.prompt_token_ids for o in outs] == PROMPTS and llm.runner.blocks.num_free == llm.runner.config.num_blocks - 1


def test_overlapped_loop_gives_the_synchronous_loop_tokens(llm):
    sync = make_llm()
    sync.engine.overlap = False
    params = fg.SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=10)
    assert tokens(sync.generate(PROMPTS, params)) == tokens(llm.generate(PROMPTS, params))


def test_seeded_requests_reproduce_across_batch_compositions_and_buckets(llm):
    params = fg.SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=10)
    alone = tokens(llm.generate([PROMPTS[1]], params))[0]
    crowded = llm.generate(PROMPTS + [[7] * 9, [8] * 21], [fg.SamplingParams(temperature=0.7, seed=i, max_tokens=14)
                                                          for i in range(1)] + [params] + [GREEDY] * 4)
    assert tokens(crowded)[1] == alone
    other = tokens(llm.generate([PROMPTS[1]], fg.SamplingParams(temperature=1.0, top_k=50, seed=99, max_tokens=10)))[0]
    assert other != alone
    unseeded = [tokens(llm.generate([PROMPTS[1]], fg.SamplingParams(temperature=1.0, max_tokens=10)))[0] for _ in range(2)]
    assert unseeded[0] != unseeded[1]  # drawn from the engine's generator: a new stream each time


def test_a_caller_editing_an_outputs_prompt_ids_changes_nothing_the_engine_computes(reference):
    """Outputs share one copy of the prompt ids per request, never the engine's own list: a
    preempted request recomputes its prompt from the engine's list, so editing what an output
    shows must not change a token."""
    small = make_llm(num_blocks=11)
    engine, finals = small.engine, {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    while engine.has_unfinished():
        for out in engine.step():
            out.prompt_token_ids[:] = [0] * len(out.prompt_token_ids)   # a careless caller
            finals[out.request_id] = out
        for request in engine.scheduler.running:   # what a recompute after preemption would read
            assert request.prompt_ids == PROMPTS[int(request.request_id)]
    assert [finals[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == reference
    assert sum(o.metrics.num_preemptions for o in finals.values()) > 0


def test_preemption_by_a_tiny_page_pool_keeps_greedy_output(reference):
    small = make_llm(num_blocks=11)  # 10 pages; at their ends the four requests need 2 + 4 + 1 + 9
    outs = small.generate(PROMPTS, GREEDY)
    assert tokens(outs) == reference
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert small.runner.blocks.num_free == 10



def test_a_request_preempted_for_an_earlier_ones_page_gets_no_chunk_that_step():
    """Two decoding requests, no free page, the earlier one due a page: the later one is preempted
    (its pages freed, back to the head of the queue) and gets no chunk in that step, even where its
    freed pages and the budget would fit a chunk of its prompt to redo; the earlier one decodes."""
    from fullgraph.engine.params import RequestMetrics
    from fullgraph.engine.scheduler import Request, Scheduler
    from fullgraph.kv_cache import BlockAllocator

    blocks = BlockAllocator(5)                                   # 4 pages of 4 positions
    sched = Scheduler(blocks, block_size=4, max_num_seqs=4, max_num_tokens=64)
    early, late = (Request(name, None, list(range(1, n + 1)), GREEDY, 0, None, RequestMetrics(0.0, num_prompt_tokens=n),
                           64) for name, n in (("early", 4), ("late", 12)))
    sched.add(early), sched.add(late)
    assert [(r.request_id, count) for r, _, count, _, _ in sched.schedule()] == [("early", 4), ("late", 12)]
    for row, r in enumerate((early, late)):   # their prompts ran; each sampled a token still on the device
        r.computed, r.pending, r.row = len(r.prompt_ids), 1, row
    assert blocks.num_free == 0
    sched.max_num_tokens = 5      # after early's decode, room for a 4-token chunk: one of late's freed pages
    slots = sched.schedule()      # early's 5th position needs a page
    assert [(r.request_id, count, prev) for r, _, count, prev, _ in slots] == [("early", 1, 0)]
    assert sched.running == [early] and list(sched.waiting) == [late] and blocks.num_free == 2
    assert late.computed == 0 and not late.blocks and late.metrics.num_preemptions == 1

def test_abort_mid_prefill_and_mid_decode_frees_every_page():
    llm = make_llm(max_num_tokens=32)
    engine, free = llm.engine, llm.runner.blocks.num_free
    engine.add_request("long", list(range(1, 121)), GREEDY)   # 120 tokens: four steps of prefill
    engine.add_request("short", [1, 2, 3], fg.SamplingParams(temperature=0, max_tokens=50))
    engine.step()
    assert llm.runner.blocks.num_free < free
    engine.abort("long")                                      # mid-prefill
    for _ in range(4):
        engine.step()
    engine.abort("short")                                     # mid-decode
    while engine.has_unfinished():
        engine.step()
    assert llm.runner.blocks.num_free == free
    with pytest.raises(ValueError, match="request 'short': request_id: no such unfinished request"):
        engine.abort("short")


def test_max_tokens_eos_and_stop_token_ids(llm, reference):
    eos = reference[0][5]
    capped = llm.generate([PROMPTS[0]], fg.SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert capped.token_ids == reference[0][:3] and capped.finish_reason == "length"
    stopped = llm.generate([PROMPTS[0]], fg.SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[eos]))[0]
    first = reference[0].index(eos)
    assert stopped.outputs[0].token_ids == reference[0][: first + 1]
    assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == ("stop", eos)
    llm.engine.eos_token_ids = frozenset({eos})
    try:
        assert tokens(llm.generate([PROMPTS[0]], GREEDY))[0] == reference[0][: first + 1]
        ignored = llm.generate([PROMPTS[0]], fg.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert tokens(ignored)[0] == reference[0]
    finally:
        llm.engine.eos_token_ids = frozenset()


def test_logprobs_of_the_greedy_token_are_the_top_logprob():
    llm = make_llm(max_logprobs=3)
    out = llm.generate([PROMPTS[1]], fg.SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0].outputs[0]
    runner = fg.FullGraphRunner(toy_model(), cudagraph="none", **LIMITS)
    blocks = runner.blocks.allocate(4)
    logits = runner.step([fg.SeqChunk(PROMPTS[1], 0, blocks)]).logits[0].double()
    expected = torch.log_softmax(logits, -1)
    first = out.logprobs[0]
    assert len(first) == 3 and max(first, key=first.get) == out.token_ids[0]
    for token, lp in first.items():
        assert abs(lp - float(expected[token])) < 1e-4


# ---- text: byte-level stop strings -----------------------------------------------------------------
def test_stop_string_split_across_tokens_stops_at_the_right_character():
    table = [b"", b"Hel", b"lo\n", b"\nWor", b"ld", b"\xe6\x97", b"\xa5"]   # \xe6\x97\xa5 = one character
    text = RequestText(table, frozenset({0}), ["\n\nW"], True, False)
    deltas = [text.add(t) for t in (1, 5, 6, 2, 3, 4)]      # "Hel" "\xe6\x97" "\xa5" "lo\n" "\nWor": stop
    assert text.stop == "\n\nW" and text.text == "Hel\u65e5lo" and "".join(deltas) == text.text
    assert deltas[:3] == ["H", "el", ""]          # 2 bytes held back (a stop string could begin there), then half a character
    whole = RequestText(table, frozenset({0}), [], True, False)
    assert "".join(whole.add(t) for t in (1, 5, 0, 6, 4)) + whole.finish() == "Hel\u65e5ld"
    kept = RequestText(table, frozenset(), ["ld"], True, True)
    for t in (1, 2, 3, 4):
        kept.add(t)
    assert kept.text == "Hello\n\nWorld"


def test_bad_requests_name_the_request_and_field(llm):
    engine = llm.engine
    engine.add_request("dup", [1, 2], GREEDY)
    cases = [
        (lambda: engine.add_request("dup", [1, 2]), "request 'dup': request_id"),
        (lambda: engine.add_request("e", []), "request 'e': prompt: empty"),
        (lambda: engine.add_request("v", [1, 600]), "request 'v': prompt: token id 600"),
        (lambda: engine.add_request("f", [1, 2.5]), "request 'f': prompt: token id 2.5"),
        (lambda: engine.add_request("t", "text"), "request 't': prompt: a text prompt needs a tokenizer"),
        (lambda: engine.add_request("l", [1] * 256), "request 'l': prompt: 256 tokens"),
        (lambda: engine.add_request("s", [1], fg.SamplingParams(stop=["x"])), "request 's': stop"),
        (lambda: engine.add_request("p", [1], fg.SamplingParams(logprobs=2)), "request 'p': logprobs"),
        (lambda: engine.add_request("p0", [1], fg.SamplingParams(logprobs=0)), "request 'p0': logprobs: 0 asked for"),
        (lambda: fg.SamplingParams(temperature=-1), "temperature"),
        (lambda: fg.SamplingParams(top_p=0), "top_p"),
        (lambda: fg.SamplingParams(top_p=1.5), "top_p"),
        (lambda: fg.SamplingParams(top_k=0), "top_k"),
        (lambda: fg.SamplingParams(top_k=-2), "top_k"),
        (lambda: fg.SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: fg.SamplingParams(max_tokens=-1), "max_tokens"),
        (lambda: fg.SamplingParams(temperature="hot"), "temperature"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    engine.abort("dup")
    assert not engine.has_unfinished() or not engine._requests
    while engine.has_unfinished():
        engine.step()
    assert llm.runner.blocks.num_free == llm.runner.config.num_blocks - 1


def test_streaming_outputs_carry_the_new_tokens():
    llm = make_llm()
    llm.engine.add_request("a", PROMPTS[0], GREEDY)
    seen = []
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            seen += out.outputs[0].delta_token_ids
            final = out
    assert seen == final.outputs[0].token_ids and final.finished and final.metrics.time_to_first_token > 0



def _stream(engine, kinds: dict[str, str], prompts, params) -> dict[str, list]:
    """Every output ``engine.step`` returns, per request, for requests of the given output kinds."""
    for (rid, kind), prompt in zip(kinds.items(), prompts):
        engine.add_request(rid, prompt, dataclasses.replace(params, output_kind=kind))
    seen = {rid: [] for rid in kinds}
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id in seen:
                seen[out.request_id].append(out)
    return seen


def test_output_kinds_cumulative_delta_and_final_only_carry_the_same_tokens_and_logprobs():
    llm = make_llm(max_logprobs=2)
    params = fg.SamplingParams(temperature=0.8, seed=5, max_tokens=9, logprobs=2)
    prompts = [PROMPTS[1], PROMPTS[1], PROMPTS[1], PROMPTS[3]]
    seen = _stream(llm.engine, {"c": "cumulative", "d": fg.RequestOutputKind.DELTA, "f": "final_only",
                                "plain": "delta"}, prompts, params)
    cumulative = seen["c"][-1].outputs[0]
    assert len(seen["c"]) == len(seen["d"]) == 9 and [o.finished for o in seen["d"]] == [False] * 8 + [True]
    delta = [o.outputs[0] for o in seen["d"]]
    assert all(len(c.token_ids) == 1 and c.token_ids == c.delta_token_ids and len(c.logprobs) == 1 for c in delta)
    assert [t for c in delta for t in c.token_ids] == cumulative.token_ids
    assert [lp for c in delta for lp in c.logprobs] == cumulative.logprobs
    assert delta[-1].finish_reason == "length" == cumulative.finish_reason
    assert len(seen["f"]) == 1 and seen["f"][0].finished
    final = seen["f"][0].outputs[0]
    assert final.token_ids == cumulative.token_ids and final.logprobs == cumulative.logprobs
    # a cumulative output is the caller's: the engine's later steps do not grow it
    assert [len(o.outputs[0].token_ids) for o in seen["c"]] == list(range(1, 10))
    assert llm.runner.blocks.num_free == llm.runner.config.num_blocks - 1


def test_generate_returns_final_outputs_whatever_kind_its_params_ask_for(llm, reference):
    outs = llm.generate(PROMPTS, dataclasses.replace(GREEDY, output_kind="delta"))
    assert tokens(outs) == reference and all(o.finished for o in outs)
    with pytest.raises(ValueError, match="SamplingParams.output_kind: expected a RequestOutputKind"):
        fg.SamplingParams(output_kind="streaming")


def test_logprobs_of_a_request_that_joins_a_running_batch_are_its_own():
    """The logprob outputs are fetched only while some request wants them: one that joins a batch
    running without them gets the logprobs the same request gets alone."""
    llm = make_llm(max_logprobs=2)
    alone = llm.generate([PROMPTS[2]], fg.SamplingParams(temperature=0, max_tokens=5, logprobs=2))[0].outputs[0]
    engine = llm.engine
    engine.add_request("long", PROMPTS[3], fg.SamplingParams(temperature=0, max_tokens=20))
    for _ in range(6):
        engine.step()
    seen = _stream(engine, {"joined": "final_only"}, [PROMPTS[2]],
                   fg.SamplingParams(temperature=0, max_tokens=5, logprobs=2))["joined"][0].outputs[0]
    assert seen.token_ids == alone.token_ids
    for got, want in zip(seen.logprobs, alone.logprobs):
        assert got.keys() == want.keys() and all(abs(got[t] - want[t]) < 1e-5 for t in got)
    assert not engine._with_logprobs


@pytest.mark.gpu
def test_compiled_full_graph_engine_gives_the_same_tokens_and_never_recompiles(reference):
    llm = make_llm(compile=True)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == reference
    sampled = llm.generate(PROMPTS, fg.SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12))
    assert all(len(t) == 12 for t in tokens(sampled))
    stats = llm.runner.stats()
    assert stats["recompiles_after_warmup"] == 0 and stats["graph_hits"]
