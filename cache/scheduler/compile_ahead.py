"""The programs a scheduler runs, compiled ahead of time from shapes alone (nothing runs): a closed set.

Every program over the KV arena (jaxsmol/runtime/batch.py) has the arena's shape, whatever the
requests' lengths, and takes every request field as data, so what a scheduler can run is known
before its first request (`scheduler_calls`):
  - prefill_rows: one prompt's chunk at each exact chunk length; 2, 4 or 8 prompts' chunks side by
    side at the lengths up to side_by_side.MAX_ROWS (the C++ kernels); a chunk of every position's
    logits (scoring: echo, prompt_logprobs);
  - decode_step at each width of the ladder, and verify_step at each width and each of VERIFY_ROWS
    where it speculates; sample_first (a prompt's first tokens) for one choice and for max_batch;
  - write_slots, copy_row, read_slots: a restore, a fork, a save;
  - a draft model's prompt chunks and greedy drafts over its own arena, where it has one.
The daemon makes all of them ready before it says it is ready (cli/server/warmup.py): a request then
never waits for a compile, nor shares the cores with one. A library call compiles what it uses on
first use; `VerifyPrograms` compiles a missing verify step in a background thread, the batch
decoding plainly meanwhile.
"""

from __future__ import annotations

import concurrent.futures

import jax
import jax.numpy as jnp

from jaxsmol.cache.scheduler.settings import BatchSettings, arena_rows
from jaxsmol.cache.scheduler.side_by_side import MAX_ROWS, group_sizes
from jaxsmol.cache.scheduler.speculation import VERIFY_ROWS, speculating
from jaxsmol.model.config import Config
from jaxsmol.model.params import abstract_params
from jaxsmol.runtime import compile_apart, programs
from jaxsmol.runtime.arena_programs import ArenaShapes
from jaxsmol.runtime.arena_size import arena_shape, rows_for
from jaxsmol.runtime.chunks import chunk_length, prefill_buckets, tight_plan
from jaxsmol.runtime.engine import SCORE_ROWS
from jaxsmol.system.host_memory import release_freed

def arena_calls(a: ArenaShapes, widths: tuple[int, ...], lengths, side_by_side: int = 1,
                verify: bool = False, first_widths: tuple[int, ...] = (1,)) -> list:
    """The arena's programs (see the module docstring), each as a (program, args, kwargs) call
    (programs.compile_all): prompt chunks of `lengths` rows (side by side up to `side_by_side`
    prompts), decode steps at each of `widths` (verify steps too where `verify`), first tokens at each of
    `first_widths`, scoring, copies."""
    calls = [a.prefill(1, T) for T in sorted(lengths)]
    calls += [a.prefill(P, T) for P in group_sizes(side_by_side) for T in sorted(lengths) if T <= MAX_ROWS]
    calls += [a.decode(W) for W in widths] + [a.first(N) for N in first_widths]
    calls += [a.verify(W, T) for W in widths for T in VERIFY_ROWS] if verify else []
    return calls + [a.prefill(1, SCORE_ROWS, all_logits=True)] + a.copies()


def scheduler_calls(scheduler) -> list:
    """Every program `scheduler` can run (the closed set the daemon compiles before it is ready)."""
    engine, draft = scheduler.engine, scheduler.speculator and scheduler.speculator.draft
    buckets = set(engine.buckets(True)) | (set() if scheduler.cache.exact else set(engine.buckets(False)))
    longest = scheduler.settings.longest_chunk(tuple(sorted(buckets)))
    lengths = {T for T in buckets if T <= longest}  # a step's chunks are no longer (settings.step_rows)
    calls = arena_calls(ArenaShapes.of(scheduler.arena), scheduler.widths, lengths, scheduler.side_by_side_most,
                        verify=scheduler.speculator is not None, first_widths=scheduler.first_widths)
    return calls + (draft.calls() if draft else [])


def compile_batched(scheduler, stop=None) -> int:
    """Make ready every program `scheduler` can run (scheduler_calls). Returns how many. Not with a mesh
    (the programs' shardings come from the live arrays there). `stop` (an Event): checked before each
    program, so a shutting-down daemon waits for the ones compiling at most."""
    if scheduler.engine.mesh is not None:
        return 0
    return programs.compile_all(scheduler_calls(scheduler), stop)


_BACKGROUND = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxsmol-verify-compile")


class VerifyPrograms:
    """Which verify steps (programs.verify_step) an arena has ready. A missing one is made ready in a
    background thread, never holding a step, with the other positions' shapes of its width: compiled
    in a child process into the program store and loaded from there, or compiled in process where
    there is no store. (The daemon compiles them all before it is ready: this is the library's way.)"""

    def __init__(self, arena):
        self.shapes, self.done = ArenaShapes.of(arena), set()
        self.pending: dict[tuple, concurrent.futures.Future] = {}

    @property
    def compiling(self) -> bool:
        """Whether a background compile is running (a step timed meanwhile shares the cores with it)."""
        return any(not f.done() for f in self.pending.values())

    def ready(self, width: int, positions: int) -> bool:
        key = (width, positions)
        if key in self.done:
            return True
        future = self.pending.get(key)
        if future is None:
            keys = [(width, t) for t in VERIFY_ROWS]
            calls = [self.shapes.verify(*k) for k in keys]
            program, args, kwargs = calls[keys.index(key)]
            if not program.ready(*args, **kwargs):
                future = _BACKGROUND.submit(_make_ready, calls)
                self.pending.update({k: future for k in keys if k not in self.done})
                return False
        elif not future.done() or future.exception() is not None:  # compiling, or failed: plain steps
            return False
        self.done.add(key)
        return True


def _make_ready(calls: list) -> None:
    compile_apart.compile_in_child([c for c in calls if c[0].missing(*c[1], **c[2])], least=1)
    programs.compile_all(calls)  # loaded from the store (compiled here where there is none)
    release_freed()  # the heap the loads (or the compiles) freed


def lone_request_calls(cfg: Config, params, cache_dtype, ctx: int, n_prompt: int, max_tokens: int,
                       settings: BatchSettings = BatchSettings(max_batch=1), draft: bool = False) -> list:
    """What a lone request of n_prompt tokens generating max_tokens runs through a scheduler of
    `settings` (`generate`'s: one decode row), as (program, args, kwargs) calls: its prompt's chunks
    (the lengths `Scheduler._prefill_newcomers` picks with no row decoding), its first token's sampling,
    and its decode row if it has one (with its verify steps where the settings speculate, `draft`
    whether with a draft model)."""
    buckets = prefill_buckets(True, cfg.cpu_kernels)
    budget, lengths, left = max(settings.step_rows(False), buckets[0]), set(), n_prompt
    while left > 0:  # one scheduler step at a time
        for rows in settings.chunks(tight_plan(left, buckets), budget, decoding=False):
            T = chunk_length(left, rows, buckets)
            lengths.add(T)
            left -= min(T, left)
    rows = rows_for(cfg, ctx, cache_dtype, arena_rows(settings.max_batch), jax.devices()[0])  # Engine.arena's
    a = ArenaShapes(cfg, params, arena_shape(cfg, ctx, rows), jnp.dtype(cache_dtype), cfg.cpu_kernels)
    calls = [a.prefill(1, T) for T in sorted(lengths)] + [a.first(1)]
    if max_tokens > 1:
        calls.append(a.decode(1))
    if max_tokens > 2 and speculating(settings, cfg, draft):
        calls += [a.verify(1, T) for T in VERIFY_ROWS]
    return calls


def compile_lone_request(cfg: Config, dtype: str, ctx: int, n_prompt: int, max_tokens: int, speculate: str = "none",
                         draft: bool = False) -> int:
    """Compile (or load from the program store) a lone request's programs (lone_request_calls) from
    shapes alone, so it can run while the weights load (`jaxsmol generate`). Returns how many."""
    params = abstract_params(cfg, getattr(jnp, dtype))
    cache_dtype = cfg.cache_dtype(params.compute_dtype)  # float32 under the kernels unless --kv-dtype says
    return programs.compile_all(lone_request_calls(cfg, params, cache_dtype, ctx, n_prompt, max_tokens,
                                                   BatchSettings(max_batch=1, speculate=speculate), draft))

