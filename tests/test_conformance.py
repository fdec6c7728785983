"""The conformance suite judges a backend: the clean ones pass, each planted bug fails its scenario."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fullgraph import testing
from fullgraph.attention.backends.sdpa import SdpaBackend
from fullgraph.padding import PaddingPolicy
from test_debug import HostScalarAtCapture, IgnoresSlotSentinel, MinusOnePadding

ROOT = Path(__file__).parent.parent
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def failed(report) -> set[int]:
    return {r.scenario for r in report.failures}


def test_the_reference_backend_conforms():
    report = testing.conformance(backend="sdpa", modes=["padded"])
    assert report.ok, report.table()
    assert {r.scenario for r in report.rows if r.ok} >= {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 14, 16}
    assert "CONFORMS" in report.table() and "DOES NOT" not in report.table()


def test_minus_one_query_start_loc_padding_fails_scenarios_1_and_2():
    report = testing.conformance(backend=MinusOnePadding, modes=["padded"], scenarios=[1, 2, 3])
    assert not report.ok and {1, 2} <= failed(report), report.table()
    detail = {r.scenario: r.detail for r in report.rows}
    assert "query_start_loc" in detail[1] and "query_start_loc" in detail[2]


def test_a_kv_write_ignoring_minus_one_fails_the_kv_canary():
    report = testing.conformance(backend=IgnoresSlotSentinel, modes=["padded"], scenarios=[3, 5])
    assert 5 in failed(report), report.table()
    assert "KV slot" in next(r.detail for r in report.rows if r.scenario == 5)


class SeqLenOneTail(SdpaBackend):
    """Declares seq_len 1 for padded requests (as a kernel that cannot take an empty row would):
    a different tail, but declared and harmless, so the backend still conforms."""

    name = "seq_len_one_tail"
    policy = PaddingPolicy("seq_len_one_tail", reads=SdpaBackend.policy.reads, tails={"seq_lens": 1})


def test_a_different_but_declared_tail_still_conforms():
    report = testing.conformance(backend=SeqLenOneTail, modes=["padded"], scenarios=[1, 2, 3, 6])
    assert report.ok, report.table()


@pytest.mark.gpu
def test_a_host_scalar_read_at_capture_fails_scenario_7():
    report = testing.conformance(backend=HostScalarAtCapture, device="cuda", modes=["full"], scenarios=[7])
    assert failed(report) == {7}, report.table()


def test_the_example_backend_conforms():
    spec = importlib.util.spec_from_file_location("custom_backend", ROOT / "examples" / "custom_backend.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = testing.conformance(backend=module.NaivePaged, device=DEVICE,
                                 modes=["padded"] if DEVICE == "cpu" else ["full"])
    assert report.ok, report.table()


def test_block_sparse_backend_gets_its_model_and_scenarios():
    report = testing.conformance(backend="blocksparse", modes=["padded"], scenarios=[17, 18, 21])
    assert report.model == "Phi3Small" and report.ok, report.table()
    assert [r.ok for r in report.rows] == [True, True, None]   # 21: no sliding-window layers


def test_cli_exit_status_and_table():
    run = [sys.executable, "-m", "fullgraph", "conformance", "--modes", "padded", "--scenarios", "1", "5"]
    good = subprocess.run(run + ["--backend", "fullgraph.attention.backends.sdpa:SdpaBackend"], capture_output=True,
                          text=True, cwd=ROOT)
    assert good.returncode == 0 and "CONFORMS" in good.stdout, good.stdout + good.stderr
    bad = subprocess.run(run + ["--backend", "test_debug:IgnoresSlotSentinel"], capture_output=True, text=True,
                         cwd=ROOT / "tests")
    assert bad.returncode == 1 and "DOES NOT CONFORM" in bad.stdout, bad.stdout + bad.stderr


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="scenarios \\[99\\]"):
        testing.conformance(scenarios=[99])
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="'full' needs a CUDA device"):
            testing.conformance(modes=["full"])
