"""The step-field table: a new field costs one declaration, and is then planned, padded, uploaded,
poisoned, checked and handed to the backend like the core fields."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fullgraph as fg
from fullgraph.attention.backends.sdpa import SdpaBackend
from fullgraph.fields import CORE_FIELDS, REQUEST, Field, FieldTable
from fullgraph.padding import PaddingPolicy, PlanInvariantError, check
from harness import toy_model

LIMITS = dict(max_num_seqs=8, max_num_tokens=64, max_model_len=128, block_size=16)


class TemperedSdpa(SdpaBackend):
    """sdpa whose queries are scaled per request by a new step field, ``attn_gain`` — declared in
    one place (the policy) and read in one place (``forward``); ``prepare`` fills its real rows."""

    name = "tempered_sdpa"
    policy = PaddingPolicy(
        "tempered_sdpa", reads=SdpaBackend.policy.reads | {"attn_gain"},
        fields=(Field("attn_gain", np.float32, REQUEST, tail=0.0, doc="per-request query gain", source="backend",
                      default=1.0),))
    gains: dict[int, float] = {}  # chunk index -> gain, set by the test

    def prepare(self, plan) -> str | None:
        for i, gain in self.gains.items():
            if i < plan.num_reqs:
                plan.attn_gain[i] = gain
        return None

    def forward(self, layer, q, k, v, kv_cache, metadata):
        gain = metadata.require("attn_gain", self.name)                       # (R,)
        qsl = metadata.require("query_start_loc", self.name)
        rows = torch.searchsorted(qsl[1:], torch.arange(q.shape[0], device=q.device, dtype=qsl.dtype), right=True)
        g = gain[rows.clamp(max=gain.shape[0] - 1)].to(q.dtype)                 # (T,): garbage past the bucket never read
        return super().forward(layer, q * g[:, None, None], k, v, kv_cache, metadata)


def chunks_for(runner, lens):
    return [fg.SeqChunk(list(range(3, 3 + n)), 0, runner.blocks.allocate(-(-n // 16))) for n in lens]


def test_a_new_field_is_planned_padded_uploaded_and_given_to_the_backend():
    TemperedSdpa.gains = {0: 0.5, 2: 2.0}
    runner = fg.FullGraphRunner(toy_model(), attention=TemperedSdpa, cudagraph="padded", **LIMITS)
    assert "attn_gain" in runner.fields and "attn_gain" in runner.buffers.tensors
    chunks = chunks_for(runner, (5, 7, 2))
    runner.step(chunks)
    on_device = runner.buffers.tensors["attn_gain"][:4].cpu().tolist()
    assert on_device == [0.5, 1.0, 2.0, 0.0]            # prepare, the default, prepare, the tail (bucket 16 -> 8 reqs)
    plan = fg.plan_step(chunks, runner.config, runner.policy)
    assert plan.attn_gain.dtype == np.float32 and plan.attn_gain.shape == (plan.num_reqs_padded,)
    assert plan.attn_gain[:3].tolist() == [1.0, 1.0, 1.0] and not plan.attn_gain[3:].any()   # no prepare here


def test_the_new_field_changes_the_result_and_eager_equals_padded():
    TemperedSdpa.gains = {1: 3.0}
    outs = {}
    for mode in ("none", "padded"):
        runner = fg.FullGraphRunner(toy_model(), attention=TemperedSdpa, cudagraph=mode, validate=mode == "padded",
                                    **LIMITS)
        outs[mode] = runner.step(chunks_for(runner, (5, 7, 2))).logits
    torch.testing.assert_close(outs["padded"], outs["none"], atol=1e-5, rtol=1e-5)
    plain = fg.FullGraphRunner(toy_model(), attention="sdpa", cudagraph="none", **LIMITS)
    base = plain.step(chunks_for(plain, (5, 7, 2))).logits
    torch.testing.assert_close(outs["none"][[0, 2]], base[[0, 2]], atol=1e-5, rtol=1e-5)   # gain 1: unchanged
    assert (outs["none"][1] - base[1]).abs().max() > 1e-3                                  # gain 3: changed


def test_validate_mode_poisons_the_new_field_past_the_bucket():
    TemperedSdpa.gains = {}
    runner = fg.FullGraphRunner(toy_model(), attention=TemperedSdpa, cudagraph="padded", validate=True, **LIMITS)
    runner.step(chunks_for(runner, (3,)))               # bucket 4: 4 requests
    assert torch.isnan(runner.buffers.tensors["attn_gain"][4:]).all()


def test_check_reads_the_new_field_tail_from_the_policy():
    policy = TemperedSdpa.policy
    cfg = fg.RunnerConfig(**LIMITS, num_blocks=20)
    plan = fg.plan_step([fg.SeqChunk([1, 2, 3], 0, [1])], cfg, policy)
    check(plan, policy)
    gains = plan.attn_gain.copy()
    gains[-1] = 7.0
    with pytest.raises(PlanInvariantError, match="attn_gain"):
        check(plan.replace(attn_gain=gains), policy)


def test_caller_values_fill_real_rows_and_defaults_the_rest():
    field = Field("boost", np.float32, REQUEST, tail=-1.0, doc="a caller value", role="sampling", source="caller",
                  default=0.25)
    policy = fg.padding.get_policy("sdpa")
    cfg = fg.RunnerConfig(**LIMITS, num_blocks=20)
    table = policy.table.extended([field])
    chunks = [fg.SeqChunk([1], 4, [1]), fg.SeqChunk([2], 0, [2])]
    plan = fg.plan_step(chunks, cfg, policy, fields=table, values={"boost": [2.0, 3.0]})
    assert plan.boost.tolist() == [2.0, 3.0]           # decode bucket 2: no tail
    plan = fg.plan_step(chunks[:1] * 1 + [fg.SeqChunk([5, 6], 0, [3])], cfg, policy, fields=table)
    assert plan.boost.tolist()[:2] == [0.25, 0.25] and set(plan.boost.tolist()[2:]) == {-1.0}


def test_table_rules():
    with pytest.raises(ValueError, match="declared twice"):
        CORE_FIELDS.extended([Field("seq_lens", np.int64, REQUEST, 0, "clash")])
    with pytest.raises(ValueError, match="axis"):
        Field("x", np.int32, "per_token", 0, "bad axis")
    with pytest.raises(ValueError, match="tail"):
        Field("x", np.int32, REQUEST, True, "a bool tail")
    with pytest.raises(ValueError, match="unknown metadata fields"):
        PaddingPolicy("p", reads=frozenset({"not_a_field"}))
    table = FieldTable(CORE_FIELDS.values())
    assert table == CORE_FIELDS and list(table.shapes(10, 3, 5)["block_table"][0]) == [3, 5]
    assert table.shapes(10, 3, 5)["query_start_loc"][0] == (4,)


def test_request_padding_rule_lives_in_the_config():
    cfg = fg.RunnerConfig(max_num_seqs=6, max_num_tokens=64, max_model_len=128)
    assert [cfg.padded_num_reqs(t) for t in (1, 4, 6, 8, 64)] == [1, 4, 6, 6, 6]
    plan = fg.plan_step([fg.SeqChunk([1] * 20, 0, [1, 2])], cfg.replace(num_blocks=10), fg.padding.get_policy("sdpa"))
    assert plan.num_tokens_padded == 24 and plan.num_reqs_padded == cfg.padded_num_reqs(24)
