"""Reading the lower tiers ahead (cache/fetch.py): a waiting request's prefix is read from the shared store or
the disk tier on the fetch thread while the scheduler's thread goes on stepping the running streams; the
request is admitted once its reads are done, restores what they read, and answers with its cold run's bits.
At most FETCH_AHEAD fetches are held at once."""

from __future__ import annotations

import threading

from cache_runs import assert_same, toks
from jaxsmol.cache.fetch import FETCH_AHEAD
from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.scheduler.many import generate
from jaxsmol.cache.scheduler.requests import Collector, Request
from jaxsmol.cache.scheduler.scheduler import Scheduler
from jaxsmol.cache.store import snapshot
from jaxsmol.cache.store.disk import DiskStore
from jaxsmol.runtime.sampling import SamplingParams
from test_shared_cache import C, SP, pair


class Gate:
    """Wraps a backend's get: records the threads that read and holds each read until `open`."""

    def __init__(self, backend, opened=True):
        self.get, self.threads, self.keys = backend.get, set(), []
        self.opened = threading.Event()
        if opened:
            self.opened.set()
        backend.get = self

    def __call__(self, key):
        self.threads.add(threading.current_thread().name)
        self.keys.append(key)
        self.opened.wait(10)
        return self.get(key)


def request(prompt, sp=SP):
    return Request(list(prompt), [sp], Collector(), detail=True)


def test_a_shared_read_runs_beside_the_running_streams_and_restores_exactly(replicas, tmp_path):
    a, b = pair(replicas, tmp_path)
    P = toks(3 * C + 10, 30)
    generate(a, P, SP)  # A computes P: its 3 whole chunks go to the store
    gate = Gate(b.shared.backend, opened=False)
    sched = Scheduler(b, max_batch=4)
    stream = request(toks(20, 31), SamplingParams(max_tokens=30))
    sched.submit(stream)
    sched.step()
    warm = request(P + toks(6, 32))
    sched.submit(warm)
    steps = sched.stats.steps
    for _ in range(5):  # its reads wait on the gate: the stream goes on, the request waits
        sched.step()
    assert sched.stats.steps == steps + 5 and warm in sched.pending and len(b.fetcher.held) == 1
    assert threading.current_thread().name not in gate.threads
    gate.opened.set()
    sched.run()
    result = warm.sink.results[0]
    assert result.report.shared_loaded == 3 * C and result.cached_tokens == 3 * C
    assert_same(result, generate(replicas[1], P + toks(6, 32), SP))  # B's cold run, bit for bit
    assert len(b.fetcher.held) == 0 and not stream.sink.errors


def test_fetches_held_are_bounded_and_every_request_is_answered(replicas, tmp_path):
    a, b = pair(replicas, tmp_path)
    prompts = [toks(2 * C + 5, 40 + i) for i in range(4)]
    for p in prompts:
        generate(a, p, SP)
    gate = Gate(b.shared.backend, opened=False)
    sched = Scheduler(b, max_batch=4)
    reqs = [request(p + [7]) for p in prompts]
    for r in reqs:
        sched.submit(r)
    sched.step()
    assert len(b.fetcher.held) == FETCH_AHEAD and len(sched.pending) == 4
    gate.opened.set()
    sched.run()
    for p, r in zip(prompts, reqs):
        assert r.sink.results[0].report.shared_loaded == 2 * C
        assert_same(r.sink.results[0], generate(replicas[1], p + [7], SP))


def test_a_disk_read_ahead_restores_and_a_file_damaged_meanwhile_is_refused(tiny_engine, tmp_path):
    ident = snapshot.identity(tiny_engine)
    first = PrefixCache(tiny_engine, disk=DiskStore(tmp_path, ident))
    P, Q = toks(90, 50), toks(90, 51)
    generate(first, P, SP)
    generate(first, Q, SP)
    first.persist_to_disk()
    restarted = PrefixCache(tiny_engine, disk=DiskStore(tmp_path, ident))
    gen = generate(restarted, P + [9], SP)  # read on the fetch thread, admitted once read
    assert gen.report.disk_loaded == 90 and gen.cached_tokens == 90
    assert_same(gen, generate(tiny_engine, P + [9], SP))
    entry = restarted.disk.find("", Q)[0]
    fetch = restarted.plan_fetch(Q + [9])
    assert fetch.disk_entry is entry
    data = bytearray(entry.path.read_bytes())
    data[-10] ^= 0xFF  # damaged after it was planned, before it is read
    entry.path.write_bytes(bytes(data))
    sched = Scheduler(restarted, max_batch=1)
    req = request(Q + [9])
    sched.submit(req)
    sched.run()
    result = req.sink.results[0]
    assert result.report.disk_loaded == 0 and restarted.stats.disk_refused["checksum"] == 1
    assert not entry.path.exists()
    assert_same(result, generate(tiny_engine, Q + [9], SP))
