"""benchmarks/profile_step.py's summary of profiled launches: a pure function, checked on
synthetic launches whose counts and times are known."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("profile_step", ROOT / "benchmarks" / "profile_step.py")
profile_step = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_step)


def test_kernel_names_map_to_kinds():
    kind = profile_step.kind_of
    assert kind("_paged_attention_decode_kernel") == "attention"
    assert kind("_split_kv_reduce_kernel") == "split-KV reduce"
    assert kind("_rope_kv_write_kernel") == "rope + KV write"
    assert kind("_rms_norm_kernel") == "norm"
    assert kind("_rms_norm_linear_kernel") == "linear"
    assert kind("_linear_kernel") == "linear"
    assert kind("_linear_rope_kv_kernel") == "linear"       # the one-row QKV with RoPE + the KV write
    assert kind("_skinny_kernel") == "linear"               # the split-K linear of 2-32 rows
    assert kind("_skinny_rope_kv_kernel") == "linear"       # ... and its QKV form
    assert kind("nvjet_tst_64x8_64x16_4x1_v_bz_TNT") == "linear"
    assert kind("_gated_kernel") == "activation"
    assert kind("_select_kernel") == "sampling + output"
    assert kind("Memcpy DtoD (Device -> Device)") == "copy / fill"
    assert kind("some_new_kernel") == "other"


def _layered_step(num_layers, head="_linear_kernel"):
    step = [("Memcpy HtoD", 0.001), ("_embed_kernel_gather", 0.002)]
    for _ in range(num_layers):
        step += [("_rms_norm_kernel", 0.003), ("_linear_kernel", 0.010), ("_rope_kv_write_kernel", 0.002),
                 ("_paged_attention_decode_kernel", 0.020), ("_linear_kernel", 0.005),
                 ("_rms_norm_kernel", 0.003), ("_linear_kernel", 0.030), ("_gated_kernel", 0.004),
                 ("_linear_kernel", 0.015)]
    step += [("_rms_norm_kernel", 0.003), (head, 0.100), ("_select_kernel", 0.006)]
    return step


def test_summary_counts_per_step_and_per_layer_and_finds_the_lm_head():
    layers, steps = 3, 4
    step = _layered_step(layers)
    launches = step * steps
    moved = {"linear": 12_000_000, "LM head": 50_000_000, "attention": 2_000_000}
    r = profile_step.summarize(launches, steps, layers, replay_ms=0.9, bytes_by_kind=moved)
    assert r["launches"] == len(step)
    kinds = {k["kind"]: k for k in r["kinds"]}
    assert kinds["linear"]["launches"] == 4 * layers
    assert kinds["linear"]["per_layer"] == 4
    assert kinds["LM head"]["launches"] == 1 and kinds["LM head"]["per_layer"] is None
    assert kinds["LM head"]["ms"] == pytest.approx(0.100)
    assert kinds["linear"]["ms"] == pytest.approx(layers * 0.060)
    assert kinds["norm"]["launches"] == 2 * layers + 1
    assert kinds["attention"]["TBps"] == pytest.approx(2_000_000 / (layers * 0.020e-3) / 1e12)
    assert kinds["LM head"]["TBps"] == pytest.approx(50_000_000 / 0.100e-3 / 1e12)
    assert kinds["norm"]["bytes"] is None and kinds["norm"]["TBps"] is None
    total = sum(ms for _, ms in step)
    assert r["kernels_ms"] == pytest.approx(total)
    assert r["gaps_ms"] == pytest.approx(0.9 - total)
    assert sum(k["share"] for k in r["kinds"]) == pytest.approx(1.0)
    # nine kernels a layer, plus the final norm (a layer kind outside the layers)
    assert r["launches_per_layer"] == pytest.approx((9 * layers + 1) / layers)
    top = r["kernels"][0]
    assert top["kernel"] == "_linear_kernel" and top["launches"] == 4 * layers
    assert top["us_each"] == pytest.approx(layers * 0.060 * 1e3 / (4 * layers))


def test_summary_refuses_replays_that_are_not_one_graph():
    step = _layered_step(2)
    other = _layered_step(2, head="nvjet_head")
    with pytest.raises(ValueError, match="replay 1 launched other kernels"):
        profile_step.summarize(step + other, 2, 2, replay_ms=1.0, bytes_by_kind={})
    with pytest.raises(ValueError, match="do not split"):
        profile_step.summarize(step + step[:-1], 2, 2, replay_ms=1.0, bytes_by_kind={})
