"""`--only first-burst`: a fresh daemon's first burst of clients, with and without compiling the
batched programs ahead.

For each round (`--rounds`), starts `jaxsmol serve` with the default (`--no-compile-ahead` off) and
then with `--no-compile-ahead`; once /health answers, waits `--idle` seconds (a daemon is usually up
a while before its first clients), then sends a burst of concurrent streaming clients (the largest of
`--clients`, `--tokens` each) and a second burst of other prompts (everything compiled by then: the
reference). Reports wall time, time to first token and inter-token latency of both bursts.
"""

from __future__ import annotations

import time

from jaxsmol.cli.bench.measure import log, now
from jaxsmol.cli.tables import format_table

SETTINGS = (("compile ahead", []), ("--no-compile-ahead", ["--no-compile-ahead"]))


def _bursts(url: str, plan) -> list[dict]:
    from jaxsmol.cli.bench.clients import clients_row

    out = []
    for seed, label in ((1, "first burst"), (2, "second burst")):
        t0 = now()
        r = clients_row(url, plan["burst_clients"], plan["burst_tokens"], False, seed=seed)
        out.append({"burst": label, "wall_s": now() - t0, **{k: r[k] for k in (
            "tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")}})
    return out


def section_first_burst(args, plan) -> dict:
    from jaxsmol.cli.bench.daemon import Daemon, model_flags

    base = ["--max-batch", str(plan["burst_max_batch"])] + model_flags(args)
    rows = []
    for rnd in range(plan["burst_rounds"]):
        for setting, flags in SETTINGS:
            with Daemon(base + flags) as d:
                time.sleep(plan["burst_idle"])
                for b in _bursts(d.url, plan):
                    rows.append({"round": rnd, "setting": setting, "healthy_after_s": d.up_s, **b})
                    log(f"first-burst {setting}, {b['burst']}: wall {b['wall_s']:.1f} s, "
                        f"TTFT p50 {b['ttft_p50_ms']:.0f} ms")
    return {"daemon_flags": base, "idle_s": plan["burst_idle"], "clients": plan["burst_clients"],
            "tokens": plan["burst_tokens"], "rounds": plan["burst_rounds"], "rows": rows}


def format_first_burst(f: dict) -> list[str]:
    rows = [[r["round"], r["setting"], f"{r['healthy_after_s']:.1f}", r["burst"], f"{r['wall_s']:.1f}",
             f"{r['ttft_p50_ms']:.0f}", f"{r['ttft_p99_ms']:.0f}", f"{r['itl_p50_ms']:.0f}", f"{r['itl_p99_ms']:.0f}"]
            for r in f["rows"]]
    return [format_table(["round", "daemon", "healthy s", "burst", "wall s", "ttft50 ms", "ttft99 ms", "itl50 ms",
                          "itl99 ms"], rows,
                         title=f"a fresh daemon's first burst: {f['clients']} clients x {f['tokens']} tokens, "
                               f"{f['idle_s']:g} s after /health answered "
                               f"(`jaxsmol serve {' '.join(f['daemon_flags'])}`)")]


def plot_first_burst(ax, res: dict) -> None:
    rows = res["first-burst"]["rows"]
    labels = list(dict.fromkeys(f"{r['setting']}\n{r['burst']}" for r in rows))
    p50 = {k: [] for k in labels}
    for r in rows:
        p50[f"{r['setting']}\n{r['burst']}"].append(r["ttft_p50_ms"])
    ax.bar(labels, [sum(v) / len(v) for v in p50.values()], color=["C3", "C2", "C3", "C2"][: len(labels)])
    ax.tick_params(axis="x", labelsize=7)
    ax.set(title="fresh daemon: first vs second burst", ylabel="TTFT p50 ms (mean over rounds)")
