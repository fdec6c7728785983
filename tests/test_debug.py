"""Debug tools: planted bugs are found at the right layer / by strict mode; clean runs stay clean."""
from __future__ import annotations

import pytest
import torch

import fullgraph as fg
from fullgraph.__main__ import main
from fullgraph.attention import reference
from fullgraph.attention.backends.sdpa import SdpaBackend
from fullgraph.padding import PaddingPolicy
from fullgraph.validate import ValidationError
from harness import toy_model

LIMITS = dict(max_num_seqs=8, max_num_tokens=128, max_model_len=256, block_size=16)
READS = SdpaBackend.policy.reads


class MinusOnePadding(SdpaBackend):
    """Planted: pads query_start_loc with -1 (the bug that broke FlashAttention under graphs)."""

    name = "planted_minus_one"
    policy = PaddingPolicy("planted_minus_one", reads=READS, tails={"query_start_loc": -1})


def write_ignoring_the_sentinel(q, k, v, kv_cache, metadata, rope=None, positions=None, keep_kv=False):
    """A KV writer that writes every slot, -1 included (which lands on the cache's last slot)."""
    if rope is not None:
        q, k = rope(positions, q, k)
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    flat[:, metadata.slot_mapping] = torch.stack((k, v))
    return q, k, v


class IgnoresSlotSentinel(SdpaBackend):
    """Planted: its KV write ignores slot -1."""

    name = "planted_kv_sentinel"
    policy = PaddingPolicy("planted_kv_sentinel", reads=READS)

    def __init__(self, limits, layers) -> None:
        super().__init__(limits, layers)
        self.kv_writer = write_ignoring_the_sentinel


class HostScalarAtCapture(SdpaBackend):
    """Planted: reads the longest sequence on the host when it can, so a capture bakes in the
    capture-time value (eager and padded runs stay right; the graph attends to too few pages)."""

    name = "planted_host_scalar"
    policy = PaddingPolicy("planted_host_scalar", reads=READS)
    longest = 1

    def forward(self, layer, q, k, v, kv_cache, metadata):
        if not torch.cuda.is_current_stream_capturing():
            self.longest = int(metadata.seq_lens.max())
        pages = max(1, -(-self.longest // kv_cache.shape[2]))
        return reference.paged_attention(q, kv_cache, metadata.query_start_loc, metadata.seq_lens,
                                         metadata.block_table[:, :pages], scale=layer.scale,
                                         decode_only=metadata.decode_only)


def primed_runner(attention="sdpa") -> tuple[fg.FullGraphRunner, list[list[int]]]:
    """A runner ("none") holding three requests' context, to compare steps against."""
    runner = fg.FullGraphRunner(toy_model(), cudagraph="none", attention=attention, **LIMITS)
    blocks = [runner.blocks.allocate(8) for _ in range(4)]
    runner.step([fg.SeqChunk(list(range(40)), 0, blocks[0]), fg.SeqChunk([3] * 5, 0, blocks[1]),
                 fg.SeqChunk(list(range(100, 170)), 0, blocks[2])])
    return runner, blocks


def mixed_step(blocks) -> list[fg.SeqChunk]:
    return [fg.SeqChunk([7], 40, blocks[0]), fg.SeqChunk([8], 5, blocks[1]),
            fg.SeqChunk(list(range(20)), 70, blocks[2]), fg.SeqChunk(list(range(9)), 0, blocks[3])]


BATCHES = {
    "mixed": mixed_step,
    "decode": lambda b: [fg.SeqChunk([i + 1], p, b[i]) for i, p in enumerate((40, 5, 70))],
    "prefill": lambda b: [fg.SeqChunk(list(range(33)), 0, b[3])],
}


@pytest.mark.parametrize("batch", list(BATCHES))
def test_clean_toy_llama_reports_no_divergence(batch):
    runner, blocks = primed_runner()
    report = fg.debug.compare(runner, BATCHES[batch](blocks), modes=("none", "padded", "full"))
    assert report.clean, str(report)
    assert report.modes["padded"].layer_delta.shape == (2, len(BATCHES[batch](blocks)))
    assert report.modes["padded"].layer_delta.max() < 1e-4


@pytest.mark.slow
def test_clean_compiled_run_reports_no_divergence():
    runner, blocks = primed_runner()
    report = fg.debug.compare(runner, mixed_step(blocks), modes=("none", "compile"))
    assert report.clean, str(report)


def test_minus_one_policy_is_found_at_the_first_layer():
    runner, blocks = primed_runner(MinusOnePadding)
    report = fg.debug.compare(runner, mixed_step(blocks), modes=("none", "padded"))
    assert report.modes["padded"].first_divergent_layer == 0, str(report)
    assert not report.clean and "DIVERGENCE" in str(report)


def test_kv_write_ignoring_the_sentinel_is_caught_by_strict_mode():
    runner = fg.FullGraphRunner(toy_model(), cudagraph="padded", attention=IgnoresSlotSentinel,
                                validate=True, **LIMITS)
    ids = runner.blocks.allocate(2)
    with pytest.raises(ValidationError, match="layer 0: KV slot"):
        runner.step([fg.SeqChunk(list(range(13)), 0, ids)])  # 13 tokens, bucket 16: 3 padded slots


def test_strict_mode_passes_a_clean_backend_and_restores_the_null_block():
    runner = fg.FullGraphRunner(toy_model(), cudagraph="padded", attention="sdpa", validate=True, **LIMITS)
    ids = runner.blocks.allocate(2)
    runner.step([fg.SeqChunk(list(range(13)), 0, ids)])
    runner.step([fg.SeqChunk([1], 13, ids)])
    assert all(not c[:, 0].any() for c in runner.kv_caches)


@pytest.mark.gpu
def test_host_scalar_baked_in_at_capture_is_found_in_full_mode():
    runner, blocks = primed_runner(HostScalarAtCapture)
    report = fg.debug.compare(runner, BATCHES["decode"](blocks), modes=("none", "padded", "full"))
    assert report.modes["padded"].first_divergent_layer is None, str(report)
    assert report.modes["full"].first_divergent_layer == 0, str(report)


def test_doctor_command_runs_clean(capsys):
    assert main(["doctor", "--modes", "none", "padded"]) == 0
    assert "no divergence" in capsys.readouterr().out


def test_compare_needs_the_reference_mode():
    runner, blocks = primed_runner()
    with pytest.raises(ValueError, match="must include 'none'"):
        fg.debug.compare(runner, mixed_step(blocks), modes=("padded",))
