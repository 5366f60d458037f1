"""Every compiled program, in one place: `jax.jit` is applied here and only here.

One sequence's cache (engine.py): `forward` (chunked prefill, and decode), `load_prefix`. The decode
rows the scheduler drives (batch.py): `decode_step`, `verify_step` (speculation) and a draft model's
`greedy_drafts`, `sample_first` (a prompt's first tokens), `insert_row`, `relayout`, `prefill_rows`.

A cache argument is donated where the caller hands over a buffer that nothing else holds (a fresh
cache, a recycled one, or one restored from a host snapshot), so XLA updates it in place. Host
snapshots held by the prefix store are NumPy arrays, never device buffers, so a donation can never
touch a stored prefix.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import jax
import jax.numpy as jnp

from jaxsmol.runtime import batch, compile_apart, sampling
from jaxsmol.runtime.structured import all_allowed
from jaxsmol.runtime.program_store import Program
from jaxsmol.model import forward as model, kv


# XLA:CPU's older loop emitters for fusions: 25 of the daemon's programs compiled in 10.9-11.4 s
# against 14.1-14.2 with the MLIR fusion emitters, and ran as fast (docs/design.md, "One layer,
# looped"). Part of every program, so the jitted and the prepared paths compute the same bits.
COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


def _program(name: str, fn, static: tuple[str, ...] = (), donate: tuple[str, ...] = ()) -> Program:
    return Program(name, jax.jit(fn, static_argnames=static, donate_argnames=donate, compiler_options=COMPILER_OPTIONS),
                   static, __name__)


forward = _program("forward", model.forward, ("cfg", "all_logits", "as_steps"), ("kv",))
load_prefix = _program("load_prefix", kv.load_prefix, ("kernel",), ("kv",))

decode_step = _program("decode_step", batch.decode_step, ("cfg", "logprobs"), ("kv",))
verify_step = _program("verify_step", batch.verify_step, ("cfg", "logprobs"), ("kv",))
greedy_drafts = _program("greedy_drafts", batch.greedy_drafts, ("cfg", "k"), ("kv",))
sample_first = _program("sample_first", batch.sample_and_score, ("logprobs",))
insert_row = _program("insert_row", batch.insert_row, donate=("batch",))
relayout = _program("relayout", batch.relayout, ("width", "capacity"))
prefill_rows = _program("prefill_rows", batch.prefill_rows, ("cfg", "window"), ("rows",))

ALL = {p.name: p for p in (forward, load_prefix, decode_step, verify_step, greedy_drafts, sample_first, insert_row,
                           relayout, prefill_rows)}


def decode_calls(params, cfg, cache_dtype, width: int, capacity: int) -> list:
    """What a batch of `width` decode rows x `capacity` slots runs, rows sampling freely, as (program,
    args, kwargs) calls (compile_all): decode_step, and insert_row of a prompt's state of that capacity."""
    batch_ = jax.eval_shape(lambda: batch.empty_batch(cfg, width, capacity, cache_dtype))
    row = jax.eval_shape(lambda: kv.KVCache.zeros(cfg, capacity, dtype=cache_dtype))
    free = batch.row_settings([sampling.SamplingParams()] * width, [0] * width, [None] * width,
                              all_allowed(width, cfg.vocab_size))
    return [(decode_step, (params, jax.ShapeDtypeStruct((width,), jnp.int32), batch_,
                           jax.ShapeDtypeStruct((width,), bool), free, cfg), {"logprobs": False}),
            (insert_row, (batch_, row, jax.ShapeDtypeStruct((), jnp.int32)), {})]


def verify_call(params, cfg, cache_dtype, width: int, capacity: int, positions: int, logprobs: bool) -> tuple:
    """verify_step over a batch of `width` rows x `capacity` slots, `positions` per row, rows sampling
    freely, as a (program, args, kwargs) call (compile_all)."""
    batch_ = jax.eval_shape(lambda: batch.empty_batch(cfg, width, capacity, cache_dtype))
    free = batch.row_settings([sampling.SamplingParams()] * width, [0] * width, [None] * width,
                              all_allowed(width, cfg.vocab_size))
    free["allowed"] = jax.ShapeDtypeStruct((width, positions, free["allowed"].shape[-1]), jnp.int32)
    rows = jax.ShapeDtypeStruct((width, positions), jnp.int32)
    return (verify_step, (params, rows, jax.ShapeDtypeStruct((width,), jnp.int32), batch_,
                          jax.ShapeDtypeStruct((width,), bool), free, cfg), {"logprobs": logprobs})


def first_token_call(cfg) -> tuple:
    """sample_first for one choice sampling freely, as a (program, args, kwargs) call (compile_all)."""
    free = batch.row_settings([sampling.SamplingParams()], [0], [None], all_allowed(1, cfg.vocab_size))
    return sample_first, (jax.ShapeDtypeStruct((1, cfg.vocab_size), jnp.float32), free), {"logprobs": False}


def compile_all(calls: Iterable[tuple[Program, tuple, dict]], stop: threading.Event | None = None) -> int:
    """Make ready the executables of `calls`, each (program, args, kwargs) as the program will be
    called (arguments may be ShapeDtypeStructs): loaded from the program store, else compiled and
    stored (program_store.py). Where many are missing from the store, a child process compiles
    them there first (compile_apart.py: XLA's compiler is ~1.5x faster outside the command line's
    single malloc arena, and its heap leaves with the child). One after another in process: XLA's
    compiler runs threads of its own. `stop` (an Event) is checked before each. Returns how many."""
    calls = list(calls)
    missing = [c for c in calls if c[0].missing(*c[1], **c[2])]
    if len(missing) >= compile_apart.MIN_CALLS:
        compile_apart.compile_in_child(missing, stop)
    n = 0
    for program, args, kwargs in calls:
        if stop is not None and stop.is_set():
            break
        program.prepare(*args, **kwargs)
        n += 1
    return n


def compiled_count(name: str = "forward") -> int:
    """How many executables the program `name` holds in this process (prepared ahead, or when a call
    first needed one): until `clear`."""
    return ALL[name].held


def clear() -> None:
    """Forget every program's executables in this process (jax.clear_caches() leaves them)."""
    for program in ALL.values():
        program.clear()
