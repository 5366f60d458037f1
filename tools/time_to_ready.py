"""A daemon's start to ready, and one stream sent at ready against the settled speed (maintainers' check of --warmup).

Starts `jaxsmol serve [FLAGS]` on a free loopback port, polls /health every 0.1 s and times the
first answer (listening) and the first 200 (ready); at that moment (or with `--at listening` at the
first answer, 503 while warming) one streaming client asks for 64 tokens (ignore_eos); then the same
client `--settled` more times, one after another. Prints one JSON line: the times, each stream's
decode tok/s (tokens after the first over their span) and the first stream's share of the settled
median. Run it twice with the same JAXSMOL_HOME for the first and second start (a fresh home:
copy models/ and kernels/ of the default one, without xla-cache/).

    JAXSMOL_HOME=/tmp/home PYTHONPATH=$PWD python tools/time_to_ready.py [--at ready|listening] [--settled 5] [-- FLAGS...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx

from cli.bench.clients import stream_one

PROMPT = "The history of the printing press begins"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(url: str, proc: subprocess.Popen, t0: float, until: str, seen: dict) -> dict:
    """Poll /health until it answers (listening) or answers 200 (ready); `seen` gets the seconds of each."""
    while proc.poll() is None:
        try:
            r = httpx.get(url + "/health", timeout=5)
            seen.setdefault("listening_s", time.monotonic() - t0)
            if r.status_code == 200:
                seen.setdefault("ready_s", time.monotonic() - t0)
            if until in ("listening", "ready") and f"{until}_s" in seen:
                return seen
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"the daemon exited with {proc.returncode}")


def tok_s(run: dict) -> float:
    a = run["arrivals"]
    return (len(a) - 1) / (a[-1] - a[0])


async def stream(url: str, tokens: int) -> float:
    async with httpx.AsyncClient() as client:
        return tok_s(await stream_one(client, url, PROMPT, tokens))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--at", choices=["ready", "listening"], default="ready")
    p.add_argument("--settled", type=int, default=5, help="streams after the first one (default 5)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("flags", nargs="*", help="jaxsmol serve's flags (after --)")
    a = p.parse_args()
    port = free_port()
    url, t0 = f"http://127.0.0.1:{port}", time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", "--port", str(port), *a.flags],
                            stdout=subprocess.DEVNULL, stderr=sys.stderr)
    try:
        out = wait(url, proc, t0, a.at, {})
        first = asyncio.run(stream(url, a.tokens))
        wait(url, proc, t0, "ready", out)
        settled = [asyncio.run(stream(url, a.tokens)) for _ in range(a.settled)]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    median = statistics.median(settled) if settled else float("nan")
    print(json.dumps({**{k: round(v, 1) for k, v in out.items()}, "at": a.at, "first_tok_s": round(first, 1),
                      "settled_tok_s": [round(x, 1) for x in settled], "first_share": round(first / median, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
