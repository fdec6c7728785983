"""The benchmark peers compute what the model computes (else their times would mean nothing), and
the benchmark CLI runs on the CPU."""
from __future__ import annotations

import json

import pytest
import torch

import fullgraph as fg
from fullgraph.bench.peers import NaiveDecoder


@pytest.mark.parametrize("model", [fg.models.Llama(fg.models.LlamaConfig.toy(), seed=3),
                                   fg.models.Phi3Small(fg.models.Phi3SmallConfig.toy(), seed=3)],
                         ids=["llama", "phi3-small"])
def test_naive_peer_decodes_what_the_model_computes(model):
    tokens = torch.randint(0, 500, (12,), generator=torch.Generator().manual_seed(0)).tolist()  # within the sparse window
    runner = fg.FullGraphRunner(model, cudagraph="none", max_num_seqs=2, max_num_tokens=32, max_model_len=64)
    want = runner.step([fg.SeqChunk(tokens, 0, runner.blocks.allocate(1))]).logits[0]
    peer = NaiveDecoder(model, batch=1, max_len=32)
    with torch.inference_mode():
        for pos, t in enumerate(tokens):   # one token at a time, over the peer's own static cache
            peer.tokens.fill_(t)
            peer.pos.fill_(pos)
            got = peer()[0]
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-4)


def test_bench_plan_and_host_run_on_cpu(tmp_path, capsys):
    from fullgraph.bench.__main__ import main

    out = tmp_path / "plan.json"
    main(["plan", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["decode_chunks"] for r in rows] == [1, 32, 256] and all(r["plan_us_median"] > 0 for r in rows)
    out = tmp_path / "host.json"
    main(["host", "--batch", "1", "4", "--iters", "20", "--out", str(out)])
    assert "pre_launch_us" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    phases = ("plan", "ledger", "upload", "launch", "outputs", "record", "other")
    for r in rows:   # the per-stage pass leaves the runner as it found it: the next batch still times its launch
        assert 0 < r["pre_launch_us"] <= r["step_us"]
        assert all(r[f"phase_{p}_us"] >= 0 for p in phases) and r["phase_plan_us"] > 0 and r["phase_ledger_us"] > 0
        assert sum(r[f"phase_{p}_us"] for p in phases) < 3 * r["step_us"]
