"""The continuous batch's programs compiled ahead of time, from shapes alone (nothing runs).

The daemon runs `compile_batched` in a background thread as soon as it listens: compiled on first
use instead, a burst's first step at each new width held every stream while the 30-layer forward
was traced and compiled. The static arguments are named exactly as the scheduler calls them (a
program lowered with them positional, or left to their defaults, is another cache key).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxsmol.cache.scheduler.side_by_side import MAX_ROWS, group_sizes
from jaxsmol.runtime import programs
from jaxsmol.runtime.batch import row_settings
from jaxsmol.runtime.chunks import capacity_for
from jaxsmol.model.kv import KVCache
from jaxsmol.runtime.sampling import SamplingParams
from jaxsmol.runtime.structured import all_allowed


def empty_batch(engine, width: int, capacity: int) -> KVCache:
    """An empty decode batch for `engine`: k, v [L, width, K, capacity, H] zeros, pos [width]."""
    return KVCache.zeros(engine.cfg, capacity, batch=width, dtype=engine.cache_dtype,
                         mesh=engine.mesh).replace(pos=jnp.zeros((width,), jnp.int32))


def compile_batched(engine, widths: tuple[int, ...], slots: int, stop=None, side_by_side: int = 1) -> int:
    """Compile the batched programs that requests of up to `slots` positions use: decode_step and
    insert_row at every width, relayout from each width to each other one, sample_first for one
    choice, and prefill_rows for up to `side_by_side` prompts side by side. Returns how many.
    Not with a mesh (the programs' shardings come from the live arrays there). `stop` (an Event):
    checked before each program, so a shutting-down daemon waits for the ones compiling at most."""
    if engine.mesh is not None:
        return 0
    return programs.compile_all(batched_calls(engine, widths, slots, side_by_side), stop)


def program_calls(scheduler, slots: int) -> tuple[list, list]:
    """What a scheduler's requests of up to `slots` positions run, as (program, args, kwargs) calls:
    (one prompt's chunks at the lengths it prefills with, the batched programs of compile_batched)."""
    engine = scheduler.engine
    lengths = set(engine.buckets(True)) | (set() if scheduler.cache.exact else set(engine.buckets(False)))
    batched = [] if engine.mesh is not None else batched_calls(  # with a mesh: none (see compile_batched)
        engine, scheduler.widths, slots, side_by_side=scheduler.side_by_side_most)
    return engine.forward_calls(slots, lengths), batched


def batched_calls(engine, widths: tuple[int, ...], slots: int, side_by_side: int = 1) -> list:
    """compile_batched's programs, each as a (program, args, kwargs) call (programs.compile_all)."""
    cfg = engine.cfg
    capacity = capacity_for(slots)
    row = jax.eval_shape(lambda: KVCache.zeros(cfg, capacity, dtype=engine.cache_dtype))

    def free_settings(width):  # rows that sample freely, as most requests do
        return row_settings([SamplingParams()] * width, [0] * width, [None] * width,
                            all_allowed(width, cfg.vocab_size))

    calls = []
    for i, width in enumerate(widths):
        batch = jax.eval_shape(lambda width=width: empty_batch(engine, width, capacity))
        calls.append((programs.decode_step, (engine.params, jax.ShapeDtypeStruct((width,), jnp.int32), batch,
                                             jax.ShapeDtypeStruct((width,), bool), free_settings(width), cfg),
                      {"logprobs": False}))
        calls.append((programs.insert_row, (batch, row, jax.ShapeDtypeStruct((), jnp.int32)), {}))
        calls += [(programs.relayout, (batch, jax.ShapeDtypeStruct((other,), jnp.int32), other, capacity), {})
                  for other in widths[:i] + widths[i + 1:]]  # growing and shrinking
    logits = jax.ShapeDtypeStruct((1, cfg.vocab_size), jnp.float32)
    calls.append((programs.sample_first, (logits, free_settings(1)), {"logprobs": False}))
    return calls + side_by_side_calls(engine, side_by_side, capacity)


def side_by_side_calls(engine, most: int, capacity: int) -> list:
    """prefill_rows for group_sizes(`most`) prompts side by side at each exact chunk length up to
    side_by_side.MAX_ROWS, at one capacity, for each window it may use (a burst of short prompts:
    the 128 leading slots; longer ones the whole capacity), each as a (program, args, kwargs) call."""
    if not engine.side_by_side:
        return []
    row = jax.eval_shape(lambda: KVCache.zeros(engine.cfg, capacity, dtype=engine.cache_dtype))
    windows = dict.fromkeys(engine.side_by_side_window(s, capacity) for s in (1, capacity))
    return [(programs.prefill_rows, (engine.params, jax.ShapeDtypeStruct((P, T), jnp.int32),
                                     jax.ShapeDtypeStruct((P,), jnp.int32), (row,) * P, engine.cfg), {"window": window})
            for P in group_sizes(most) for T in engine.buckets(True) if T <= MAX_ROWS for window in windows]
