"""Continuous batching: many requests decode together, one jitted step for all of them.

Each `step()` does, in order:
  1. admission: waiting requests, while decode rows will be free for their choices (and fewer than
     PREFILLS_AT_ONCE prompts are being prefilled), are looked up in the prefix cache and restored
     into one-row staging caches (prefill / insert / generate, as in JetStream), in the settings'
     admission order (cache/scheduler/admission.py: the longest stored prefix first, bounded, or
     by arrival); the chosen request waits, and none other goes before it, while it does not fit;
  2. prefill: their prompts' next chunks, exact (a prompt state has a cold prefill's bits), chunks
     of one length side by side in one forward (see `_prefill_newcomers`); or else one chunk of an
     answer being stored for the next turn. A complete prompt's first tokens are sampled and its
     state inserted into a decode row per choice (`n` forks share one prefill);
  3. decode: one step of every live row (forward at each row's position, then each row's own
     sampling; or, where rows drafted tokens and it pays, a verify step of their drafts:
     cache/scheduler/speculation.py), then the host side of every row (its TokenStream).
Rows leave as they finish or as their client goes; their rows are reused by the next admissions.

The batch's width comes from a ladder (1, 2, 4, ... `max_batch`) and its capacity from the engine's
doubling ladder; it grows when a newcomer needs more (at once to the width the waiting requests need
too, as far as kv_bytes allows) and shrinks after SHRINK_AFTER steps at most half used (layout.py), so that a
lone stream decodes at width 1. With `batch_invariant`, the width is always `max_batch`: a row's
logits then do not depend on how many other rows are live, so a request's tokens are the same
alone or among others (a step's row count changes the last bits).

Decode rows' memory is bounded by `kv_bytes` (width x capacity x bytes per position); a request that
would break it waits, except that one request alone is always admitted. An idle batch is kept for
the next burst: reused as it is for the same shape, else freed just before the new one is made (its
memory, not fresh pages); a bigger one that a smaller one replaces (a lone request after a burst)
is kept as the spare for the next burst, within kv_bytes together.
"""

from __future__ import annotations

import collections
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxsmol.cache.scheduler.admission import admitted, next_index
from jaxsmol.cache.scheduler.answers import AnswerQueue
from jaxsmol.cache.scheduler.settings import BatchSettings
from jaxsmol.cache.scheduler.compile_ahead import VerifyPrograms, compile_batched
from jaxsmol.cache.scheduler.draft_model import DraftModel
from jaxsmol.cache.scheduler.layout import DecodeRows
from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.scheduler.requests import Request
from jaxsmol.cache.scheduler.side_by_side import group_chunks
from jaxsmol.cache.scheduler.speculation import Speculator, column, run_step, speculating
from jaxsmol.cache.scheduler.state import Prefill, Row, SchedulerStats, free_mask
from jaxsmol.runtime import programs
from jaxsmol.runtime.chunks import MIN_CAPACITY, tight_plan
from jaxsmol.errors import JaxsmolError
from jaxsmol.runtime.batch import row_settings
from jaxsmol.runtime.engine import Engine
from jaxsmol.model.kv import KVCache
from jaxsmol.runtime.stream import TokenStream
from jaxsmol.runtime.structured import constraint_for

# Prompts prefilled at once (side by side where their chunks have one length), each holding a
# one-row staging cache until its rows decode (8 x 512 slots: 189 MB in float32).
PREFILLS_AT_ONCE = 8


class Scheduler:
    def __init__(self, cache: PrefixCache, draft: Engine | DraftModel | None = None, **settings):
        """settings: the fields of BatchSettings (max_batch, kv_bytes, batch_invariant, chunk_rows, speculate...);
        draft: a draft model for speculate "draft" / "auto" (an Engine gets a DraftModel of its own)."""
        self.settings = s = BatchSettings(**settings)
        self.cache, self.engine = cache, cache.engine
        self.max_batch, self.kv_bytes, self.batch_invariant = s.max_batch, s.kv_bytes, s.batch_invariant
        self.widths = s.widths
        # the most prompt chunks in one forward, no more than the batch's rows (--max-batch 2 compiles no
        # group of 4 or 8); 1 without the kernels (each alone)
        self.side_by_side_most = min(PREFILLS_AT_ONCE, s.max_batch) if self.engine.side_by_side else 1
        self.pending: collections.deque[Request] = collections.deque()
        self.prefills: list[Prefill] = []  # admitted, prompt not yet complete (admission order)
        self.saves = AnswerQueue(cache)  # answers being stored for the next turn
        self.stats = SchedulerStats()
        if isinstance(draft, Engine):
            draft = DraftModel(draft, cache)
        self.speculator = Speculator(self.engine, most=s.speculate_tokens, from_cache=s.speculate != "ngram",
                                     draft=draft) if speculating(s, self.engine.cfg, draft is not None) else None
        # a decode row's bytes per position: the target's, and its draft cache's where a draft model drafts
        self.kv_bytes_per_token = self.engine.kv_bytes_per_token + (draft.engine.kv_bytes_per_token if draft else 0)
        self.layout = DecodeRows(self.engine, s, self.kv_bytes_per_token, self.stats)
        self.verify_programs = VerifyPrograms(self.engine)
        self._relayouts = 0  # the relayouts before the last decode step

    # ---- the public surface ------------------------------------------------------------------------
    @property
    def rows(self) -> list[Row | None]:  # the decode rows (None: free), one per batch row
        return self.layout.rows

    @rows.setter
    def rows(self, rows: list[Row | None]) -> None:
        self.layout.rows = rows

    @property
    def batch(self) -> KVCache | None:  # k, v [L, W, K, S, H], pos [W]
        return self.layout.batch

    @batch.setter
    def batch(self, batch: KVCache | None) -> None:
        self.layout.batch = batch

    @property
    def spare(self) -> KVCache | None:  # an idle bigger batch (see kv_bytes_held)
        return self.layout.spare

    def submit(self, request: Request) -> None:
        """Queue a request; its events reach its sink from `step()` (a bad one: one error event)."""
        if len(request.samplings) > self.max_batch:
            request.sink.error(JaxsmolError(f"at most {self.max_batch} choices per request (max_batch), "
                                            f"got {len(request.samplings)}"))
            return
        self.pending.append(request)

    @property
    def live_rows(self) -> int:
        return self.layout.live

    @property
    def free_rows(self) -> int:
        """Decode rows neither live nor held by a prompt being prefilled."""
        return self.max_batch - self.live_rows - sum(p.request.decode_rows for p in self.prefills)

    @property
    def has_work(self) -> bool:
        return bool(self.pending or self.prefills or self.saves or self.live_rows)

    @property
    def kv_bytes_held(self) -> int:
        """The batch's bytes and the spare's (kept for the next burst: 8 x 512 fresh slots took 65-200 ms),
        and the live rows' draft caches (a draft model's)."""
        drafts = sum(r.drafts.nbytes for r in self.rows if r is not None and r.drafts is not None)
        return drafts + sum(b.nbytes for b in (self.batch, self.spare) if b is not None)

    def figures(self) -> dict:
        """What /metrics shows of the batch (see cli/server/metrics.py)."""
        return {"rows": self.live_rows, "width": len(self.rows), "pending": len(self.pending),
                "kv_bytes": self.kv_bytes_held, "steps": self.stats.steps,
                "decoded_tokens": self.stats.decoded_tokens, "prefilled_tokens": self.stats.prefilled_tokens,
                "speculation": {k: tuple(v) for k, v in self.stats.by_source.items()},
                **(self.speculator.draft.figures() if self.speculator and self.speculator.draft else {})}

    def compile_programs(self, slots: int = MIN_CAPACITY, stop=None) -> int:
        """Compile the batched programs ahead, from shapes alone (cache/scheduler/compile_ahead.py);
        returns how many."""
        return compile_batched(self.engine, self.widths, slots, stop, side_by_side=self.side_by_side_most)

    def step(self) -> None:
        """One round: admit and prefill newcomers (else one chunk of an answer being stored), then one
        decode step of all rows."""
        self._drop_cancelled()
        busy = self._prefill_newcomers()
        if not busy and self.saves.may_run(rows_decoding=self.live_rows > 0):
            self.saves.step(self.settings.step_rows(self.live_rows > 0))
            busy = True
        if self.live_rows:
            # timed where nothing ran before it that it may wait for (a chunk, an insert, a relayout)
            self._decode(timed=not busy and self.stats.relayouts == self._relayouts)
        if not (self.batch_invariant or self.prefills):
            self.layout.maybe_shrink()

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
            for group in group_chunks(todo, lambda c: (c[1], c[0].kv.capacity), self.side_by_side_most):
                self._prefill_group(group)
        return True

    def _rows_left(self, p: Prefill) -> int:  # prompt positions not yet in p.kv
        return len(p.lookup.prompt) - int(p.kv.pos)

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
        """Whether decode rows (and memory for them) will be free for req's choices, counting the
        requests already being prefilled as holding theirs."""
        need = req.decode_rows
        held = [p.request for p in self.prefills if p.request.decode_rows]
        rows = self.live_rows + sum(r.decode_rows for r in held) + need
        if rows > self.max_batch:
            return False
        if not need:
            return True
        width = self.settings.width_for(rows)
        capacity = max([r.capacity for r in held + [req]]
                       + [self.batch.capacity if self.batch is not None and self.live_rows else 0])
        return self.live_rows + len(held) == 0 or width * capacity * self.kv_bytes_per_token <= self.kv_bytes

    def _begin(self, req: Request) -> None:
        started, cfg = time.perf_counter(), self.engine.cfg
        constraints = [constraint_for(self.engine.tokenizer, cfg.eos_ids, cfg.vocab_size, sp.structured)
                       for sp in req.samplings]  # a bad spec fails here, before any model work
        lk = self.cache.lookup(req.prompt_ids, max(sp.max_tokens for sp in req.samplings),
                               salt=req.salt, bypass=req.bypass)
        self.stats.admitted += 1
        slots = max(req.capacity, self.batch.capacity if self.batch is not None else 0)
        n, reused = len(lk.prompt), lk.report.reused
        try:
            if req.pin:
                self.cache.pins.check(lk)  # before any work: a prompt that cannot be pinned is refused
            if reused and (reused < n or req.decode_rows):
                kv = self.engine.restore(lk.prefix, slots, reused, self.cache.exact_state(lk.prompt))
            else:
                kv = self.engine.new_cache(slots) if reused < n else None
        except BaseException:
            self.cache.release(lk)
            raise
        p = Prefill(req, lk, kv, constraints, started)
        self.prefills.append(p)
        if reused == n:  # an exact full hit: the stored logits stand in for the forward
            self._prompt_done(p, jnp.asarray(lk.logits, jnp.float32)[None])

    def _prefill_group(self, group: list[tuple[Prefill, int]]) -> None:
        """One chunk of T padded rows of each prompt in group (one T), side by side when more than one."""
        prefills, T = [p for p, _ in group], group[0][1]
        try:
            if len(group) == 1:
                logits, prefills[0].kv = self.engine.prefill_chunk(prefills[0].lookup.prompt, prefills[0].kv, T,
                                                                   exact=self._exact(prefills[0]))
            else:
                logits, kvs = self.engine.prefill_side_by_side([p.lookup.prompt for p in prefills],
                                                               [p.kv for p in prefills], T)
                for p, kv in zip(prefills, kvs):
                    p.kv = kv
            done = [(p, logits[i:i + 1]) for i, p in enumerate(prefills) if int(p.kv.pos) >= len(p.lookup.prompt)]
        except Exception as e:  # a failure costs these requests, never the others
            for p in prefills:
                self._abort_prefill(p, e)
            return
        self.stats.prefill_calls += 1
        for p, logits in done:
            self._prompt_done(p, logits)

    def _exact(self, p: Prefill) -> bool:
        return self.cache.exact or not p.lookup.report.reused  # a cold prefill is always exact

    def _abort_prefill(self, p: Prefill, error: Exception | None) -> None:
        self.prefills.remove(p)
        self.cache.release(p.lookup)
        self.engine.recycle(p.kv)
        if error is not None:
            p.request.sink.error(error)

    def _prompt_done(self, p: Prefill, logits: jax.Array) -> None:
        """p's prompt is in p.kv and `logits` [1, V] follow it: store it, sample each choice's first
        token, and give every choice that goes on a decode row."""
        req, lk = p.request, p.lookup
        prefill_s = time.perf_counter() - p.started
        want, m = max(sp.logprobs for sp in req.samplings), len(req.samplings)
        out = jax.device_get(programs.sample_first(  # (a broadcast is an eager op: ~10 ms the first time)
            logits if m == 1 else jnp.broadcast_to(logits, (m, logits.shape[-1])),
            row_settings(req.samplings, [0] * m, p.constraints, free_mask(self.engine.cfg.vocab_size, m)),
            logprobs=want > 0))
        ttft = time.perf_counter() - req.submitted
        kept = np.array(np.asarray(logits)[0]) if req.detail else None
        rows = []
        drafts = self.speculator.drafter(self.cache, lk, max(sp.max_tokens for sp in req.samplings)) if (
            self.speculator) else lambda: None
        for i, (index, sp) in enumerate(zip(req.indices, req.samplings)):
            rows.append(Row(req, lk, index, TokenStream(self.engine.tokenizer, sp, self.engine.cfg.eos_ids), ttft,
                            p.constraints[i], prefill_s, kept, drafts()))
            if sp.max_tokens:  # max_tokens 0: the prompt alone (it is stored, nothing is sampled)
                rows[-1].push(out, i)
        # stored once the first tokens are out, not on their time to first token (a fresh host copy
        # of a 700-token prompt: ~70 ms), and before a finished choice's answer extends it
        self.cache.save_prompt(lk, p.kv, logits)
        refused = self._pin(req, lk)
        prefilled = len(lk.prompt) - lk.report.reused
        self.cache.finish(lk, prefilled)
        self.cache.release(lk)
        self.stats.prefilled_tokens += prefilled
        if refused is not None:
            req.sink.error(refused)
            rows = []
        going_on = []
        for row, sp in zip(rows, req.samplings):
            if row.stream.done or sp.max_tokens == 0:
                self._finish(row)
            else:
                going_on.append(row)
        if going_on:
            self._insert(going_on, p.kv)
        self.engine.recycle(p.kv)
        self.prefills.remove(p)

    def _pin(self, req: Request, lk) -> JaxsmolError | None:
        """Pin a pin request's prompt, stored just now (cache/pins.py); the error if it cannot be."""
        try:
            if req.pin:
                self.cache.pins.pin(lk.ns, lk.prompt)
        except JaxsmolError as e:
            return e
        return None

    # ---- decode rows ---------------------------------------------------------------------------------
    def _insert(self, rows: list[Row], kv: KVCache) -> None:
        """Write the prompt state `kv` [L, 1, K, S, H] into one free decode row per choice, the batch
        grown first where needed (with room for the choices waiting or being prefilled too)."""
        coming = list(self.pending) + [p.request for p in self.prefills if p.request is not rows[0].request]
        self.layout.insert(rows, kv, waiting=sum(r.decode_rows for r in coming))

    def _decode(self, timed: bool = True) -> None:
        """One decode step of every live row (a verify step where rows drafted tokens: speculation.py),
        then each row's host side (its tokens' stream, stop strings, events). (Dispatching the next
        step before reading this one, as vLLM's async scheduling does, gave no steady gain on two
        cores: docs/design.md, the scheduler.)"""
        live = [(i, r) for i, r in enumerate(self.rows) if r is not None]
        want = any(r.stream.sp.logprobs for _, r in live)
        plan = self.speculator.plan(self.rows, self.batch.capacity, lambda t: self.verify_programs.ready(
            len(self.rows), self.batch.capacity, t, want)) if self.speculator else None
        free = free_mask(self.engine.cfg.vocab_size, len(self.rows))
        started = time.perf_counter()
        try:
            out, self.batch = run_step(self.engine, self.batch, self.rows, plan, free, want)
        except Exception as e:  # the batch is lost: fail its requests, keep serving
            for _, r in live:
                r.request.sink.error(e)
            self.batch, self.rows = None, []
            return
        self._relayouts = self.stats.relayouts
        if self.speculator and timed and not self.verify_programs.compiling:  # (a compile shares the cores)
            self.speculator.timed(len(self.rows), 1 if plan is None else plan[0], time.perf_counter() - started)
        self.stats.steps += 1
        for i, r in live:
            n = 1 if plan is None else int(out["count"][i])
            if plan is not None:
                self.speculator.verified(r, len(plan[1][i]), n - 1)
                self.stats.verified(r.draft_source, len(plan[1][i]), n - 1)
            try:  # the step's new tokens, up to where the row's stream ends
                self.stats.decoded_tokens += r.take([out] if plan is None else [column(out, j) for j in range(n)], i)
            except Exception as e:  # (its grammar refused a token) this row's request fails, no other
                self.rows[i] = None
                r.release()
                r.request.sink.error(e)
                continue
            if r.stream.done:
                self.rows[i] = None
                self._finish(r)

    def _finish(self, row: Row) -> None:
        s, lk = row.stream, row.lookup
        row.release()
        row.request.sink.done(row.finished())
        if s.finish_reason and self.cache.wants_answer(lk, s.output_ids):
            save = self.cache.begin_answer(lk, s.output_ids)
            if save is not None:
                self.saves.add(save)

    def _drop_cancelled(self) -> None:
        for i, r in enumerate(self.rows):
            if r is not None and r.request.sink.cancelled():
                r.release()
                self.rows[i] = None
        for p in [p for p in self.prefills if p.request.sink.cancelled()]:
            self._abort_prefill(p, None)
