"""The Scheduler's admission and prefill stage (a base class of scheduler.py's Scheduler, whose docstring
tells the whole step): waiting requests admitted in the admission order while rows and the KV budget will
be free for them, their stored prefixes restored into their rows, their prompts' chunks prefilled side by
side, and a complete prompt stored and turned into decode rows (its first tokens sampled, its choices
forked). The decode stage, the rows' lifecycle and the public surface stay in scheduler.py."""

from __future__ import annotations

import collections
import time

import numpy as np

from jaxsmol.cache.fetch import WAIT_S
from jaxsmol.cache.scheduler.admission import admitted, next_index
from jaxsmol.cache.scheduler.settings import PREFILLS_AT_ONCE, SPARE_ROWS
from jaxsmol.cache.scheduler.requests import Request
from jaxsmol.cache.scheduler.side_by_side import group_chunks
from jaxsmol.cache.scheduler.state import Prefill, Row, first_tokens
from jaxsmol.errors import JaxsmolError
from jaxsmol.runtime.chunks import tight_plan
from jaxsmol.runtime.stream import TokenStream
from jaxsmol.runtime.structured import constraint_for


class PrefillStage:
    """Admission and prefill, on the Scheduler's state (its pending queue, prefills, live rows and forks,
    arena, lease, cache and KV budget); the Scheduler calls `_prefill_newcomers` once a step."""

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

    # ---- admission and prefill ---------------------------------------------------------------------
    def _admit(self) -> None:
        """Begin waiting requests, in the admission order (cache/scheduler/admission.py), while decode
        rows (and memory) will be free for them and fewer than PREFILLS_AT_ONCE prompts are being prefilled."""
        if any(r.sink.cancelled() for r in self.pending):
            self.pending = collections.deque(r for r in self.pending if not r.sink.cancelled())
        self._fetch_ahead()
        if self.free_rows <= 0 and all(r.decode_rows for r in self.pending):
            return  # every row taken: nothing to choose yet
        stored: dict = {}  # id(request) -> its stored prefix, looked up once a step
        while self.pending and len(self.prefills) < PREFILLS_AT_ONCE:
            i = next_index(self.pending, self.settings, self.cache, stored, lambda r: self.cache.fetcher.ready(r.fetch))
            if i is None:  # waiting for reads: nothing else to do, wait a little for them (no spinning)
                reading = [r.fetch for r in self.pending if r.fetch is not None and r.fetch.future is not None]
                if reading and not (self.live or self.prefills or self.saves):
                    reading[0].wait(WAIT_S)
                return
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

    def _fetch_ahead(self) -> None:
        """Plan each waiting request's reads from the lower tiers once, and start them, oldest first, while
        the fetch thread has room (cache/fetch.py): they run while the request waits."""
        fetcher = self.cache.fetcher
        for r in self.pending:
            if not r.planned:
                r.fetch, r.planned = self.cache.plan_fetch(r.prompt_ids, salt=r.salt, bypass=r.bypass), True
            if r.fetch is not None and not r.fetch.done and r.fetch.future is None and fetcher.room:
                fetcher.start(r.fetch, self.cache.read_ahead)

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
        try:
            lk = self.cache.lookup(req.prompt_ids, max(sp.max_tokens for sp in req.samplings),
                                   salt=req.salt, bypass=req.bypass, fetched=req.fetch)
        finally:
            self.cache.fetcher.taken(req.fetch)
            req.fetch = None
        self.stats.admitted += 1
        n, reused = len(lk.prompt), lk.report.reused
        row = None
        try:
            if req.pin:
                self.cache.pins.check(lk)  # before any work: a prompt that cannot be pinned is refused
            if reused < n or req.decode_rows:  # a row to prefill or decode in (an exact full hit without
                row = self.cache.device.row_for(  # decode rows needs none)
                    self.lease, lk.match, reused, req.reservation(self.arena.slots), lk.parts)
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
        self.cache.note_prefill(len(lk.prompt) - lk.report.reused, prefill_s)
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
        if req.retain_s:
            self.cache.retain(lk, req.retain_s)
        prefilled = len(lk.prompt) - lk.report.reused
        self.cache.finish(lk, prefilled)
        self.cache.release(lk)
        self.stats.prefilled_tokens += prefilled
        return refused

    def _pin(self, req: Request, lk) -> JaxsmolError | None:
        """Pin a pin request's prompt, stored just now (cache/pins.py); the error if it cannot be."""
        try:
            if req.pin:
                o = req.pin
                self.cache.pins.pin(lk.ns, lk.prompt, ttl_s=o.ttl_s, holder=o.holder, record=o.record)
        except JaxsmolError as e:
            return e
        return None
