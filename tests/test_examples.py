"""Every file in examples/ runs to completion (on this machine's device), as a user would run it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user runs it
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=600, env=env,
                          cwd=path.parent.parent)
    assert done.returncode == 0, f"{path.name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert done.stdout.strip(), f"{path.name} printed nothing"


def test_there_are_examples():
    assert EXAMPLES, "examples/ is empty"
