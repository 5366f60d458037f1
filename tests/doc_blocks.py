"""The fenced code blocks of the documentation pages, and how tests run them (tests/test_docs.py runs
every page's blocks on the two-layer checkpoint; tests/test_docs_serving.py checks docs/serving.md's
example outputs against the bundled model)."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNABLE_LANGS = ("bash", "sh", "python")
MARKER = re.compile(r"^<!-- docs-test: (\w+)(?: \((.*)\))? -->$")
DAEMON_ADDRESS = re.compile(r"(?:localhost|127\.0\.0\.1):8000")


@dataclasses.dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: tuple[str, str | None] | None  # (kind, reason) of a docs-test comment right before it

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    lines, out, marker, i = path.read_text().splitlines(), [], None, 0
    while i < len(lines):
        line = lines[i]
        if m := MARKER.match(line.strip()):
            marker = (m[1], m[2])
        elif m := re.match(r"^```(\w*)\s*$", line):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            out.append(Block(path, i + 1, m[1], "\n".join(lines[i + 1:end]), marker))
            marker, i = None, end
        elif line.strip():
            marker = None  # a marker is for the block right after it
        i += 1
    return out


def _commands_with_model() -> dict[str, bool]:
    """{"jaxsmol generate": True, "jaxsmol info": False, "aitest": True, ...}: whether each takes --model."""
    from jaxsmol.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    out = {f"jaxsmol {name}": any("--model" in a.option_strings for a in p._actions) for name, p in sub.choices.items()}
    out["aitest"] = True
    return out


def bash_on(code: str, model: Path | None, address: str | None) -> str:
    """The block with --model on every jaxsmol / aitest command that takes it and names none (unless
    `model` is None: the default model), and the daemon's address for localhost:8000."""
    takes_model, lines = _commands_with_model(), []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True) if line.split()[:1] in (["jaxsmol"], ["aitest"]) else []
        command = " ".join(words[:2]) if words[:1] == ["jaxsmol"] else " ".join(words[:1])
        if model is not None and takes_model.get(command) and "--model" not in words:
            line = shlex.join(words + ["--model", str(model)])
        lines.append(DAEMON_ADDRESS.sub(address, line) if address else line)
    return "\n".join(lines)


def python_prelude(model: Path) -> str:
    """Engine.load() (the default model) loads `model` instead."""
    return ("import jaxsmol.runtime.engine as _engine\n"
            "_load = _engine.Engine.load.__func__\n"
            "_engine.Engine.load = classmethod(lambda cls, model_dir=None, **kw: "
            f"_load(cls, model_dir or {str(model)!r}, **kw))\n")


def run_env() -> dict:
    """The environment the blocks run in: this Python's jaxsmol and aitest, the checkout importable, JAX on the CPU."""
    bin_dir = str(Path(sys.executable).parent)  # jaxsmol and aitest of this environment
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
