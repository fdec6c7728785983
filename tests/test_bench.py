"""The benchmark peers compute what the model computes (else their times would mean nothing), and
the benchmark CLI runs on the CPU."""
from __future__ import annotations

import argparse
import json
import sys

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import fullgraph as fg
from fullgraph.bench import peers
from fullgraph.bench.peers import HFStaticDecoder, NaiveDecoder, NoPeer, hf_llama

# toy-llama with what the presets add (tied head, llama3 RoPE) and every bias LlamaForCausalLM has
LLAMA_VARIANT = fg.models.LlamaConfig.toy().replace(
    tie_word_embeddings=True, attention_bias=True, mlp_bias=True, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32})


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


def ours(model, prompts: torch.Tensor) -> torch.Tensor:
    """Our model's logits (B, vocab) after each row of ``prompts`` (B, T), eagerly."""
    runner = fg.FullGraphRunner(model, cudagraph="none", max_num_seqs=4, max_num_tokens=128, max_model_len=64)
    return runner.step([fg.SeqChunk(p.tolist(), 0, runner.blocks.allocate(4)) for p in prompts]).logits


@pytest.mark.parametrize("model", [fg.models.Llama(LLAMA_VARIANT, seed=5),
                                   fg.models.Phi3Small(fg.models.Phi3SmallConfig.toy(), seed=5)],
                         ids=["llama", "phi3-small"])
def test_naive_peer_decodes_a_batch_at_one_position(model):
    prompts = torch.randint(0, 500, (3, 13), generator=torch.Generator().manual_seed(1))   # within the sparse window
    peer = NaiveDecoder(model, batch=3, max_len=48)
    with torch.inference_mode():
        for pos in range(prompts.shape[1]):  # every request at the same position, as the benchmark runs them
            peer.tokens.copy_(prompts[:, pos])
            peer.pos.fill_(pos)
            got = peer()
    want = ours(model, prompts)
    finite = torch.isfinite(want)
    assert got.shape == (3, model.vocab_size) and torch.equal(finite, torch.isfinite(got))
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-4)


def test_naive_peer_compiles_whole_once_for_every_position():
    model = fg.models.Llama(fg.models.LlamaConfig.toy(), seed=3)
    peer = NaiveDecoder(model, batch=2, max_len=32)
    peer.tokens.copy_(torch.tensor([7, 300]))
    counter = CompileCounter()
    compiled = torch.compile(peer, backend=counter, fullgraph=True)   # fullgraph: no host sync, no break
    with torch.inference_mode():
        for pos in (5, 6, 9):
            peer.pos.fill_(pos)
            got = compiled()
        keys = peer.k0.clone()
        want = peer()   # eager, at the same position over the same cache
    assert counter.frame_count == 1
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(peer.k0, keys)   # rewriting position 9 changed nothing else


@pytest.mark.parametrize("config", [fg.models.LlamaConfig.toy(), LLAMA_VARIANT], ids=["toy", "tied-llama3-bias"])
def test_hf_peer_model_computes_what_the_model_computes(config):
    pytest.importorskip("transformers")
    model = fg.models.Llama(config, seed=4)
    prompts = torch.randint(0, config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = hf_llama(model)(prompts).logits[:, -1]
    want = ours(model, prompts)
    assert (got - want).abs().max() / want.abs().max() < 1e-5


def test_hf_peer_prefills_in_chunks_then_decodes_under_one_compiled_graph():
    pytest.importorskip("transformers")
    model = fg.models.Llama(LLAMA_VARIANT, seed=6)
    with torch.inference_mode():
        dec = HFStaticDecoder(model, batch=3, context=21, max_len=64, prefill_tokens=24)   # chunks of 8, 8, 5
        first = dec.step()
        dec.advance()
        counter = CompileCounter()
        dec.hf.forward = torch.compile(dec.hf.forward, backend=counter, fullgraph=True)   # the timed path's tracing
        steps = []
        for _ in range(3):
            steps.append(dec.step())
            dec.advance()
    assert counter.frame_count == 1 and dec.positions[:, 0].tolist() == [25] * 3
    for k, got in enumerate([first] + steps):   # the same token decoded again at each next position
        want = ours(model, torch.cat([dec.prompt] + [dec.prompt[:, -1:]] * k, dim=1))
        assert (got - want).abs().max() / want.abs().max() < 1e-5, f"step {k}"


def test_hf_peer_refuses_what_llama_cannot_express(monkeypatch, capsys):
    from fullgraph.bench import DECODE_COLUMNS, _peer_rows

    phi3 = fg.models.Phi3Small(fg.models.Phi3SmallConfig.toy(), seed=0)
    with pytest.raises(ValueError, match="no transformers peer for Phi3Small"):
        hf_llama(phi3)
    with pytest.raises(NoPeer, match="Qwen3"):
        hf_llama(fg.models.Llama(fg.models.LlamaConfig.toy().replace(qk_norm=True), seed=0))
    with pytest.raises(ValueError, match="expected one of"):
        peers.time_peer(phi3, "eager", batch=1, context=4)
    monkeypatch.setattr(peers, "PEERS", ("hf-static-compile",))   # the others need CUDA
    args = argparse.Namespace(steps=2, warmup=1, preset="phi3-toy")
    assert _peer_rows(args, phi3, 1, 1.0, 4, 1, {}) == []
    assert "peer hf-static-compile skipped: no transformers peer for Phi3Small" in capsys.readouterr().out
    monkeypatch.setattr(peers, "time_peer", lambda *a, **k: {"step_ms": 1.5, "replay_ms": 1.4})
    like = {"preset": "phi3-toy", "batch": 1, "context": 4, "dtype": "float32", "weight_bytes": 1, "copy_TBps": 1.0,
            "tensor_parallel": 1}
    (row,) = _peer_rows(args, phi3, 1, 1.0, 4, 1, like)
    assert set(DECODE_COLUMNS) <= set(row), "a peer row has every column the decode table prints"
    monkeypatch.setitem(sys.modules, "transformers", None)   # not installed
    with pytest.raises(NoPeer, match="needs transformers"):
        hf_llama(fg.models.Llama(fg.models.LlamaConfig.toy(), seed=0))


def test_bench_plan_and_host_run_on_cpu(tmp_path, capsys, monkeypatch):
    from fullgraph.bench.__main__ import main

    out = tmp_path / "plan.json"
    monkeypatch.setenv("FULLGRAPH_PDL", "late")   # the run's knobs travel with its rows
    main(["plan", "--out", str(out)])
    assert json.loads(out.read_text())["env"]["FULLGRAPH_PDL"] == "late"
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



def test_bench_engine_host_runs_on_cpu(tmp_path):
    from fullgraph.bench.__main__ import main

    out = tmp_path / "engine_host.json"
    main(["engine-host", "--batch", "1", "3", "--context", "40", "--steps", "6", "--output-kind", "delta",
          "final_only", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["output_kind"]) for r in rows] == [(1, "delta"), (1, "final_only"), (3, "delta"),
                                                              (3, "final_only")]
    for r in rows:   # every decode step schedules, steps the runner and collects the step before
        assert r["steps_timed"] == 6   # steps with every request decoding, the batch whole
        assert r["schedule_us"] > 0 and r["runner_us"] > 0 and r["collect_us"] > 0
        assert r["schedule_us"] + r["runner_us"] + r["collect_us"] < r["step_us"]

def test_bench_serve_runs_on_cpu_and_plots(tmp_path, capsys):
    """bench serve (the engine, the runner's floor) on the toy preset, all at once and at a rate, and
    bench plot of both runs; a serve file beside a decode file is refused."""
    pytest.importorskip("matplotlib")
    from fullgraph.bench.__main__ import main

    common = ["serve", "--preset", "toy", "--requests", "6", "--input-len", "16", "--output-len", "4",
              "--max-num-seqs", "4", "--max-num-tokens", "64"]
    runs = []
    for rate in ("0", "50"):
        runs.append(tmp_path / f"serve_{rate}.json")
        main([*common, "--rate", rate, "--out", str(runs[-1])])
        data = json.loads(runs[-1].read_text())
        assert data["command"] == "serve" and data["preset"] == "toy" and data["rate"] == float(rate)
        ours = data["rows"][0]
        assert ours["system"].startswith("fullgraph") and ours["output_tok_s"] > 0 and ours["tpot_p50_ms"] > 0
    image = tmp_path / "serve.png"
    main(["plot", "--inputs", *map(str, runs), "--out", str(image)])
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.stat().st_size > 10_000
    decode = tmp_path / "decode.json"
    decode.write_text(json.dumps({"command": "decode", "rows": []}))
    with pytest.raises(SystemExit):
        main(["plot", "--inputs", str(runs[0]), str(decode), "--out", str(image)])
    assert "mix decode and serve" in capsys.readouterr().err
