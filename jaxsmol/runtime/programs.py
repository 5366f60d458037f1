"""Every compiled program, in one place: `jax.jit` is applied here and only here.

One sequence's cache (engine.py, the library's pure API): `forward` (chunked prefill, and decode),
`load_prefix`. The rows of the KV arena the scheduler drives (batch.py, kv_arena.py): `prefill_rows`,
`decode_step`, `verify_step` (speculation), a draft model's `greedy_drafts`, `sample_first` (a prompt's
first tokens), `write_slots` (a restore), `copy_row` (forks), `read_slots` (a save), `reserve` (the arena).

A cache argument is donated where the caller hands over a buffer that nothing else holds (a fresh
cache, a recycled one, the arena), so XLA updates it in place. Host snapshots held by the prefix store
are NumPy arrays, never device buffers, so a donation can never touch a stored prefix.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import jax

from jaxsmol.runtime import batch, compile_apart
from jaxsmol.runtime.program_store import Program
from jaxsmol.system.progress import Wait
from jaxsmol.model import forward as model, kv


# XLA:CPU's older loop emitters for fusions: 25 of the daemon's programs compiled in 10.9-11.4 s
# against 14.1-14.2 with the MLIR fusion emitters, and ran as fast (docs/design.md, "One layer,
# looped"). Part of every program, so the jitted and the prepared paths compute the same bits.
COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


def _program(name: str, fn, static: tuple[str, ...] = (), donate: tuple[str, ...] = ()) -> Program:
    return Program(name, jax.jit(fn, static_argnames=static, donate_argnames=donate, compiler_options=COMPILER_OPTIONS),
                   static, __name__)


def _one_sequence(params, tokens, length, kv, cfg, all_logits: bool = False, as_steps: bool = False):
    """model.forward over one sequence's cache (no arena rows): the pure API's program."""
    return model.forward(params, tokens, length, kv, cfg, all_logits, as_steps)


forward = _program("forward", _one_sequence, ("cfg", "all_logits", "as_steps"), ("kv",))
load_prefix = _program("load_prefix", kv.load_prefix, ("kernel",), ("kv",))

prefill_rows = _program("prefill_rows", batch.prefill_rows, ("cfg", "all_logits"), ("kv",))
decode_step = _program("decode_step", batch.decode_step, ("cfg",), ("kv",))
verify_step = _program("verify_step", batch.verify_step, ("cfg",), ("kv",))
greedy_drafts = _program("greedy_drafts", batch.greedy_drafts, ("cfg", "k"), ("kv",))
sample_first = _program("sample_first", batch.sample_first)
write_slots = _program("write_slots", batch.write_slots, ("kernel",), ("k", "v"))
copy_row = _program("copy_row", batch.copy_row, ("kernel",), ("k", "v"))
read_slots = _program("read_slots", batch.read_slots, ("kernel",))
reserve = _program("reserve", batch.reserve, ("shape", "dtype", "kernel"))

ALL = {p.name: p for p in (forward, load_prefix, prefill_rows, decode_step, verify_step, greedy_drafts, sample_first,
                           write_slots, copy_row, read_slots, reserve)}


def compile_all(calls: Iterable[tuple[Program, tuple, dict]], stop: threading.Event | None = None) -> int:
    """Make ready the executables of `calls`, each (program, args, kwargs) as the program will be
    called (arguments may be ShapeDtypeStructs): loaded from the program store, else compiled and
    stored (program_store.py). Where many are missing from the store, children (one per core, each a
    share) compile them there first (compile_apart.py: XLA's compiler is ~1.5x faster outside the
    command line's single malloc arena, and its heap leaves with the children). One after another in process: XLA's
    compiler runs threads of its own. `stop` (an Event) is checked before each. Returns how many."""
    calls = list(calls)
    missing = [c for c in calls if c[0].missing(*c[1], **c[2])]
    what = f"compiling {len(missing)} of {len(calls)} programs (once: later runs load them)"
    with Wait(what, total=len(calls), show=bool(missing)) as wait:
        if len(missing) >= compile_apart.MIN_CALLS:
            compile_apart.compile_in_child(missing, stop)
        for program, args, kwargs in calls:
            if stop is not None and stop.is_set():
                break
            program.prepare(*args, **kwargs)
            wait.advance()
    return wait.done


def compiled_count(name: str = "forward") -> int:
    """How many executables the program `name` holds in this process (prepared ahead, or when a call
    first needed one): until `clear`."""
    return ALL[name].held


def clear() -> None:
    """Forget every program's executables in this process (jax.clear_caches() leaves them)."""
    for program in ALL.values():
        program.clear()
