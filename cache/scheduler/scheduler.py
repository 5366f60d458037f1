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

import numpy as np

from jaxsmol.cache.scheduler.admission import admitted, next_index
from jaxsmol.cache.scheduler.answers import AnswerQueue
from jaxsmol.cache.scheduler.settings import PREFILLS_AT_ONCE, SPARE_ROWS, BatchSettings, arena_rows
from jaxsmol.cache.scheduler.compile_ahead import VerifyPrograms, compile_batched
from jaxsmol.cache.scheduler.draft_model import DraftModel
from jaxsmol.cache.scheduler.kv_budget import KVBudget
from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.scheduler.requests import Request
from jaxsmol.cache.scheduler.side_by_side import group_chunks
from jaxsmol.cache.scheduler.speculation import VERIFY_ROWS, Speculator, column, run_step, speculating
from jaxsmol.cache.scheduler.state import Prefill, Row, SchedulerStats, first_tokens
from jaxsmol.runtime.chunks import tight_plan
from jaxsmol.errors import JaxsmolError
from jaxsmol.runtime.engine import Engine
from jaxsmol.runtime.stream import TokenStream
from jaxsmol.runtime.structured import constraint_for
from jaxsmol.system.host_memory import release_freed

IDLE_RELEASE_S = 5.0  # idle this long: free rows' pages and malloc's free memory go back to the OS
# While busy, malloc's free pages go back this often: the prefix cache's snapshots are large blocks of
# many sizes, and as they are evicted and stored the heap's free memory grew ~100 MB every few long
# prompts, never returned (a trim: ~1 ms, and the few MB a step reuses faulted in again)
TRIM_EVERY_S = 2.0


class Scheduler:
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

    def _prefill_newcomers(self) -> bool:
        """Admit what fits (at most PREFILLS_AT_ONCE prompts being prefilled), then give each prompt,
        the fewest rows left first, this step's chunks: at most `step_rows` rows per prompt, as one chunk
        of at most `chunk_cap` rows while rows decode (a long prompt advances in short steps) unless
        the rest finishes it, in its least padded plan (45 tokens: 32 + 16 rows, not 64). The
        prompts' chunks of the same length run side by side in one forward (a burst of short prompts
        reads the weights once, not once per prompt). Returns whether any prompt work was done."""
        self._admit()
        if not self.prefills:
            return False
        decoding = self.live_rows > 0  # a budget below the smallest exact chunk acts as it:
        budget = max(self.settings.step_rows(decoding), self.engine.buckets(True)[0])
        plans = {p: self.settings.chunks(tight_plan(self._rows_left(p), self.engine.buckets(self._exact(p))),
                                         budget, decoding) for p in sorted(self.prefills, key=self._rows_left)}
        for j in range(max(map(len, plans.values()))):  # round j: every prompt's j-th chunk, padded rows T
            todo = [(p, self.engine.chunk_rows(self._rows_left(p), rows[j], self._exact(p)))
                    for p, rows in plans.items() if j < len(rows) and p in self.prefills]
            for group in group_chunks(todo, lambda c: (c[1], 0), self.side_by_side_most):
                self._prefill_group(group)
        return True

    def _rows_left(self, p: Prefill) -> int:  # prompt positions not yet in p's row
        return len(p.lookup.prompt) - self.arena.pos[p.row]

    def run(self) -> None:
        while self.has_work:
            self.step()

    # ---- admission and prefill ---------------------------------------------------------------------
    def _admit(self) -> None:
        """Begin waiting requests, in the admission order (cache/scheduler/admission.py), while decode
        rows (and memory) will be free for them and fewer than PREFILLS_AT_ONCE prompts are being prefilled."""
        if any(r.sink.cancelled() for r in self.pending):
            self.pending = collections.deque(r for r in self.pending if not r.sink.cancelled())
        if self.free_rows <= 0 and all(r.decode_rows for r in self.pending):
            return  # every row taken: nothing to choose yet
        stored: dict = {}  # id(request) -> its stored prefix, looked up once a step
        while self.pending and len(self.prefills) < PREFILLS_AT_ONCE:
            i = next_index(self.pending, self.settings, self.cache, stored)
            req = self.pending[i]
            if not self._room_for(req) or (not req.bypass and self.saves and self.saves.wanted_by(
                    req.prompt_ids, self.cache.namespace(req.salt))):  # store the answer it continues first
                return
            admitted(self.pending, i)
            del self.pending[i]
            try:
                self._begin(req)
            except JaxsmolError as e:
                req.sink.error(e)

    def _room_for(self, req: Request) -> bool:
        """Whether decode rows, arena rows and the KV budget will be free for req's choices, counting the
        requests already being prefilled as holding theirs (one request alone is always admitted: a
        row missing then is its error, not a wait)."""
        held = [p.request for p in self.prefills if p.request.decode_rows]
        if self.live_rows + sum(r.decode_rows for r in held) + req.decode_rows > self.max_batch:
            return False
        need = self.reserved_slots + req.reservation(self.arena.slots)
        if self.live_rows + len(self.prefills):
            # rows the prompts being prefilled fork into at their end, and the choices waiting to fork
            forks = sum(max(0, p.request.decode_rows - 1) for p in self.prefills) + len(self.forks)
            if self.arena.free_rows - forks - SPARE_ROWS < max(1, req.decode_rows):
                return False
            if not self.budget.fits(need):
                return False
        self.budget.keep_within(need)
        return True

    def _begin(self, req: Request) -> None:
        started, cfg = time.perf_counter(), self.engine.cfg
        constraints = [constraint_for(self.engine.tokenizer, cfg.eos_ids, cfg.vocab_size, sp.structured)
                       for sp in req.samplings]  # a bad spec fails here, before any model work
        lk = self.cache.lookup(req.prompt_ids, max(sp.max_tokens for sp in req.samplings),
                               salt=req.salt, bypass=req.bypass)
        self.stats.admitted += 1
        n, reused = len(lk.prompt), lk.report.reused
        row = None
        try:
            if req.pin:
                self.cache.pins.check(lk)  # before any work: a prompt that cannot be pinned is refused
            if reused < n or req.decode_rows:  # a row to prefill or decode in (an exact full hit without
                exact = self.cache.exact_state(lk.prompt[:reused])  # decode rows needs none)
                row, held = self.lease.take(exact if reused else None, req.reservation(self.arena.slots))
                if held < reused:
                    self.arena.restore(row, lk.parts, held, reused, exact)
        except BaseException:
            if row is not None:
                self.lease.give(row)
            raise
        finally:
            self.cache.release(lk)  # restored: the store's budget bounds it again
        p = Prefill(req, lk, row, constraints, started)
        self.prefills.append(p)
        if reused == n:  # an exact full hit: the stored logits stand in for the forward
            self._prompt_done(p, np.asarray(lk.logits, np.float32)[None])

    def _prefill_group(self, group: list[tuple[Prefill, int]]) -> None:
        """One chunk of T padded rows of each prompt in group (one T), side by side when more than one."""
        prefills, T = [p for p, _ in group], group[0][1]
        try:
            logits = self.arena.prefill([(p.row, p.lookup.prompt) for p in prefills], T,
                                        exact_rows=T in self.engine.buckets(True))
            done = [p for p in prefills if self._rows_left(p) <= 0]
            # each prompt's row sliced on the host: a slice of a device array would be a program of its own
            logits = np.asarray(logits) if done else None
        except Exception as e:  # a failure costs these requests, never the others
            for p in prefills:
                self._abort_prefill(p, e)
            self._recover()
            return
        self.stats.prefill_calls += 1
        for p in done:
            self._prompt_done(p, logits[prefills.index(p)][None])

    def _exact(self, p: Prefill) -> bool:
        return self.cache.exact or not p.lookup.report.reused  # a cold prefill is always exact

    def _abort_prefill(self, p: Prefill, error: Exception | None) -> None:
        self.prefills.remove(p)
        self.cache.release(p.lookup)
        if p.row is not None:
            self.lease.give(p.row)
        if error is not None:
            p.request.sink.error(error)

    def _prompt_done(self, p: Prefill, logits: np.ndarray) -> None:
        """p's prompt is in its row and `logits` [1, V] (on the host) follow it: store it, sample each
        choice's first token, and give every choice that goes on a decode row: the first the prompt's,
        the others a fork of it each, as their KV grants fit (`_start_forks`)."""
        req, lk = p.request, p.lookup
        prefill_s = time.perf_counter() - p.started
        out = first_tokens(logits, req.samplings, p.constraints, self.engine.cfg.vocab_size, self.first_widths)
        # stored once the first tokens are out, not on their time to first token (a fresh host copy of a
        # 700-token prompt: ~70 ms), and before a finished choice's answer extends it; but first where
        # cache breakpoints are kept, so that the first tokens come with what they kept (Request.keep)
        refused = self._store(p, logits) if req.keep else None
        ttft = time.perf_counter() - req.submitted
        kept = np.array(logits[0]) if req.detail else None
        rows = []
        drafts = self.speculator.drafter(self.cache, lk, max(sp.max_tokens for sp in req.samplings)) if (
            self.speculator) else lambda: None
        req.sink.prompt(req.indices, lk.report)
        for i, (index, sp) in enumerate(zip(req.indices, req.samplings)):
            stream = TokenStream(self.engine.tokenizer, sp, self.engine.cfg.eos_ids)
            rows.append(Row(req, lk, index, stream, ttft, p.constraints[i], prefill_s, kept, drafts(),
                            reserved=req.row_reservation(i, self.arena.slots),
                            final=req.row_final(i, self.arena.slots)))
            if sp.max_tokens:  # max_tokens 0: the prompt alone (it is stored, nothing is sampled)
                rows[-1].push(out, i)
        if not req.keep:
            refused = self._store(p, logits)
        if refused is not None:
            req.sink.error(refused)
            rows = []
        going_on = []
        for row, sp in zip(rows, req.samplings):
            if row.stream.done or sp.max_tokens == 0:
                row.release()
                self._finish(row)
            else:
                going_on.append(row)
        self.prefills.remove(p)
        if going_on:  # the first continues in the prompt's row, the others fork from it when their KV fits
            going_on[0].slot = p.row
            self.live.append(going_on[0])
            for row in going_on[1:]:
                row.source = going_on[0]
                self.forks.append(row)
            self._start_forks()
        elif p.row is not None:
            self.lease.give(p.row)

    def _store(self, p: Prefill, logits: np.ndarray) -> JaxsmolError | None:
        """Store p's prompt (its row holds it), pin it for a pin request and its cache breakpoints
        (cache/pins.py), and account its prefill; the error where a pin request's pin is refused."""
        req, lk = p.request, p.lookup
        if p.row is not None:
            self.cache.save_prompt(lk, self.arena.view(p.row), logits)
        refused = self._pin(req, lk)
        if req.keep:
            lk.report.kept = self.cache.pins.keep(lk.ns, lk.prompt, req.keep, lk.report.reused)
        prefilled = len(lk.prompt) - lk.report.reused
        self.cache.finish(lk, prefilled)
        self.cache.release(lk)
        self.stats.prefilled_tokens += prefilled
        return refused

    def _pin(self, req: Request, lk) -> JaxsmolError | None:
        """Pin a pin request's prompt, stored just now (cache/pins.py); the error if it cannot be."""
        try:
            if req.pin:
                self.cache.pins.pin(lk.ns, lk.prompt)
        except JaxsmolError as e:
            return e
        return None

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
            row.slot = self.lease.take(expect=row.reserved)[0]
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
