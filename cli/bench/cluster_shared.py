"""`--only cluster`'s shared-cache runs: the same replicas with `--shared-cache DIR` (a fresh directory for
each `--shared-cache-write` mode of `cluster_shared_write`: through, back), cache_aware, then the whole
cluster restarted on the last directory.

The replicas are warmed on another seed's tenants (the store then holds none of the measured prefixes),
their memory flushed, and each workload variant runs as in cli/bench/cluster.py's `run_policy`: a
prefix one replica computed is found by the other in the shared store, so the fleet prefills each
tenant's prefix about once whatever the router decides (written back, a prefix reaches the store only
when memory evicts it, or at shutdown). Then every replica is stopped and started
again on the same directory, and each tenant's next question is sent once, alternating between the
replicas, with no warm-up (their times include loading the programs, as a restarted cluster's first
requests do): with the shared store, they restore their prefixes from it.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import tempfile
from pathlib import Path

from jaxsmol.cli.bench.cluster_runs import COUNTERS, counters, run_policy, settle, warm
from jaxsmol.cli.bench.measure import log

SHARED_COUNTERS = ("jaxsmol_cache_shared_loads_total", "jaxsmol_cache_shared_hits_total")


def _start(flags: list[str], n: int, log_dir: Path):
    from jaxsmol.cli.replicas import Replica, start_replicas, wait_until

    log_dir.mkdir(parents=True, exist_ok=True)
    replicas = start_replicas([flags] * n, log_dir)
    wait_until(replicas, Replica.ready, 3600, "ready")
    return replicas


def _after_restart(replicas, work, plan) -> dict:
    """Each tenant's next question, once, sent to the replicas in turn (one at a time, flushed memories):
    how much of their prompts the restarted fleet restored."""
    from jaxsmol.cli.bench.tenants import question, send

    settle(replicas, flush=True)
    names = COUNTERS + SHARED_COUNTERS
    before = [counters(r.url, names) for r in replicas]
    rng, ttfts = random.Random(plan["cluster_tenants"]), []
    for t, prefix in enumerate(work.prefixes):
        one = dataclasses.replace(work, completions=[(t, prefix + question(rng, plan["cluster_suffix"]))])
        ttfts += send(replicas[t % len(replicas)].url, one, "completions", 1, plan["cluster_tokens"])[0]
    settle(replicas, flush=False)
    after = [counters(r.url, names) for r in replicas]
    got = {k: sum(int(a[k] - b[k]) for a, b in zip(after, before)) for k in after[0]}
    reused, prefilled = got["jaxsmol_cache_tokens_reused_total"], got["jaxsmol_cache_tokens_prefilled_total"]
    return {"requests": len(ttfts), "reused": reused, "prefilled": prefilled,
            "hit_rate": reused / (reused + prefilled) if reused + prefilled else 0.0,
            "shared_loads": got["jaxsmol_cache_shared_loads_total"], "ttft_p50_ms": 1e3 * statistics.median(ttfts)}


def label(write: str) -> str:
    """The policy column of a shared run's row."""
    return "cache_aware + shared" + ("" if write == "through" else f" (write-{write})")


def shared_runs(flags: list[str], work, other, plan, log_dir: Path) -> dict:
    """The cache_aware runs with a fresh shared directory for each `cluster_shared_write` mode, and the
    restart's first requests (on the last one's directory); `other`: the warm-up's workload (other tenants)."""
    from jaxsmol.cli.replicas import stop

    rows, n = [], plan["cluster_replicas"]
    for write in plan["cluster_shared_write"]:
        store = Path(tempfile.mkdtemp(prefix="jaxsmol-bench-shared-"))
        with_store = flags + ["--shared-cache", str(store), "--shared-cache-write", write]
        log(f"cluster: {n} replicas again, sharing {store} (write-{write})")
        replicas = _start(with_store, n, log_dir / f"shared-{write}")
        try:
            warm(replicas, other, plan)
            rows += [run_policy(replicas, work, variant, "cache_aware", plan, log_dir, label=label(write))
                     for variant in plan["cluster_shared"]]
        finally:
            stop(replicas)  # a write-back store gets the rest of the replicas' prefixes now
    flags = with_store
    log("cluster: every replica restarted on the same shared directory")
    replicas = _start(flags, n, log_dir / "restarted")  # no warm-up: a restarted cluster's first requests
    try:
        restart = _after_restart(replicas, work, plan)
    finally:
        stop(replicas)
    log(f"cluster: after the restart, each tenant's first request: hit rate {restart['hit_rate']:.3f}, "
        f"{restart['shared_loads']} prefixes from the shared store")
    return {"rows": rows, "restart": restart, "store": str(store)}
