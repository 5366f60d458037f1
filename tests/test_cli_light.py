"""The commands that answer from files alone load no jax, numpy or HTTP stack: `jaxsmol --help` (and each
command's), `--version` and `cache ls DIR` come back at once (no timing asserted: the modules are)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("jax", "numpy", "httpx", "fastapi", "llguidance", "tokenizers")
PROBE = f"HEAVY = {HEAVY!r}" + """
import json, sys
from jaxsmol.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "loaded": [m for m in HEAVY if m in sys.modules]}), file=sys.stderr)
"""


def loaded_by(*argv: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    return json.loads(done.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["generate", "--help"], ["serve", "--help"],
                                  ["cluster", "--help"], ["bench", "--help"], ["cache", "ls", "--help"]])
def test_help_and_version_load_nothing_heavy(argv):
    assert loaded_by(*argv) == {"code": 0, "loaded": []}


def test_info_reads_files_alone_without_load():
    assert loaded_by("info") == {"code": 0, "loaded": []}
    assert "jax" in loaded_by("info", "--load")["loaded"]


def test_cache_ls_reads_a_directory_without_jax(tmp_path):
    out = loaded_by("cache", "ls", str(tmp_path))
    assert out["code"] == 0 and "jax" not in out["loaded"], out
