"""The daemon's model worker: one thread runs jobs one at a time from a bounded FIFO queue.

The model runs one request at a time, as in the lab's synchronous path; the HTTP side only submits
jobs and relays their events (the contract is in cli/events.py). A job whose client went away, or
stopped reading, is cancelled between tokens. Nothing a request does can stop the worker: every
failure is reported on the job's own channel.
"""

from __future__ import annotations

import queue
import threading

from cache.prefix_cache import PrefixCache
from cli.events import ChoiceDone, ChoiceResult, ChoiceSpec, Job, JobEnd, JobError, TokenEvent
from jaxsmol.errors import JaxsmolError
from jaxsmol.scoring import score


class QueueFull(Exception):
    pass


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
                job.emit(JobEnd())
                continue
            self.busy = True
            try:
                with self.lock:
                    self._execute(job)
            except BaseException as e:  # never let one request take the worker down
                job.emit(JobError(e))
            finally:
                self.busy = False
                job.emit(JobEnd())

    def _execute(self, job: Job) -> None:
        scores: dict = {}  # (prompt, k) -> prompt logprobs: n choices of one prompt score it once
        for spec in job.choices:
            if job.cancelled.is_set():
                self.metrics.cancelled += 1
                return
            try:
                prompt_lp = self._prompt_logprobs(spec, scores)
                if not self._run_choice(job, spec, prompt_lp):
                    self.metrics.cancelled += 1
                    return
            except JaxsmolError as e:
                job.emit(JobError(e))
                return

    def _prompt_logprobs(self, spec: ChoiceSpec, scores: dict) -> list | None:
        if spec.prompt_logprobs is None:
            return None
        key = (tuple(spec.prompt_ids), spec.prompt_logprobs)
        if key not in scores:
            scores[key] = [s.as_dict() for s in score(self.cache.engine, spec.prompt_ids, spec.prompt_logprobs)]
        return scores[key]

    def _run_choice(self, job: Job, spec: ChoiceSpec, prompt_lp) -> bool:
        """Generate one choice, emitting its tokens and its result; False if the job was cancelled."""
        req = self.cache.start(spec.prompt_ids, spec.sampling, salt=job.salt, bypass=job.bypass)
        steps, reported = iter(req), False
        try:
            for step in steps:
                if not job.emit(TokenEvent(spec.index, step)):
                    return False
                if req.gen.finish_reason and not reported:
                    # Answer now: what the cache does after the last token (saving the answer
                    # for the next turn) need not delay this client.
                    reported = True
                    self._done(job, spec, req, prompt_lp)
                if job.cancelled.is_set() and not reported:
                    return False
        finally:
            steps.close()  # runs the cache's bookkeeping (lease release) even when cancelled
        if not reported:  # max_tokens 0: no token, no step
            self._done(job, spec, req, prompt_lp)
        return True

    def _done(self, job: Job, spec: ChoiceSpec, req, prompt_lp) -> None:
        self.metrics.observe(req.gen, req.report, queue_s=0.0)
        gen = req.gen
        result = ChoiceResult(index=spec.index, prompt_tokens=len(gen.prompt_ids), cached_tokens=req.report.reused,
                              output_ids=list(gen.output_ids), text=gen.text, finish_reason=gen.finish_reason,
                              logprobs=list(gen.logprobs), prompt_logprobs=prompt_lp)
        job.emit(ChoiceDone(result))  # a client that left meanwhile is noticed before the next choice
