"""`--only admission`: cache-aware admission (`jaxsmol serve --admission lpm`) against arrival order
(`--admission fifo`), time to first token side by side in one run, under two few-shot workloads:

  bursts  `admission_blocks` few-shot blocks of ~`admission_block_tokens` tokens that
          `admission_hot` of the requests share (the rest: prompts of the same length that share
          nothing), each followed by a question of its own (~`admission_question` tokens); `--clients`
          requests sent at once, then the next burst once they are answered, `admission_requests`
          bursts; the prefix cache large enough for every block.
  churn   `admission_churn_blocks` blocks, one chosen at random for every request, and a prefix cache
          that holds about `admission_cache_blocks` of them, so blocks go in and out of it; `--clients`
          clients each sending `admission_requests` requests one after another.

`--tokens` (`admission_tokens`) tokens are answered; the daemon has `--max-batch` (4) rows, so requests
wait. For each round (`--rounds`) and workload a daemon is started with each order in turn, warmed
up, flushed, and sent the same requests (the same seed); the table gives each order's time to first
token (p50, p90, p99, mean, from sending to the first token: waiting included), requests a second
and the share of prompt tokens found in the cache, with lpm / fifo ratios per workload; `load` is the
machine's load average before and after (other work skews a row: compare rounds run in either order).
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import numpy as np

from jaxsmol.cli.bench.measure import loadavg, log
from jaxsmol.cli.tables import format_table

ORDERS = ("lpm", "fifo")
WORKLOADS = ("bursts", "churn")


def _workload(plan, kind: str, seed: int) -> list[list[str]]:
    """Per client, its prompts in order (the same for both admission orders)."""
    from jaxsmol.cli.bench.clients import text

    rng, n = random.Random(seed), plan["admission_block_tokens"]
    count = plan["admission_blocks"] if kind == "bursts" else plan["admission_churn_blocks"]
    blocks = [f"Example set {i}. " + text(random.Random(1000 + i), n) for i in range(count)]

    def prompt(c, j):
        if kind == "bursts" and rng.random() >= plan["admission_hot"]:
            head = f"Document {seed}.{c}.{j}. " + text(rng, n)  # shares nothing
        else:
            head = rng.choice(blocks)
        return head + f"\nQuestion {c}.{j}: " + text(rng, plan["admission_question"]) + "\nAnswer:"
    return [[prompt(c, j) for j in range(plan["admission_requests"])] for c in range(plan["admission_clients"])]


async def _one(client, url: str, prompt: str, tokens: int) -> tuple[float, int, int]:
    """(seconds to the first token, prompt tokens, cached prompt tokens) of one streamed completion."""
    body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0, first, usage = time.perf_counter(), None, {}
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=1200) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    return first, usage.get("prompt_tokens", 0), (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


async def _run(url: str, workload: list[list[str]], tokens: int, bursts: bool) -> tuple[list, float]:
    """Every request of the workload: in bursts (every client's j-th request at once, burst after
    burst), or each client's requests one after another, all clients at once."""
    import httpx

    async def client_run(client, prompts):
        return [await _one(client, url, p, tokens) for p in prompts]

    limits = httpx.Limits(max_connections=len(workload) + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        t0, out = time.perf_counter(), []
        if bursts:
            for j in range(len(workload[0])):
                out += await asyncio.gather(*(_one(client, url, prompts[j], tokens) for prompts in workload))
        else:
            out = [x for run in await asyncio.gather(*(client_run(client, p) for p in workload)) for x in run]
        return out, time.perf_counter() - t0


def _summary(kind: str, order: str, rnd: int, results: list, wall: float) -> dict:
    ttft = [r[0] for r in results if r[0] is not None]
    prompt, cached = sum(r[1] for r in results), sum(r[2] for r in results)

    def pct(q):
        return 1e3 * float(np.percentile(ttft, q))
    return {"workload": kind, "admission": order, "round": rnd, "requests": len(results), "ttft_p50_ms": pct(50),
            "ttft_p90_ms": pct(90), "ttft_p99_ms": pct(99), "ttft_mean_ms": 1e3 * float(np.mean(ttft)),
            "wall_s": wall, "req_s": len(results) / wall, "cached_share": cached / max(prompt, 1)}


def _flags(args, engine, plan, kind: str, order: str) -> list[str]:
    from jaxsmol.cli.bench.daemon import model_flags

    flags = ["--admission", order, "--max-batch", str(plan["admission_max_batch"])]
    if kind == "churn":  # a cache of about admission_cache_blocks prompts, with their answers' logits
        prompt = plan["admission_block_tokens"] + plan["admission_question"] + plan["admission_tokens"] + 16
        per = prompt * engine.kv_bytes_per_token + 2 * 4 * engine.cfg.vocab_size
        flags += ["--cache-bytes", str(int(plan["admission_cache_blocks"] * per))]
    return flags + model_flags(args)


def _measure(args, engine, plan, kind: str, order: str, rnd: int) -> tuple[dict, list[str]]:
    import httpx

    from jaxsmol.cli.bench.daemon import Daemon

    flags = _flags(args, engine, plan, kind, order)
    load0 = loadavg()
    with Daemon(flags) as d:
        warm = [[p] for p in _workload(plan, kind, seed=10_000 + rnd)[0][:2]]  # compiles what is left
        asyncio.run(_run(d.url, warm * 2, plan["admission_tokens"], bursts=False))
        httpx.post(d.url + "/v1/cache/flush", timeout=60).raise_for_status()
        results, wall = asyncio.run(_run(d.url, _workload(plan, kind, seed=rnd), plan["admission_tokens"],
                                         bursts=kind == "bursts"))
    r = _summary(kind, order, rnd, results, wall)
    r["load"] = [load0[0] if load0 else None, (loadavg() or [None])[0]]  # other work on the machine meanwhile
    log(f"admission {kind} {order} round {rnd}: TTFT p50 {r['ttft_p50_ms']:.0f} ms, p99 {r['ttft_p99_ms']:.0f} ms, "
        f"cached {r['cached_share']:.0%}")
    return r, flags


def section_admission(args, engine, plan) -> dict:
    rows, flags = [], {}
    for rnd in range(plan["admission_rounds"]):
        for kind in plan["admission_workloads"]:
            for order in ORDERS if rnd % 2 == 0 else ORDERS[::-1]:  # either order first, round by round
                row, flags[f"{kind} {order}"] = _measure(args, engine, plan, kind, order, rnd)
                rows.append(row)
    return {"daemon_flags": flags, "clients": plan["admission_clients"], "requests": plan["admission_requests"],
            "blocks": plan["admission_blocks"], "churn_blocks": plan["admission_churn_blocks"],
            "hot": plan["admission_hot"], "block_tokens": plan["admission_block_tokens"],
            "cache_blocks": plan["admission_cache_blocks"], "tokens": plan["admission_tokens"], "rows": rows}


def format_admission(a: dict) -> list[str]:
    rows = [[r["workload"], r["admission"], r["round"], r["requests"], f"{r['ttft_p50_ms']:.0f}",
             f"{r['ttft_p90_ms']:.0f}", f"{r['ttft_p99_ms']:.0f}", f"{r['ttft_mean_ms']:.0f}", f"{r['req_s']:.2f}",
             f"{r['cached_share']:.0%}", "->".join("-" if x is None else f"{x:.1f}" for x in r.get("load", ()))]
            for r in a["rows"]]
    first = next(iter(a["daemon_flags"].values()))
    out = [format_table(["workload", "admission", "round", "requests", "ttft50 ms", "ttft90 ms", "ttft99 ms",
                         "mean ms", "req/s", "cached", "load"], rows,
                        title=f"admission order, few-shot workloads, {a['tokens']} tokens each: bursts of "
                              f"{a['clients']} requests ({a['hot']:.0%} sharing {a['blocks']} blocks of "
                              f"~{a['block_tokens']} tokens); churn: {a['clients']} clients x {a['requests']} "
                              f"requests over {a['churn_blocks']} blocks, a cache of ~{a['cache_blocks']} "
                              f"(`jaxsmol serve {' '.join(first[2:])}`)")]
    for kind in dict.fromkeys(r["workload"] for r in a["rows"]):
        by = {o: [r for r in a["rows"] if r["workload"] == kind and r["admission"] == o] for o in ORDERS}
        if not all(by.values()):
            continue

        def med(o, k, by=by):
            return float(np.median([r[k] for r in by[o]]))
        out.append(f"{kind}: lpm / fifo (medians over rounds): " + ", ".join(
            f"{label} {med('lpm', k) / med('fifo', k):.2f}x" for label, k in
            (("TTFT p50", "ttft_p50_ms"), ("TTFT p99", "ttft_p99_ms"), ("mean", "ttft_mean_ms"), ("req/s", "req_s"))))
    return out
