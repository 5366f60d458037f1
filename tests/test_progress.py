"""Progress lines on stderr (jaxsmol/system/progress.py): a wait past its threshold is named, counted and
timed on a terminal; a short one, a pipe, and `--quiet` get nothing. The command line's waits use it."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import time
from pathlib import Path

from jaxsmol.system import progress
from jaxsmol.system.progress import Wait


class Terminal:
    """A stream that says it is a terminal and keeps what is written."""

    def __init__(self, tty: bool = True):
        self.tty, self.parts = tty, []

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> None:
        self.parts.append(text)

    def flush(self) -> None:
        pass

    @property
    def text(self) -> str:
        return "".join(self.parts)


def test_a_long_wait_is_named_counted_and_timed_on_a_terminal():
    term = Terminal()
    with Wait("compiling 3 programs", total=3, stream=term, after_s=0.05) as w:
        for _ in range(3):
            time.sleep(0.1)
            w.advance()
    lines = term.text.split("\r\033[K")
    assert lines[0] == "" and all(ln.startswith("jaxsmol: compiling 3 programs ") for ln in lines[1:])
    assert lines[-1].startswith("jaxsmol: compiling 3 programs 3/3 ... done in ") and lines[-1].endswith(" s\n")


def test_a_short_wait_a_pipe_and_quiet_say_nothing(monkeypatch):
    short, pipe, quiet = Terminal(), Terminal(tty=False), Terminal()
    with Wait("fast", stream=short, after_s=5):
        pass
    with Wait("to a pipe", stream=pipe, after_s=0):
        time.sleep(0.05)
    monkeypatch.setattr(progress, "_quiet", False)
    progress.set_quiet()
    with Wait("silenced", stream=quiet, after_s=0):
        time.sleep(0.05)
    assert short.text == pipe.text == quiet.text == ""


def test_nested_waits_draw_the_innermost_then_the_outer_below_it():
    term = Terminal()
    with Wait("loading", stream=term, after_s=0):
        time.sleep(0.05)
        with Wait("importing", total=2, stream=term, after_s=0) as inner:
            inner.advance(2)
            time.sleep(0.05)
        time.sleep(0.05)
    text = term.text
    done_inner = text.index("importing 2/2 ... done in")
    assert text.index("jaxsmol: loading") < done_inner < text.rindex("loading ... done in")
    assert text.endswith("\n") and text.count("\n") == 2


def test_a_bad_threshold_setting_falls_back_to_the_default(monkeypatch):
    monkeypatch.setenv("JAXSMOL_PROGRESS_AFTER_S", "soon")
    assert Wait("x").after_s == progress.AFTER_S
    monkeypatch.setenv("JAXSMOL_PROGRESS_AFTER_S", "0")
    assert Wait("x").after_s == 0


def on_a_terminal(cmd: list[str], env: dict) -> str:
    """Run cmd with its stderr (and stdout) on a pseudo-terminal -> everything it wrote."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    assert proc.wait(timeout=300) == 0, out.decode(errors="replace")[-3000:]
    return out.decode(errors="replace")


def test_the_probe_on_a_fresh_home_shows_its_waits_on_a_terminal_and_not_with_quiet(tiny_model_dir, tmp_path):
    env = {**os.environ, "JAXSMOL_HOME": str(tmp_path / "home"), "JAXSMOL_PROGRESS_AFTER_S": "0"}
    aitest = str(Path(sys.executable).with_name("aitest"))
    cmd = [aitest, "--cacheprobe", "--predict", "1", "--model", str(tiny_model_dir), "1", "2", "3"]
    shown = on_a_terminal(cmd, env)
    assert f"jaxsmol: loading {tiny_model_dir}" in shown
    assert "jaxsmol: compiling " in shown and " programs (once: later runs load them) " in shown
    assert "cache probe" in shown
    # (the same home: its programs compiled now, but loading the model is still a wait shown at 0 s)
    quiet = on_a_terminal([*cmd, "--quiet"], env)
    assert "\033[K" not in quiet and "cache probe" in quiet
    piped = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert piped.returncode == 0 and "\033[K" not in piped.stderr, piped.stderr[-2000:]


def test_a_line_wider_than_the_terminal_is_elided_in_the_middle_while_redrawn(monkeypatch):
    monkeypatch.setattr(progress.os, "get_terminal_size", lambda fd: os.terminal_size((40, 24)))
    term = Terminal()
    term.fileno = lambda: 2
    with Wait("compiling the CPU kernels for this CPU (once: kept in /a/very/long/directory/name)", stream=term,
              after_s=0):
        time.sleep(0.05)
    drawn = [part for part in term.text.split("\r\033[K") if part]
    assert all(len(d) <= 39 and "..." in d and d.endswith(" s") for d in drawn[:-1])
    assert drawn[-1].startswith("jaxsmol: compiling the CPU kernels") and drawn[-1].endswith(" s\n")  # in full
