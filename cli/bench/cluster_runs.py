"""The runs of `--only cluster` (cli/bench/cluster.py, cli/bench/cluster_shared.py): replicas settled and
flushed, a fresh router in front of them, a workload sent, and the work the fleet's caches did, read
from every replica's counters."""

from __future__ import annotations

import statistics
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from jaxsmol.cli.bench.measure import log

VARIANTS = ("completions", "chat")
COUNTERS = ("jaxsmol_cache_tokens_reused_total", "jaxsmol_cache_tokens_prefilled_total")


def counters(url: str, names=COUNTERS) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in names}


def work_counts(replicas, before: list[dict]) -> dict:
    after = [counters(r.url) for r in replicas]
    reused = [int(a[COUNTERS[0]] - b[COUNTERS[0]]) for a, b in zip(after, before)]
    prefilled = [int(a[COUNTERS[1]] - b[COUNTERS[1]]) for a, b in zip(after, before)]
    total = sum(reused) + sum(prefilled)
    return {"reused": sum(reused), "prefilled": sum(prefilled), "hit_rate": sum(reused) / total if total else 0.0,
            "reused_per_replica": reused, "prefilled_per_replica": prefilled}


def settle(replicas, flush: bool) -> None:
    """Wait until no replica has work left (answers being stored included); then empty their caches."""
    from jaxsmol.cli.bench.clients import wait_idle

    for r in replicas:
        wait_idle(r.url, timeout_s=1800)
        if flush:
            httpx.post(r.url + "/flush_cache", timeout=300).raise_for_status()


def run_policy(replicas, work, variant: str, policy: str, plan, log_dir: Path, label: str | None = None) -> dict:
    """One run: a fresh router with `policy` in front of the (flushed) replicas, the variant's requests;
    its row's policy is `label` (default: the policy's name)."""
    from jaxsmol.cli.bench.tenants import send
    from jaxsmol.cli.replicas import Router, free_port, start_router, stop, wait_until

    settle(replicas, flush=True)
    router = start_router([r.url for r in replicas], policy, "127.0.0.1", free_port(), log_dir / f"router-{policy}.log")
    try:
        wait_until([router], Router.ready, 300, "ready with every replica healthy")
        before = [counters(r.url) for r in replicas]
        ttfts, wall = send(router.url, work, variant, plan["cluster_clients"], plan["cluster_tokens"],
                           plan["cluster_first_together"])
        settle(replicas, flush=False)
        row = {"variant": variant, "policy": label or policy, "requests": len(ttfts), **work_counts(replicas, before),
               "wall_s": wall, "req_s": len(ttfts) / wall, "ttft_p50_ms": 1e3 * statistics.median(ttfts)}
    finally:
        stop([router])
    log(f"cluster {variant} {label or policy}: hit rate {row['hit_rate']:.3f}, prefilled {row['prefilled']}, "
        f"{row['req_s']:.2f} req/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms")
    return row


def warm(replicas, work, plan) -> None:
    """Each replica alone sends a few of the workload's requests (both variants), so the programs their
    lengths take are compiled before any run."""
    import dataclasses

    from jaxsmol.cli.bench.tenants import send

    some = dataclasses.replace(work, completions=work.completions[:4], chats=work.chats[:1])
    for r in replicas:
        for variant in VARIANTS:
            send(r.url, some, variant, min(plan["cluster_clients"], 4), plan["cluster_tokens"])
