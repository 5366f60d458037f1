"""What the scheduler (cache/scheduler/scheduler.py) holds: per request a prompt being prefilled and a decode
row per choice (which feeds its tokens to its stream and sink); a prompt's first tokens; its counters."""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from jaxsmol.cache.records import Lookup
from jaxsmol.cache.scheduler.requests import ChoiceResult, Request, Timings
from jaxsmol.cache.scheduler.draft_model import ModelDrafts
from jaxsmol.cache.scheduler.speculation import NgramDrafts
from jaxsmol.runtime import programs
from jaxsmol.runtime.batch import free_mask, row_settings
from jaxsmol.runtime.sampling import SamplingParams
from jaxsmol.runtime.stream import TokenStream
from jaxsmol.runtime.structured import Constraint


@dataclasses.dataclass(eq=False)  # compared by identity (in self.prefills)
class Prefill:
    """An admitted request whose prompt is being prefilled into its arena row, a chunk per step (row
    None: an exact full hit whose choices decode nothing)."""
    request: Request
    lookup: Lookup
    row: int | None
    constraints: list  # per choice: its structured-output Constraint, or None
    started: float  # admitted (before its lookup)


@dataclasses.dataclass(eq=False)  # compared by identity (in the scheduler's live rows)
class Row:
    """A decode row: one choice of a request."""
    request: Request
    lookup: Lookup
    index: int
    stream: TokenStream
    ttft_s: float
    constraint: Constraint | None = None
    prefill_s: float = 0.0  # admission to the prompt's state computed
    prompt_logits: np.ndarray | None = None  # [V], kept where the request asked for detail
    drafts: NgramDrafts | ModelDrafts | None = None  # speculation's drafter (None: this row does not speculate)
    draft_source: str = "ngram"  # of the last drafts: one of speculation.SOURCES
    reserved: int = 0  # KV positions granted to it (its prompt, then GROW_SLOTS at a time: the scheduler's _grant)
    final: int = 0  # the most it can take: its prompt and its max_tokens
    slot: int = -1  # its row in the KV arena, once it decodes
    source: Row | None = None  # while it waits to fork: the row of its request it forks from

    @property
    def position(self) -> int:
        """The cache position its last token goes to (the tokens before it are in the cache)."""
        return len(self.lookup.prompt) + len(self.stream.output_ids) - 1

    def room(self, most: int) -> int:
        """Drafts the row may verify, at most `most`: one fewer than its max_tokens leaves."""
        return max(0, min(most, self.stream.sp.max_tokens - len(self.stream.output_ids) - 1))

    def draft(self, most: int, run_model: bool = True) -> list[int] | None:
        """Up to `most` drafted tokens, no more than `room` allows: under a grammar the tokens it forces
        (jump-forward) where there are any, else the drafter's (n-gram lookup, or a draft model's; with
        `run_model` False None stands for those, made later) as far as the grammar allows them;
        `draft_source` says which (speculation.SOURCES)."""
        s = self.stream
        most = self.room(most)
        self.drafts.sync(s.output_ids, len(self.lookup.prompt))
        forced = self.constraint.forced()[:most] if self.constraint is not None and most > 0 else []
        if forced:
            self.draft_source = "grammar"
            return forced
        drafts = self.drafts.draft(most, run_model)
        self.draft_source = self.drafts.source
        if drafts is None:
            return None
        return drafts if self.constraint is None else drafts[:self.constraint.valid_prefix(drafts)]

    def release(self) -> None:
        """Hand back what its drafter holds (a draft model's cache), once the row is done."""
        if self.drafts is not None:
            self.drafts.release()

    def push(self, out: dict, i: int) -> None:
        """Feed this row's sampled token (entry i of a step's output, with its logprobs if asked) to
        its stream, its structured-output constraint and its request's sink."""
        k = self.stream.sp.logprobs
        logprob, top = None, None
        if k:
            logprob = float(out["logprob"][i])
            top = [(int(a), float(b)) for a, b in zip(out["top_ids"][i][:k], out["top_logprobs"][i][:k])]
        token = int(out["tokens"][i])
        if self.constraint is not None:
            self.constraint.advance(token)
        self.request.sink.token(self.index, self.stream.push(token, logprob, top))

    def take(self, outs: list[dict], i: int) -> int:
        """Push the step's tokens for this row (entry i of each position's output) until its stream ends;
        returns how many it took."""
        for n, out in enumerate(outs, 1):
            self.push(out, i)
            if self.stream.done:
                return n
        return len(outs)

    def finished(self) -> ChoiceResult:
        """This row's result so far (its stream's tokens, text, finish reason and timings)."""
        s, lk, n = self.stream, self.lookup, len(self.lookup.prompt)
        total = time.perf_counter() - self.request.submitted
        timings = Timings(prompt_tokens=n, reused_tokens=lk.report.reused, prefilled_tokens=n - lk.report.reused,
                          generated_tokens=len(s.output_ids), prefill_s=self.prefill_s,
                          ttft_s=self.ttft_s if s.output_ids else total,
                          decode_s=total - self.ttft_s if s.output_ids else 0.0, total_s=total)
        return ChoiceResult(index=self.index, prompt_tokens=n, cached_tokens=lk.report.reused,
                            kept_tokens=lk.report.kept, stop_string=s.stop_string, output_ids=list(s.output_ids),
                            text=s.text, finish_reason=s.finish_reason or "length",
                            logprobs=list(s.logprobs), timings=timings, prompt_logits=self.prompt_logits,
                            report=lk.report if self.request.detail else None)


def first_tokens(logits, samplings: list[SamplingParams], constraints: list, vocab_size: int,
                 widths: tuple[int, ...]) -> dict:
    """Each choice's first token from a prompt's logits [1, V] (and its log-probabilities), on the host:
    one sample_first of the narrowest width on the ladder that holds the choices, padded with greedy
    rows (the ladder's widths are its programs: the choices' count is data)."""
    m = len(samplings)
    N = next((w for w in widths if w >= m), m)
    pad = N - m
    settings = row_settings(list(samplings) + [SamplingParams()] * pad, [0] * N, list(constraints) + [None] * pad,
                            free_mask(vocab_size, N))
    return jax.device_get(programs.sample_first(logits, settings))


@dataclasses.dataclass
class SchedulerStats:
    steps: int = 0  # decode steps
    width: int = 0  # the rows the last decode step computed (live ones and padding)
    stalled: int = 0  # rows that sat a decode step out: their next grant did not fit the KV budget
    decoded_tokens: int = 0  # tokens sampled by decode steps (first tokens excluded)
    prefilled_tokens: int = 0  # prompt positions computed (padding excluded)
    prefill_calls: int = 0  # forwards that ran prompt chunks (several prompts side by side count once)
    admitted: int = 0
    relayouts: int = 0
    drafted: int = 0  # drafted tokens verified (speculation)
    accepted: int = 0  # of which accepted
    by_source: dict = dataclasses.field(default_factory=dict)  # source -> [drafted, accepted]

    def verified(self, source: str, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        counts = self.by_source.setdefault(source, [0, 0])
        counts[0] += drafted
        counts[1] += accepted
