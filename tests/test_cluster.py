"""Replicas behind sglang-router: `jaxsmol cluster` (cli/cluster.py, cli/replicas.py) and the benchmark's
cluster section (cli/bench/cluster.py), with the router itself (pip install 'jaxsmol[cluster]').

* The command on the two-layer checkpoint: each replica pinned to its share of the CPUs, the router
  in front once every replica is ready, API keys checked by the replicas (the router passes the
  client's Authorization on), each key's prompts in its own namespace on the replica the router picks,
  the router's /get_loads reading every replica's /get_load, SIGTERM stopping everything with status 0.
* The work counts of cache_aware against round_robin (hit rate, prefilled positions) on a small
  checkpoint whose KV cache, like the real model's, is much bigger than the logits kept per stored
  prompt (on the two-layer one the logits are as big as a prefix, and the cache budget means nothing):
  every tenant's first request at once, the rest by one client, answers independent of their batch,
  so the counts are the same on every run. Then the same replicas with `--shared-cache DIR`: no prefix
  prefilled twice across the fleet, and after every replica restarts on the directory, each tenant's
  first request restores its prefix's whole chunks from it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import httpx
import pytest

from jaxsmol.cli.replicas import split_cpus, usable_cpus
from daemon import ROOT, free_port

SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, rope_theta=10000.0)
KEYS = "sk-alice\nsk-bob\nsk-ops - admin\n"
START_TIMEOUT_S = 600


def test_cpus_are_split_in_contiguous_blocks_or_shared_when_too_few():
    assert split_cpus(2, [0, 1]) == [(0,), (1,)]
    assert split_cpus(3, [0, 1, 2, 3, 4, 5, 6, 7]) == [(0, 1, 2), (3, 4, 5), (6, 7)]
    assert split_cpus(3, [4, 5]) == [(4,), (5,), (4,)]
    assert split_cpus(1, [0, 1]) == [(0, 1)]


def test_serve_options_are_passed_on_as_given():
    from jaxsmol.cli.cluster import replica_args
    from jaxsmol.cli.main import build_parser

    args = build_parser().parse_args(["cluster", "--replicas", "3", "--policy", "round_robin", "--port", "9000",
                                      "--api-key", "k1", "--api-key", "k2", "--no-compile-ahead", "--max-batch", "4",
                                      "--cache-dir", "/c", "--model", "/m", "--kv-dtype", "bfloat16"])
    assert replica_args(args, 2) == ["--cache-dir", "/c/replica-2", "--api-key", "k1", "--api-key", "k2",
                                     "--max-batch", "4", "--warmup", "none", "--model", "/m", "--kv-dtype", "bfloat16"]
    assert replica_args(build_parser().parse_args(["cluster"]), 0) == []


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _cpus_allowed(pid: int) -> tuple[int, ...]:
    """The process's affinity, from /proc (a list like "0-2,5")."""
    status = Path(f"/proc/{pid}/status").read_text()
    text = next(line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list"))
    cpus = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return tuple(cpus)


def _wait_for_line(log: Path, proc: subprocess.Popen, text: str) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while text not in (out := log.read_text(errors="replace")):
        assert proc.poll() is None, f"jaxsmol cluster exited with {proc.returncode}:\n{out[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} after {START_TIMEOUT_S} s:\n{out[-3000:]}"
        time.sleep(0.25)
    return out


def _complete(url: str, key: str, prompt: str) -> dict:
    r = httpx.post(url + "/v1/completions", headers={"authorization": f"Bearer {key}"}, timeout=120,
                   json={"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_jaxsmol_cluster_serves_through_the_router_keeps_tenants_apart_and_stops_on_sigterm(tiny_model_dir,
                                                                                           tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text(KEYS)
    port, log = free_port(), tmp_path / "cluster.log"
    cmd = [sys.executable, "-m", "jaxsmol.cli.main", "cluster", "--replicas", "2", "--port", str(port), "--log-dir",
           str(tmp_path / "logs"), "--model", str(tiny_model_dir), "--ctx", "2048", "--warmup", "none",
           "--api-keys", str(keys)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        text = _wait_for_line(log, proc, "serving on")
        url = f"http://127.0.0.1:{port}"
        replica_urls = text.split("in front of", 1)[1].split()
        assert len(replica_urls) == 2

        replicas = [c for c in _children(proc.pid)
                    if b"jaxsmol.cli.main\x00serve" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert sorted(_cpus_allowed(c) for c in replicas) == sorted(split_cpus(2, usable_cpus()))

        prompt = "The history of the printing press in Europe begins in the fifteenth century with"
        assert httpx.post(url + "/v1/completions", json={"model": "m", "prompt": prompt}).status_code == 401
        first, again = _complete(url, "sk-alice", prompt), _complete(url, "sk-alice", prompt)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the same replica, her namespace
        bob = _complete(url, "sk-bob", prompt)  # the router's tree sends him there too (it knows text, not keys)
        assert bob["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        loads = httpx.get(url + "/get_loads", timeout=30).json()["workers"]
        assert sorted(w["worker"] for w in loads) == sorted(replica_urls)
        assert all(w["load"] == 0 for w in loads)  # num_tokens of idle replicas (-1: not read)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(120)
    assert rc == 0, log.read_text()[-3000:]
    for u in replica_urls:
        with pytest.raises(httpx.TransportError):
            httpx.get(u + "/health", timeout=5)


@pytest.fixture(scope="module")
def small_engine(tmp_path_factory, model_dir):
    from make_checkpoint import make_checkpoint

    from jaxsmol.runtime.engine import Engine

    path = make_checkpoint(SMALL, tmp_path_factory.mktemp("small-model"), dtype="float32", tokenizer_dir=model_dir)
    return Engine.load(path, ctx=2048, progress=False)


def test_cache_aware_reuses_prefixes_round_robin_spreads_them(small_engine):
    from jaxsmol.cli.bench.cluster import section_cluster
    from jaxsmol.cli.bench.plans import FULL

    plan = dict(FULL, cluster_clients=1, cluster_first_together=True, cluster_batch_invariant=True,
                cluster_max_batch=4, cluster_tenants=4, cluster_per_tenant=8, cluster_prefix=400,
                cluster_shared=("completions",), cluster_shared_write=("through",))
    args = types.SimpleNamespace(model=str(small_engine.model_dir), ctx=2048, dtype="float32", tp=1, dp=1, seed=0,
                                 kv_dtype=None)
    res = section_cluster(args, small_engine, plan)
    rows = {(r["variant"], r["policy"]): r for r in res["rows"]}
    tenants, requests = plan["cluster_tenants"], plan["cluster_tenants"] * plan["cluster_per_tenant"]
    assert all(r["requests"] == requests for r in res["rows"])

    ca, rr = rows["completions", "cache_aware"], rows["completions", "round_robin"]
    assert ca["hit_rate"] >= 0.8 and ca["hit_rate"] >= rr["hit_rate"] + 0.3, (ca, rr)
    assert ca["prefilled"] <= 0.5 * rr["prefilled"], (ca, rr)
    assert min(ca["prefilled_per_replica"]) > 0  # the tenants spread over both replicas
    # every tenant's prefix is prefilled once (its first request); the other requests prefill their question
    prefix_tokens = min(len(small_engine.tokenizer.encode(p)) for p in _prefixes(plan, args.seed, small_engine))
    assert ca["prefilled"] < tenants * prefix_tokens + requests * 40
    assert ca["reused"] >= (requests - tenants) * prefix_tokens

    ca, rr = rows["chat", "cache_aware"], rows["chat", "round_robin"]
    assert ca["hit_rate"] >= 0.7 and ca["hit_rate"] >= rr["hit_rate"] + 0.2, (ca, rr)
    assert ca["prefilled"] <= 0.5 * rr["prefilled"], (ca, rr)

    # the same replicas sharing a directory (--shared-cache): no prefix prefilled twice across the fleet
    # (the bound above; not "<= the unshared run": both reach it here, and a router tie that sends a repeated
    # prompt to the other replica may cost it its last position, which no chunk carries logits for), and after
    # every replica restarts, each tenant's first request restores its prefix's whole chunks
    shared, ca = rows["completions", "cache_aware + shared"], rows["completions", "cache_aware"]
    assert shared["prefilled"] < tenants * prefix_tokens + requests * 40 and shared["hit_rate"] >= 0.8, (shared, ca)
    restart = res["restart"]
    assert restart["shared_loads"] == tenants and restart["reused"] >= tenants * (prefix_tokens // 64) * 64, restart


def _prefixes(plan, seed, engine) -> list[str]:
    from jaxsmol.cli.bench.tenants import build_workload

    tok = engine.tokenizer
    return build_workload(seed, plan["cluster_tenants"], plan["cluster_per_tenant"], plan["cluster_prefix"],
                          plan["cluster_suffix"], plan["cluster_turns"], lambda t: len(tok.encode(t))).prefixes


def test_the_report_gives_a_row_a_workload_against_round_robin():
    from jaxsmol.cli.bench.performance import markdown

    runs = [{"variant": v, "policy": p, "hit_rate": h, "prefilled": f, "req_s": q, "ttft_p50_ms": t}
            for v in ("completions", "chat")
            for p, h, f, q, t in (("round_robin", 0.4, 30000, 0.5, 900.0), ("cache_aware", 0.8, 10000, 1.0, 450.0))]
    res = {"meta": {"cpu": "Test CPU", "cpus": 2, "date": "2026-12-04", "command": "jaxsmol bench --only cluster"},
           "cluster": {"replicas": 2, "tenants": 6, "per_tenant": 12, "clients": 4, "rows": runs}}
    rows = [line for line in markdown([res]).splitlines() if "sglang-router" in line]
    assert rows == [
        "| 2 replicas behind sglang-router, 6 tenants x 12 requests, 4 clients | cache_aware: hit rate 0.80, 10000 "
        "tokens prefilled, 1.00 req/s, TTFT p50 450 ms | round_robin: hit rate 0.40, 30000 tokens prefilled, 0.50 "
        "req/s, TTFT p50 900 ms | 2.00x req/s, 0.33x the tokens prefilled | `jaxsmol bench --only cluster` |",
        "| 2 replicas behind sglang-router, 6 tenants x 12 chat turns, 4 clients | cache_aware: hit rate 0.80, 10000 "
        "tokens prefilled, 1.00 req/s, TTFT p50 450 ms | round_robin: hit rate 0.40, 30000 tokens prefilled, 0.50 "
        "req/s, TTFT p50 900 ms | 2.00x req/s, 0.33x the tokens prefilled | `jaxsmol bench --only cluster` |"]
