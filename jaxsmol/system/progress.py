"""Progress on stderr for the waits a user would otherwise sit through in silence: compiling the CPU
kernels, importing a model, compiling programs, starting (importing jax).

A wait says nothing if it ends within `AFTER_S`; past that, one line names it (what, how many, once or
every time) and updates in place while it lasts (elapsed seconds, `done/total` where counted); at its end
the line says how long it took. Waits nest (loading a model imports it first): the innermost one draws,
the outer one goes on below it when it ends. Shown only when stderr is a terminal and not silenced
(`set_quiet`: the command line's `--quiet`), so logs and pipes get no progress lines.
`JAXSMOL_PROGRESS_AFTER_S` changes the 2 s (0: every wait shows).
"""

from __future__ import annotations

import os
import sys
import threading
import time

AFTER_S = 2.0  # a wait shorter than this says nothing (JAXSMOL_PROGRESS_AFTER_S overrides)
TICK_S = 0.5  # how often a shown line is redrawn

_quiet = False
_open: list[Wait] = []  # the waits in progress, innermost last: only it draws
_lock = threading.Lock()


def set_quiet(quiet: bool = True) -> None:
    """Silence (or allow) every progress line of this process."""
    global _quiet
    _quiet = quiet


def shown(stream=None) -> bool:
    """Whether progress lines are written: stderr is a terminal and they are not silenced."""
    stream = stream or sys.stderr
    return not _quiet and stream.isatty()


def _after_s() -> float:
    """JAXSMOL_PROGRESS_AFTER_S where it is a number >= 0, else AFTER_S."""
    try:
        return max(0.0, float(os.environ.get("JAXSMOL_PROGRESS_AFTER_S", AFTER_S)))
    except ValueError:
        return AFTER_S


class Wait:
    """`with Wait("compiling 35 programs", total=35) as w: ... w.advance()`: a line on stderr once the
    wait passes AFTER_S, redrawn until it ends; nothing where progress is not shown."""

    def __init__(self, what: str, total: int | None = None, show: bool = True, stream=None,
                 after_s: float | None = None):
        self.what, self.total, self.done, self.show = what, total, 0, show
        self.stream = stream or sys.stderr
        self.after_s = after_s if after_s is not None else _after_s()
        self._t0 = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._drawn = False

    def __enter__(self) -> Wait:
        self._t0 = time.monotonic()
        if self.show and shown(self.stream):
            with _lock:
                _open.append(self)
            self._thread = threading.Thread(target=self._draw_while_waiting, name="jaxsmol-progress", daemon=True)
            self._thread.start()
        return self

    def advance(self, n: int = 1) -> None:
        self.done += n

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is None:
            return
        self._thread.join()
        with _lock:
            _open.remove(self)
        if self._drawn:
            outcome = "stopped" if exc[0] is not None else "done"
            self._write(f"{outcome} in {time.monotonic() - self._t0:.1f} s", end="\n")

    def _draw_while_waiting(self) -> None:
        if self._stop.wait(self.after_s):
            return
        while not self._stop.is_set():
            with _lock:
                innermost = _open[-1] is self
            if innermost:
                self._write(f"{time.monotonic() - self._t0:.0f} s")
            self._stop.wait(TICK_S)

    def _write(self, state: str, end: str = "") -> None:
        count = f" {self.done}/{self.total}" if self.total is not None else ""
        line = f"jaxsmol: {self.what}{count} ... {state}"
        if not end:  # redrawn in place: a line wider than the terminal would wrap and leave its head behind
            line = _fit(line, self.stream)
        self.stream.write(f"\r\033[K{line}{end}")
        self.stream.flush()
        self._drawn = True


def _fit(line: str, stream) -> str:
    """`line` shortened to the terminal's width (its middle elided), where that width can be read."""
    try:
        width = os.get_terminal_size(stream.fileno()).columns - 1
    except (AttributeError, OSError, ValueError):
        return line
    if len(line) <= width or width < 20:
        return line
    keep = width - 3
    return line[: keep - keep // 3] + "..." + line[len(line) - keep // 3:]

