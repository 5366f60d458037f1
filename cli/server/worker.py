"""The daemon's model worker: one thread drives the continuous-batching scheduler (cache/scheduler/scheduler.py).

The HTTP side submits `Job`s (cli/api/events.py); the worker turns each into scheduler requests (the
choices of one prompt become forks of one request: prefilled once, one decode row each) and relays
the scheduler's events to the job. Between scheduler steps it takes the jobs that arrived, so
requests join and leave the running batch as they come. `Job.emit` never waits: a client that stops
reading is cancelled once its events have waited for the write timeout (`Job.stalled`), and a
cancelled job's rows are freed at the next step. Nothing a request does can stop the worker: every
failure is reported on the job's own channel.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading

from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.records import CacheReport
from jaxsmol.cache.scheduler.draft_model import DraftModel
from jaxsmol.cache.scheduler.requests import ChoiceResult, Request
from jaxsmol.cache.scheduler.settings import BatchSettings
from jaxsmol.cache.scheduler.scheduler import Scheduler
from jaxsmol.cli.api.events import ChoiceDone, ChoiceSpec, Job, JobEnd, JobError, PromptDone, TokenEvent
from jaxsmol.cli.server.prompt_scores import PromptScores
from jaxsmol.runtime.stream import Step


class QueueFull(Exception):
    pass


# An idle worker that gets a job waits this long for more before its first step, as long as they keep
# coming: a step begun with a burst's first job alone (a prompt's prefill, ~0.1-0.2 s here) held
# every other until it ended. The jobs of a burst reach the worker together (8 streaming clients
# started at once: within 0.3 ms), and every ms of this wait is a lone request's too (20 ms cost its
# time to first token 7-15 ms in jaxsmol bench --only serve), so it is short.
ARRIVAL_GAP_S = 0.005


@dataclasses.dataclass(eq=False)
class JobSink:
    """The scheduler's sink for one job: relays its events and ends the job after its last choice."""
    job: Job
    metrics: object
    remaining: int  # choices not finished yet
    prompt_logprobs: dict  # ChoiceSpec.index -> the prompt's log-probabilities, when asked
    ended: bool = False

    def prompt(self, indices: list[int], report: CacheReport) -> None:
        self.job.emit(PromptDone(list(indices), report.reused, report.kept))

    def token(self, index: int, step: Step) -> None:
        self.job.emit(TokenEvent(index, step))

    def done(self, r: ChoiceResult) -> None:
        self.metrics.observe(r.prompt_tokens, len(r.output_ids), r.timings.ttft_s)
        self.job.emit(ChoiceDone(dataclasses.replace(r, prompt_logprobs=self.prompt_logprobs.get(r.index))))
        self.remaining -= 1
        if self.remaining == 0:
            self._end()

    def error(self, error: Exception) -> None:
        if not self.ended:
            self.job.emit(JobError(error))
            self._end()
            self.job.cancelled.set()  # the job's other choices stop too

    def cancelled(self) -> bool:
        if self.job.stalled():  # its client has not read for the write timeout
            self.job.cancelled.set()
        if self.job.cancelled.is_set() and not self.ended:
            self.ended = True
            self.metrics.cancelled += 1
        return self.job.cancelled.is_set()

    def _end(self) -> None:
        if not self.ended:
            self.ended = True
            self.job.emit(JobEnd())


class Worker(threading.Thread):
    def __init__(self, cache: PrefixCache, max_queue: int, metrics, batch: BatchSettings = BatchSettings(),
                 draft=None):
        """draft: a draft model's Engine (--draft-model): its DraftModel (and draft cache) outlives the schedulers."""
        super().__init__(name="jaxsmol-worker", daemon=True)
        self.cache, self.metrics = cache, metrics
        self._settings = dataclasses.asdict(batch)
        self.draft = DraftModel(draft, cache, batch.max_batch) if draft is not None else None
        self.scheduler = Scheduler(cache, self.draft, **self._settings)
        self.max_queue = max_queue
        self.jobs: queue.Queue = queue.Queue(maxsize=max_queue)
        self.scoring: collections.deque[tuple[Job, PromptScores]] = collections.deque()  # before they are submitted
        self.lock = threading.Lock()  # held while the model or the cache is in use (flush waits for it)
        self.stopping = threading.Event()

    @property
    def busy(self) -> bool:
        return self.scheduler.has_work or bool(self.scoring)

    def submit(self, job: Job) -> None:
        """Queue a job; QueueFull when max_queue requests already wait, here or in the scheduler."""
        if self.jobs.qsize() + len(self.scoring) + len(self.scheduler.pending) >= self.max_queue:
            raise QueueFull
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull from None

    def stop(self) -> None:
        """Finish the queued and running jobs, then exit (never blocks, even with a full queue)."""
        self.stopping.set()

    def run(self) -> None:
        while True:
            self._take_jobs(wait=not self.busy)
            if self.scoring:
                with self.lock:
                    self._score_chunk()
            if self.scheduler.has_work:
                try:
                    with self.lock:
                        self.scheduler.step()
                except BaseException as e:  # never let a failure take the worker down
                    self._fail_all(e)
            elif self.scoring:
                continue
            elif self.stopping.is_set() and self.jobs.empty():
                return
            elif self.jobs.empty():
                with self.lock:
                    self.scheduler.idle()  # memory back to the OS once idle for a while

    def _take_jobs(self, wait: bool) -> None:
        """Submit the jobs that have arrived (waiting up to 0.1 s for one when idle, then for more while
        they arrive at most ARRIVAL_GAP_S apart) to the scheduler, whose admission order (--admission)
        chooses among every waiting request: a burst is admitted and prefilled together. `submit`
        answers 503 once --max-queue requests wait, here or in the scheduler."""
        timeout = 0.1 if wait else None
        while len(self.scheduler.pending) < max(self.max_queue, 1):
            try:
                job = self.jobs.get(timeout=timeout) if timeout else self.jobs.get_nowait()
            except queue.Empty:
                return
            timeout = ARRIVAL_GAP_S if wait else None
            try:
                with self.lock:
                    self._start(job)
            except BaseException as e:
                job.emit(JobError(e if isinstance(e, Exception) else RuntimeError(repr(e))))
                job.emit(JobEnd())

    def _start(self, job: Job) -> None:
        """Submit the job (_submit), once the prompt scores its choices ask for are in (_score_chunk)."""
        if job.cancelled.is_set():  # its client left while it waited
            self.metrics.cancelled += 1
            job.emit(JobEnd())
            return
        scores = PromptScores(self.cache.engine, job.choices)
        if scores.done:
            self._submit(job, {})
        else:  # scored a chunk per round first (_score_chunk)
            self.scoring.append((job, scores))

    def _submit(self, job: Job, prompt_lp: dict) -> None:
        """Group the job's choices by prompt (n samples of one prompt are forks) and submit them."""
        groups: dict[tuple, list[ChoiceSpec]] = {}
        for spec in job.choices:
            groups.setdefault(tuple(spec.prompt_ids), []).append(spec)
        sink = JobSink(job, self.metrics, len(job.choices), prompt_lp)
        for prompt, specs in groups.items():
            self.scheduler.submit(Request(list(prompt), [s.sampling for s in specs], sink,
                                          indices=[s.index for s in specs], salt=job.salt, bypass=job.bypass,
                                          pin=job.pin, keep=job.keep, retain_s=job.retain_s))

    def _score_chunk(self) -> None:
        """One chunk of the first waiting job's prompt scores; the job is submitted once they are in, or
        ends with the error a scoring raised (or its client left meanwhile)."""
        job, scores = self.scoring[0]
        if job.cancelled.is_set():
            self._end_scoring(None)
            self.metrics.cancelled += 1
            return
        try:
            scores.advance()
        except BaseException as e:  # a refused prompt or top k, or a failed forward: this job's error alone
            if self.scheduler.arena.lost:  # ... unless the forward took the arena with it
                self._fail_all(e)
            else:
                self._end_scoring(e)
            return
        if scores.done:
            self.scoring.popleft()
            self._submit(job, scores.result)

    def _end_scoring(self, error: BaseException | None) -> None:
        """End the first waiting job's scoring (its arena row given back), with `error` where one cut it short."""
        job, scores = self.scoring.popleft()
        scores.close()
        if error is not None:
            job.emit(JobError(error if isinstance(error, Exception) else RuntimeError(repr(error))))
        job.emit(JobEnd())

    def _fail_all(self, error: BaseException) -> None:
        """A step failed outside any one request: tell every request in flight, start afresh."""
        while self.scoring:
            self._end_scoring(error)
        s = self.scheduler
        sinks = [r.request.sink for r in s.rows if r is not None] + [r.sink for r in s.pending]
        sinks += [p.request.sink for p in s.prefills]
        for sink in {id(k): k for k in sinks}.values():
            sink.error(error if isinstance(error, Exception) else RuntimeError(repr(error)))
        try:
            s.close()  # its rows back to the arena
        except Exception:  # noqa: BLE001 - its state is not to be trusted: the arena starts afresh
            s.arena.recover()
        if s.arena.lost:
            s.arena.recover()
        self.scheduler = Scheduler(self.cache, self.draft, **self._settings)
