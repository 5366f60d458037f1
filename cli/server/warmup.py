"""The daemon's warm-up: the programs requests run, compiled before the daemon says it is ready.

Ready means that no request waits for a compile and no compile competes with requests for the
cores: one stream started while the batched programs compiled in the background decoded at
15-18 tok/s, against 41-47 once they were done. `--warmup` chooses when:
  block       compile, then listen: the port opens ready (a plain client can start at once);
  background  listen at once and compile in a thread (the default): /health and /ready answer 503
              {"status": "warming"} until done, then 200; requests sent meanwhile are served, slower;
  none        compile nothing ahead: ready at once, each program compiles when first used (holding
              every stream while it does).
What is compiled: every program the scheduler can run, a closed set whatever the requests' fields and
lengths (cache/scheduler/compile_ahead.py: scheduler_calls). A later start finds them in the program
store (jaxsmol/runtime/program_store.py) and loads each without tracing it. Once ready, the daemon
counts any program compiled after (`programs_after_ready`, /metrics): none should be.
"""

from __future__ import annotations

import sys
import threading
import time

from jaxsmol.system import program_memory

MODES = ("block", "background", "none")


class Warmup:
    """Compiles the daemon's programs once (`run`, or `start` for a thread) and says whether it is ready.

    The scheduler's programs (Scheduler.compile_programs, which checks the Event `stop` between
    them), made ready in one pass, so that what the program store lacks compiles in one child
    process (jaxsmol/runtime/compile_apart.py). A failure only loses the head start (the programs
    then compile on first use): the daemon is ready after it too, never stuck warming."""

    def __init__(self, mode: str, scheduler):
        if mode not in MODES:
            raise ValueError(f"warmup mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode, self.scheduler = mode, scheduler
        self.stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._began: float | None = None
        self.seconds: float | None = None  # how long it took, once ready
        self.programs_at_ready: int | None = None  # programs made in this process when it became ready
        if mode == "none":
            self._mark_ready()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def state(self) -> dict:
        """What /health and /ready say of it: ready or not, the mode, seconds spent (so far, or in all)."""
        ready = self.ready  # read once: the warm-up thread may finish meanwhile
        if ready:
            spent = self.seconds or 0.0
        else:
            spent = 0.0 if self._began is None else time.perf_counter() - self._began
        return {"ready": ready, "warmup": self.mode, "warmup_s": round(spent, 1)}

    def run(self) -> None:
        """Make ready every program the scheduler runs (compiled or loaded); ready after, unless stopped."""
        self._began = t0 = time.perf_counter()
        try:
            with program_memory.span():  # their memory: the warm-up's growth (program_memory.py)
                n = self.scheduler.compile_programs(self.stop)
            print(f"programs ready ahead: {n} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        except Exception as e:  # only the head start is lost
            print(f"jaxsmol: programs not compiled ahead ({type(e).__name__}: {e}); they compile on first use",
                  file=sys.stderr, flush=True)
        if not self.stop.is_set():
            self.seconds = time.perf_counter() - t0
            self._mark_ready()
            print(f"jaxsmol ready: warm-up ({self.mode}) took {self.seconds:.1f} s", file=sys.stderr, flush=True)

    def _mark_ready(self) -> None:
        self.programs_at_ready = program_memory.held().count
        self._ready.set()

    def programs_after_ready(self) -> int:
        """Programs compiled (or loaded) in this process since it became ready: 0 when the set is closed."""
        return 0 if self.programs_at_ready is None else program_memory.held().count - self.programs_at_ready

    def start(self) -> None:
        """`run` in a thread (background mode; block runs it before listening, none not at all)."""
        if self.mode == "background" and self._thread is None:
            self._thread = threading.Thread(target=self.run, name="jaxsmol-warmup", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 120) -> None:
        """Stop between two programs and wait: a process that exits while XLA compiles in a thread can
        crash (SIGSEGV)."""
        self.stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
