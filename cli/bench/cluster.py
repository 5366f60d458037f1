"""`--only cluster`: replicas of `jaxsmol serve` behind sglang-router, cache_aware against round_robin.

Starts `--replicas` daemons (cli/replicas.py: free loopback ports, the CPUs split between them) with
`--cache-bytes` sized so that one holds about half the tenants' prefixes (and a few of their latest
questions each), then for each workload of cli/bench/tenants.py (completions, then multi-turn chat)
and each policy (round_robin, then cache_aware) starts the router in front of them, sends the
requests, and reads every replica's cache counters. Between two runs the router is stopped and every
replica's cache flushed, so each run starts from empty caches and an empty router tree; a warm-up on
each replica first compiles the programs these prompt lengths take, so neither policy pays for them.

Reports per run: the prefix hit rate (prompt positions reused / (reused + prefilled), summed over
the replicas), the positions prefilled, requests/s over the run's wall time and the time to first
token's median; and cache_aware against round_robin. The work counts depend on which replica each
request reaches, in what order, and (chat) on the answers sent back. sglang-router's cache_aware sends
a prompt that matches no replica's past prompts well to the replica with the fewest requests in flight
(the first on a tie), so where a tenant's first request lands depends on what else is in flight: with
`cluster_first_together` every tenant's first request is sent at once (they alternate between the
replicas), the rest by one client, and with `cluster_batch_invariant` an answer does not depend on
its batch, so the counts are the same on every run (tests/test_cluster.py holds them). The times are
this machine's.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from jaxsmol.cli.bench.measure import log
from jaxsmol.cli.tables import format_table

POLICIES = ("round_robin", "cache_aware")
VARIANTS = ("completions", "chat")
COUNTERS = ("jaxsmol_cache_tokens_reused_total", "jaxsmol_cache_tokens_prefilled_total")


def cache_bytes_for(plan, prefix_tokens: int, bytes_per_token: int, payload_bytes: int) -> int:
    """Room for half the tenants' prefixes (rounded up; `prefix_tokens` the longest), each with
    `cluster_room` + 1 of its latest questions and answers (their positions, and the logits kept per
    stored prompt and per stored answer), in one replica."""
    half = -(-plan["cluster_tenants"] // 2)
    per_entry = (plan["cluster_suffix"] + plan["cluster_tokens"]) * bytes_per_token + 2 * payload_bytes
    return half * (prefix_tokens * bytes_per_token + (plan["cluster_room"] + 1) * per_entry)


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in COUNTERS}


def _work_counts(replicas, before: list[dict]) -> dict:
    after = [counters(r.url) for r in replicas]
    reused = [int(a[COUNTERS[0]] - b[COUNTERS[0]]) for a, b in zip(after, before)]
    prefilled = [int(a[COUNTERS[1]] - b[COUNTERS[1]]) for a, b in zip(after, before)]
    total = sum(reused) + sum(prefilled)
    return {"reused": sum(reused), "prefilled": sum(prefilled), "hit_rate": sum(reused) / total if total else 0.0,
            "reused_per_replica": reused, "prefilled_per_replica": prefilled}


def _settle(replicas, flush: bool) -> None:
    """Wait until no replica has work left (answers being stored included); then empty their caches."""
    from jaxsmol.cli.bench.clients import wait_idle

    for r in replicas:
        wait_idle(r.url, timeout_s=1800)
        if flush:
            httpx.post(r.url + "/flush_cache", timeout=300).raise_for_status()


def run_policy(replicas, work, variant: str, policy: str, plan, log_dir: Path) -> dict:
    """One run: a fresh router with `policy` in front of the (flushed) replicas, the variant's requests."""
    from jaxsmol.cli.bench.tenants import send
    from jaxsmol.cli.replicas import Router, free_port, start_router, stop, wait_until

    _settle(replicas, flush=True)
    router = start_router([r.url for r in replicas], policy, "127.0.0.1", free_port(), log_dir / f"router-{policy}.log")
    try:
        wait_until([router], Router.ready, 300, "ready with every replica healthy")
        before = [counters(r.url) for r in replicas]
        ttfts, wall = send(router.url, work, variant, plan["cluster_clients"], plan["cluster_tokens"],
                           plan["cluster_first_together"])
        _settle(replicas, flush=False)
        row = {"variant": variant, "policy": policy, "requests": len(ttfts), **_work_counts(replicas, before),
               "wall_s": wall, "req_s": len(ttfts) / wall, "ttft_p50_ms": 1e3 * statistics.median(ttfts)}
    finally:
        stop([router])
    log(f"cluster {variant} {policy}: hit rate {row['hit_rate']:.3f}, prefilled {row['prefilled']}, "
        f"{row['req_s']:.2f} req/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms")
    return row


def _warm(replicas, work, plan) -> None:
    """Each replica alone sends a few of the workload's requests (both variants), so the programs their
    lengths take are compiled before any run."""
    import dataclasses

    from jaxsmol.cli.bench.tenants import send

    some = dataclasses.replace(work, completions=work.completions[:4], chats=work.chats[:1])
    for r in replicas:
        for variant in VARIANTS:
            send(r.url, some, variant, min(plan["cluster_clients"], 4), plan["cluster_tokens"])


def compare(rows: list[dict]) -> list[dict]:
    """Per variant, cache_aware against round_robin."""
    out = []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        by = {r["policy"]: r for r in rows if r["variant"] == variant}
        if set(POLICIES) <= set(by):
            ca, rr = by["cache_aware"], by["round_robin"]
            out.append({"variant": variant, "hit_rate_gain": ca["hit_rate"] - rr["hit_rate"],
                        "prefilled_ratio": ca["prefilled"] / rr["prefilled"] if rr["prefilled"] else float("nan"),
                        "req_s_ratio": ca["req_s"] / rr["req_s"],
                        "ttft_p50_ratio": ca["ttft_p50_ms"] / rr["ttft_p50_ms"]})
    return out


def section_cluster(args, engine, plan) -> dict:
    from jaxsmol.cli.bench.daemon import model_flags
    from jaxsmol.cli.bench.tenants import build_workload
    from jaxsmol.cli.replicas import Replica, start_replicas, stop, wait_until

    tok = engine.tokenizer
    work = build_workload(args.seed, plan["cluster_tenants"], plan["cluster_per_tenant"], plan["cluster_prefix"],
                          plan["cluster_suffix"], plan["cluster_turns"], lambda text: len(tok.encode(text)))
    n = plan["cluster_replicas"]
    prefix_tokens = max(len(tok.encode(p)) for p in work.prefixes)
    cache_bytes = cache_bytes_for(plan, prefix_tokens, engine.kv_bytes_per_token, 4 * engine.cfg.vocab_size)
    flags = model_flags(args) + ["--cache-bytes", str(cache_bytes), "--max-batch", str(plan["cluster_max_batch"])]
    flags += ["--batch-invariant"] if plan["cluster_batch_invariant"] else []
    log_dir = Path(tempfile.mkdtemp(prefix="jaxsmol-bench-cluster-"))
    log(f"cluster: {n} replicas of `jaxsmol serve {' '.join(flags)}`, logs in {log_dir}")
    replicas = start_replicas([flags] * n, log_dir)
    rows = []
    try:
        wait_until(replicas, Replica.ready, 3600, "ready")
        _warm(replicas, work, plan)
        for variant in plan["cluster_variants"]:
            for policy in POLICIES:
                rows.append(run_policy(replicas, work, variant, policy, plan, log_dir))
    finally:
        stop(replicas)
    return {"replicas": n, "cpus": [list(r.cpus or ()) for r in replicas], "daemon_flags": flags,
            "cache_bytes": cache_bytes, "tenants": plan["cluster_tenants"], "per_tenant": plan["cluster_per_tenant"],
            "prefix_tokens": plan["cluster_prefix"], "suffix_tokens": plan["cluster_suffix"],
            "turns": plan["cluster_turns"], "clients": plan["cluster_clients"], "tokens": plan["cluster_tokens"],
            "rows": rows, "compare": compare(rows)}


def format_cluster(c: dict) -> list[str]:
    rows = [[r["variant"], r["policy"], r["requests"], f"{r['hit_rate']:.3f}", r["reused"], r["prefilled"],
             " / ".join(map(str, r["prefilled_per_replica"])), f"{r['req_s']:.2f}", f"{r['ttft_p50_ms']:.0f}"]
            for r in c["rows"]]
    lines = [format_table(["workload", "policy", "requests", "hit rate", "reused", "prefilled", "prefilled by replica",
                           "req/s", "ttft50 ms"], rows,
                          title=f"{c['replicas']} replicas behind sglang-router: {c['tenants']} tenants, "
                                f"~{c['prefix_tokens']}-token prefixes, {c['per_tenant']} requests each (~"
                                f"{c['suffix_tokens']} new tokens), {c['clients']} clients, --cache-bytes "
                                f"{c['cache_bytes']} (`jaxsmol serve {' '.join(c['daemon_flags'])}`)")]
    for x in c["compare"]:
        lines.append(f"cluster {x['variant']}: cache_aware against round_robin: hit rate +{x['hit_rate_gain']:.3f}, "
                     f"prefilled {x['prefilled_ratio']:.2f}x, requests/s {x['req_s_ratio']:.2f}x, "
                     f"TTFT p50 {x['ttft_p50_ratio']:.2f}x")
    return lines
