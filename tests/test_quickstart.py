"""The README's Quick start is what CI runs, and its test command works as a user types it.

CI (.ci/run) reads the second Quick start command out of the README (.ci/readme-command) and runs it
verbatim, so the two cannot drift apart. The command ends in plain `pytest`, which, unlike `python -m
pytest`, does not put the working directory on sys.path: a test importing `tests.<helper>` collected
under one and failed under the other, so both are checked here on the files that import helpers.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELPER_USERS = ["tests/test_soak.py", "tests/test_serve.py", "tests/test_radix.py", "tests/test_side_by_side.py"]


def readme_command(n: int) -> str:
    done = subprocess.run([str(ROOT / ".ci" / "readme-command"), str(n)], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def quick_start_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_the_quick_start_has_two_commands_and_ci_reads_them():
    block = quick_start_block()
    assert len(block) == 2, block
    assert [readme_command(1), readme_command(2)] == block
    assert block[0].endswith("aitest --cacheprobe --predict 1 0 1 2 3")
    assert "pip install -e . &&" in block[0] and "[test]" not in block[0]  # the probe needs the runtime only
    assert block[1].endswith("&& pytest")


def test_ci_runs_the_readme_test_command_itself():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "tests/test_quickstart.py checks both" in (ROOT / ".ci" / "readme-command").read_text()
    assert 'test_command="$(.ci/readme-command 2)"' in ci
    assert '$test_command"' in ci.split('test_command="$(.ci/readme-command 2)"', 1)[1]
    assert "python -m pytest -p no:cacheprovider --durations" not in ci  # no second, private test command


def collect(*runner: str) -> subprocess.CompletedProcess:
    return subprocess.run([*runner, "--collect-only", "-q", "-p", "no:cacheprovider", *HELPER_USERS], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_the_tests_import_under_plain_pytest_and_python_m_pytest():
    pytest_exe = Path(sys.executable).with_name("pytest")
    for runner in ([str(pytest_exe)], [sys.executable, "-m", "pytest"]):
        done = collect(*runner)
        assert done.returncode == 0, (f"{' '.join(runner)} --collect-only failed:\n"
                                      f"{done.stdout[-3000:]}{done.stderr[-2000:]}")
