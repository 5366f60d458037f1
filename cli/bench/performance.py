"""`jaxsmol bench --report`: the performance table of docs/performance.md and the README, in markdown.

From this run's results, or from earlier runs' JSON files (`--report a.json b.json`: nothing runs,
no model loads). One row per measurement: jaxsmol, the peer measured in the same run (transformers
with `--compare hf`; the `--peer-url` server, named by `--peer-name`, in ttft-peer and serve;
jaxsmol's own one-at-a-time runs in forks, round_robin's run in cluster), jaxsmol's speed against that
peer (above 1: faster) and the command. A measurement found in several runs (or repeated in one, as
`--clients 1 8 1 8`) shows the range over them. One table per machine (CPU model and cores), with the
dates of its runs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

HEADER = ["measurement", "jaxsmol", "peer, same run", "jaxsmol's speed against the peer", "command"]


@dataclass(frozen=True)
class Row:
    """A measurement: its cells are templates over `values` (str.format indices), filled in at the end,
    so the same measurement from several runs becomes one row of ranges."""
    name: str
    ours: str
    peer: str = ""
    ratio: str = ""
    values: tuple = ()


class Span:
    """The values one template field took over the runs: `format` gives "lo" or "lo-hi" in its spec."""

    def __init__(self, values):
        self.values = [v for v in values if v is not None]

    def __format__(self, spec: str) -> str:
        if not self.values:
            return "-"
        lo, hi = format(min(self.values), spec), format(max(self.values), spec)
        return lo if lo == hi else f"{lo}-{hi}"


def _label(name: str) -> str:
    return name.replace("{", "{{").replace("}", "}}")


def _hf(h: dict, _peer: str):
    peer = _label(f"transformers {h['transformers']}")
    metrics = {r["metric"]: r for r in h["rows"]}
    for metric, r in metrics.items():
        j, p = r["jaxsmol"], r["hf"]
        if m := re.fullmatch(r"prefill (\d+) \(tok/s\)", metric):
            yield Row(f"prefill {m[1]} tokens", "{0:.0f} tok/s", peer + " {1:.0f} tok/s", "{2:.2f}x", (j, p, j / p))
        elif m := re.fullmatch(r"decode at (\d+) \(tok/s\)", metric):
            yield Row(f"decode at position {m[1]}", "{0:.1f} tok/s", peer + " {1:.1f} tok/s", "{2:.2f}x", (j, p, j / p))
        elif m := re.fullmatch(r"ttft cold (\d+)\+(\d+) \(ms\)", metric):
            yield Row(f"time to first token, {m[1]} + {m[2]} tokens, cold", "{0:.0f} ms", peer + " {1:.0f} ms",
                      "{2:.2f}x", (j, p, p / j))
        elif m := re.fullmatch(r"ttft warm (\d+)\+(\d+) \(ms\)", metric):
            cold = metrics[f"ttft cold {m[1]}+{m[2]} (ms)"]
            yield Row(f"time to first token, {m[2]} new after {m[1]} stored", "{0:.1f} ms exact ({2:.1f}x cold)",
                      peer + " {1:.0f} ms (not exact)", "{3:.2f}x", (j, p, cold["jaxsmol"] / j, p / j))


def _ttft_peer(t: dict, peer: str):
    ways = {r["way"]: r for r in t["rows"]}
    ex, fast, other = ways["jaxsmol exact"], ways["jaxsmol fast"], ways.get("peer")
    pc, pw = (1e3 * other["cold_ttft_s"], 1e3 * other["warm_ttft_s"]) if other else (None, None)
    has = bool(other)
    yield Row(f"time to first token, {t['prefix']} + {t['suffix']} tokens, cold", "{0:.0f} ms",
              _label(peer) + " {1:.0f} ms" if has else "", "{2:.2f}x" if has else "",
              (1e3 * ex["cold_ttft_s"], pc, pc / (1e3 * ex["cold_ttft_s"]) if has else None))
    yield Row(f"time to first token, {t['suffix']} new after {t['prefix']} stored",
              "{0:.0f} ms exact ({2:.1f}x cold); exact=False {3:.0f} ms",
              _label(peer) + " {1:.0f} ms ({4:.1f}x cold)" if has else "", "{5:.2f}x" if has else "",
              (1e3 * ex["warm_ttft_s"], pw, ex["cold_over_warm"], 1e3 * fast["warm_ttft_s"],
               other["cold_over_warm"] if has else None, pw / (1e3 * ex["warm_ttft_s"]) if has else None))


def _serve(s: dict, peer: str):
    rows, tokens, label = s["rows"], s["tokens"], _label(peer)
    ours = [r for r in rows if r["server"] == "jaxsmol"]
    theirs = {i: r for i, r in enumerate(rows) if r["server"] == "peer"}
    single = [r["tok_s"] for r in ours if r["clients"] == 1 and not r["long_prompts"]]
    for i, r in enumerate(rows):
        if r["server"] != "jaxsmol":
            continue
        p = theirs.get(i + 1)  # each row is measured on the peer right after jaxsmol
        c = r["clients"]
        name = f"{c} streaming client{'s' if c > 1 else ''}"
        if r["long_prompts"]:
            cell = "ITL p99 {%d:.0f} ms, {%d:.1f} tok/s, {%d} long prompts answered"
            yield Row(f"{name} while 1000-token prompts arrive", cell % (0, 1, 2),
                      label + " " + cell % (3, 4, 5) if p else "",
                      "", (r["itl_p99_ms"], r["tok_s"], r["long_answered"]) + ((p["itl_p99_ms"], p["tok_s"],
                                                                                  p["long_answered"]) if p else ()))
            continue
        cell = "{%d:.1f} tok/s (steady {%d:.0f})"
        yield Row(f"{name}, {tokens} tokens each", cell % (0, 1), label + " " + cell % (2, 3) if p else "",
                  "{4:.2f}x" if p else "", (r["tok_s"], r["steady_tok_s"])
                  + ((p["tok_s"], p["steady_tok_s"], r["tok_s"] / p["tok_s"]) if p else ()))
        cell = "{%d:.0f} ms, {%d:.0f} ms"
        yield Row(f"{name}: TTFT p50, ITL p50", cell % (0, 1), label + " " + cell % (2, 3) if p else "", "",
                  (r["ttft_p50_ms"], r["itl_p50_ms"]) + ((p["ttft_p50_ms"], p["itl_p50_ms"]) if p else ()))
        if c > 1 and single:
            yield Row(f"{name} against 1 client", "{0:.2f}x the tokens a second", "", "",
                      (r["tok_s"] / sorted(single)[len(single) // 2],))


def _forks(f: dict, _peer: str):
    ways = {r["way"]: r["seconds"] for r in f["rows"]}
    n = f["samples"]
    yield Row(f"{n} samples x {f['tokens']} tokens of one {f['prompt']}-token question",
              f"{{0:.2f}} s batched (one prefill, {n} forks)", "jaxsmol: {1:.2f} s sequential, {2:.2f} s cached",
              "{3:.1f}x / {4:.1f}x", (ways["batched"], ways["sequential"], ways["cached"],
                                      ways["sequential"] / ways["batched"], ways["cached"] / ways["batched"]))


def _ready(r: dict, _peer: str):
    for row in r["rows"]:
        cache = "empty" if row["start"] == "first" else "filled"
        yield Row(f"start to ready, {cache} compilation cache",
                  "{0:.1f} s (listening {1:.1f} s); a stream at ready {2:.1f} tok/s, {3:.2f}x settled", "", "",
                  (row["ready_s"], row["listening_s"], row["at_ready_tok_s"], row["share"]))


def _cluster(c: dict, _peer: str):
    """Per workload: cache_aware's run against round_robin's, on the same replicas in the same run."""
    rows = {(r["variant"], r["policy"]): r for r in c["rows"]}
    for variant in dict.fromkeys(r["variant"] for r in c["rows"]):
        ca, rr = rows.get((variant, "cache_aware")), rows.get((variant, "round_robin"))
        if ca is None or rr is None:
            continue
        cell = "hit rate {%d:.2f}, {%d:.0f} tokens prefilled, {%d:.2f} req/s, TTFT p50 {%d:.0f} ms"
        yield Row(f"{c['replicas']} replicas behind sglang-router, {c['tenants']} tenants x {c['per_tenant']} "
                  f"{'chat turns' if variant == 'chat' else 'requests'}, {c['clients']} clients",
                  "cache_aware: " + cell % (0, 1, 2, 3), "round_robin: " + cell % (4, 5, 6, 7),
                  "{8:.2f}x req/s, {9:.2f}x the tokens prefilled",
                  (ca["hit_rate"], ca["prefilled"], ca["req_s"], ca["ttft_p50_ms"], rr["hit_rate"], rr["prefilled"],
                   rr["req_s"], rr["ttft_p50_ms"], ca["req_s"] / rr["req_s"], ca["prefilled"] / rr["prefilled"]))


def _admission(a: dict, _peer: str):
    """Per workload: admission lpm against fifo, medians over the rounds (daemons of the same run)."""
    import statistics

    for kind in dict.fromkeys(r["workload"] for r in a["rows"]):
        by = {o: [r for r in a["rows"] if r["workload"] == kind and r["admission"] == o] for o in ("lpm", "fifo")}
        if not all(by.values()):
            continue
        med = {(o, k): statistics.median(r[k] for r in by[o]) for o in by for k in ("ttft_p50_ms", "ttft_p99_ms")}
        if kind == "bursts":
            name = (f"few-shot bursts: {a['clients']} requests at once, {a['hot']:.0%} sharing {a['blocks']} blocks "
                    f"of {a['block_tokens']} tokens")
        else:
            name = (f"few-shot churn: {a['clients']} clients x {a['requests']} requests over {a['churn_blocks']} "
                    f"blocks, a cache of {a['cache_blocks']}")
        cell = "TTFT p50 {%d:.0f} ms, p99 {%d:.0f} ms"
        values = [med["lpm", "ttft_p50_ms"], med["lpm", "ttft_p99_ms"], med["fifo", "ttft_p50_ms"],
                  med["fifo", "ttft_p99_ms"]]
        yield Row(name, "admission lpm: " + cell % (0, 1), "fifo: " + cell % (2, 3), "{4:.2f}x / {5:.2f}x the TTFT",
                  tuple(values) + (values[0] / values[2], values[1] / values[3]))


def _alone(res: dict):
    """The default run's prefill and decode (jaxsmol alone) when transformers was not measured beside them."""
    if "hf" in res:
        return
    for r in res.get("prefill", []):
        yield Row(f"prefill {r['tokens']} tokens", "{0:.0f} tok/s", values=(r["tok_s"],))
    for r in res.get("decode", []):
        yield Row(f"decode at position {r['position']}", "{0:.1f} tok/s", values=(r["tok_s"],))


SECTIONS = {"hf": _hf, "ttft-peer": _ttft_peer, "serve": _serve, "forks": _forks, "ready": _ready,
            "cluster": _cluster, "admission": _admission}


def rows_of(res: dict) -> list[Row]:
    """The markdown rows of one run's results (the dict `jaxsmol bench` writes as JSON)."""
    peer = res["meta"].get("peer_name") or "peer"
    out = list(_alone(res))
    for name, fn in SECTIONS.items():
        if name in res:
            out += fn(res[name], peer)
    return out


def command_of(meta: dict) -> str:
    """The command of a run (results written before the command was recorded: rebuilt from its sections)."""
    if meta.get("command"):
        return meta["command"]
    sections = meta.get("sections", [])
    only = [s for s in sections if s != "hf"]
    return ("jaxsmol bench" + (f" --only {' '.join(only)}" if only else "")
            + (" --compare hf" if "hf" in sections else ""))


def machine_of(meta: dict) -> str:
    return f"{meta.get('cpu') or 'CPU model not recorded'}, {meta.get('cpus', '?')} cores"


def markdown(results: list[dict]) -> str:
    """The tables of every measurement in `results` (one or more runs), a range where runs repeat one."""
    groups: dict[str, dict] = {}  # machine -> {"dates": set, "rows": {key: [values, commands]}}
    for run, res in enumerate(results):
        meta = res["meta"]
        g = groups.setdefault(machine_of(meta), {"dates": set(), "rows": {}})
        g["dates"].add(meta.get("date") or "date not recorded")
        for row in rows_of(res):
            entry = g["rows"].setdefault((row.name, row.ours, row.peer, row.ratio), [[], {}])
            entry[0].append(row.values)
            entry[1][run] = command_of(meta)
    out = []
    for machine, g in groups.items():
        out += [f"**{machine}** ({', '.join(sorted(g['dates']))})", "",
                "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        for (name, ours, peer, ratio), (values, commands) in g["rows"].items():
            spans = [Span(column) for column in zip(*values)]
            runs = f" ({len(commands)} runs)" if len(commands) > 1 else ""
            command = " ; ".join(f"`{c}`" for c in dict.fromkeys(commands.values())) + runs
            cells = [name] + [t.format(*spans) if t else "" for t in (ours, peer, ratio)] + [command]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def report_files(paths: list[str]) -> str:
    """The tables of earlier runs' results files (`jaxsmol bench --json FILE`)."""
    from jaxsmol.errors import JaxsmolError

    results = []
    for p in paths:
        try:
            results.append(json.loads(Path(p).read_text()))
        except (OSError, ValueError) as e:
            raise JaxsmolError(f"--report: cannot read the results file {p}: {e}") from None
        if not isinstance(results[-1], dict) or "meta" not in results[-1]:
            raise JaxsmolError(f"--report: {p} is not the results of `jaxsmol bench` (no meta)")
    return markdown(results)
