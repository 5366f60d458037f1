"""Pins with an expiry (cache/pins.py: `pin(..., ttl_s=...)`, `keep`, `expire`) and a request's cache
breakpoints in the scheduler (`Request.keep`), on the tiny config with a clock the test moves by hand.

An expiring pin is kept exactly its TTL from its last pin, then returns to the LRU (evictable, not
dropped); a renewed one is extended; a lasting pin stays lasting; expiring pins count against the
pinned budget, and a breakpoint the budget refuses is left out while its request is served all the
same. The scheduler expires pins between its steps and while idle, and reports what a request's
breakpoints newly kept (`ChoiceResult.kept_tokens`) before its first token (`Sink.prompt`).
"""

from __future__ import annotations

import dataclasses

import pytest

from cache_runs import distinct
from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.scheduler.many import generate
from jaxsmol.cache.scheduler.requests import Collector, Request
from jaxsmol.cache.scheduler.scheduler import Scheduler
from jaxsmol.errors import JaxsmolError
from jaxsmol.runtime.sampling import SamplingParams

SP = SamplingParams(max_tokens=3)
FIVE_MINUTES, ONE_HOUR = 300.0, 3600.0


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


def stored(engine, clock, prompt, **kw) -> PrefixCache:
    """A radix cache (the clock its pins' clock) holding `prompt`."""
    cache = PrefixCache(engine, **kw)
    cache.pins.clock = clock
    generate(cache, prompt, SamplingParams(max_tokens=1))
    return cache


def test_an_expiring_pin_is_kept_its_ttl_then_returns_to_the_lru(tiny_engine, clock, bpt):
    prompt = distinct(80, 10, 1)
    cache = stored(tiny_engine, clock, prompt, budget_bytes=200 * bpt)
    ns = cache.namespace()
    pinned = cache.pins.pin(ns, prompt[:50], ttl_s=FIVE_MINUTES)  # a prefix of a stored prompt
    assert pinned.added_bytes == 50 * bpt and not pinned.on_disk and cache.pins.held == 50 * bpt
    assert not cache.pins.is_pinned(ns, prompt[:50], lasting=True) and cache.pins.keys(lasting=True) == []
    clock.now += FIVE_MINUTES - 0.001
    assert cache.pins.expire() == 0 and cache.pins.is_pinned(ns, prompt[:50])
    clock.now += 0.001
    assert cache.pins.expire() == 1 and not cache.pins.is_pinned(ns, prompt[:50])
    assert cache.pins.held == 0 == cache.stats.pinned_bytes and cache.pins.expires == {}
    assert cache.cached_prefix(prompt) == 80  # back to the LRU, not dropped: evicted when its turn comes
    for i in range(3):
        generate(cache, distinct(150, 20 + i, 2 + i), SP)
    assert cache.cached_prefix(prompt) == 0


def test_a_renewed_pin_is_extended_and_a_lasting_pin_stays_lasting(tiny_engine, clock, bpt):
    prompt = distinct(60, 10, 1)
    cache = stored(tiny_engine, clock, prompt)
    ns, key = cache.namespace(), prompt[:40]
    cache.pins.pin(ns, key, ttl_s=FIVE_MINUTES)
    clock.now += 200
    renewed = cache.pins.pin(ns, key, ttl_s=FIVE_MINUTES)
    assert renewed.added_bytes == 0  # nothing newly kept: the same pin, later
    clock.now += 299
    assert cache.pins.expire() == 0
    clock.now += 1
    assert cache.pins.expire() == 1 and cache.pins.held == 0
    # a shorter TTL never cuts a longer expiry short
    cache.pins.pin(ns, key, ttl_s=ONE_HOUR)
    cache.pins.pin(ns, key, ttl_s=FIVE_MINUTES)
    clock.now += FIVE_MINUTES
    assert cache.pins.expire() == 0 and cache.pins.is_pinned(ns, key)
    # a lasting pin (POST /v1/cache/pin) turns it lasting; a TTL on a lasting pin leaves it lasting
    cache.pins.pin(ns, key)
    cache.pins.pin(ns, prompt, ttl_s=FIVE_MINUTES)
    cache.pins.pin(ns, prompt)
    cache.pins.pin(ns, prompt, ttl_s=FIVE_MINUTES)
    clock.now += 10 * ONE_HOUR
    assert cache.pins.expire() == 0
    assert cache.pins.keys(lasting=True) == sorted([(ns, tuple(key)), (ns, tuple(prompt))])
    # unpinning an expiring pin forgets its expiry
    cache.pins.unpin(ns, key)
    cache.pins.pin(ns, key, ttl_s=1.0)
    assert cache.pins.unpin(ns, key) and cache.pins.expires == {}


def test_expiring_pins_count_against_the_pinned_budget(tiny_engine, clock, bpt, payload_bytes):
    prompt = distinct(120, 10, 1)
    cache = stored(tiny_engine, clock, prompt, pinned_bytes=100 * bpt)
    ns = cache.namespace()
    cache.pins.pin(ns, prompt[:60], ttl_s=FIVE_MINUTES)
    with pytest.raises(JaxsmolError, match="--pinned-bytes"):
        cache.pins.pin(ns, prompt[:110], ttl_s=FIVE_MINUTES)  # 50 more positions: over the budget
    assert cache.pins.held == 60 * bpt
    clock.now += FIVE_MINUTES  # once the first one expires, its bytes are free for another
    assert cache.pins.pin(ns, prompt[:90], ttl_s=FIVE_MINUTES).added_bytes == 90 * bpt
    assert cache.pins.held == 90 * bpt and not cache.pins.is_pinned(ns, prompt[:60])


@dataclasses.dataclass(eq=False)
class Ordered(Collector):
    """A Collector that notes its prompt event (with what was kept) and its tokens in order."""
    log: list = dataclasses.field(default_factory=list)

    def prompt(self, indices, report):
        self.log.append(("prompt", report.reused, report.kept))

    def token(self, index, step):
        self.log.append("token")
        super().token(index, step)


def run(sched, prompt, keep=(), salt=None) -> Ordered:
    sink = Ordered()
    sched.submit(Request(prompt, [SP], sink, salt=salt, keep=keep))
    sched.run()
    assert not sink.errors, sink.errors
    return sink


def test_a_requests_breakpoints_are_kept_and_reported_before_its_first_token(tiny_engine, clock, bpt):
    cache = PrefixCache(tiny_engine, budget_bytes=300 * bpt, pinned_bytes=200 * bpt)
    cache.pins.clock = clock
    sched = Scheduler(cache, max_batch=2)
    system, turn = distinct(70, 10, 1), distinct(20, 11, 2)
    first = run(sched, system + turn, keep=((70, FIVE_MINUTES), (40, ONE_HOUR)))
    assert first.log[:2] == [("prompt", 0, 70), "token"] and first.results[0].kept_tokens == 70
    alone = generate(tiny_engine, system + turn, SP)
    assert first.results[0].output_ids == alone.output_ids  # a breakpoint changes where, never which bits
    ns = cache.namespace()
    assert cache.pins.is_pinned(ns, system) and cache.pins.is_pinned(ns, system[:40])
    assert cache.pins.held == 70 * bpt
    # the LRU churns through its whole budget: the breakpoints' prefix stays, read by the next turn
    for i in range(3):
        run(sched, distinct(150, 30 + i, 3 + i))
    assert cache.stats.evictions > 0
    second = run(sched, system + distinct(25, 12, 9), keep=((70, FIVE_MINUTES),))
    assert second.results[0].cached_tokens == 70 and second.results[0].kept_tokens == 0  # renewed, nothing new
    assert second.log[0] == ("prompt", 70, 0)
    # at the first expiry (5 minutes from the renewal) the 70-token pin goes, the 1-hour one stays
    clock.now += FIVE_MINUTES
    sched.idle()
    assert not cache.pins.is_pinned(ns, system) and cache.pins.is_pinned(ns, system[:40])
    assert cache.pins.held == 40 * bpt
    clock.now += ONE_HOUR
    sched.step()  # a step expires them as idle() does
    assert cache.pins.held == 0 and cache.pins.expires == {}


def test_a_breakpoint_over_the_budget_is_left_out_and_the_request_served(tiny_engine, clock, bpt):
    cache = PrefixCache(tiny_engine, pinned_bytes=50 * bpt)
    cache.pins.clock = clock
    sched = Scheduler(cache, max_batch=2)
    prompt = distinct(90, 10, 1)
    got = run(sched, prompt, keep=((30, FIVE_MINUTES), (80, FIVE_MINUTES)))
    assert got.results[0].kept_tokens == 30
    assert got.results[0].output_ids == generate(tiny_engine, prompt, SP).output_ids
    assert cache.pins.held == 30 * bpt
    # without the radix cache (or bypassing it), breakpoints keep nothing and cost nothing
    off = Scheduler(PrefixCache(tiny_engine, mode="single"), max_batch=2)
    assert run(off, prompt, keep=((30, FIVE_MINUTES),)).results[0].kept_tokens == 0
    bypassed = Ordered()
    sched.submit(Request(distinct(40, 11, 2), [SP], bypassed, bypass=True, keep=((30, FIVE_MINUTES),)))
    sched.run()
    assert bypassed.results[0].kept_tokens == 0 and bypassed.results[0].cached_tokens == 0
