"""The repository is clean under ruff with the project's configuration (pyproject.toml, [tool.ruff]:
pycodestyle, pyflakes, bugbear and pyupgrade at 120 columns); ruff comes with the test extra."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
