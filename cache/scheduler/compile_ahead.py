"""The continuous batch's programs compiled ahead of time, from shapes alone (nothing runs).

The daemon runs `compile_batched` in a background thread as soon as it listens: compiled on first
use instead, a burst's first step at each new width held every stream while the 30-layer forward
was traced and compiled. The static arguments are named exactly as the scheduler calls them (a
program lowered with them positional, or left to their defaults, is another cache key).
Speculation's verify steps (3 shapes a width) are not among them: `VerifyPrograms` compiles each in
a background thread when a step first wants it, and the batch decodes plainly until it is ready.
"""

from __future__ import annotations

import concurrent.futures

import jax
import jax.numpy as jnp

from jaxsmol.cache.scheduler.settings import BatchSettings
from jaxsmol.cache.scheduler.side_by_side import MAX_ROWS, group_sizes
from jaxsmol.cache.scheduler.speculation import VERIFY_ROWS, speculating
from jaxsmol.cache.scheduler.state import free_mask
from jaxsmol.model.config import Config
from jaxsmol.model.kv import KVCache
from jaxsmol.model.params import abstract_params
from jaxsmol.runtime import compile_apart, programs
from jaxsmol.runtime.batch import empty_batch
from jaxsmol.system.host_memory import release_freed
from jaxsmol.runtime.chunks import capacity_for, chunk_length, prefill_buckets, tight_plan


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
    (one prompt's chunks at the lengths it prefills with, and a draft model's programs; the batched
    programs of compile_batched)."""
    engine, draft = scheduler.engine, scheduler.speculator and scheduler.speculator.draft
    lengths = set(engine.buckets(True)) | (set() if scheduler.cache.exact else set(engine.buckets(False)))
    batched = [] if engine.mesh is not None else batched_calls(  # with a mesh: none (see compile_batched)
        engine, scheduler.widths, slots, side_by_side=scheduler.side_by_side_most)
    return engine.forward_calls(slots, lengths) + (draft.calls(slots) if draft else []), batched


def batched_calls(engine, widths: tuple[int, ...], slots: int, side_by_side: int = 1) -> list:
    """compile_batched's programs, each as a (program, args, kwargs) call (programs.compile_all)."""
    cfg, capacity = engine.cfg, capacity_for(slots)
    calls = []
    for i, width in enumerate(widths):
        calls += programs.decode_calls(engine.params, cfg, engine.cache_dtype, width, capacity)
        batch = jax.eval_shape(lambda width=width: empty_batch(cfg, width, capacity, engine.cache_dtype))
        calls += [(programs.relayout, (batch, jax.ShapeDtypeStruct((other,), jnp.int32), other, capacity), {})
                  for other in widths[:i] + widths[i + 1:]]  # growing and shrinking
    return calls + [programs.first_token_call(cfg)] + side_by_side_calls(engine, side_by_side, capacity)


_BACKGROUND = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxsmol-verify-compile")


class VerifyPrograms:
    """Which verify steps (programs.verify_step) an engine has ready. A missing one is made ready in a
    background thread, never holding a step, with the other positions' shapes of its batch: compiled
    in a child process into the program store and loaded from there (a verify program compiled in
    process left ~8 MB of heap behind after malloc_trim, one loaded ~4 MB), or compiled in process
    where there is no store."""

    def __init__(self, engine):
        self.engine, self.done = engine, set()
        self.pending: dict[tuple, concurrent.futures.Future] = {}

    @property
    def compiling(self) -> bool:
        """Whether a background compile is running (a step timed meanwhile shares the cores with it)."""
        return any(not f.done() for f in self.pending.values())

    def ready(self, width: int, capacity: int, positions: int, logprobs: bool) -> bool:
        key = (width, capacity, positions, logprobs)
        if key in self.done:
            return True
        future = self.pending.get(key)
        if future is None:
            e, shapes = self.engine, [(width, capacity, t, logprobs) for t in VERIFY_ROWS]
            calls = [programs.verify_call(e.params, e.cfg, e.cache_dtype, *s) for s in shapes]
            program, args, kwargs = calls[shapes.index(key)]
            if not program.ready(*args, **kwargs):
                future = _BACKGROUND.submit(_make_ready, calls)
                self.pending.update({s: future for s in shapes if s not in self.done})
                return False
        elif not future.done() or future.exception() is not None:  # compiling, or failed: plain steps
            return False
        self.done.add(key)
        return True


def _make_ready(calls: list) -> None:
    compile_apart.compile_in_child([c for c in calls if c[0].missing(*c[1], **c[2])], least=1)
    programs.compile_all(calls)  # loaded from the store (compiled here where there is none)
    release_freed()  # the heap the loads (or the compiles) freed


def lone_request_calls(cfg: Config, params, cache_dtype, n_prompt: int, max_tokens: int,
                       settings: BatchSettings = BatchSettings(), draft: bool = False) -> list:
    """What a lone request of n_prompt tokens generating max_tokens runs through a scheduler, as
    (program, args, kwargs) calls: its prompt's chunks (the lengths `Scheduler._prefill_newcomers`
    picks with no row decoding), its first token's sampling, and its decode row if it has one (with
    its verify steps where the settings speculate, `draft` whether with a draft model)."""
    buckets = prefill_buckets(True, cfg.cpu_kernels)
    capacity = capacity_for(n_prompt + max_tokens)  # Request.capacity
    budget, lengths, left = max(settings.step_rows(False), buckets[0]), set(), n_prompt
    while left > 0:  # one scheduler step at a time
        for rows in settings.chunks(tight_plan(left, buckets), budget, decoding=False):
            T = chunk_length(left, rows, buckets)
            lengths.add(T)
            left -= min(T, left)
    row = jax.eval_shape(lambda: KVCache.zeros(cfg, capacity, dtype=cache_dtype))
    calls = [(programs.forward, (params, jax.ShapeDtypeStruct((1, T), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32),
                                 row, cfg), {}) for T in sorted(lengths)]
    calls.append(programs.first_token_call(cfg))
    if max_tokens > 1:
        calls += programs.decode_calls(params, cfg, cache_dtype, 1, capacity)
    if max_tokens > 2 and speculating(settings, cfg, draft):
        calls += [programs.verify_call(params, cfg, cache_dtype, 1, capacity, t, False) for t in VERIFY_ROWS]
    return calls


def compile_lone_request(cfg: Config, dtype: str, n_prompt: int, max_tokens: int, speculate: str = "none",
                         draft: bool = False) -> int:
    """Compile (or load from the program store) a lone request's programs (lone_request_calls) from
    shapes alone, so it can run while the weights load (`jaxsmol generate`). Returns how many."""
    params = abstract_params(cfg, getattr(jnp, dtype))
    cache_dtype = cfg.cache_dtype(params.compute_dtype)  # float32 under the kernels unless --kv-dtype says
    n = programs.compile_all(lone_request_calls(cfg, params, cache_dtype, n_prompt, max_tokens,
                                                BatchSettings(speculate=speculate), draft))
    # the zeros of its caches are small programs of their own, compiled on first use (15-150 ms each),
    # and its first token's all-allowed mask a copy to the device: made here, beside the weights' load
    capacity = capacity_for(n_prompt + max_tokens)
    jax.block_until_ready((KVCache.zeros(cfg, capacity, dtype=cache_dtype), empty_batch(cfg, 1, capacity, cache_dtype),
                           free_mask(cfg.vocab_size, 1)))
    return n


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
