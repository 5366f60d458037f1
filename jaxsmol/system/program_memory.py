"""The host memory the compiled programs hold, measured as each one is made.

An XLA:CPU executable of the forward (one decoder layer in a loop), with JAX's trace and lowering
caches beside it, holds ~3-6 MB of heap (SmolLM2-135M: a decode step or a prompt chunk; a batch
relayout ~1.7 MB), and JAX reports none of it (`memory_analysis()` gives no code size on CPU). The
daemon compiles dozens of them ahead (cache/scheduler/compile_ahead.py): they are most of what it
holds beyond the weights and its caches. `watch()` measures them through JAX's monitoring events:
the memory held (host_memory.held_bytes: anonymous resident memory less malloc's free bytes, so
Python's own arenas, where jaxprs live, count too) when a thread starts tracing (or lowering) a
program, and again when its executable is compiled or loaded from the persistent cache; the
difference is that program's. An executable loaded from the program store (runtime/program_store.py)
makes no such event: `loading()` measures it.
Other threads' allocations meanwhile count too, so serve traffic after the programs compiled ahead
(the daemon's readiness); a program found in JAX's in-memory caches makes no event and no bytes.
The daemon's warm-up measures its programs as one `span`: the memory held after it less before it,
where nothing else runs (summed load by load, the figure read 60-70 MB over the resident set's growth:
each load's own passing allocations).
"""

from __future__ import annotations

import dataclasses
import threading

from jax import monitoring

from jaxsmol.system.host_memory import held_bytes

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"  # jax._src.dispatch's names
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # a compile, or a load from the disk cache


@dataclasses.dataclass(frozen=True)
class Programs:
    """What the programs made in this process hold: `count` executables, `bytes` of memory (see watch)."""
    count: int
    bytes: int


_lock = threading.Lock()
_started = threading.local()  # the memory held when this thread began its current program
_count, _bytes = 0, 0
_watching = False
_spans = 0  # spans open: programs made in one are counted, their bytes measured by the span


def watch() -> bool:
    """Measure every program made from now on (idempotent). False where malloc cannot be read."""
    global _watching
    with _lock:
        if not _watching and held_bytes() is not None:
            monitoring.register_scalar_listener(_on_start)
            monitoring.register_event_duration_secs_listener(_on_end)
            _watching = True
        return _watching


def held() -> Programs:
    with _lock:
        return Programs(_count, _bytes)


def span():
    """A context whose programs' memory is its whole growth in memory held (see the module docstring),
    where watched; the programs are still counted one by one."""
    import contextlib

    @contextlib.contextmanager
    def measure():
        global _spans, _bytes
        start = held_bytes() if _watching else None
        with _lock:
            _spans += 1
        try:
            yield
        finally:
            end = held_bytes() if start is not None else None
            with _lock:
                _spans -= 1
                if start is not None and end is not None:
                    _bytes += max(0, end - start)

    return measure()


def loading():
    """A context in which this thread loads a stored executable (runtime/program_store.py), which
    makes no compile event: counted here as one program with the memory it added, where watched."""
    import contextlib

    @contextlib.contextmanager
    def measure():
        global _count, _bytes
        start = held_bytes() if _watching else None
        yield
        end = held_bytes() if start is not None else None
        with _lock:
            if start is not None and end is not None:
                _count += 1
                if not _spans:
                    _bytes += max(0, end - start)

    return measure()


def _on_start(event: str, value: float, **kwargs) -> None:
    """A trace or lowering began in this thread (JAX records its start time as a scalar): the first
    of them since this thread's last executable marks where the program's memory starts."""
    if event in (TRACE_EVENT, LOWER_EVENT) and getattr(_started, "held", None) is None:
        _started.held = held_bytes()


def _on_end(event: str, duration: float, **kwargs) -> None:
    global _count, _bytes
    if event != COMPILE_EVENT:
        return
    start, _started.held = getattr(_started, "held", None), None
    end = held_bytes()
    with _lock:
        _count += 1
        if start is not None and end is not None and not _spans:
            _bytes += max(0, end - start)
