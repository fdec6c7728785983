"""Tensor parallelism on the CPU: N gloo processes against one process, logits and greedy tokens."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from fullgraph.models import Llama, LlamaConfig
from fullgraph.parallel import TensorParallel, shard_model
from fullgraph.parallel.shard import split_heads


def _run(model: str, world: int, tmp_path, steps: int = 40, *extra: str) -> dict:
    out = tmp_path / f"{model}-{world}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "fullgraph.testing.parallel", "--model", model, "--steps", str(steps), "--out", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("model, world, steps", [("toy-llama", 2, 40), ("toy-llama-mqa", 2, 40),
                                                 ("toy-phi3-small", 4, 12)])
def test_sharded_model_matches_one_process(model, world, steps, tmp_path):
    # toy-llama-mqa: one KV head replicated on both ranks; toy-phi3-small on 4 ranks: each holds 2 of
    # a KV group's 4 query heads, and its block-sparse heads start at global head 2r (at 2 ranks the
    # offset 4 is a whole period of the toy's vertical stride, so a wrong offset would not show).
    # 12 steps: four interpreted ranks share a CI machine's two cores (~2 min); with every rank's
    # offset 0 the logits are off by 4.5e-2 already after 8
    result = _run(model, world, tmp_path, steps)
    assert result["world_size"] == world
    assert result["max_rel_logit_error"] <= 1e-5, result
    assert result["greedy_equal"], result


def test_ranks_loading_their_checkpoint_shards_match_one_process(tmp_path):
    # every rank reads only its slices of a safetensors checkpoint (KV heads split over 2 ranks)
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():   # logits far from uniform, so greedy tokens have no near-ties
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.2)
    model.save_pretrained(tmp_path / "ckpt")
    result = _run("toy-llama", 2, tmp_path, 20, "--checkpoint", str(tmp_path / "ckpt"))
    assert result["model"] == str(tmp_path / "ckpt")
    assert result["max_rel_logit_error"] <= 1e-5 and result["greedy_equal"], result


def test_compiled_sharded_model_traces_the_collectives(tmp_path):
    # torch.compile(fullgraph=True) over the functional all-reduces and all-gather (Inductor on the CPU)
    result = _run("toy-llama", 2, tmp_path, 12, "--compile")
    assert result["max_rel_logit_error"] <= 1e-5 and result["greedy_equal"], result
    assert result["compiled_graphs"] > 0 and result["recompiles"] == 0, result


def _tp(rank: int, world: int) -> TensorParallel:
    return TensorParallel(rank, world, group=None)  # layout only: no collective runs


def test_head_split_covers_every_head_once():
    for heads, kv, world in ((32, 8, 2), (32, 8, 8), (32, 8, 16), (9, 3, 3), (4, 2, 4)):
        splits = [split_heads(heads, kv, _tp(r, world)) for r in range(world)]
        assert sorted(h for s in splits for h in s.q) == list(range(heads))
        group = heads // kv
        for s in splits:  # every query head reads a KV head its rank holds
            assert all(h // group in s.kv for h in s.q)
            assert len(s.kv) == max(1, kv // world)


def test_unsupported_splits_are_refused_by_name():
    with pytest.raises(ValueError, match="must divide the 9 query heads"):
        split_heads(9, 3, _tp(0, 2))
    with pytest.raises(ValueError, match="intermediate_size"):
        shard_model(Llama(LlamaConfig.toy().replace(intermediate_size=129)), _tp(0, 2))
    model = Llama(LlamaConfig.toy())
    shard_model(model, _tp(1, 2))
    with pytest.raises(ValueError, match="already sharded"):
        shard_model(model, _tp(1, 2))
    with pytest.raises(ValueError, match="supports Llama-family and Phi-3-Small"):
        shard_model(torch.nn.Linear(2, 2), _tp(0, 2))


def test_shard_keeps_the_rank_slices():
    full, part = Llama(LlamaConfig.toy(), seed=3), shard_model(Llama(LlamaConfig.toy(), seed=3), _tp(1, 2))
    c, d = full.config, full.config.head_dim
    a_full, a_part = full.layers[0].self_attn, part.layers[0].self_attn
    q_size = c.num_heads * d
    # rank 1 of 2: query heads 2-3, KV head 1, the second half of the FFN and of the vocabulary
    torch.testing.assert_close(a_part.qkv_proj.weight[: 2 * d], a_full.qkv_proj.weight[2 * d: 4 * d], rtol=0, atol=0)
    torch.testing.assert_close(a_part.qkv_proj.weight[2 * d: 3 * d], a_full.qkv_proj.weight[q_size + d: q_size + 2 * d],
                               rtol=0, atol=0)
    torch.testing.assert_close(a_part.o_proj.weight, a_full.o_proj.weight[:, 2 * d:], rtol=0, atol=0)
    assert (a_part.attn.num_heads, a_part.attn.num_kv_heads) == (2, 1)
    half = c.intermediate_size // 2
    up_full, up_part = full.layers[0].mlp.gate_up_proj.weight, part.layers[0].mlp.gate_up_proj.weight
    torch.testing.assert_close(up_part, torch.cat((up_full[half: 2 * half], up_full[3 * half:])), rtol=0, atol=0)
    torch.testing.assert_close(part.embed_tokens.weight, full.embed_tokens.weight[c.vocab_size // 2:], rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL inside captured graphs)")
@pytest.mark.parametrize("model", ["toy-llama", "toy-phi3-small"])
def test_captured_graphs_with_nccl_match_one_process(model, tmp_path):
    out = tmp_path / f"{model}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "fullgraph.testing.parallel", "--model", model, "--mode", "full", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["max_rel_logit_error"] <= 1e-4 and result["greedy_equal"], result  # float32, GPU reduction order
