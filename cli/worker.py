"""The daemon's model worker: one thread runs requests one at a time from a bounded FIFO queue.

The model runs one request at a time, as in the lab's synchronous path; the HTTP side only
enqueues jobs and relays their events. A job whose client went away is cancelled between tokens.
Nothing a request does can stop the worker: every failure is reported on the job's own channel.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import threading
import time

from cache.prefix_cache import PrefixCache
from jaxsmol.errors import JaxsmolError
from jaxsmol.sampling import SamplingParams


class QueueFull(Exception):
    pass


@dataclasses.dataclass
class Job:
    """One HTTP request: `n` generations of one prompt (choice i uses seed + i)."""
    prompt_ids: list[int]
    sampling: list[SamplingParams]
    salt: str | None
    bypass: bool
    loop: asyncio.AbstractEventLoop
    return_token_ids: bool = False
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    id: int = dataclasses.field(default_factory=itertools.count(1).__next__)
    enqueued_at: float = dataclasses.field(default_factory=time.perf_counter)

    def emit(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Worker(threading.Thread):
    def __init__(self, cache: PrefixCache, max_queue: int, metrics):
        super().__init__(name="jaxsmol-worker", daemon=True)
        self.cache, self.metrics = cache, metrics
        self.jobs: queue.Queue = queue.Queue(maxsize=max_queue)
        self.lock = threading.Lock()  # held while the model or the cache is in use
        self.busy = False
        self.stopping = threading.Event()

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull from None

    def stop(self) -> None:
        """Finish the queued jobs, then exit (never blocks, even with a full queue)."""
        self.stopping.set()

    def run(self) -> None:
        while True:
            try:
                job = self.jobs.get(timeout=0.1)
            except queue.Empty:
                if self.stopping.is_set():
                    return
                continue
            if job.cancelled.is_set():  # its client left while it waited
                self.metrics.cancelled += 1
                job.emit("end")
                continue
            self.busy = True
            try:
                with self.lock:
                    self._execute(job)
            except BaseException as e:  # never let one request take the worker down
                job.emit("error", e)
            finally:
                self.busy = False
                job.emit("end")

    def _execute(self, job: Job) -> None:
        for index, sp in enumerate(job.sampling):
            if job.cancelled.is_set():
                return
            try:
                req = self.cache.start(job.prompt_ids, sp, salt=job.salt, bypass=job.bypass)
            except JaxsmolError as e:
                job.emit("error", e)
                return
            steps, done = iter(req), False
            try:
                for step in steps:
                    job.emit("token", index, step)
                    if req.gen.finish_reason and not done:
                        # Answer now: what the cache does after the last token (saving the answer
                        # for the next turn) need not delay this client.
                        done = self._done(job, index, req)
                    if job.cancelled.is_set() and not done:
                        self.metrics.cancelled += 1
                        return
            finally:
                steps.close()  # runs the cache's bookkeeping (lease release) even when cancelled
            if not done:
                self._done(job, index, req)

    def _done(self, job: Job, index: int, req) -> bool:
        self.metrics.observe(req.gen, req.report, queue_s=0.0)
        job.emit("done", index, req.gen, req.report)
        return True
