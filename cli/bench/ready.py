"""`--only ready`: a daemon's start to ready on an empty data directory (the model's import and every
compile included; not the C++ kernels': a wheel's are prebuilt, and a source install's are those of this
process's kernels directory, compiled before the first start: system/data_dirs.py) and then again on the
one it filled, its memory at ready and after 8 concurrent streams, and one stream sent the moment it is
ready against its settled speed.

Each start runs `jaxsmol serve` with its default warm-up (background: /health 503 "warming", then
200) and the benchmark's model flags, with `JAXSMOL_HOME` a temporary directory (`JAXSMOL_COMPILE_CACHE`
unset: the programs are kept there), so the first start makes everything and the second loads it.
Reports seconds to listening and to ready, the resident set and the compiled programs' count and bytes
at ready (/metrics), the resident set after 8 concurrent streams of `--tokens` tokens, the first
stream's tok/s (ignore_eos) and the median of the streams after it."""

from __future__ import annotations

import asyncio
import statistics
import tempfile

from jaxsmol.cli.bench.measure import log
from jaxsmol.cli.tables import format_table

PROMPT = "The history of the printing press begins"


def _stream_tok_s(url: str, tokens: int) -> float:
    """One streaming completion's decode speed: tokens after the first over their span."""
    import httpx

    from jaxsmol.cli.bench.clients import stream_one

    async def one():
        async with httpx.AsyncClient() as client:
            return await stream_one(client, url, PROMPT, tokens)

    arrivals = asyncio.run(one())["arrivals"]
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


def _gauges(url: str) -> dict[str, float]:
    """The daemon's jaxsmol_* gauges from /metrics, by name without the prefix."""
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("jaxsmol_") and "{" not in name:
            out[name.removeprefix("jaxsmol_")] = float(value)
    return out


def section_ready(args, plan) -> dict:
    import os

    from jaxsmol.cli.bench.clients import clients_row
    from jaxsmol.cli.bench.daemon import Daemon, model_flags

    flags, tokens, rows = model_flags(args) + ["--max-batch", str(plan["ready_max_batch"])], plan["ready_tokens"], []
    from jaxsmol.kernels import cpu_kernels
    from jaxsmol.system.data_dirs import kernels_dir

    cpu_kernels.state()  # found or compiled here, before the fresh start is timed
    env = {k: v for k, v in os.environ.items() if k != "JAXSMOL_COMPILE_CACHE"}
    env["JAXSMOL_KERNELS_DIR"] = str(kernels_dir())  # this process's: the fresh home does not compile them again
    with tempfile.TemporaryDirectory(prefix="jaxsmol-bench-home-") as home:
        for start in ("fresh", "second"):
            with Daemon(flags, start_timeout_s=1800, env={**env, "JAXSMOL_HOME": home}) as d:
                at = _gauges(d.url)
                at_ready = _stream_tok_s(d.url, tokens)
                settled = statistics.median(_stream_tok_s(d.url, tokens) for _ in range(plan["ready_settled"]))
                clients_row(d.url, 8, tokens, False, 0)
                after = _gauges(d.url)
            rows.append({"start": start, "listening_s": d.listening_s, "ready_s": d.up_s, "at_ready_tok_s": at_ready,
                         "settled_tok_s": settled, "share": at_ready / settled,
                         "resident_mb": at["resident_bytes"] / 1e6,
                         "programs": at["programs"], "programs_mb": at["programs_bytes"] / 1e6,
                         "resident_after_8_mb": after["resident_bytes"] / 1e6})
            log(f"ready, {start} start: listening {d.listening_s:.1f} s, ready {d.up_s:.1f} s, "
                f"{at['resident_bytes'] / 1e6:.0f} MB resident at ready ({at['programs']:.0f} programs, "
                f"{at['programs_bytes'] / 1e6:.0f} MB), {after['resident_bytes'] / 1e6:.0f} MB after 8 streams; "
                f"a stream at ready {at_ready:.1f} tok/s ({at_ready / settled:.2f}x settled)")
    return {"daemon_flags": flags, "tokens": tokens, "settled_streams": plan["ready_settled"], "rows": rows}


def format_ready(f: dict) -> list[str]:
    rows = [[r["start"], f"{r['listening_s']:.1f}", f"{r['ready_s']:.1f}", f"{r.get('resident_mb', 0):.0f}",
             f"{r.get('programs', 0):.0f} / {r.get('programs_mb', 0):.0f}", f"{r.get('resident_after_8_mb', 0):.0f}",
             f"{r['at_ready_tok_s']:.1f}", f"{r['settled_tok_s']:.1f}", f"{r['share']:.2f}x"] for r in f["rows"]]
    return [format_table(["start", "listening s", "ready s", "MB at ready", "programs / MB", "MB after 8 streams",
                          "tok/s at ready", "settled tok/s", "at ready / settled"],
                         rows, title=f"start to ready (`jaxsmol serve {' '.join(f['daemon_flags'])}`, an empty "
                                     f"data directory, then the same again): one stream of {f['tokens']} tokens "
                                     f"at ready, against the median of {f['settled_streams']} after it; 8 concurrent "
                                     f"streams of as many tokens, then the resident set")]
