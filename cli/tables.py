"""ASCII tables for the command line: the one table printer, and the cache probe's cold/warm table."""

from __future__ import annotations

import json


def format_table(header: list, rows: list[list], *, title: str | None = None, numbers: bool = True,
                 rule: bool = True, align: str | None = None) -> str:
    """Columns joined by two spaces. The first column is left-aligned; the others are right-aligned
    (numbers=True) or left-aligned; `align` ("l"/"r" a column) says it column by column instead. `rule`
    draws dashes under the header. No trailing spaces."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    align = align or "l" + ("r" if numbers else "l") * (len(header) - 1)
    lines = [] if title is None else [title]
    for k, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if a == "r" else c.ljust(w)
                               for c, w, a in zip(r, widths, align)).rstrip())
        if k == 0 and rule:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


# (label, key of a run's dict, how to show it): a row is shown when the runs have that key, so the
# same table serves a local probe (cache.probe.run_probe) and a remote one (cli.client.remote_probe).
_PROBE_ROWS = (
    ("prompt tokens", "prompt_tokens", str),
    ("tokens reused", "tokens_reused", str),
    ("cached tokens", "cached_tokens", str),
    ("tokens prefilled", "tokens_prefilled", str),
    ("bypass", "bypass", lambda v: v or "-"),
    ("exact full hit", "exact_hit", lambda v: "yes" if v else "no"),
    ("time to first token", "ttft_s", _ms),
    ("total time", "total_s", _ms),
    ("generated ids", "output_ids", lambda v: " ".join(map(str, v))),
    ("generated text", "text", json.dumps),
    ("snapshot bytes", "snapshot_bytes", str),
)


def format_probe(result: dict) -> str:
    """The cold/warm table of a probe result, local or against a daemon (result has a `url`)."""
    cold, warm = result["cold"], result["warm"]
    if "url" in result:
        title = f"cache probe against {result['url']} (predict {result['max_tokens']})"
    else:
        title = f"cache probe (mode {result['mode']}, predict {result['max_tokens']})"
    rows = [[label, show(cold[key]), show(warm[key])] for label, key, show in _PROBE_ROWS if key in cold]
    why = " (no reuse: the prompt bypassed the cache, so both runs do the same work)" if warm.get("bypass") else ""
    lines = [format_table(["", "cold", "warm"], rows, title=title, numbers=False, rule=False),
             f"identical outputs: {'yes' if result['identical'] else 'NO'}; "
             f"time-to-first-token speedup: {result['ttft_speedup']:.1f}x{why}"]
    if result.get("first_run_s") is not None:
        lines.append(f"first run, before the probe: {result['first_run_s'] * 1e3:.0f} ms (other tokens, cold then "
                     "warm: one-time costs kept out of the cold run)")
    if not warm.get("bypass") and result["ttft_speedup"] < 2:  # the cache saved less than half the prompt's time
        lines.append(f"a {warm['prompt_tokens']}-token prompt leaves the cache little to save (the warm run still "
                     "computes a chunk); a long prefix shows it: jaxsmol cacheprobe --text ...")
    pc = result.get("prompt_cache")
    if pc:
        used = f"refused ({pc['refused']})" if pc["refused"] else f"{pc['loaded']} tokens loaded"
        lines.append(f"prompt cache {pc['file']}: {used}; {pc['saved']} tokens saved")
    return "\n".join(lines)


def format_scores(scores, decode) -> str:
    """`jaxsmol score`'s table: each position's token, log P(token | tokens before it), its rank in the
    vocabulary there (1: the most likely) and, where asked (--top-k), the most likely tokens. The first
    token has no score: nothing comes before it."""
    with_top = any(s.top for s in scores)
    rows = []
    for pos, s in enumerate(scores):
        row = [pos, s.token, "-" if s.logprob is None else f"{s.logprob:.4f}", "-" if s.rank is None else s.rank,
               json.dumps(decode([s.token]))]
        rows.append(row + [", ".join(f"{json.dumps(decode([i]))} {v:.3f}" for i, v in s.top or ())] * with_top)
    header = ["pos", "id", "logprob", "rank", "token"] + ["most likely there"] * with_top
    return format_table(header, rows, align="rrrrll")
