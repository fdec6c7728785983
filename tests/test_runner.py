"""FullGraphRunner API: config resolution, modes, allocator, metadata contract, stats."""
from __future__ import annotations

import pytest
import torch

import fullgraph as fg
from fullgraph.attention.backends.sdpa import SdpaBackend
from fullgraph.kv_cache import BlockAllocator
from fullgraph.padding import PaddingPolicy
from harness import toy_model


def test_defaults_resolve_for_this_machine():
    runner = fg.FullGraphRunner(toy_model())
    cfg = runner.config
    cuda = torch.cuda.is_available()
    assert cfg.cudagraph == ("full" if cuda else "padded")
    assert cfg.attention in fg.attention.backends.available_backends()
    assert cfg.num_blocks == cfg.max_num_seqs * cfg.max_blocks_per_seq + 1
    assert len(runner.kv_caches) == 2
    assert runner.kv_caches[0].shape == (2, cfg.num_blocks, cfg.block_size, 2, 16)


def test_config_object_and_overrides():
    base = fg.RunnerConfig(max_num_seqs=4, max_num_tokens=64, max_model_len=128, cudagraph="none")
    runner = fg.FullGraphRunner(toy_model(), base, block_size=32, attention="sdpa")
    assert runner.config.block_size == 32 and runner.config.max_num_seqs == 4 and runner.config.cudagraph == "none"


@pytest.mark.parametrize("bad,match", [
    (dict(block_size=24), "power of two"), (dict(max_num_seqs=0), "positive"),
    (dict(max_num_seqs=64, max_num_tokens=32), "max_num_seqs"), (dict(cudagraph="graph"), "cudagraph"),
    (dict(num_blocks=1), "null block"), (dict(capture_sizes=(0, 4)), "capture_sizes"),
    (dict(max_num_seqs=1, max_num_tokens=512, max_model_len=256), "max_num_seqs \\* max_model_len"),
])
def test_config_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        fg.RunnerConfig(**bad)


def test_unknown_backend_and_too_long_model_len():
    with pytest.raises(ValueError, match="no attention backend named 'fast'"):
        fg.FullGraphRunner(toy_model(), attention="fast")
    with pytest.raises(ValueError, match="exceeds the model.s max_model_len"):
        fg.FullGraphRunner(toy_model(), max_model_len=8192)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_full_mode_without_cuda_suggests_padded(monkeypatch):
    with pytest.raises(ValueError, match='cudagraph="full" needs a CUDA device.*nothing to capture.*"padded"'):
        fg.FullGraphRunner(toy_model(), cudagraph="full")
    monkeypatch.setenv("FULLGRAPH_CUDAGRAPH", "full")
    with pytest.raises(ValueError, match="FULLGRAPH_CUDAGRAPH=full in the environment needs a CUDA device"):
        fg.FullGraphRunner(toy_model(), cudagraph="padded")
    monkeypatch.delenv("FULLGRAPH_CUDAGRAPH")
    runner = fg.FullGraphRunner(toy_model(), cudagraph="padded")
    with pytest.raises(ValueError, match="nothing to capture here.*padded"):
        runner.capture()


def test_environment_forces_eager(monkeypatch):
    monkeypatch.setenv("FULLGRAPH_CUDAGRAPH", "none")
    runner = fg.FullGraphRunner(toy_model(), cudagraph="padded")
    out = runner.step([fg.SeqChunk([1, 2, 3], 0, runner.blocks.allocate(1))])
    assert runner.config.cudagraph == "none" and out.mode == "none" and out.num_tokens_padded == 3
    monkeypatch.setenv("FULLGRAPH_CUDAGRAPH", "eager")
    with pytest.raises(ValueError, match="FULLGRAPH_CUDAGRAPH"):
        fg.FullGraphRunner(toy_model())


def test_allocator_never_hands_out_the_null_block():
    blocks = BlockAllocator(5)
    ids = blocks.allocate(4)
    assert sorted(ids) == [1, 2, 3, 4] and blocks.num_free == 0
    with pytest.raises(ValueError, match="only 0 of 4 are free"):
        blocks.allocate(1)
    blocks.free(ids[:2])
    with pytest.raises(ValueError, match="not allocated"):
        blocks.free([ids[0]])
    with pytest.raises(ValueError, match="not allocated"):
        blocks.free([0])
    assert sorted(blocks.allocate(2)) == sorted(ids[:2])


def test_step_output_and_stats():
    runner = fg.FullGraphRunner(toy_model(), max_num_seqs=4, max_num_tokens=64, max_model_len=128,
                                cudagraph="padded", attention="sdpa", validate=True)
    a, b = runner.blocks.allocate(2), runner.blocks.allocate(2)
    out = runner.step([fg.SeqChunk([5, 9, 2], 0, a), fg.SeqChunk(list(range(10)), 0, b)])
    assert out.logits.shape == (2, 512) and out.logits.dtype == torch.float32
    assert out.mode == "padded" and out.num_tokens == 13 and out.num_tokens_padded == 16
    runner.step([fg.SeqChunk([1], 3, a), fg.SeqChunk([1], 10, b)])
    stats = runner.stats()
    assert stats["steps"] == 2 and stats["tokens"] == 15 and stats["padded_tokens"] == 3
    assert "steps=2" in runner.stats_line()


class ProbeBackend(SdpaBackend):
    """sdpa, declaring fewer fields than it reads: the contract must catch it."""

    name = "probe_undeclared"
    policy = PaddingPolicy("probe_undeclared", reads=frozenset({"query_start_loc", "seq_lens", "slot_mapping"}))


def test_undeclared_field_is_not_built_and_reading_it_fails_loudly(registered_backend):
    registered_backend(ProbeBackend)
    runner = fg.FullGraphRunner(toy_model(), attention="probe_undeclared", cudagraph="padded")
    with pytest.raises(RuntimeError, match="'probe_undeclared' read metadata field 'block_table'"):
        runner.step([fg.SeqChunk([1, 2], 0, runner.blocks.allocate(1))])


def test_backend_refuses_a_layer_kind_it_does_not_serve():
    limits = fg.attention.backends.BackendLimits(4, 64, 128, 16, 10, torch.device("cpu"), torch.float32)
    dense = fg.attention.Attention(2, 2, 8, 1.0)
    with pytest.raises(ValueError, match="'blocksparse' serves \\['blocksparse'\\] layers, not 'dense'"):
        fg.attention.backends.resolve_backends("blocksparse", [dense], limits)


@pytest.mark.gpu
def test_flash_without_paging_refuses_cached_context_before_writing():
    flash = fg.attention.backends.get_backend_class("flash")
    if flash.supports_context():
        pytest.skip("this PyTorch pages FlashAttention: every step is served")
    model = fg.models.Llama(fg.models.LlamaConfig.toy(), dtype=torch.bfloat16, device="cuda")
    runner = fg.FullGraphRunner(model, max_num_seqs=4, max_num_tokens=64, max_model_len=128, attention="flash")
    ids = runner.blocks.allocate(2)
    runner.step([fg.SeqChunk([1, 2, 3], 0, ids)])
    before = [c.clone() for c in runner.kv_caches]
    with pytest.raises(ValueError, match="attention='triton'"):
        runner.step([fg.SeqChunk([4], 3, ids)])
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches))


def test_step_logits_are_a_copy_the_caller_owns():
    runner = fg.FullGraphRunner(toy_model(), max_num_seqs=4, max_num_tokens=64, max_model_len=128,
                                cudagraph="padded", attention="sdpa")
    a, b = runner.blocks.allocate(1), runner.blocks.allocate(1)
    first = runner.step([fg.SeqChunk([5], 0, a), fg.SeqChunk([9], 0, b)])
    kept = first.logits.clone()
    second = runner.step([fg.SeqChunk([7], 1, a)])
    assert torch.equal(first.logits, kept) and not torch.equal(second.logits[0], kept[0])
    assert first.logits.data_ptr() != runner.buffers.outputs["logits"].data_ptr() and first.logits.is_inference()


def test_a_bad_decode_step_after_good_ones_is_refused_before_anything_changes():
    runner = fg.FullGraphRunner(toy_model(), max_num_seqs=4, max_num_tokens=64, max_model_len=128,
                                cudagraph="padded", attention="sdpa")
    a, b = runner.blocks.allocate(2), runner.blocks.allocate(2)
    for pos in range(3):  # the same lists every step: the runner remembers them
        runner.step([fg.SeqChunk([1], pos, a), fg.SeqChunk([2], pos, b)])
    kv, stats = [c.clone() for c in runner.kv_caches], runner.stats()
    b.append(a[0])  # in place: b now shares a's first page
    with pytest.raises(ValueError, match=f"block {a[0]} is also used by chunk 0"):
        runner.step([fg.SeqChunk([1], 3, a), fg.SeqChunk([2], 3, b)])
    with pytest.raises(ValueError, match="also used by chunk 0"):
        runner.step([fg.SeqChunk([1], 3, a), fg.SeqChunk([2], 3, a)])
    assert runner.stats() == stats and all(torch.equal(x, y) for x, y in zip(kv, runner.kv_caches))
    b.pop()
    assert runner.step([fg.SeqChunk([1], 3, a), fg.SeqChunk([2], 3, b)]).num_tokens == 2
