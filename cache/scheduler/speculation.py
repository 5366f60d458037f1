"""Speculative decoding's host side: drafts for a decode row, when to verify them, and one step's run
(a plain decode step's inputs or a verify step's).

A row drafts the tokens that followed the last time its newest n-gram appeared in what the prefix
cache stored after its prompt and in its own prompt and output (prompt lookup: `NgramDrafts`), or
the tokens its grammar forces (jump-forward: `Row.draft`); a step then runs every row's last token and its drafts in one
forward (`programs.verify_step`), each position with a decode step's bits and sampled with its own
step's key, and each row keeps its drafts while they equal what was sampled before them. So the
tokens, logprobs and KV are the ones plain decoding would have produced, bit for bit; speculation only
changes how many tokens one pass over the weights yields (docs/design.md, "Speculation").

A step verifies only where that is expected to pay (`Speculator`): each row's chance of accepting a
drafted token is estimated from what it accepted before and from what drafts of the same source were
accepted lately (its prior), and each step shape's time (rows x positions) is measured as it runs,
so open-ended text (drafts rarely accepted) decodes one token per step and a wide batch verifies
only where many rows copy.
"""

from __future__ import annotations

import weakref

import numpy as np

from jaxsmol.cache.scheduler.speculation_modes import SPECULATE_MODES, VERIFY_ROWS  # noqa: F401 (the API's)
from jaxsmol.errors import JaxsmolError
from jaxsmol.runtime.batch import free_mask, row_settings
from jaxsmol.runtime.sampling import SamplingParams

# where drafts come from: the prefix cache, the row's own tokens, a draft model, the grammar (forced)
SOURCES = ("cache", "ngram", "draft", "grammar")
NGRAM_SIZES = (4, 3)  # the longest n-gram found is used (2-grams drafted more and were accepted less)
FORCED_CHANCE = 0.99  # a token the grammar forces: another tokenization of its text is still possible
DECAY = 0.9  # the weight a row's earlier drafts keep at each of its drafts (see Speculator.chance)
SOURCE_DECAY = 0.99  # the weight a source's earlier verify steps keep at each of its verify steps
PRIOR = 2.0  # the weight, in drafts, of a source's record in a row's chance
MEASURED = 0.2  # the weight of the newest time of a step shape in its running estimate
RETIME_AFTER = 512  # steps after which a verify shape's time is measured afresh (see StepTimes): ~1% of them


def speculating(settings, cfg, draft: bool = False) -> str | None:
    """What a scheduler with these BatchSettings drafts from ("ngram", "cache" or "draft"; None: it does
    not), for a model of this Config, `draft` whether a draft model is given. "auto": "draft" with a
    draft model, else "cache" where the CPU kernels run; any mode only there (a verify step has a decode
    step's bits only with them)."""
    mode = settings.speculate
    if mode == "auto":
        mode = "draft" if draft else "cache" if cfg.cpu_kernels else "none"
    if draft and mode != "draft":
        raise JaxsmolError(f"a draft model drafts only with --speculate draft or auto, not {mode}")
    if mode == "draft" and not draft:
        raise JaxsmolError("--speculate draft needs a draft model (--draft-model PATH)")
    if mode == "none":
        return None
    if not cfg.cpu_kernels:
        raise JaxsmolError(f"--speculate {mode} needs the CPU kernels (its verify step has a decode "
                           "step's bits only with them); use --speculate auto or none here")
    return mode


def _index(seen: dict, tokens: list[int], new) -> None:
    """Append `new` to tokens, recording in `seen` each n-gram's latest position (of the token after it)."""
    for token in new:
        i = len(tokens)  # token i follows every n-gram ending at i
        for n in NGRAM_SIZES:
            if i >= n:
                seen[tuple(tokens[i - n:i])] = i
        tokens.append(int(token))


class NgramDrafts:
    """A row's drafts by n-gram lookup in a reference (what the prefix cache stored after the row's
    prompt: an earlier answer to it) and in its own tokens (prompt, then output so far); and its record."""

    nbytes = 0  # device memory held (a draft model's drafter holds its cache)

    def __init__(self, prompt, most: int, reference=()):
        self.tokens: list[int] = []
        self.seen: dict[tuple[int, ...], int] = {}  # n-gram -> where the token after its latest occurrence is
        self.ref: list[int] = []
        self.ref_seen: dict[tuple[int, ...], int] = {}  # the same over the prompt's tail + the reference
        if len(reference):
            _index(self.ref_seen, self.ref, list(prompt[-max(NGRAM_SIZES):]) + list(reference))
        self.most, self.source = most, "ngram"  # source: where the last drafts came from (SOURCES)
        self.accepted = self.rejected = 0.0  # decayed counts of accepted drafts and of rejections
        self.extend(prompt)

    def extend(self, tokens) -> None:
        _index(self.seen, self.tokens, tokens)

    def sync(self, output_ids: list[int], prompt_n: int) -> None:
        """Take in the row's output tokens not yet seen."""
        self.extend(output_ids[len(self.tokens) - prompt_n:])

    def draft(self, most: int, run_model: bool = True) -> list[int]:
        """Up to `most` tokens that followed the newest n-gram's latest earlier occurrence, in the
        reference first (none when no n-gram recurs; a lookup: made whatever `run_model` says). Each
        draft ages the row's record, so a row that stopped being verified comes back to its source's
        chance and is tried again."""
        for n in NGRAM_SIZES:
            key = tuple(self.tokens[-n:]) if len(self.tokens) >= n else None
            for source, seen, tokens in (("cache", self.ref_seen, self.ref), ("ngram", self.seen, self.tokens)):
                at = seen.get(key)
                if at is not None and at < len(tokens):
                    self.accepted, self.rejected = self.accepted * DECAY, self.rejected * DECAY
                    self.source = source
                    return tokens[at:at + min(most, self.most)]
        return []

    def verified(self, drafted: int, accepted: int) -> None:
        self.accepted += accepted
        self.rejected += accepted < drafted

    def release(self) -> None:
        """(Nothing held beyond the row's tokens.)"""


def expected(chance: float, k: int) -> float:
    """Tokens expected accepted of k drafts, each accepted with `chance` after the one before it."""
    return sum(chance ** i for i in range(1, k + 1))


class StepTimes:
    """Each step shape's time, (width, positions per row): a plain step's in seconds, a verify step's
    over a plain step's of its width (a ratio: the machine's speed swings move both), running
    estimates, and when each was last measured. A verify shape not timed for RETIME_AFTER steps
    counts as untimed again, so that one timed on a busy machine (beside a compile) is tried again
    rather than never chosen."""

    def __init__(self):
        self.seconds: dict[tuple[int, int], float] = {}  # (width, 1): seconds; (width, T > 1): ratios
        self.seen: set[tuple[int, int]] = set()  # shapes run once (a first run compiles: not timed)
        self.when: dict[tuple[int, int], int] = {}  # shape -> the step count when it was last timed
        self.steps = 0

    def stale(self, key: tuple[int, int]) -> bool:
        """Whether the shape was not timed for RETIME_AFTER steps (or never)."""
        return key not in self.seconds or self.steps - self.when[key] > RETIME_AFTER

    def estimate(self, key: tuple[int, int], plain: float) -> float:
        """The shape's time; untimed or stale: a guess a little above a plain step's, so that it is tried."""
        if self.stale(key):
            return plain * (1 + 0.05 * (key[1] - 1))
        return plain * self.seconds[key]

    def timed(self, key: tuple[int, int], seconds: float) -> None:
        self.steps += 1
        plain = self.seconds.get((key[0], 1))
        if key not in self.seen or (key[1] > 1 and plain is None):
            self.seen.add(key)
            return
        value = seconds if key[1] == 1 else seconds / plain
        old = self.seconds.get(key)
        fresh = old is None or self.steps - self.when[key] > RETIME_AFTER
        self.seconds[key] = value if fresh else old + MEASURED * (value - old)
        self.when[key] = self.steps


class SourceRecords:
    """Each draft source's decayed [accepted, rejections]: the prior of a row's chance. One not verified
    for RETIME_AFTER steps starts again from its first record, so that a source written off (on text
    that did not repeat, or beside a compile) is tried again rather than never."""

    # a draft model of the target's family agrees with it on most tokens (the bundled Q4_1 drafting for its
    # float32 weights: 90% of drafts accepted on open text); n-gram sources start even
    FIRST = {"draft": (3.0, 1.0)}

    def __init__(self):
        self.records = {s: list(self.FIRST.get(s, (1.0, 1.0))) for s in SOURCES}
        self.when = dict.fromkeys(SOURCES, 0)  # source -> the step count when it was last verified

    def prior(self, source: str, steps: int) -> float:
        if steps - self.when[source] > RETIME_AFTER:
            self.records[source] = list(self.FIRST.get(source, (1.0, 1.0)))
        accepted, rejected = self.records[source]
        return accepted / (accepted + rejected)

    def verified(self, source: str, drafted: int, accepted: int, steps: int) -> None:
        record = self.records[source]
        record[0] = record[0] * SOURCE_DECAY + accepted
        record[1] = record[1] * SOURCE_DECAY + (accepted < drafted)
        self.when[source] = steps


# engine -> what its speculation measured (StepTimes, SourceRecords)
_LEARNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Speculator:
    """Which verify step, if any, the batch runs next: the shape whose expected new tokens per second
    is highest, plain decoding included, from each row's record and each shape's measured time."""

    def __init__(self, engine=None, adaptive: bool = True, most: int = VERIFY_ROWS[-1] - 1, from_cache: bool = True,
                 draft=None):
        # one table per engine, so that a library call's scheduler starts from what earlier ones measured
        learned = (StepTimes(), SourceRecords())
        self.times, self.sources = _LEARNED.setdefault(engine, learned) if engine is not None else learned
        self.most, self.from_cache = most, from_cache  # drafts a row verifies at most; drafts from the cache
        self.draft = draft  # a DraftModel (draft_model.py), or None: drafts by n-gram lookup
        self.adaptive = adaptive  # False: verify whenever a row drafts (the tests' way to exercise it)

    def drafter(self, cache, lookup, max_tokens: int):
        """What makes each new decode row's drafter for a prompt (`lookup`): NgramDrafts over its tokens and
        what the prefix cache stored after it (read once for the request's choices), within a draft
        model's ModelDrafts where there is one."""
        reference = cache.continuation(lookup, max_tokens) if self.from_cache else []
        if self.draft is not None:
            return lambda: self.draft.drafts(lookup, max_tokens, NgramDrafts(lookup.prompt, self.most, reference))
        return lambda: NgramDrafts(lookup.prompt, self.most, reference)

    def plan(self, rows: list, W: int, capacity: int, ready=lambda positions: True
             ) -> tuple[int, list[list[int]]] | None:
        """(T, each row's drafts) for a verify step of T positions per row (one of VERIFY_ROWS, every
        row's pos + T within the capacity, `ready(T)`: its program compiled) over the live `rows` at
        width W, or None for a plain decode step. A draft model's drafts are made only once a verify
        step is chosen, for its T - 1 (their cost counted in the choice)."""
        plain = self.times.seconds.get((W, 1))
        room = min(capacity - r.position for r in rows)
        fits = [t for t in VERIFY_ROWS if t <= room]
        # a plain step timed long ago is timed afresh (verify times are ratios to it: one timed beside a
        # background compile made every verify shape look cheap)
        if (self.adaptive and self.times.stale((W, 1))) or not fits:
            return None
        # None: a draft model's, for as many as the row has room for (Row.room)
        drafts = [r.draft(fits[-1] - 1, run_model=False) if r.drafts is not None else [] for r in rows]
        lengths = [r.room(fits[-1] - 1) if d is None else len(d) for r, d in zip(rows, drafts)]
        if not self.adaptive:
            longest = max(lengths)
            return (self._made(rows, drafts, next(t for t in fits if t > longest)) if longest else None)
        best, best_rate = None, len(rows) / plain
        for t in fits:
            gain = sum(expected(self.chance(r), min(n, t - 1)) for r, n in zip(rows, lengths) if n)
            if gain == 0:
                break
            if not ready(t):
                continue
            # the rows a draft model drafts for; a row's first draft prefills its prompt into its draft row,
            # which holds up the rows beside it (counted) and alone serves its later drafts (not counted)
            cost = sum(self.draft.seconds(t - 1, plain, r.drafts.behind if len(rows) > 1 else 0)
                       for r, d, n in zip(rows, drafts, lengths) if d is None and n > 0)
            rate = (len(rows) + gain) / (self.times.estimate((W, t), plain) + cost)
            if rate > best_rate:
                best, best_rate = t, rate
        return None if best is None else self._made(rows, drafts, best)

    @staticmethod
    def _made(rows: list, drafts: list, T: int) -> tuple[int, list[list[int]]]:
        """(T, every row's drafts for it): a draft model's made now, for T - 1 positions."""
        return T, [r.draft(T - 1) if d is None else d[:T - 1] for r, d in zip(rows, drafts)]

    def timed(self, width: int, positions: int, seconds: float) -> None:
        """A step of this shape took `seconds` (its first run, which compiles, is left out)."""
        self.times.timed((width, positions), seconds)

    def chance(self, row) -> float:
        """The estimated chance that a token of row's last drafts is accepted, given the one before it
        was: the row's accepted over its accepted and rejections (a geometric model), with its drafts'
        source's record as the prior (tokens a grammar forces: FORCED_CHANCE)."""
        if row.draft_source == "grammar":
            return FORCED_CHANCE
        prior = self.sources.prior(row.draft_source, self.times.steps)
        d = row.drafts
        return (d.accepted + PRIOR * prior) / (d.accepted + d.rejected + PRIOR)

    def verified(self, row, drafted: int, accepted: int) -> None:
        """Row's drafts of the last step: `accepted` of `drafted` were; its record and its source's."""
        if not drafted:
            return
        row.drafts.verified(drafted, accepted)
        self.sources.verified(row.draft_source, drafted, accepted, self.times.steps)


def _settings(rows: list, W: int, vocab_size: int, constraints: bool) -> dict:
    """The sampling arrays of a step over `rows` padded to W entries (padding: greedy, unconstrained)."""
    pad = W - len(rows)
    return row_settings([r.stream.sp for r in rows] + [SamplingParams()] * pad,
                        [len(r.stream.output_ids) for r in rows] + [0] * pad,
                        [r.constraint if constraints else None for r in rows] + [None] * pad,
                        free_mask(vocab_size, W))


def run_step(arena, rows: list, W: int, plan, vocab_size: int) -> dict:
    """One step of the live `rows` (Row) at width W, padding entries writing the arena's pad row: a
    plain decode step (plan None), else the verify step of `plan` (Speculator.plan). Returns its output
    on the host (entry i: rows[i])."""
    slots = [r.slot for r in rows] + [arena.pad] * (W - len(rows))
    if plan is None:
        tokens = np.zeros((W,), np.int32)
        tokens[:len(rows)] = [r.stream.output_ids[-1] for r in rows]
        return arena.decode(slots, tokens, _settings(rows, W, vocab_size, constraints=True))
    T, drafts = plan
    tokens, lengths = np.zeros((W, T), np.int32), np.ones((W,), np.int32)
    settings = _settings(rows, W, vocab_size, constraints=False)
    allowed = np.repeat(np.asarray(settings["allowed"])[:, None], T, axis=1)
    for i, (r, d) in enumerate(zip(rows, drafts)):
        tokens[i, :1 + len(d)] = [r.stream.output_ids[-1], *d]
        lengths[i] = 1 + len(d)
        if r.constraint is not None:  # a constrained row's mask at each of its positions, given the drafts
            allowed[i, :1 + len(d)] = r.constraint.masks_along(d)
    settings["allowed"] = allowed
    return arena.verify(slots, tokens, lengths, settings)


def column(out: dict, j: int) -> dict:
    """Position j of a verify step's output, in a decode step's form (per row)."""
    return {k: v[:, j] for k, v in out.items() if k != "count"}
