"""The library's batched call: many prompts, and n samples of each, through one continuous batch."""

from __future__ import annotations

import dataclasses

from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.scheduler.requests import ChoiceResult, Collector, Request
from jaxsmol.cache.scheduler.scheduler import Scheduler
from jaxsmol.runtime.sampling import SamplingParams


def generate_many(cache: PrefixCache, prompts, sp: SamplingParams = SamplingParams(), *, n: int = 1,
                  salt: str | None = None, max_batch: int = 16, batch_invariant: bool = False,
                  scheduler: Scheduler | None = None) -> list[list[ChoiceResult]]:
    """Run every prompt (n samples each: seeds sp.seed + i, prefilled once) as one continuous batch.

    Returns, per prompt, its n results. Raises the first request's error, if any."""
    sched = scheduler or Scheduler(cache, max_batch=max(max_batch, n), batch_invariant=batch_invariant)
    sinks = []
    for prompt in prompts:
        sink = Collector()
        samplings = [dataclasses.replace(sp, seed=(sp.seed + i) % 2**63) for i in range(n)]
        sched.submit(Request(list(prompt), samplings, sink, salt=salt))
        sinks.append(sink)
    sched.run()
    for sink in sinks:
        if sink.errors:
            raise sink.errors[0]
    return [[sink.results[i] for i in range(n)] for sink in sinks]
