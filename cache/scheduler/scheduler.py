"""Continuous batching: many requests decode together, one jitted step for all of them.

Every sequence lives in a row of the engine's KV arena (jaxsmol/runtime/kv_arena.py), from its
admission to its end: a prompt is restored and prefilled in the row it then decodes in, a prompt's n
choices fork into rows of their own, and a step names the rows it runs. Each `step()` does, in order:
  1. admission: waiting requests, while decode rows and the KV budget will be free for them (and
     fewer than PREFILLS_AT_ONCE prompts are being prefilled), in the settings' admission order
     (cache/scheduler/admission.py: the longest stored prefix first, bounded, or by arrival), take a
     row, are looked up in the prefix cache and their stored prefix restored into it (a row that
     already holds the prefix is taken as it is); the chosen request waits, and none other goes
     before it, while it does not fit;
  2. prefill: their prompts' next chunks, exact (a prompt state has a cold prefill's bits), chunks
     of one length side by side in one forward (see `_prefill_newcomers`); or else one chunk of an
     answer being stored for the next turn. A complete prompt is stored, its first tokens are
     sampled, and its first choice that goes on decodes in the prompt's row; the others fork from it
     (its prompt's positions copied into a row of their own) as their KV grants fit the budget;
  3. decode: one step of every live row (forward at each row's position, then each row's own
     sampling; or, where rows drafted tokens and it pays, a verify step of their drafts:
     cache/scheduler/speculation.py), then the host side of every row (its TokenStream).
Rows leave as they finish or as their client goes, and go back to the arena.

A step's width (the rows it computes, its program's shape) comes from a ladder (1, 2, 4, ...
`max_batch`): the narrowest that holds the live rows, padding entries writing the arena's pad row, so a
lone stream decodes at width 1 and nothing moves when the batch grows or shrinks. With
`batch_invariant`, the width is always `max_batch`: a row's logits then do not depend on how many
other rows are live, so a request's tokens are the same alone or among others (a step's row count
changes the last bits without the CPU kernels).

Memory: the KV positions granted to the requests in flight stay within `kv_bytes`. A request is
admitted when its grant fits: per row it will decode in, its prompt and up to GROW_SLOTS tokens
(requests.GROW_SLOTS; the checks and grants: kv_budget.py). A row reaching the end of its grant is
granted GROW_SLOTS more where they fit; where they do not, it sits out decode steps (its stream pauses)
until rows finish and free their grants, except the rows of the oldest request decoding, which always go
on (as one request alone is always admitted): no row is ever stopped or recomputed, and the budget holds
but for that one request. Rows given back keep their pages (and the prefix they hold: the next turn of a chat takes
that row without a copy) while the budget allows; beyond it, and once the scheduler has been idle for
IDLE_RELEASE_S, their pages go back to the OS (`idle`).
"""

from __future__ import annotations

import collections
import time
import weakref


from jaxsmol.cache.scheduler.answers import AnswerQueue
from jaxsmol.cache.scheduler.settings import PREFILLS_AT_ONCE, SPARE_ROWS, BatchSettings, arena_rows
from jaxsmol.cache.scheduler.compile_ahead import VerifyPrograms, compile_batched
from jaxsmol.cache.scheduler.draft_model import DraftModel
from jaxsmol.cache.scheduler.kv_budget import KVBudget
from jaxsmol.cache.scheduler.prefill_stage import PrefillStage
from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.scheduler.requests import Request
from jaxsmol.cache.scheduler.speculation import VERIFY_ROWS, Speculator, column, run_step, speculating
from jaxsmol.cache.scheduler.state import Prefill, Row, SchedulerStats
from jaxsmol.errors import JaxsmolError
from jaxsmol.runtime.engine import Engine
from jaxsmol.system.host_memory import release_freed

IDLE_RELEASE_S = 5.0  # idle this long: free rows' pages and malloc's free memory go back to the OS
# While busy, malloc's free pages go back this often: the prefix cache's snapshots are large blocks of
# many sizes, and as they are evicted and stored the heap's free memory grew ~100 MB every few long
# prompts, never returned (a trim: ~1 ms, and the few MB a step reuses faulted in again)
TRIM_EVERY_S = 2.0


class Scheduler(PrefillStage):
    def __init__(self, cache: PrefixCache, draft: Engine | DraftModel | None = None, **settings):
        """settings: the fields of BatchSettings (max_batch, kv_bytes, batch_invariant, chunk_rows, speculate...);
        draft: a draft model for speculate "draft" / "auto" (an Engine gets a DraftModel of its own)."""
        self.cache, self.engine = cache, cache.engine
        self.arena = self.engine.arena(arena_rows(settings.get("max_batch", BatchSettings.max_batch)))
        if self.arena.pad - SPARE_ROWS < settings.get("max_batch", BatchSettings.max_batch):  # a small machine's
            settings["max_batch"] = max(1, self.arena.pad - SPARE_ROWS)  # arena: fewer rows decode at once
        self.settings = s = BatchSettings(**settings)
        self.max_batch, self.kv_bytes, self.batch_invariant = s.max_batch, s.kv_bytes, s.batch_invariant
        self.widths = s.widths
        # a prompt's first tokens: one choice, or its choices padded to max_batch rows (sampling 16 rows
        # costs ~1 ms once a request, where each width's program was 0.5 s of the daemon's warm-up)
        self.first_widths = tuple(dict.fromkeys((1, s.max_batch)))
        self.lease = self.arena.lease()  # the rows it holds: back to the arena at close, or when it is dropped
        # the most prompt chunks in one forward, no more than the batch's rows (--max-batch 2 compiles no
        # group of 4 or 8); 1 without the kernels (each alone)
        self.side_by_side_most = min(PREFILLS_AT_ONCE, s.max_batch) if self.engine.side_by_side else 1
        self.pending: collections.deque[Request] = collections.deque()
        self.prefills: list[Prefill] = []  # admitted, prompt not yet complete (admission order)
        self.live: list[Row] = []  # the decode rows, in the order they came
        self.forks: list[Row] = []  # choices whose prompt is done, waiting for a row and the KV to fork into
        self.saves = AnswerQueue(cache, self.arena, self.lease)  # answers being stored for the next turn
        self.stats = SchedulerStats()
        if isinstance(draft, Engine):
            draft = DraftModel(draft, cache, s.max_batch)
        self.speculator = Speculator(self.engine, most=s.speculate_tokens, from_cache=s.speculate != "ngram",
                                     draft=draft) if speculating(s, self.engine.cfg, draft is not None) else None
        # a decode row's bytes per position: the target's, and its draft row's where a draft model drafts
        self.kv_bytes_per_token = self.engine.kv_bytes_per_token + (draft.engine.kv_bytes_per_token if draft else 0)
        self.budget = KVBudget(self.arena, self.kv_bytes, self.kv_bytes_per_token)
        self.verify_programs = VerifyPrograms(self.arena)
        self._idle_since: float | None = None
        self._trimmed = time.monotonic()
        weakref.finalize(self, _abandon, self.live, self.forks, self.lease)

    # ---- the public surface ------------------------------------------------------------------------
    @property
    def rows(self) -> list[Row]:  # the live decode rows
        return self.live

    @property
    def width(self) -> int:
        """The width of the next decode step (0 with no row live)."""
        if not self.live:
            return 0
        return self.max_batch if self.batch_invariant else self.settings.width_for(len(self.live))

    def submit(self, request: Request) -> None:
        """Queue a request; its events reach its sink from `step()` (a bad one: one error event)."""
        if len(request.samplings) > self.max_batch:
            request.sink.error(JaxsmolError(f"at most {self.max_batch} choices per request (max_batch), "
                                            f"got {len(request.samplings)}"))
            return
        self.pending.append(request)

    @property
    def live_rows(self) -> int:
        return len(self.live)

    @property
    def free_rows(self) -> int:
        """Decode rows neither live, nor waiting to fork, nor held by a prompt being prefilled."""
        return (self.max_batch - self.live_rows - len(self.forks)
                - sum(p.request.decode_rows for p in self.prefills))

    @property
    def has_work(self) -> bool:
        return bool(self.pending or self.prefills or self.saves or self.live_rows or self.forks)

    @property
    def granted_slots(self) -> int:
        """Positions granted to the rows that hold KV: each live row's, each prompt being prefilled's."""
        return sum(r.reserved for r in self.live) + sum(p.request.reservation(self.arena.slots) for p in self.prefills)

    @property
    def reserved_slots(self) -> int:
        """granted_slots, and the first grant of each choice waiting to fork (admission leaves them room)."""
        return self.granted_slots + sum(r.reserved for r in self.forks)

    @property
    def kv_bytes_held(self) -> int:
        """The KV memory the arena's rows hold now (resident pages: live rows' and free rows' kept), and
        a draft model's arena's."""
        draft = self.speculator.draft if self.speculator else None
        return self.arena.resident_bytes() + (draft.arena.resident_bytes() if draft else 0)

    @property
    def arena_span(self) -> int:
        """Bytes the KV arenas span (reserved, mostly never backed): the target's and a draft model's."""
        draft = self.speculator.draft if self.speculator else None
        return self.arena.span_bytes + (draft.arena.span_bytes if draft else 0)

    def figures(self) -> dict:
        """What /metrics shows of the batch (see cli/server/metrics.py)."""
        return {"rows": self.live_rows, "width": self.stats.width, "pending": len(self.pending),
                "kv_bytes": self.kv_bytes_held, "kv_reserved_bytes": self.granted_slots * self.kv_bytes_per_token,
                "steps": self.stats.steps, "decoded_tokens": self.stats.decoded_tokens, "stalled": self.stats.stalled,
                "prefilled_tokens": self.stats.prefilled_tokens,
                "speculation": {k: tuple(v) for k, v in self.stats.by_source.items()},
                **(self.speculator.draft.figures() if self.speculator and self.speculator.draft else {})}

    def compile_programs(self, stop=None) -> int:
        """Compile the programs over the arena ahead, from shapes alone (cache/scheduler/compile_ahead.py);
        returns how many."""
        return compile_batched(self, stop)

    def step(self) -> None:
        """One round: admit and prefill newcomers (else one chunk of an answer being stored), then one
        decode step of all rows."""
        self._idle_since = None
        self.cache.pins.expire()  # pins past their expiry back to the LRU, between two steps
        self._drop_cancelled()
        busy = self._prefill_newcomers()
        if not busy and self.saves.may_run(rows_decoding=self.live_rows > 0):
            self.saves.step(self.settings.step_rows(self.live_rows > 0))
            busy = True
        if self.live_rows:
            self._decode(timed=not busy)
        self.budget.keep_within(self.reserved_slots)  # the rows this step gave back keep no more than the budget
        if time.monotonic() - self._trimmed >= TRIM_EVERY_S:
            release_freed()
            self._trimmed = time.monotonic()

    def idle(self) -> None:
        """Called while there is no work: pins past their expiry go back to the LRU; once idle for
        IDLE_RELEASE_S, the free rows' pages and malloc's free memory go back to the OS (the resident set
        returns toward its size at start)."""
        now = time.monotonic()
        self.cache.pins.expire()
        if self._idle_since is None:
            self._idle_since = now
        elif now - self._idle_since >= IDLE_RELEASE_S and self._idle_since > 0:
            self.arena.release_free()
            if self.speculator and self.speculator.draft:
                self.speculator.draft.arena.release_free()
            release_freed()
            self._idle_since = -1.0  # done until the next work

    def close(self) -> None:
        """Give back every row this scheduler holds (its requests are abandoned)."""
        for p in list(self.prefills):
            self._abort_prefill(p, None)
        for r in list(self.live):
            self._free_row(r)
        for r in self.forks:
            r.release()
        self.forks.clear()
        self.saves.close()

    def run(self) -> None:
        while self.has_work:
            self.step()

    # ---- decode rows ---------------------------------------------------------------------------------
    def _decode(self, timed: bool = True) -> None:
        """One decode step of every live row (a verify step where rows drafted tokens: speculation.py),
        then each row's host side (its tokens' stream, stop strings, events). (Dispatching the next
        step before reading this one, as vLLM's async scheduling does, gave no steady gain on two
        cores: docs/design.md, the scheduler.)"""
        self._start_forks()
        live, stalled = self.budget.grow(self.live, self.granted_slots, VERIFY_ROWS[-1] if self.speculator else 1)
        self.stats.stalled += stalled
        W = self.max_batch if self.batch_invariant else self.settings.width_for(len(live))
        plan = self.speculator.plan(live, W, self.arena.slots, lambda t: self.verify_programs.ready(W, t)) if (
            self.speculator) else None
        started = time.perf_counter()
        try:
            out = run_step(self.arena, live, W, plan, self.engine.cfg.vocab_size)
        except Exception as e:  # the arena is lost: fail its requests, keep serving
            for r in live:
                r.request.sink.error(e)
            self._recover()
            return
        if self.speculator and timed and not self.verify_programs.compiling:  # (a compile shares the cores)
            self.speculator.timed(W, 1 if plan is None else plan[0], time.perf_counter() - started)
        self.stats.steps += 1
        self.stats.width = W
        for i, r in enumerate(live):
            n = 1 if plan is None else int(out["count"][i])
            if plan is not None:
                self.speculator.verified(r, len(plan[1][i]), n - 1)
                self.stats.verified(r.draft_source, len(plan[1][i]), n - 1)
            try:  # the step's new tokens, up to where the row's stream ends
                self.stats.decoded_tokens += r.take([out] if plan is None else [column(out, j) for j in range(n)], i)
            except Exception as e:  # (its grammar refused a token) this row's request fails, no other
                self._free_row(r)
                r.request.sink.error(e)
                continue
            if r.stream.done:
                self._free_row(r)
                self._finish(r)

    def _start_forks(self) -> None:
        """Fork the waiting choices, in order, while their first grants fit the KV budget: each into a row
        of its own, its prompt's positions copied from a row of its request (a request's n choices then
        hold the budget's worth at a time, not n rows at once)."""
        budget, others = self.budget.slots, self.granted_slots
        while self.forks and others + self.forks[0].reserved <= budget and self.arena.free_rows > 1:
            row = self.forks.pop(0)
            row.slot = self.lease.take(expect=row.reserved)
            self.arena.fork(row.source.slot, row.slot, len(row.lookup.prompt))
            row.source = None
            self.live.append(row)
            others += row.reserved

    def _free_row(self, row: Row) -> None:
        """A decode row leaves: its arena row goes back (holding its prompt's exact state), its drafter's
        too; or, where choices of its request wait to fork from it, the first of them takes the row
        over as it is (its prompt's positions are the prompt's state: no copy)."""
        self.live.remove(row)
        row.release()
        heirs = [f for f in self.forks if f.source is row]
        if not heirs:
            self.lease.give(row.slot)
            return
        heir = heirs[0]
        self.forks.remove(heir)
        heir.slot, heir.source = row.slot, None
        self.arena.pos[heir.slot] = len(heir.lookup.prompt)
        self.live.append(heir)
        for f in heirs[1:]:
            f.source = heir

    def _recover(self) -> None:
        """After a program failed: the arena's buffers may be gone with it; every row in flight fails
        and the arena starts afresh (the prefix cache keeps its entries)."""
        if not self.arena.lost:
            return
        for r in list(self.live) + self.forks:
            r.request.sink.error(JaxsmolError("the KV arena was lost to a failed step"))
        self.live.clear()
        self.forks.clear()
        for p in list(self.prefills):
            self.prefills.remove(p)
            self.cache.release(p.lookup)
            p.request.sink.error(JaxsmolError("the KV arena was lost to a failed step"))
        self.saves.close()
        self.arena.recover()

    def _finish(self, row: Row) -> None:
        s, lk = row.stream, row.lookup
        row.request.sink.done(row.finished())
        if s.finish_reason and self.cache.wants_answer(lk, s.output_ids):
            save = self.cache.begin_answer(lk, s.output_ids)
            if save is not None:
                self.saves.add(save)

    def _drop_cancelled(self) -> None:
        for r in [r for r in self.forks if r.request.sink.cancelled()]:
            self.forks.remove(r)
            r.release()
        for r in [r for r in self.live if r.request.sink.cancelled()]:
            self._free_row(r)
        for p in [p for p in self.prefills if p.request.sink.cancelled()]:
            self._abort_prefill(p, None)


def _abandon(live: list[Row], forks: list[Row], lease) -> None:
    """A scheduler dropped with rows in flight (a library call abandoned): its drafters' rows and its
    arena rows go back."""
    for r in live + forks:
        r.release()
    lease.close()
