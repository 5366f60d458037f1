"""The library's calls, run the way the daemon runs its requests: through the scheduler.

`generate`: one request (a lone decode row), streamed through `on_token` if asked; `generate_many`: many
prompts, and n samples of each, as one continuous batch. Both return `ChoiceResult`s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.scheduler.draft_model import DraftModel
from jaxsmol.cache.scheduler.requests import ChoiceResult, Collector, Request
from jaxsmol.cache.scheduler.scheduler import Scheduler
from jaxsmol.runtime.engine import Engine
from jaxsmol.runtime.sampling import SamplingParams
from jaxsmol.runtime.stream import Step


def generate(model: Engine | PrefixCache, prompt_ids, sp: SamplingParams = SamplingParams(), *,
             salt: str | None = None, bypass: bool = False, speculate: str = "auto", speculate_tokens: int = 7,
             draft: Engine | DraftModel | None = None, on_token: Callable[[Step], None] | None = None) -> ChoiceResult:
    """Run one request to the end: `model` a PrefixCache (its prefixes reused and the request's saved),
    or an Engine (no cache). `on_token` gets each Step as it is sampled. The result carries the prompt's
    last logits and the cache report. `speculate`, `speculate_tokens`: see BatchSettings (the output is the
    same either way); `draft`: a draft model (cache/scheduler/draft_model.py).
    Raises the request's error (JaxsmolError for a bad prompt)."""
    cache = model if isinstance(model, PrefixCache) else PrefixCache(model, mode="off")
    sink = Collector(on_token=None if on_token is None else lambda _, step: on_token(step))
    sched = Scheduler(cache, draft, max_batch=1, speculate=speculate, speculate_tokens=speculate_tokens)
    return _run(sched, [Request(list(prompt_ids), [sp], sink, salt=salt, bypass=bypass, detail=True)])[0][0]


def generate_many(cache: PrefixCache, prompts, sp: SamplingParams = SamplingParams(), *, n: int = 1,
                  salt: str | None = None, max_batch: int = 16, batch_invariant: bool = False,
                  speculate: str = "auto", draft: Engine | DraftModel | None = None,
                  scheduler: Scheduler | None = None) -> list[list[ChoiceResult]]:
    """Run every prompt (n samples each: seeds sp.seed + i, prefilled once) as one continuous batch.

    Returns, per prompt, its n results. Raises the first request's error, if any."""
    sched = scheduler or Scheduler(cache, draft, max_batch=max(max_batch, n), batch_invariant=batch_invariant,
                                   speculate=speculate)
    samplings = [dataclasses.replace(sp, seed=(sp.seed + i) % 2**63) for i in range(n)]
    return _run(sched, [Request(list(prompt), samplings, Collector(), salt=salt) for prompt in prompts])


def _run(sched: Scheduler, requests: list[Request]) -> list[list[ChoiceResult]]:
    """Submit the requests, step the scheduler until it is idle (answers stored included), and return
    each request's results in choice order, or raise the first error."""
    for req in requests:
        sched.submit(req)
    sched.run()
    for req in requests:
        if req.sink.errors:
            raise req.sink.errors[0]
    return [[req.sink.results[i] for i in req.indices] for req in requests]
