"""Cache-aware admission (cache/scheduler/admission.py) and pin requests in the scheduler, on the tiny config.

A queue of prompts with mixed stored prefixes goes through one decode row (one request at a time),
so the order requests start in is the admission order: longest stored prefix first, the oldest among
equals, a request overtaken `admission_bound` times next; fifo by arrival. Whatever the order, every
request gets the bits it gets alone. A pin request prefills its prompt once and pins it, or is refused
with an error naming why, before any work where it can be.
"""

from __future__ import annotations

import dataclasses

import pytest

from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.records import PinOrder
from jaxsmol.cache.scheduler.requests import Collector, Request
from jaxsmol.cache.scheduler.scheduler import Scheduler
from cache_runs import distinct
from jaxsmol.errors import JaxsmolError
from jaxsmol.runtime.sampling import SamplingParams
from jaxsmol.cache.scheduler.many import generate

SP = SamplingParams(max_tokens=3, logprobs=2)


@dataclasses.dataclass(eq=False)
class Ordered(Collector):
    """A Collector that writes its name into `log` when its first token arrives."""
    log: list = dataclasses.field(default_factory=list)
    name: str = ""

    def token(self, index, step):
        if not self.steps:
            self.log.append(self.name)
        super().token(index, step)


def queue(engine):
    """(cache with two stored few-shot blocks, {name: prompt}, {name: stored prefix length})."""
    A, B = distinct(100, 10, 1), distinct(60, 11, 2)
    cache = PrefixCache(engine)
    for block in (A, B):
        generate(cache, block, SamplingParams(max_tokens=1))
    prompts = {"cold0": distinct(40, 20, 3), "B1": B + distinct(10, 30, 4), "cold2": distinct(50, 21, 5),
               "A3": A + distinct(10, 31, 6), "A4": A + distinct(20, 32, 7), "B5": B + distinct(5, 33, 8)}
    stored = {name: cache.cached_prefix(p) for name, p in prompts.items()}
    assert stored == {"cold0": 0, "B1": 60, "cold2": 0, "A3": 100, "A4": 100, "B5": 60}
    return cache, prompts


def run_queue(engine, **settings):
    """The queue through one decode row: (the order requests started in, {name: result})."""
    cache, prompts = queue(engine)
    sched = Scheduler(cache, max_batch=1, **settings)
    log, sinks = [], {}
    for name, prompt in prompts.items():  # all waiting before the first step
        sinks[name] = Ordered(log=log, name=name)
        sched.submit(Request(prompt, [SP], sinks[name]))
    sched.run()
    assert not any(s.errors for s in sinks.values())
    return log, {name: s.results[0] for name, s in sinks.items()}


def overtaken(order: list[str], arrival: list[str]) -> dict[str, int]:
    """For each request, how many that arrived after it started before it."""
    return {r: sum(arrival.index(o) > arrival.index(r) for o in order[:order.index(r)]) for r in order}


def test_longest_stored_prefix_first_bounded_and_the_same_bits(tiny_engine):
    arrival = ["cold0", "B1", "cold2", "A3", "A4", "B5"]
    fifo, fifo_results = run_queue(tiny_engine, admission="fifo")
    assert fifo == arrival
    # bound 2: A3 and A4 (100 stored) overtake cold0, B1 and cold2 twice, which then go in arrival order
    lpm, lpm_results = run_queue(tiny_engine, admission="lpm", admission_bound=2)
    assert lpm == ["A3", "A4", "cold0", "B1", "cold2", "B5"]
    assert max(overtaken(lpm, arrival).values()) == 2
    # no bound in reach: the longest stored prefix first, the oldest among equals
    unbounded, _ = run_queue(tiny_engine, admission="lpm", admission_bound=100)
    assert unbounded == ["A3", "A4", "B1", "B5", "cold0", "cold2"]
    zero, _ = run_queue(tiny_engine, admission="lpm", admission_bound=0)
    assert zero == arrival
    # the order changes when a request starts, never its bits
    cache, prompts = queue(tiny_engine)
    for name, r in lpm_results.items():
        alone = generate(tiny_engine, prompts[name], SP)
        assert r.output_ids == fifo_results[name].output_ids == alone.output_ids, name
        assert r.logprobs == fifo_results[name].logprobs == alone.logprobs, name
        assert r.cached_tokens >= {"A": 100, "B": 60, "c": 0}[name[0]], (name, r.cached_tokens)


def test_cancelled_requests_anywhere_in_the_queue_are_dropped(tiny_engine):
    cache, prompts = queue(tiny_engine)
    sched = Scheduler(cache, max_batch=1)
    log, sinks = [], {}
    for name, prompt in prompts.items():
        sinks[name] = Ordered(log=log, name=name)
        sched.submit(Request(prompt, [SP], sinks[name]))
    sinks["A4"].cancel = sinks["cold2"].cancel = True
    sched.run()
    assert log == ["A3", "B1", "B5", "cold0"]
    assert not sinks["A4"].results and not sinks["cold2"].results and not sinks["A4"].errors


# ---- pin requests -------------------------------------------------------------------------------------
def pin_request(sched, prompt, salt=None) -> Collector:
    sink = Collector()
    sched.submit(Request(prompt, [SamplingParams(max_tokens=0)], sink, salt=salt, pin=PinOrder()))
    sched.run()
    return sink


def test_a_pin_request_prefills_once_and_pins_in_its_namespace(tiny_engine, bpt, payload_bytes):
    cache = PrefixCache(tiny_engine, budget_bytes=150 * bpt, pinned_bytes=200 * bpt)
    sched = Scheduler(cache, max_batch=2)
    system = distinct(120, 40, 9)
    sink = pin_request(sched, system, salt="tenant")
    assert not sink.errors and sink.results[0].output_ids == [] and sink.results[0].cached_tokens == 0
    ns = cache.namespace("tenant")
    assert cache.pins.keys() == [(ns, tuple(system))]
    assert cache.pins.held == 120 * bpt + payload_bytes == cache.stats.pinned_bytes
    # the LRU churns through prompts of its whole budget; the pinned block stays, and is restored exactly
    for i in range(4):
        sched.submit(Request(distinct(140, 50 + i, 10 + i), [SP], Collector(), salt="tenant"))
        sched.run()
    assert cache.stats.evictions > 0 and cache.cached_prefix(system, salt="tenant") == 120
    assert cache.cached_prefix(system) == 0  # another namespace
    prompt = system + distinct(9, 60, 20)
    got = Collector()
    sched.submit(Request(prompt, [SP], got, salt="tenant"))
    sched.run()
    alone = generate(tiny_engine, prompt, SP)
    assert got.results[0].cached_tokens == 120
    assert got.results[0].output_ids == alone.output_ids and got.results[0].logprobs == alone.logprobs
    # pinning again does nothing; a stored prompt is pinned without a prefill
    assert not pin_request(sched, system, salt="tenant").errors and cache.pins.held == 120 * bpt + payload_bytes
    prefilled = sched.stats.prefilled_tokens
    assert pin_request(sched, prompt, salt="tenant").results[0].cached_tokens == len(prompt)
    assert sched.stats.prefilled_tokens == prefilled
    assert cache.pins.unpin(ns, system) and cache.pins.unpin(ns, prompt) and cache.pins.held == 0


def test_pins_beyond_the_budget_or_without_the_radix_cache_are_refused_with_the_reason(tiny_engine, bpt):
    cache = PrefixCache(tiny_engine, budget_bytes=400 * bpt, pinned_bytes=100 * bpt)
    sched = Scheduler(cache, max_batch=2)
    sink = pin_request(sched, distinct(150, 70, 21))
    [error] = sink.errors
    assert isinstance(error, JaxsmolError) and "--pinned-bytes" in str(error) and f"{100 * bpt:,}" in str(error)
    assert sched.stats.prefilled_tokens == 0  # refused before the prefill
    assert not sink.results and cache.pins.held == 0
    first = distinct(60, 71, 22)
    assert not pin_request(sched, first).errors
    [error] = pin_request(sched, distinct(60, 72, 23)).errors  # fits alone, not beside the first
    assert "pinned budget" in str(error) and cache.pins.keys() == [(cache.namespace(), tuple(first))]
    for mode in ("single", "off"):
        [error] = pin_request(Scheduler(PrefixCache(tiny_engine, mode=mode), max_batch=1), first).errors
        assert "radix" in str(error)


def test_admission_settings_are_checked():
    from jaxsmol.cache.scheduler.settings import BatchSettings

    with pytest.raises(JaxsmolError, match="admission must be one of lpm, fifo"):
        BatchSettings(admission="sjf")
    with pytest.raises(JaxsmolError, match="admission_bound"):
        BatchSettings(admission_bound=-1)
    assert (BatchSettings().admission, BatchSettings().admission_bound) == ("lpm", 8)
