"""What goes in and out of the scheduler (cache/scheduler/scheduler.py): requests, their sinks, their results.

A `Request` is n choices of one prompt; its `Sink` receives each choice's streamed steps and result
(`ChoiceResult`: plain data, no device buffers, no cache entries), or one error. `Collector` is the sink
that keeps everything, for library calls (`generate_many`) and tests.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

from jaxsmol.runtime.chunks import capacity_for
from jaxsmol.errors import JaxsmolError
from jaxsmol.runtime.sampling import SamplingParams
from jaxsmol.runtime.stream import Step


@dataclasses.dataclass
class ChoiceResult:
    """One finished choice, as plain data (no device buffers, no cache entries): what the scheduler
    hands its sink, `generate_many` returns and the daemon answers with.

    cached_tokens: prompt positions this choice restored from the prefix cache;
    logprobs: per generated token {"token", "logprob", "top": [(id, logprob)]} (empty when not asked);
    prompt_logprobs: per prompt position the same dict, None at position 0 (None when not asked: the
    daemon's scoring fills it).
    """
    index: int
    prompt_tokens: int
    cached_tokens: int
    output_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[dict]
    ttft_s: float = 0.0
    prompt_logprobs: list | None = None


class Sink(Protocol):
    """Where a request's events go (the daemon's job, or `generate_many`'s collector)."""
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
    pin: bool = False  # pin the prompt once it is stored (cache/pins.py); its choices sample nothing
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    overtaken: int = 0  # later requests admitted before it (cache-aware admission bounds this)

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

    @property
    def capacity(self) -> int:  # cache slots for the prompt and the longest choice
        return capacity_for(len(self.prompt_ids) + max(sp.max_tokens for sp in self.samplings))


@dataclasses.dataclass(eq=False)
class Collector:
    """A Sink that keeps a request's results (and streamed steps) for `generate_many`."""
    results: dict = dataclasses.field(default_factory=dict)
    steps: dict = dataclasses.field(default_factory=dict)
    errors: list = dataclasses.field(default_factory=list)
    cancel: bool = False

    def token(self, index: int, step: Step) -> None:
        self.steps.setdefault(index, []).append(step)

    def done(self, result: ChoiceResult) -> None:
        self.results[result.index] = result

    def error(self, error: Exception) -> None:
        self.errors.append(error)

    def cancelled(self) -> bool:
        return self.cancel
