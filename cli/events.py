"""The contract between the HTTP side (cli/serve.py) and the model worker (cli/worker.py).

The HTTP side turns a request into a `Job` of `ChoiceSpec`s and submits it; the worker answers on the
job's own bounded event queue, in this order for each choice: `TokenEvent`s, then one `ChoiceDone`;
a `JobError` for a failure; always one `JobEnd` last. Events are plain data: a `ChoiceDone` carries a
`ChoiceResult`, never the `Generation` (which would keep its restored prefix alive for as long as a
slow client leaves the event unread).

Back-pressure: `Job.emit` (called on the worker thread) waits while the queue is full, up to the job's
write timeout; a client that does not drain its queue for that long has its job cancelled. The event
queue belongs to the HTTP side's event loop; the worker reaches it only through `emit`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import threading
from typing import Union

from jaxsmol.engine import Step
from jaxsmol.sampling import SamplingParams

DEFAULT_MAX_EVENTS = 256  # events a job may hold unread (one token each: ~a few KB in all)
DEFAULT_WRITE_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class ChoiceSpec:
    """One choice to generate: `index` in the response, its prompt and sampling.

    echo: the response repeats the prompt before the generated text (the HTTP side builds it);
    prompt_logprobs: score the prompt with this many top log-probabilities per position (None: don't).
    """
    index: int
    prompt_ids: list[int]
    sampling: SamplingParams
    echo: bool = False
    prompt_logprobs: int | None = None


@dataclasses.dataclass(frozen=True)
class ChoiceResult:
    """A finished choice, as plain data.

    cached_tokens: prompt positions this choice restored from the prefix cache;
    logprobs: per generated token {"token", "logprob", "top": [(id, logprob)]} (empty when not asked);
    prompt_logprobs: per prompt position the same dict, None at position 0 (None when not asked).
    """
    index: int
    prompt_tokens: int
    cached_tokens: int
    output_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[dict]
    prompt_logprobs: list | None = None


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    index: int  # the ChoiceSpec.index it belongs to
    step: Step


@dataclasses.dataclass(frozen=True)
class ChoiceDone:
    result: ChoiceResult


@dataclasses.dataclass(frozen=True)
class JobError:
    error: Exception  # a JaxsmolError is the client's fault (400); anything else is the server's


@dataclasses.dataclass(frozen=True)
class JobEnd:
    pass


Event = Union[TokenEvent, ChoiceDone, JobError, JobEnd]

_job_ids = itertools.count(1)


@dataclasses.dataclass(eq=False)
class Job:
    """One HTTP request: its choices (one per prompt x n), where its cache entries live, and its events.

    salt: the cache namespace within the model (tenant namespace + cache_salt), None for the default;
    bypass: this request does not use the prefix cache; loop: the event loop that owns `events`.
    """
    choices: list[ChoiceSpec]
    salt: str | None
    bypass: bool
    loop: asyncio.AbstractEventLoop
    return_token_ids: bool = False
    max_events: int = DEFAULT_MAX_EVENTS
    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    id: int = dataclasses.field(default_factory=lambda: next(_job_ids))
    events: asyncio.Queue = dataclasses.field(init=False)

    def __post_init__(self):
        self.events = asyncio.Queue(maxsize=self.max_events)

    def emit(self, event: Event) -> bool:
        """Queue `event` for the client (worker thread only). Waits while the queue is full, up to
        write_timeout_s; then cancels the job. Returns whether the event was queued for a live job
        (False: the job was cancelled before, or is now, for not being read).

        A cancelled job's events are queued only if there is room: nobody may be reading them."""
        if self.cancelled.is_set():
            self._offer(event)
            return False
        try:
            future = asyncio.run_coroutine_threadsafe(self.events.put(event), self.loop)
        except RuntimeError:  # the event loop is closed: nobody is listening
            self.cancelled.set()
            return False
        try:
            future.result(timeout=self.write_timeout_s)
            return True
        except concurrent.futures.TimeoutError:
            future.cancel()
            self.cancelled.set()
            return False
        except concurrent.futures.CancelledError:
            self.cancelled.set()
            return False

    def _offer(self, event: Event) -> None:
        def put():
            try:
                self.events.put_nowait(event)
            except asyncio.QueueFull:
                pass
        try:
            self.loop.call_soon_threadsafe(put)
        except RuntimeError:
            pass
