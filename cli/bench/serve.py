"""`--only serve`: concurrent streaming clients against a `jaxsmol serve` daemon (and a peer server).

Starts a daemon (`--max-batch`, `--prefill-chunk`, the benchmark's model flags, ctx 2048 unless
`--ctx`) on a free loopback port, warms it up, then for each client count (`--clients`) runs that
many concurrent streaming /v1/completions clients (each a different prompt, `--tokens` sampled
tokens, ignore_eos so every answer has the same length) and reports aggregate decode tok/s (over the
wall time: prompts and ramp included), the steady decode tok/s (while every client streams), time to
first token p50/p99 and inter-token latency p50/p99. Then the same with one extra client that keeps
sending ~1000-token prompts (max_tokens 1), to show decode beside prefill (not with --no-long), and
how many of them were answered while the clients ran and their median time to the token (`longs`,
`long ttft`): a server whose slots are all taken queues them. Every row has prompts of its own (a
client count may be repeated: `--clients 8 16 8 16`), the same for jaxsmol and the peer.
With --peer-url (e.g. llama.cpp's llama-server with as many slots), every row is measured on the
peer right after jaxsmol, in the same run, with the same client code.
"""

from __future__ import annotations

import math

from jaxsmol.cli.bench.measure import log
from jaxsmol.cli.tables import format_table


def daemon_flags(args, plan) -> list[str]:
    from jaxsmol.cli.bench.daemon import model_flags

    return (["--max-batch", str(plan["serve_max_batch"]), "--prefill-chunk", str(plan["serve_prefill_chunk"])]
            + (["--batch-invariant"] if plan["serve_batch_invariant"] else []) + model_flags(args))


def _measure(url: str, targets: list, plan) -> list[dict]:
    from jaxsmol.cli.bench.clients import clients_row, wait_idle

    clients, tokens = list(plan["serve_clients"]), plan["serve_tokens"]
    longs = (False, True) if plan["serve_long"] else (False,)
    for c in sorted(set(clients)):  # warm up: compile every width, growth and shrink on the way
        for with_long in longs:
            clients_row(url, c, 12, with_long, seed=0)
    for _, u in targets[1:]:  # a peer compiles nothing; one call wakes it
        clients_row(u, 1, 4, False, seed=0)
    rows = []
    for with_long in longs:
        for i, c in enumerate(clients):
            for name, u in targets:  # alternate servers row by row: same machine state for both
                for _, other in targets:  # a jaxsmol peer stores its last row's answers meanwhile
                    wait_idle(other)
                # the same prompts for both servers, new ones for every row (a repeated row would
                # find its prompts in either server's prompt cache)
                r = clients_row(u, c, tokens, with_long, seed=1000 * (i + 1) + c)
                rows.append({"server": name, **{k: (None if isinstance(v, float) and math.isnan(v) else v)
                                                for k, v in r.items()}})
                log(f"serve {name} {c} clients{' + long prompts' if with_long else ''}: {r['tok_s']:.1f} tok/s")
    return rows


def section_serve(args, plan, peer_url: str | None) -> dict:
    from jaxsmol.cli.bench.daemon import Daemon

    flags = daemon_flags(args, plan)
    log(f"serve: starting `jaxsmol serve {' '.join(flags)}`")
    with Daemon(flags) as d:
        targets = [("jaxsmol", d.url)] + ([("peer", peer_url.rstrip("/"))] if peer_url else [])
        rows = _measure(d.url, targets, plan)
    return {"daemon_flags": flags, "peer_url": peer_url, "tokens": plan["serve_tokens"],
            "clients": list(plan["serve_clients"]), "rows": rows}


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_serve(s: dict) -> list[str]:
    rows = [[r["server"], r["clients"], "yes" if r["long_prompts"] else "no", _f(r["tok_s"], ".1f"),
             _f(r["steady_tok_s"], ".1f"), _f(r["ttft_p50_ms"], ".0f"), _f(r["ttft_p99_ms"], ".0f"),
             _f(r["itl_p50_ms"], ".0f"), _f(r["itl_p99_ms"], ".0f"),
             r["long_answered"] if r["long_prompts"] else "", _f(r["long_ttft_ms"], ".0f") if r["long_prompts"] else ""]
            for r in s["rows"]]
    peer = f" and the peer {s['peer_url']}" if s["peer_url"] else ""
    return [format_table(["server", "clients", "long", "tok/s", "steady", "ttft50 ms", "ttft99 ms", "itl50 ms",
                          "itl99 ms", "longs", "long ttft ms"], rows,
                         title=f"serving: concurrent streaming clients, {s['tokens']} tokens each, against "
                               f"`jaxsmol serve {' '.join(s['daemon_flags'])}`{peer}")]


def plot_serve(ax, res: dict) -> None:
    rows = res["serve"]["rows"]
    for server in dict.fromkeys(r["server"] for r in rows):
        for long_ in (False, True):
            pts = sorted((r["clients"], r["tok_s"]) for r in rows
                         if r["server"] == server and r["long_prompts"] == long_)
            if pts:
                ax.plot(*zip(*pts), "o-" if not long_ else "s--", label=server + (" + long prompts" if long_ else ""))
    ax.set(title="serving: streaming clients", xlabel="clients", ylabel="tok/s (wall)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
