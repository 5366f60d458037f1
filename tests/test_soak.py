"""A soak of a real daemon under adversarial traffic, with a small cache budget: its
resident memory must stay within the budgets plus a fixed overhead, its prefix cache within
--cache-bytes, and it must answer a known request with the same tokens afterwards.

The traffic, per round: the radix-split pattern (a ~1200-token random prompt, its first 2 tokens + one
other token, then every short prompt so far again, all max_tokens 0: a split must not keep the whole
long segment alive behind a view), many distinct cache_salt values (one radix root each), many bogus
paths (one metrics label each, if they were labels), stop strings at the limits; across the rounds a
streaming client that stops reading (its job must be cancelled, not its events piled up).
Run with `pytest -s` to see the RSS figures.
"""

from __future__ import annotations

import json
import random
import re
import socket
import time
import uuid

import httpx
import pytest

from jaxsmol.cli.server.serve import ROUTES
from daemon import Server, assert_healthy, metrics, post

pytestmark = [pytest.mark.soak, pytest.mark.real]

MB = 1_000_000
CACHE_BYTES = 100 * MB
KV_CACHE_BYTES = 100 * MB
WRITE_TIMEOUT_S = 3
WARMUP_ROUNDS = 2  # 2 x ~1200 tokens x 46 KB > 100 MB: the cache is full (and evicting) after them
SOAK_ROUNDS = 4  # a split keeping its long segment alive (53 MB a round) would exceed the bound within these
LONG_PROMPT = 1200
SALTS_PER_ROUND = 10  # 60 namespaces over the run
BOGUS_PATHS_PER_ROUND = 50
# Growth allowed beyond the budgets and the programs (jaxsmol_programs_bytes, added to the bound after
# the stalled stream): what a full, steady daemon still legitimately gains. Measured here
# (2 shared cores, CPU XLA, glibc malloc; a 200 MB cache after 4 warm-up rounds of 20 salts each, the
# larger sizes of a longer soak): +24 MB over the 4 soak rounds, +29 MB more with the stalled
# stream (whose 189 MB decode batch reused freed memory): programs compiled for shapes first seen after
# the warm-up, allocator fragmentation of freed host snapshots (glibc keeps freed arenas), tokenizer and
# uvicorn buffers. A split keeping its long segment alive leaks 53 MB a round: over 200 MB in these 4 rounds.
FIXED_OVERHEAD = 100 * MB
KNOWN = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "return_token_ids": True}


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc status")


def known_answer(url: str) -> list[int]:
    r = post(url, "/v1/completions", KNOWN)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def ok(r: httpx.Response) -> httpx.Response:
    assert r.status_code == 200, (r.status_code, r.text)
    return r


class Rounds:
    """The adversarial traffic of one soak round after another (see the module docstring)."""

    def __init__(self, url: str, vocab: int = 49152, seed: int = 0):
        self.url, self.vocab, self.rng = url, vocab, random.Random(seed)
        self.shorts: list[list[int]] = []

    def radix_split(self) -> None:
        # ids >= 100: clear of the special tokens at the bottom of the vocabulary
        long = [self.rng.randrange(100, self.vocab) for _ in range(LONG_PROMPT)]
        ok(post(self.url, "/v1/completions", {"prompt": long, "max_tokens": 0}))
        self.shorts.append(long[:2] + [self.rng.randrange(100, self.vocab)])
        for short in self.shorts:
            ok(post(self.url, "/v1/completions", {"prompt": short, "max_tokens": 0}))

    def salts(self) -> None:
        for _ in range(SALTS_PER_ROUND):
            prompt = [self.rng.randrange(100, self.vocab) for _ in range(32)]
            ok(post(self.url, "/v1/completions", {"prompt": prompt, "max_tokens": 0,
                                                  "cache_salt": uuid.uuid4().hex * 8}))  # 256 chars: the limit

    def bogus_paths(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as c:
            for _ in range(BOGUS_PATHS_PER_ROUND):
                assert c.get(f"/v1/{uuid.uuid4().hex}?x={uuid.uuid4().hex}").status_code == 404
                assert c.post(f"/{uuid.uuid4().hex}/completions", json={}).status_code == 404

    def stops_at_limit(self) -> None:
        stops = ["".join(self.rng.choice("abc xyz") for _ in range(128)) for _ in range(4)]
        ok(post(self.url, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 24, "stop": stops,
                                              "temperature": 1.0, "seed": self.rng.randrange(1 << 30)}))

    def round(self) -> None:
        self.radix_split()
        self.salts()
        self.bogus_paths()
        self.stops_at_limit()


def stalled_stream(port: int) -> socket.socket:
    """A streaming chat request whose client reads its headers, then nothing. Its events are big (8
    choices, top_logprobs 20: ~16 KB a decode step), so the server's socket buffer (tcp_wmem, up to
    4 MB here) fills in ~250 steps; then the job's event queue and backlog back up, and after
    --write-timeout the worker cancels the job. max_tokens keeps the rows at capacity 512."""
    body = json.dumps({"messages": [{"role": "user", "content": "Write a long story."}], "stream": True, "n": 8,
                       "max_tokens": 470, "ignore_eos": True, "logprobs": True, "top_logprobs": 20,
                       "temperature": 1.0, "seed": 1}).encode()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small advertised window
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    assert s.recv(1024).startswith(b"HTTP/1.1 200")
    return s  # never read again until closed


def wait_cancelled(url: str, rounds: Rounds, timeout_s: float = 600) -> float:
    """Bogus-path traffic (the HTTP side only) until the worker has cancelled a job; returns the
    largest decode batch (jaxsmol_batch_kv_bytes) seen meanwhile."""
    deadline, batch = time.monotonic() + timeout_s, 0.0
    while (m := metrics(url))["jaxsmol_cancelled_total"] < 1:
        assert time.monotonic() < deadline, "the stalled stream was not cancelled"
        batch = max(batch, m["jaxsmol_batch_kv_bytes"])
        rounds.bogus_paths()
        time.sleep(1)
    return batch


def test_soak_memory_stays_within_budget():
    server = Server("--cache-bytes", str(CACHE_BYTES), "--kv-cache-bytes", str(KV_CACHE_BYTES),
                    "--write-timeout", str(WRITE_TIMEOUT_S)).wait_ready()
    try:
        url, pid = server.url, server.proc.pid
        before = known_answer(url)
        rounds = Rounds(url)
        for _ in range(WARMUP_ROUNDS):
            rounds.round()
        m0, rss0 = metrics(url), rss_bytes(pid)
        print(f"\nsoak: after {WARMUP_ROUNDS} warm-up rounds: RSS {rss0 / MB:.0f} MB, cache "
              f"{m0['jaxsmol_cache_bytes'] / MB:.0f} MB, pool {m0['jaxsmol_pool_bytes'] / MB:.0f} MB")
        for i in range(SOAK_ROUNDS):
            rounds.round()
            print(f"soak: round {i + 1}: RSS {rss_bytes(pid) / MB:.0f} MB, cache "
                  f"{metrics(url)['jaxsmol_cache_bytes'] / MB:.0f} MB")
        rss_rounds = rss_bytes(pid)
        # alone: a small --kv-cache-bytes keeps other requests waiting while its 8 rows decode
        stalled = stalled_stream(server.port)
        try:
            batch_peak = wait_cancelled(url, rounds)
        finally:
            stalled.close()
        m1, rss1 = metrics(url), rss_bytes(pid)
        # what may still grow after warm-up: the cache up to its budget, the recycled pool (up to its
        # bound), the decode batch up to its budget (or one request alone), and the fixed overhead above
        cache_room = CACHE_BYTES - m0["jaxsmol_cache_bytes"]
        pool_room = m1["jaxsmol_pool_bytes"] - m0["jaxsmol_pool_bytes"]
        rounds_bound = cache_room + pool_room + FIXED_OVERHEAD  # the rounds' decode rows are a few MB
        # the stalled stream's shapes (8 rows with logprobs) compile programs of ~50 MB each: measured
        # (jaxsmol_programs_bytes), bounded by the shapes there are
        programs = m1["jaxsmol_programs_bytes"] - m0["jaxsmol_programs_bytes"]
        bound = rounds_bound + max(KV_CACHE_BYTES, batch_peak) + programs
        print(f"soak: RSS after warm-up {rss0 / MB:.0f} MB, after {SOAK_ROUNDS} more rounds {rss_rounds / MB:.0f} MB "
              f"(growth {(rss_rounds - rss0) / MB:+.0f} MB, bound {rounds_bound / MB:.0f} MB), after the stalled "
              f"stream (batch peak {batch_peak / MB:.0f} MB, new programs {programs / MB:.0f} MB) {rss1 / MB:.0f} MB "
              f"(growth {(rss1 - rss0) / MB:+.0f} MB, "
              f"bound {bound / MB:.0f} MB); cache {m1['jaxsmol_cache_bytes'] / MB:.0f} MB, pool "
              f"{m1['jaxsmol_pool_bytes'] / MB:.0f} MB, evictions {m1['jaxsmol_cache_evictions_total']:.0f}, "
              f"cancelled {m1['jaxsmol_cancelled_total']:.0f}")
        assert m1["jaxsmol_cache_bytes"] <= CACHE_BYTES
        assert m1["jaxsmol_cache_evictions_total"] > 0, "the soak never filled the cache"
        assert rss_rounds - rss0 <= rounds_bound, f"RSS grew {(rss_rounds - rss0) / MB:.0f} MB in the rounds"
        assert rss1 - rss0 <= bound, f"RSS grew {(rss1 - rss0) / MB:.0f} MB, over the bound of {bound / MB:.0f} MB"
        # no series per bogus path: they all count as endpoint "other"
        endpoints = {re.search(r'endpoint="([^"]*)"', k)[1] for k in m1 if k.startswith("jaxsmol_requests_total")}
        assert "other" in endpoints and endpoints <= set(ROUTES) | {"other"}, endpoints
        assert_healthy(url)
        assert known_answer(url) == before
    finally:
        server.stop()


# ---- the radix-split rounds with the daemon's defaults ------------------------------------------------
SPLIT_CACHE_BYTES = 200 * MB
FLAT_AFTER_ROUND = 4  # the cache is full (3 x 56 MB) and every program the rounds use is made by then
FLAT_SLACK = 60 * MB
# From round 4 on, each round's long prompt evicts an older one (56 MB): a split keeping the long segment
# alive behind its 2-token view leaks those 56 MB a round, 3 x 56 = 168 MB over rounds 5-7, 2.8x the
# slack. Measured (2 shared cores): RSS 823 MB at round 4, 827 MB at round 12 (+4 MB over 8 rounds); in
# 7 rounds 860 MB at round 4, 824 MB at round 7 (the rounds swing by ~40 MB: 168 - 40 still clears 60).
SPLIT_ROUNDS = 7
UNEXPLAINED_SHARE = 0.10  # of the resident growth since start


def test_radix_split_rounds_hold_memory_flat_and_the_gauges_explain_it():
    """`jaxsmol serve --cache-bytes 200000000`, every other flag at its default
    (--kv-cache-bytes, --max-batch, the programs compiled ahead), then rounds of one random
    1200-token prompt and every earlier round's 3-token prompt P[:2] + [7] again, all max_tokens 0.
    The programs compiled ahead (~50 MB each) are made before the daemon says it is ready (/health
    200 after its warm-up); from then on RSS must hold flat from round 4, and the memory gauges must explain
    the resident growth since start (jaxsmol_unaccounted_bytes within 10% of it)."""
    # ready (/health 200) once the programs are compiled ahead: from scratch in a fresh CI home, minutes
    server = Server("--cache-bytes", str(SPLIT_CACHE_BYTES), compile_ahead=True).wait_ready(timeout=1500)
    try:
        url, pid = server.url, server.proc.pid
        rng, shorts, rss = random.Random(40), [], {}
        for r in range(1, SPLIT_ROUNDS + 1):
            long = [rng.randrange(100, 49152) for _ in range(LONG_PROMPT)]
            ok(post(url, "/v1/completions", {"prompt": long, "max_tokens": 0}))
            shorts.append(long[:2] + [7])
            for short in shorts:
                ok(post(url, "/v1/completions", {"prompt": short, "max_tokens": 0}))
            rss[r] = rss_bytes(pid)
        m = metrics(url)
        growth = m["jaxsmol_resident_bytes"] - m["jaxsmol_resident_at_start_bytes"]
        print(f"\nsplit rounds: RSS by round (MB) {[round(v / MB) for v in rss.values()]}; since start "
              f"{growth / MB:+.0f} MB: programs {m['jaxsmol_programs']:.0f} holding "
              f"{m['jaxsmol_programs_bytes'] / MB:.0f} "
              f"MB, cache {m['jaxsmol_cache_bytes'] / MB:.0f}, pool {m['jaxsmol_pool_bytes'] / MB:.0f}, batch "
              f"{m['jaxsmol_batch_kv_bytes'] / MB:.0f}, malloc free {m['jaxsmol_heap_free_bytes'] / MB:.0f}, "
              f"unaccounted {m['jaxsmol_unaccounted_bytes'] / MB:+.0f} MB")
        assert rss[SPLIT_ROUNDS] <= rss[FLAT_AFTER_ROUND] + FLAT_SLACK, rss
        assert m["jaxsmol_cache_bytes"] <= SPLIT_CACHE_BYTES
        assert abs(m["jaxsmol_unaccounted_bytes"]) <= UNEXPLAINED_SHARE * growth, m
    finally:
        server.stop()
