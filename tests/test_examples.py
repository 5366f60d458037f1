"""examples/prefix_cache.py, the core idea in one file, runs on the bundled model and shows what it says:
a prompt restored from a stored prefix gives the tokens and logits of a run from zero, bit for bit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.real
def test_the_prefix_cache_example_restores_and_matches_a_cold_run(model_dir):
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "prefix_cache.py")], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 2, done.stdout
    for line in lines:
        assert "restored" in line and " 0 restored" not in line, line
        assert "identical tokens: True, identical logits: True" in line, line
