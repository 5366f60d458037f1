"""`--only ready`: a daemon's start to ready, first with an empty compilation cache and then again
with the one the first start filled, and one stream sent the moment it is ready against the same
daemon's settled speed.

Each start runs `jaxsmol serve` with its default warm-up (background: /health 503 "warming", then
200) and the benchmark's model flags, its persistent compilation cache in a temporary directory
(`JAXSMOL_COMPILE_CACHE`), so the first start compiles everything and the second loads it. Reports
seconds to listening and to ready, the first stream's tok/s (`--tokens`, ignore_eos) and the median
of the streams after it."""

from __future__ import annotations

import asyncio
import statistics
import tempfile

from cli.bench.measure import log
from cli.tables import format_table

PROMPT = "The history of the printing press begins"


def _stream_tok_s(url: str, tokens: int) -> float:
    """One streaming completion's decode speed: tokens after the first over their span."""
    import httpx

    from cli.bench.clients import stream_one

    async def one():
        async with httpx.AsyncClient() as client:
            return await stream_one(client, url, PROMPT, tokens)

    arrivals = asyncio.run(one())["arrivals"]
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


def section_ready(args, plan) -> dict:
    from cli.bench.daemon import Daemon, model_flags

    flags, tokens, rows = model_flags(args) + ["--max-batch", str(plan["ready_max_batch"])], plan["ready_tokens"], []
    with tempfile.TemporaryDirectory(prefix="jaxsmol-bench-xla-") as compile_cache:
        for start in ("first", "second"):
            with Daemon(flags, start_timeout_s=1800, env={"JAXSMOL_COMPILE_CACHE": compile_cache}) as d:
                at_ready = _stream_tok_s(d.url, tokens)
                settled = statistics.median(_stream_tok_s(d.url, tokens) for _ in range(plan["ready_settled"]))
            rows.append({"start": start, "listening_s": d.listening_s, "ready_s": d.up_s, "at_ready_tok_s": at_ready,
                         "settled_tok_s": settled, "share": at_ready / settled})
            log(f"ready, {start} start: listening {d.listening_s:.1f} s, ready {d.up_s:.1f} s, a stream at ready "
                f"{at_ready:.1f} tok/s ({at_ready / settled:.2f}x settled)")
    return {"daemon_flags": flags, "tokens": tokens, "settled_streams": plan["ready_settled"], "rows": rows}


def format_ready(f: dict) -> list[str]:
    rows = [[r["start"], f"{r['listening_s']:.1f}", f"{r['ready_s']:.1f}", f"{r['at_ready_tok_s']:.1f}",
             f"{r['settled_tok_s']:.1f}", f"{r['share']:.2f}x"] for r in f["rows"]]
    return [format_table(["start", "listening s", "ready s", "tok/s at ready", "settled tok/s", "at ready / settled"],
                         rows, title=f"start to ready (`jaxsmol serve {' '.join(f['daemon_flags'])}`, empty "
                                     f"compilation cache, then the same again): one stream of {f['tokens']} tokens "
                                     f"at ready, against the median of {f['settled_streams']} after it")]
