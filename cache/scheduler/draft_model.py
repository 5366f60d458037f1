"""A draft model's drafts (`--draft-model`, `speculate="draft"`): a smaller model with the target's tokenizer
proposes each decode row's next tokens, greedily; the target verifies them in one exact step
(speculation.py), so the output is the target's, bit for bit, whatever the draft proposes.

Each row drafting keeps the draft's KV state of its tokens in a row of the draft engine's own KV arena
(jaxsmol/runtime/kv_arena.py), taken when the row first drafts: its prompt's state is looked up in the
draft's prefix cache (a PrefixCache over the draft engine, the request's salt, its byte budget the
target cache's in proportion to the bytes of a position), restored, the rest prefilled and stored, as
the target's prompt is. At each draft call the row takes in the tokens it has not seen (the last one
sampled; also the last draft where all were accepted) and runs k - 1 greedy steps after them
(programs.greedy_drafts, one call). Its position then moves back to what the target accepted: the KV
of rejected drafts is overwritten later, never read.
"""

from __future__ import annotations

import time

import numpy as np

from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.records import Lookup
from jaxsmol.cache.scheduler.speculation import DECAY, MEASURED, VERIFY_ROWS, NgramDrafts
from jaxsmol.errors import JaxsmolError
from jaxsmol.runtime.arena_programs import ArenaShapes
from jaxsmol.runtime.chunks import FAST_BUCKETS
from jaxsmol.runtime.engine import Engine

FED_AT_ONCE = 2  # the tokens a draft call feeds before its greedy steps (more: a prefill first)
DRAFT_STEPS = tuple(t - 1 for t in VERIFY_ROWS)  # a draft call's k (its programs), the drafts cut to those asked
# n-gram drafts are used while their acceptance is at least this share of the draft model's: they cost
# nothing to make, where a draft call of 7 took as long as a plain step of the float32 135M target
# (measured: turn 2 and json 2.9x with them first, 1.9-2.5x when the model's higher acceptance won)
LOOKUP_SHARE = 0.5
# a prompt token prefilled into a row's draft cache, guessed against a drafted token until measured: low,
# so that first drafts are tried (measured for the bundled Q4_1 file drafting its float32 weights: 0.8 ms
# a prompt token, where the drafted token's guess is 3.4 ms; a prefill chunk runs its tokens side by side)
PREFILL_SHARE = 1 / 16


def check_pair(draft: Engine, target: Engine) -> None:
    """Refuse a draft model whose token ids do not mean the target's."""
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise JaxsmolError(f"the draft model's vocabulary ({draft.cfg.vocab_size} ids) is not the target's "
                           f"({target.cfg.vocab_size}): a draft model needs the same tokenizer")
    if draft.tokenizer is not None and target.tokenizer is not None and (
            draft.tokenizer.fingerprint != target.tokenizer.fingerprint):
        raise JaxsmolError("the draft model's tokenizer is not the target's (tokenizer.json or chat template "
                           "differ): a draft model needs the same tokenizer")


class DraftModel:
    """A draft engine, its KV arena and prefix cache, and the measured cost of its draft calls, for one
    target cache and a scheduler of `rows` decode rows."""

    def __init__(self, engine: Engine, target: PrefixCache, rows: int = 16):
        check_pair(engine, target.engine)
        self.engine, self.arena = engine, engine.arena(rows)
        self.lease = self.arena.lease()
        share = engine.kv_bytes_per_token / target.engine.kv_bytes_per_token  # as many positions as the target's
        self.cache = PrefixCache(engine, mode="off" if target.mode == "off" else "radix",
                                 budget_bytes=int(target.budget_bytes * share), salt=target.salt,
                                 save_generated=False, exact=False)
        # until measured, a drafted token costs a plain target step's time in the share of the weights' bytes
        self.share = engine.params.nbytes / target.engine.params.nbytes
        self._seconds: dict[int | str, float] = {}  # k -> a draft call's running estimate; "token": a prefill's
        self._seen: set[int | str] = set()  # run once (its first call compiles: not timed)

    def drafts(self, lookup: Lookup, max_tokens: int, lookups: NgramDrafts | None = None) -> ModelDrafts:
        """A new decode row's drafter (its cache is made at its first draft), n-gram `lookups` first."""
        return ModelDrafts(self, lookup, max_tokens, lookups)

    def figures(self) -> dict:
        """Its prefix cache's bytes (counted in the daemon's memory; its arena's, with the batch's KV)."""
        return {"draft_cache_bytes": self.cache.bytes_held}

    def seconds(self, k: int, plain: float, behind: int = 0) -> float:
        """A draft call of k tokens' time, with `behind` prompt tokens to prefill first (a row's first draft):
        measured, else a guess from a plain target step's `plain`."""
        call = self._seconds.get(k, self.share * k * plain)
        return call + behind * self._seconds.get("token", self.share * PREFILL_SHARE * plain)

    def calls(self) -> list:
        """What its rows run, as (program, args, kwargs) calls (programs.compile_all; the daemon's
        warm-up): prompt chunks at the fast path's lengths, draft calls of each k, restores and saves."""
        a = ArenaShapes.of(self.arena)
        return [a.prefill(1, T) for T in FAST_BUCKETS] + [a.drafts(FED_AT_ONCE, k) for k in DRAFT_STEPS] + a.copies()

    def start(self, lookup: Lookup, max_tokens: int) -> int:
        """A draft arena row holding lookup's prompt: its stored prefix restored, the rest prefilled and
        stored. Raises JaxsmolError where the draft cannot take the prompt (its context is shorter) or
        has no free row."""
        salt = None if lookup.ns is None else lookup.ns[1]
        lk = self.cache.lookup(lookup.prompt, max_tokens, salt=salt, bypass=lookup.ns is None)
        n, reused, row = len(lk.prompt), lk.report.reused, None
        try:
            row = self.cache.device.row_for(self.lease, lk.match, reused, n + max_tokens, lk.parts)
            self.cache.release(lk)
            if reused < n:
                started = time.perf_counter()
                logits = self.arena.fill(row, lk.prompt, exact=False)
                self._timed("token", (time.perf_counter() - started) / (n - reused))
                self.cache.save_prompt(lk, self.arena.view(row), logits)
            self.cache.finish(lk, n - reused)
        except BaseException:
            if row is not None:
                self.lease.give(row)
            raise
        finally:
            self.cache.release(lk)
        return row

    def run(self, row: int, tokens: list[int], fed: int, k: int) -> list[int]:
        """k (one of DRAFT_STEPS) greedy drafts after `tokens`, of which the row holds the first `fed`.
        Needs len(tokens) + k <= the arena's slots."""
        self.arena.pos[row] = fed
        if len(tokens) - fed > FED_AT_ONCE:  # after plain steps: their tokens (not the call's time: their steps')
            self.arena.fill(row, tokens[:-1], exact=False)
            fed = len(tokens) - 1
        started = time.perf_counter()
        chunk = np.zeros((1, FED_AT_ONCE), np.int32)
        chunk[0, :len(tokens) - fed] = tokens[fed:]
        drafts = self.arena.greedy_drafts(row, chunk, len(tokens) - fed, k)
        self._timed(k, time.perf_counter() - started)
        return drafts

    def _timed(self, k: int | str, seconds: float) -> None:
        if k not in self._seen:
            self._seen.add(k)
            return
        old = self._seconds.get(k)
        self._seconds[k] = seconds if old is None else old + MEASURED * (seconds - old)


def _rate(accepted: float, rejected: float) -> float:
    """A record's acceptance, from even (what ModelDrafts compares its two sources by)."""
    return (accepted + 1) / (accepted + rejected + 2)


class ModelDrafts:
    """A row's drafts from a draft model (the drafter interface of speculation.NgramDrafts), its draft
    cache, and its record; where an n-gram recurs (`lookups`: the row's own tokens and what the prefix
    cache stored after its prompt) those drafts come first (free to make, and copied text is where they
    are accepted most) while their record is at least LOOKUP_SHARE of the draft model's."""

    def __init__(self, model: DraftModel, lookup: Lookup, max_tokens: int, lookups: NgramDrafts | None = None):
        self.model, self.lookup, self.max_tokens, self.lookups = model, lookup, max_tokens, lookups
        self.output: list[int] = []
        self.row: int | None = None  # its row of the draft arena, from its first draft
        self.fed = 0  # the row's tokens whose state its draft row holds
        self.unsure = 0  # drafts fed to the draft model at its last call (kept in kv as far as accepted)
        self.failed = False  # the draft model cannot take this prompt: no drafts
        self.source = "draft"  # of the last drafts: "draft", or the lookups' source
        self.record = [0.0, 0.0]  # the draft model's decayed counts of accepted drafts and of rejections

    @property
    def accepted(self) -> float:  # of the last drafts' source (Speculator.chance)
        return self.record[0] if self.source == "draft" else self.lookups.accepted

    @property
    def rejected(self) -> float:
        return self.record[1] if self.source == "draft" else self.lookups.rejected

    @property
    def behind(self) -> int:
        """The prompt tokens its first draft call would prefill (its stored prefix is reused, but how much is
        known only at the lookup); 0 once started. (A catch-up after plain steps is not counted: it grows
        with every plain step, and a row charged for it would never draft again.)"""
        return len(self.lookup.prompt) if self.row is None and not self.failed else 0

    def sync(self, output_ids: list[int], prompt_n: int) -> None:
        self.output = output_ids
        if self.lookups is not None:
            self.lookups.sync(output_ids, prompt_n)

    def draft(self, most: int, run_model: bool = True) -> list[int] | None:
        """Up to `most` drafts: an n-gram lookup's where one recurs (and lookups fare nearly as well as
        the model), else the draft model's (None with `run_model` False: made once a verify step is chosen)."""
        found = self.lookups.draft(most) if self.lookups is not None and most > 0 else []
        self.unsure = 0
        if found and _rate(self.lookups.accepted, self.lookups.rejected) >= LOOKUP_SHARE * _rate(*self.record):
            self.source = self.lookups.source
            return found
        self.source = "draft"
        if not run_model:
            return None
        if most <= 0 or self.failed:
            return []
        if self.row is None:
            try:
                self.row = self.model.start(self.lookup, self.max_tokens)
            except JaxsmolError:  # e.g. a prompt longer than the draft's context: decoded plainly
                self.failed = True
                return []
            self.fed = len(self.lookup.prompt)
        tokens = self.lookup.prompt + self.output
        fits = [k for k in DRAFT_STEPS if len(tokens) + k <= self.model.arena.slots]
        if not fits:
            return []
        k = min((k for k in fits if k >= most), default=fits[-1])
        drafts = self.model.run(self.row, tokens, self.fed, k)
        self.fed, self.unsure = len(tokens), k - 1
        self.record = [self.record[0] * DECAY, self.record[1] * DECAY]
        return drafts[:most]

    def release(self) -> None:
        """Hand its draft row back (once; later calls do nothing)."""
        if self.row is not None:
            self.model.lease.give(self.row)
        self.row, self.failed = None, True

    def verified(self, drafted: int, accepted: int) -> None:
        if self.source != "draft":
            self.lookups.verified(drafted, accepted)  # (the draft cache catches up at its next call)
            return
        self.fed += min(accepted, self.unsure)
        self.unsure = 0
        self.record[0] += accepted
        self.record[1] += accepted < drafted
