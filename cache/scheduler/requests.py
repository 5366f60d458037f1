"""What goes in and out of the scheduler (cache/scheduler/scheduler.py): requests, their sinks, their results.

A `Request` is n choices of one prompt; its `Sink` receives each choice's streamed steps and result
(`ChoiceResult`: plain data, no device buffers, no cache entries), or one error. `Collector` is the sink
that keeps everything, for library calls (`generate_many`) and tests.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from jaxsmol.cache.fetch import Fetch
from jaxsmol.cache.records import CacheReport, PinOrder
from jaxsmol.errors import JaxsmolError
from jaxsmol.runtime.sampling import SamplingParams
from jaxsmol.runtime.stream import Step


# A decode row's KV is granted in steps of this many positions past its prompt (at admission, then as it
# grows), not its whole max_tokens at once: a client asking for 4,096 tokens and stopping after 40 then
# holds 40 positions' worth of the KV budget, not 4,096 (cache/scheduler/scheduler.py, the budget).
GROW_SLOTS = 128


@dataclasses.dataclass
class Timings:
    """Where a choice's time went, in seconds (the request's submission starts ttft_s and total_s)."""
    prompt_tokens: int = 0
    reused_tokens: int = 0  # positions taken from a prefix snapshot
    prefilled_tokens: int = 0  # positions computed by prefill (real tokens, padding excluded)
    generated_tokens: int = 0
    prefill_s: float = 0.0  # admission to the prompt's state computed (its lookup and restore included)
    ttft_s: float = 0.0  # submission to the first token sampled
    decode_s: float = 0.0  # first token to last
    total_s: float = 0.0
    # Set by a caller that loads the model or compiles programs for this request (the CLI): so the
    # prefill/decode figures above are compute, and the start-up cost is reported apart from them.
    load_s: float = 0.0  # reading config, tokenizer and weights
    compile_s: float = 0.0  # compiling (or loading from the program store) the request's programs
    startup_s: float = 0.0  # wall time until both were done (they may overlap: compile_s runs while loading)

    @property
    def prefill_tok_s(self) -> float:
        return self.prefilled_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        # the first token comes from prefill logits; the rest each cost one decode step
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(prefill_tok_s=round(self.prefill_tok_s, 2), decode_tok_s=round(self.decode_tok_s, 2))
        return d


@dataclasses.dataclass
class ChoiceResult:
    """One finished choice, as plain data (no device buffers, no cache entries): what the scheduler
    hands its sink, `generate_many` returns and the daemon answers with.

    cached_tokens: prompt positions this choice restored from the prefix cache;
    kept_tokens: prompt positions past those its request's cache breakpoints newly pinned (CacheReport.kept);
    stop_string: the stop string that ended it (None: another reason);
    logprobs: per generated token {"token", "logprob", "top": [(id, logprob)]} (empty when not asked);
    prompt_logprobs: per prompt position the same dict, None at position 0 (None when not asked: the
    daemon's scoring fills it);
    prompt_logits, report (where the request asked for `detail`: the library's calls): [V] float32 logits
    after the last prompt token; the request's cache report (shared by its choices; an answer stored
    after the last token is counted in it once stored).
    """
    index: int
    prompt_tokens: int
    cached_tokens: int
    output_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[dict]
    timings: Timings = dataclasses.field(default_factory=Timings)
    kept_tokens: int = 0
    stop_string: str | None = None
    prompt_logprobs: list | None = None
    prompt_logits: np.ndarray | None = None
    report: CacheReport | None = None


class Sink(Protocol):
    """Where a request's events go (the daemon's job, or `generate_many`'s collector): `prompt` once its
    prompt is in (restored, prefilled) with the cache's report, before the first `token` of its choices
    `indices`; then each choice's tokens and result, or one error."""
    def prompt(self, indices: list[int], report: CacheReport) -> None: ...
    def token(self, index: int, step: Step) -> None: ...
    def done(self, result: ChoiceResult) -> None: ...
    def error(self, error: Exception) -> None: ...
    def cancelled(self) -> bool: ...


@dataclasses.dataclass
class Request:
    """`len(samplings)` choices of one prompt: prefilled once, decoded as one row each."""
    prompt_ids: list[int]
    samplings: list[SamplingParams]
    sink: Sink
    indices: list[int] | None = None  # the choice indices the sink sees (default 0..n-1)
    salt: str | None = None
    bypass: bool = False
    pin: PinOrder | None = None  # pin the prompt once it is stored (cache/pins.py); its choices sample nothing
    # cache breakpoints: (position, ttl seconds) prefixes of the prompt pinned with an expiry once it is
    # stored (cache/pins.py `keep`), before its first tokens go out so that they come with what was kept
    keep: tuple = ()
    retain_s: float | None = None  # keep the stored prompt in the disk tier this long (PrefixCache.retain)
    detail: bool = False  # results carry the prompt's last logits and the cache report (library calls)
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    overtaken: int = 0  # later requests admitted before it (cache-aware admission bounds this)
    fetch: Fetch | None = None  # its lower tiers' reads, made while it waits (cache/fetch.py)
    planned: bool = False  # whether `fetch` was planned (None then: nothing to read)

    def __post_init__(self):
        if not self.samplings:
            raise JaxsmolError("a request needs at least one choice")
        self.indices = list(range(len(self.samplings))) if self.indices is None else list(self.indices)

    @property
    def decode_rows(self) -> int:
        """The decode rows its choices take: a choice of at most one token takes none (its token is
        sampled from the prompt's logits), so a long prompt scored or answered with one token does
        not keep a streaming newcomer from a free row while it is prefilled."""
        return sum(sp.max_tokens > 1 for sp in self.samplings)

    def reservation(self, slots: int) -> int:
        """The KV positions it is granted when admitted: its prompt's row, with the first grant of a
        choice that decodes in it (row_reservation); its other choices fork later, each with a grant of
        its own (the scheduler's forks). At most `slots`."""
        rows = [self.row_reservation(i, slots) for i, sp in enumerate(self.samplings) if sp.max_tokens > 1]
        return max(rows) if rows else min(slots, len(self.prompt_ids) + 1)

    def row_reservation(self, i: int, slots: int) -> int:
        """The positions choice i's row is granted first: its prompt and up to GROW_SLOTS tokens (a row
        is granted more as it grows: the scheduler's _grant), at most `slots`."""
        return min(slots, len(self.prompt_ids) + min(self.samplings[i].max_tokens, GROW_SLOTS))

    def row_final(self, i: int, slots: int) -> int:
        """The most positions choice i's row can take: its prompt and its max_tokens, at most `slots`."""
        return min(slots, len(self.prompt_ids) + self.samplings[i].max_tokens)


@dataclasses.dataclass(eq=False)
class Collector:
    """A Sink that keeps a request's results (and streamed steps) for `generate_many`."""
    results: dict = dataclasses.field(default_factory=dict)
    steps: dict = dataclasses.field(default_factory=dict)
    errors: list = dataclasses.field(default_factory=list)
    cancel: bool = False
    on_token: Callable[[int, Step], None] | None = None  # called with each step as it comes

    def prompt(self, indices: list[int], report: CacheReport) -> None:
        pass

    def token(self, index: int, step: Step) -> None:
        self.steps.setdefault(index, []).append(step)
        if self.on_token is not None:
            self.on_token(index, step)

    def done(self, result: ChoiceResult) -> None:
        self.results[result.index] = result

    def error(self, error: Exception) -> None:
        self.errors.append(error)

    def cancelled(self) -> bool:
        return self.cancel
