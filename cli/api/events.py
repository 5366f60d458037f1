"""The contract between the HTTP side (cli/server/serve.py) and the model worker (cli/server/worker.py).

The HTTP side turns a request into a `Job` of `ChoiceSpec`s and submits it; the worker answers on the
job's own bounded event queue, in this order for each prompt: one `PromptDone` (what the prefix cache
restored and kept), then for each of its choices `TokenEvent`s and one `ChoiceDone`; a `JobError` for
a failure; always one `JobEnd` last. Events are plain data: a `ChoiceDone` carries
the scheduler's `ChoiceResult` (cache/scheduler/requests.py): plain data, no device buffer or cache
entry that a slow client leaving the event unread would keep alive.

Back-pressure: `Job.emit` (called on the worker thread) never waits; events past the queue's room
wait in a bounded backlog, and a client that leaves them unread for the job's write timeout has its
job cancelled by the worker (`Job.stalled`). The event queue belongs to the HTTP side's event loop;
the worker reaches it only through `emit`, the HTTP side reads it with `next_event`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import threading
import time

from jaxsmol.cache.records import PinOrder
from jaxsmol.cache.scheduler.requests import ChoiceResult
from jaxsmol.runtime.sampling import SamplingParams
from jaxsmol.runtime.stream import Step

DEFAULT_MAX_EVENTS = 256  # events a job may hold unread (one token each: ~a few KB in all)
DEFAULT_WRITE_TIMEOUT_S = 30.0
MAX_BACKLOG = 4096  # events waiting behind a full queue; beyond them the job is cancelled at once


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
class PromptDone:
    """A prompt is in (restored and prefilled), before its choices' first tokens."""
    indices: list[int]  # the ChoiceSpec indices of its choices
    cached_tokens: int  # positions restored from the prefix cache
    kept_tokens: int  # positions its cache breakpoints newly pinned past those (Job.keep)


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


Event = PromptDone | TokenEvent | ChoiceDone | JobError | JobEnd

_job_ids = itertools.count(1)


@dataclasses.dataclass(eq=False)
class Job:
    """One HTTP request: its choices (one per prompt x n), where its cache entries live, and its events.

    salt: the cache namespace within the model (tenant namespace + cache_salt), None for the default;
    bypass: this request does not use the prefix cache; loop: the event loop that owns `events`;
    pin: pin each prompt in the prefix cache once it is stored (POST /v1/cache/pin, lasting; a named
    cached content, with an expiry);
    keep: cache breakpoints, (position, ttl seconds) prefixes of each prompt pinned with an expiry once it
    is stored (the Messages API's cache_control; cache/pins.py `keep`);
    retain_s: keep each stored prompt in the disk tier this long (`prompt_cache_retention: "24h"`).
    """
    choices: list[ChoiceSpec]
    salt: str | None
    bypass: bool
    loop: asyncio.AbstractEventLoop
    return_token_ids: bool = False
    pin: PinOrder | None = None
    keep: tuple = ()
    retain_s: float | None = None
    max_events: int = DEFAULT_MAX_EVENTS
    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    id: int = dataclasses.field(default_factory=lambda: next(_job_ids))
    events: asyncio.Queue = dataclasses.field(init=False)

    def __post_init__(self):
        self.events = asyncio.Queue(maxsize=self.max_events)
        self._backlog: collections.deque = collections.deque()  # events past the queue's room
        self._stalled_since: float | None = None  # when the backlog started waiting for a read

    def emit(self, event: Event) -> bool:
        """Queue `event` for the client (worker thread only). Never waits: the worker decodes many
        jobs at once, and one slow reader must not stall the others. Events past the queue's room
        wait in a backlog on the event loop's side; `stalled()` tells the worker when the client has
        not read for write_timeout_s, and the worker then cancels the job. Returns False once the
        job is cancelled (its events are dropped: nobody is reading them)."""
        if self.cancelled.is_set():
            return False
        try:
            self.loop.call_soon_threadsafe(self._put, event)
        except RuntimeError:  # the event loop is closed: nobody is listening
            self.cancelled.set()
            return False
        return True

    def _put(self, event: Event) -> None:  # on the event loop
        if self._backlog or self.events.full():
            self._backlog.append(event)
            if self._stalled_since is None:
                self._stalled_since = time.monotonic()
            if len(self._backlog) > MAX_BACKLOG:
                self.cancelled.set()
        else:
            self.events.put_nowait(event)

    async def next_event(self) -> Event:
        """The next event (HTTP side). Each read refills the queue from the backlog and restarts
        the write timeout."""
        return self._read(await self.events.get())

    def next_event_nowait(self) -> Event | None:
        """The next event if one is waiting, else None (HTTP side; as next_event)."""
        return None if self.events.empty() else self._read(self.events.get_nowait())

    def _read(self, event: Event) -> Event:
        while self._backlog and not self.events.full():
            self.events.put_nowait(self._backlog.popleft())
        self._stalled_since = time.monotonic() if self._backlog else None
        return event

    def idle(self) -> bool:
        """No event is waiting (queue and backlog empty)."""
        return self.events.empty() and not self._backlog

    def stalled(self) -> bool:
        """Has the client left events unread for longer than write_timeout_s? (any thread)"""
        since = self._stalled_since
        return since is not None and time.monotonic() - since > self.write_timeout_s
