"""`--only cluster`: replicas of `jaxsmol serve` behind sglang-router, cache_aware against round_robin, and
with a shared cache.

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

With `cluster_shared` (the full plan's variants), the replicas then run cache_aware again with `--shared-cache`, and
are restarted on it (cli/bench/cluster_shared.py): rows "cache_aware + shared" against cache_aware, and
the hit rate of each tenant's first request after the restart. The runs themselves are in
cli/bench/cluster_runs.py.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from jaxsmol.cli.bench.cluster_runs import run_policy, warm
from jaxsmol.cli.bench.cluster_shared import label, shared_runs
from jaxsmol.cli.bench.measure import log
from jaxsmol.cli.tables import format_table

POLICIES = ("round_robin", "cache_aware")
SHARED = label("through")  # the policy of the runs with a shared cache (cli/bench/cluster_shared.py)


def cache_bytes_for(plan, prefix_tokens: int, bytes_per_token: int, payload_bytes: int) -> int:
    """Room for half the tenants' prefixes (rounded up; `prefix_tokens` the longest), each with
    `cluster_room` + 1 of its latest questions and answers (their positions, and the logits kept per
    stored prompt and per stored answer), in one replica."""
    half = -(-plan["cluster_tenants"] // 2)
    per_entry = (plan["cluster_suffix"] + plan["cluster_tokens"]) * bytes_per_token + 2 * payload_bytes
    return half * (prefix_tokens * bytes_per_token + (plan["cluster_room"] + 1) * per_entry)


def compare(rows: list[dict], new: str = "cache_aware", old: str = "round_robin") -> list[dict]:
    """Per variant, the rows of policy `new` against those of `old`."""
    out = []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        by = {r["policy"]: r for r in rows if r["variant"] == variant}
        if {new, old} <= set(by):
            a, b = by[new], by[old]
            out.append({"variant": variant, "new": new, "old": old, "hit_rate_gain": a["hit_rate"] - b["hit_rate"],
                        "prefilled_ratio": a["prefilled"] / b["prefilled"] if b["prefilled"] else float("nan"),
                        "req_s_ratio": a["req_s"] / b["req_s"], "ttft_p50_ratio": a["ttft_p50_ms"] / b["ttft_p50_ms"]})
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
        warm(replicas, work, plan)
        for variant in plan["cluster_variants"]:
            for policy in POLICIES:
                rows.append(run_policy(replicas, work, variant, policy, plan, log_dir))
    finally:
        stop(replicas)
    shared = None
    if plan["cluster_shared"]:
        other = build_workload(args.seed + 1, plan["cluster_tenants"], plan["cluster_per_tenant"],
                               plan["cluster_prefix"], plan["cluster_suffix"], plan["cluster_turns"],
                               lambda text: len(tok.encode(text)))
        shared = shared_runs(flags, work, other, plan, log_dir)
        rows += shared["rows"]
    return {"replicas": n, "cpus": [list(r.cpus or ()) for r in replicas], "daemon_flags": flags,
            "cache_bytes": cache_bytes, "tenants": plan["cluster_tenants"], "per_tenant": plan["cluster_per_tenant"],
            "prefix_tokens": plan["cluster_prefix"], "suffix_tokens": plan["cluster_suffix"],
            "turns": plan["cluster_turns"], "clients": plan["cluster_clients"], "tokens": plan["cluster_tokens"],
            "rows": rows, "compare": compare(rows) + compare(rows, SHARED, "cache_aware")
            + compare(rows, label("back"), SHARED),
            "restart": shared and shared["restart"]}


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
        lines.append(f"cluster {x['variant']}: {x.get('new', 'cache_aware')} against {x.get('old', 'round_robin')}: "
                     f"hit rate {x['hit_rate_gain']:+.3f}, prefilled {x['prefilled_ratio']:.2f}x, requests/s "
                     f"{x['req_s_ratio']:.2f}x, TTFT p50 {x['ttft_p50_ratio']:.2f}x")
    if c.get("restart"):
        r = c["restart"]
        lines.append(f"cluster restarted on its shared cache: each tenant's first request ({r['requests']}): hit rate "
                     f"{r['hit_rate']:.3f} ({r['reused']} positions restored, {r['prefilled']} prefilled; "
                     f"{r['shared_loads']} prefixes from the shared store), TTFT p50 {r['ttft_p50_ms']:.0f} ms")
    return lines
