"""benchmarks/profile_loop.py's timeline summary: a pure function, checked on synthetic device
events whose spans, overlaps and extra launches are known."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("profile_loop", ROOT / "benchmarks" / "profile_loop.py")
profile_loop = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_loop)


def test_timeline_splits_busy_idle_and_the_ops_outside_the_graph():
    # two steps; the graph launches "a" twice and "b" once; "c" (and one overlapping "up") run outside it
    events = [("a", 0, 10), ("b", 12, 20), ("a", 20, 30), ("c", 31, 35), ("up", 33, 38),
              ("a", 40, 50), ("b", 52, 60), ("a", 60, 70), ("c", 71, 75), ("up", 76, 79)]
    t = profile_loop.timeline(list(reversed(events)), 2, {"a": 2, "b": 1})
    assert t["span_us"] == pytest.approx(79 / 2)
    # busy: 0-10, 12-30, 31-38, 40-50, 52-70, 71-75, 76-79 = 10 + 18 + 7 + 10 + 18 + 4 + 3
    assert t["busy_us"] == pytest.approx(70 / 2)
    assert t["idle_us"] == pytest.approx(9 / 2)
    assert list(t["outside"]) == ["c", "up"]                  # by time a step, largest first
    assert t["outside"]["c"] == pytest.approx((1.0, 4.0))
    assert t["outside"]["up"] == pytest.approx((1.0, 4.0))
    assert profile_loop.timeline(events, 2)["outside"]["a"] == pytest.approx((2.0, 20.0))   # no replay: all of it
    # idle 10-12 and 50-52 before "b", 30-31 and 70-71 before "c", 38-40 before "a", 75-76 before "up"
    assert t["idle_before"] == pytest.approx({"b": 2.0, "c": 1.0, "a": 1.0, "up": 0.5})


def test_timeline_refuses_an_empty_profile():
    with pytest.raises(ValueError, match="no device events"):
        profile_loop.timeline([], 3)
