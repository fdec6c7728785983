"""The front door: a caller's mistake is a clear ValueError before anything changes (never a silent
wrong result), and the CLI speaks plainly (one line, exit status 2, defaults in --help)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fullgraph as fg
from fullgraph.generate import greedy
from harness import kv_bytes, toy_model

ROOT = Path(__file__).parent.parent
LIMITS = dict(max_num_seqs=4, max_num_tokens=64, max_model_len=128, block_size=16, cudagraph="padded")


@pytest.fixture
def primed():
    """A runner holding one request of 3 tokens in its first page."""
    runner = fg.FullGraphRunner(toy_model(), validate=True, **LIMITS)
    pages = runner.blocks.allocate(2)
    runner.step([fg.SeqChunk([1, 2, 3], 0, pages)])
    return runner, pages


def refused(runner, chunks, match, **kw) -> None:
    before, free = kv_bytes(runner), runner.blocks.num_free
    with pytest.raises(ValueError, match=match):
        runner.step(chunks, **kw)
    assert all(torch.equal(a, b) for a, b in zip(before, kv_bytes(runner))) and runner.blocks.num_free == free


def test_start_pos_past_what_was_written_is_refused(primed):
    runner, pages = primed
    refused(runner, [fg.SeqChunk([7], 10, pages)], "chunk 0: start_pos: 10 says that many positions are in the "
                                                   "cache, but its pages hold 3 written")
    refused(runner, [fg.SeqChunk([7], 20, pages)], "chunk 0: start_pos: 20")
    runner.step([fg.SeqChunk([7], 3, pages)])                          # the right position still runs


def test_pages_never_allocated_or_freed_are_refused(primed):
    runner, pages = primed
    refused(runner, [fg.SeqChunk(list(range(20)), 3, [pages[0], 30])], "block 30 \\(page 1\\) is not allocated")
    other = runner.blocks.allocate(1)
    runner.blocks.free(other)
    refused(runner, [fg.SeqChunk([5], 0, other)], f"block {other[0]} \\(page 0\\) is not allocated")


def test_page_ledger_of_many_requests_checks_only_used_pages():
    """Past four requests the ledger check is vectorised (and skips its per-page mask when every
    listed page is allocated): a spare unallocated page past a request's used ones still runs, an
    unallocated page it uses is refused, naming the chunk."""
    runner = fg.FullGraphRunner(toy_model(), validate=True, **{**LIMITS, "max_num_seqs": 8})
    lists = [runner.blocks.allocate(1) for _ in range(6)]
    runner.step([fg.SeqChunk([i + 1, 2, 3], 0, ids) for i, ids in enumerate(lists)])
    spare = runner.blocks.allocate(1)
    runner.blocks.free(spare)
    runner.step([fg.SeqChunk([5], 3, ids + (spare if i == 2 else [])) for i, ids in enumerate(lists)])
    grows = [fg.SeqChunk(list(range(14)) if i == 4 else [5], 4, ids + (spare if i == 4 else []))
             for i, ids in enumerate(lists)]                      # chunk 4 reaches position 17: page 1
    refused(runner, grows, f"chunk 4: block_ids: block {spare[0]} \\(page 1\\) is not allocated")


def test_page_ledger_reuses_owned_lists_only_while_no_page_was_released():
    """A decode batch's lists, found owned, are not gathered again while they only grow by owned
    pages and no page loses an owner; a page freed under unchanged lists, an appended page never
    allocated, and a refused step's lists sent again are each still refused."""
    runner = fg.FullGraphRunner(toy_model(), validate=True, **{**LIMITS, "max_num_seqs": 8})
    lists = [runner.blocks.allocate(1) for _ in range(6)]
    runner.step([fg.SeqChunk([i + 1, 2, 3], 0, ids) for i, ids in enumerate(lists)])
    decode = lambda pos: [fg.SeqChunk([5], pos, ids) for ids in lists]   # noqa: E731
    cache = runner._block_ids
    runner.step(decode(3))
    first = cache.version
    runner.step(decode(4))                                             # the lists of ``first``: not gathered
    assert cache.basis() == (first, (), cache.version) and runner.blocks._owned_lists[0] == cache.version
    victim = lists[2][0]
    runner.blocks.free([victim])
    refused(runner, decode(5), f"chunk 2: block_ids: block {victim} \\(page 0\\) is not allocated")
    runner.blocks.allocate(1)                                          # the victim again, owned by nobody's list
    lists[2] = runner.blocks.allocate(1)                               # chunk 2 restarts on a page of its own
    runner.step([fg.SeqChunk([1, 2, 3, 4, 5], 0, lists[2])])
    runner.step(decode(5))
    runner.step(decode(6))                                             # compared with the last: owned, none released
    runner.step([fg.SeqChunk(list(range(9)), 7, lists[4])])            # chunk 4's first page full
    never = runner.config.num_blocks - 1                               # never handed out
    assert not runner.blocks.is_allocated(never)
    lists[4].append(never)                                             # the list grown in place, as an engine does
    grown = [fg.SeqChunk([5], 16 if i == 4 else 7, ids) for i, ids in enumerate(lists)]
    refused(runner, grown, f"chunk 4: block_ids: block {never} \\(page 1\\) is not allocated")
    refused(runner, grown, f"chunk 4: block_ids: block {never} \\(page 1\\) is not allocated")
    lists[4][-1] = runner.blocks.allocate(1)[0]
    runner.step(grown)


@pytest.mark.parametrize("chunk, match", [
    (fg.SeqChunk([7.9], 3, [1]), "token_ids: expected ints, got float 7.9"),
    (fg.SeqChunk(["7"], 3, [1]), "token_ids: expected ints, got str"),
    (fg.SeqChunk([True], 3, [1]), "token_ids: expected ints, got bool True"),
    (fg.SeqChunk([7], 3.9, [1]), "start_pos: expected an int, got float 3.9"),
    (fg.SeqChunk([7], None, [1]), "start_pos: expected an int, got NoneType"),
    (fg.SeqChunk("hello", 3, [1]), "token_ids: expected a list of ints, got str 'hello'"),
    (fg.SeqChunk([7], 3, [1.0]), "block_ids: expected ints, got float"),
    (fg.SeqChunk(np.array([7.0]), 3, [1]), "token_ids: expected a 1-D integer array"),
], ids=["float", "str", "bool", "float-start", "none-start", "str-tokens", "float-block", "float-array"])
def test_no_silent_coercion(primed, chunk, match):
    refused(primed[0], [chunk], "chunk 0: " + match)


def test_wrong_containers(primed):
    runner, pages = primed
    refused(runner, [([7], 3, pages)], "chunk 0: expected a SeqChunk, got tuple")
    refused(runner, fg.SeqChunk([7], 3, pages), "chunks: expected a list of SeqChunk, got SeqChunk")


def test_device_token_ids_out_of_the_vocabulary():
    strict = fg.FullGraphRunner(toy_model(), validate=True, **LIMITS)
    pages = strict.blocks.allocate(1)
    with pytest.raises(ValueError, match="token_ids\\[1\\] = 600: outside the vocabulary"):
        strict.step([fg.SeqChunk([0, 0], 0, pages)], token_ids=torch.tensor([5, 600]))
    loose = fg.FullGraphRunner(toy_model(), **LIMITS)        # documented: clamped into range, never out of bounds
    same = fg.FullGraphRunner(toy_model(), **LIMITS)
    a = loose.step([fg.SeqChunk([0, 0], 0, loose.blocks.allocate(1))], token_ids=torch.tensor([5, 10**6])).logits
    b = same.step([fg.SeqChunk([5, 511], 0, same.blocks.allocate(1))]).logits
    assert torch.equal(a, b)


def test_fed_back_rows_out_of_range_are_refused():
    runner = fg.FullGraphRunner(toy_model(), sampling=True, validate=True, **LIMITS)
    pages = [runner.blocks.allocate(1) for _ in range(2)]
    runner.step([fg.SeqChunk([3, 4], 0, pages[0]), fg.SeqChunk([5], 0, pages[1])])
    chunks = [fg.SeqChunk([0], 2, pages[0]), fg.SeqChunk([0], 1, pages[1])]
    for rows, bad in (([0, 4], "\\[1\\] = 4"), ([-2, 1], "\\[0\\] = -2"), ([0, 1.0], "\\[1\\] = 1.0"),
                      ([True, 1], "\\[0\\] = True")):
        refused(runner, chunks, f"values\\['prev_token_row'\\]{bad}: expected -1 .* in \\[0, 4\\)",
                values={"prev_token_row": rows})
    out = runner.step(chunks, values={"prev_token_row": [1, -1]})           # in range: runs
    assert out.token_ids.shape == (2,)


def test_greedy_refuses_what_it_cannot_do():
    runner = fg.FullGraphRunner(toy_model(), **LIMITS)
    for prompts, n, match in (([[]], 4, "prompt 0: empty"), ([[1, 2]], 0, "max_new_tokens"),
                              ([[1, 2]], -1, "max_new_tokens"), ([[1] * 120], 16, "prompt 0: 120 tokens .* max_model_len")):
        with pytest.raises(ValueError, match=match):
            greedy(runner, prompts, n)
    assert runner.blocks.num_free == runner.config.num_blocks - 1


def cli(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, **(env or {})})


def test_cli_errors_are_one_line_with_status_2():
    done = cli("-m", "fullgraph", "doctor", "--attention", "flash", "--modes", "none", "padded")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: ") and "FlashAttention needs a CUDA device" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    done = cli("-m", "fullgraph", "--debug", "doctor", "--attention", "flash", "--modes", "none", "padded")
    assert done.returncode != 0 and "Traceback" in done.stderr


def test_cli_help_shows_defaults_and_choices():
    done = cli("-m", "fullgraph", "demo", "--help")
    assert "(default: 32)" in done.stdout and "{auto,sdpa,triton,flash}" in done.stdout and "--requests" in done.stdout
    done = cli("-m", "fullgraph.bench", "decode", "--help")
    assert "--context" in done.stdout and "(default: [1024])" in " ".join(done.stdout.split())
    assert "(none: print the table only) (default: None)" in " ".join(done.stdout.split())  # JSON only when asked


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_bench_capture_on_cpu_says_why(tmp_path):
    done = subprocess.run([sys.executable, "-m", "fullgraph.bench", "capture"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and "needs a CUDA device" in done.stderr and "Traceback" not in done.stderr
    assert not list(tmp_path.iterdir()), "a benchmark wrote a file without --out"
