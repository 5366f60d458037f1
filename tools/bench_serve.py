"""Serving benchmark: concurrent streaming clients against `jaxsmol serve` (and optionally a peer).

    python tools/bench_serve.py [--clients 1 2 4 8 16] [--tokens 64] [--peer-url http://127.0.0.1:8090] [--no-long]

Starts a daemon (`--max-batch`, default 16) on a free loopback port, warms it up, then for each
client count runs that many concurrent streaming /v1/completions clients (each a different prompt,
`--tokens` sampled tokens, ignore_eos so every answer has the same length) and prints aggregate
decode tok/s (over the wall time: prompts and ramp included), the steady decode tok/s (while every
client streams), time to first token p50/p99 and inter-token latency p50/p99. Then the same with one
extra client that keeps sending ~1000-token prompts (max_tokens 1), to show decode beside prefill
(not with --no-long), and how many of them were answered while the clients ran and their median
time to the token (`longs`, `long_ttft`): a server whose slots are all taken queues them. Every row
has prompts of its own (a client count may be repeated: `--clients 8 16 8 16`), the same for
jaxsmol and the peer.
With --peer-url (e.g. llama.cpp's llama-server with as many slots), every row is measured on the
peer right after jaxsmol, in the same run, with the same client code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time

import httpx
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def stream_one(client: httpx.AsyncClient, url: str, prompt: str, tokens: int) -> dict:
    """One streaming completion: the arrival time of every token chunk."""
    body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 1.0, "seed": 1,
            "stream": True, "ignore_eos": True}
    t0, arrivals = time.perf_counter(), []
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    arrivals.append(time.perf_counter())
    return {"t0": t0, "arrivals": arrivals}


async def long_prompts(client, url, rng, stop: asyncio.Event) -> list[float]:
    """Send ~1000-token prompts (one answer token each) one after another until stopped: the seconds
    each took to its token (a server that queues it behind busy slots answers few of them)."""
    waits = []
    while not stop.is_set():
        r = await stream_one(client, url, text(rng, 700), 1)  # ~1000 tokens of prompt
        waits.append(r["arrivals"][0] - r["t0"] if r["arrivals"] else float("nan"))
    return waits


async def run_clients(url: str, clients: int, tokens: int, with_long: bool, seed: int) -> dict:
    rng = random.Random(seed)
    # no keep-alive: llama-server closes idle connections, and a pooled one then fails mid-run
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        stop = asyncio.Event()
        background = asyncio.create_task(long_prompts(client, url, rng, stop)) if with_long else None
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(stream_one(client, url, text(rng, 40), tokens) for _ in range(clients)))
        wall = time.perf_counter() - t0
        stop.set()
        long_waits = await background if background is not None else []
    ttft = [r["arrivals"][0] - r["t0"] for r in runs if r["arrivals"]]
    itl = [b - a for r in runs for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    n = sum(len(r["arrivals"]) for r in runs)
    # decode alone: the tokens that arrived while every client was streaming (after the last first
    # token, before the first last one), per second of that window; the wall figure adds the ramp
    # (every prompt prefilled) and the tail
    begin, end = max(r["arrivals"][0] for r in runs), min(r["arrivals"][-1] for r in runs)
    steady = sum(begin < t <= end for r in runs for t in r["arrivals"])
    return {"clients": clients, "long_prompts": with_long, "tokens": n, "tok_s": n / wall,
            "steady_tok_s": steady / (end - begin) if end > begin else float("nan"),
            "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)), "ttft_p99_ms": 1e3 * float(np.percentile(ttft, 99)),
            "itl_p50_ms": 1e3 * float(np.percentile(itl, 50)), "itl_p99_ms": 1e3 * float(np.percentile(itl, 99)),
            # the long prompts answered while the clients ran (the last one may finish after them)
            "long_answered": len(long_waits),
            "long_ttft_ms": 1e3 * float(np.median(long_waits)) if long_waits else float("nan")}


def start_daemon(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "cli.main", "serve", "--port", str(port), "--ctx", "2048",
           "--max-batch", str(args.max_batch), "--prefill-chunk", str(args.prefill_chunk)] + (
           ["--batch-invariant"] if args.batch_invariant else [])
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the daemon did not start")


def wait_idle(url: str, timeout_s: float = 300) -> None:
    """Wait until a jaxsmol daemon has no work left (/health "busy" and "compiling" false). After a
    row it stores the answers for their next turns (~16 x 64 tokens re-prefilled after 16 clients, a
    few seconds), and after its start it compiles the batched programs in the background (~1 min);
    the next row, on either server, must not run beside that. A peer without the fields is taken as
    idle."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        health = httpx.get(url + "/health", timeout=10).json()
        if not health.get("busy", False) and not health.get("compiling", False):
            return
        time.sleep(0.2)
    raise SystemExit(f"{url} still busy after {timeout_s} s")


def row(name: str, r: dict) -> str:
    return (f"{name:9} {r['clients']:3} {'yes' if r['long_prompts'] else 'no':>5} {r['tok_s']:8.1f} {r['steady_tok_s']:8.1f} "
            f"{r['ttft_p50_ms']:8.0f} {r['ttft_p99_ms']:8.0f} {r['itl_p50_ms']:7.0f} {r['itl_p99_ms']:7.0f}"
            + (f" {r['long_answered']:5} {r['long_ttft_ms']:8.0f}" if r["long_prompts"] else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--batch-invariant", action="store_true")
    p.add_argument("--prefill-chunk", type=int, default=48, help="the daemon's --prefill-chunk")
    p.add_argument("--peer-url", help="also measure this OpenAI-compatible server (e.g. llama-server)")
    p.add_argument("--no-long", action="store_true", help="skip the rows with long prompts arriving")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    proc, url = start_daemon(args)
    targets = [("jaxsmol", url)] + ([("peer", args.peer_url)] if args.peer_url else [])
    rows = []
    longs = (False,) if args.no_long else (False, True)
    try:
        for c in sorted(set(args.clients)):  # warm up: compile every width, growth and shrink on the way
            for with_long in longs:
                asyncio.run(run_clients(url, c, 12, with_long, seed=0))
        for name, u in targets[1:]:  # a peer compiles nothing; one call wakes it
            asyncio.run(run_clients(u, 1, 4, False, seed=0))
        print(f"{'server':9} {'clients':>3} {'long':>5} {'tok/s':>8} {'steady':>8} {'ttft50':>8} {'ttft99':>8} {'itl50':>7} {'itl99':>7}"
              f" {'longs':>5} {'long_ttft':>8}")
        for with_long in longs:
            for i, c in enumerate(args.clients):
                for name, u in targets:  # alternate servers row by row: same machine state for both
                    wait_idle(url)
                    # the same prompts for both servers, new ones for every row (a repeated row would
                    # find its prompts in either server's prompt cache)
                    r = asyncio.run(run_clients(u, c, args.tokens, with_long, seed=1000 * (i + 1) + c))
                    rows.append({"server": name, **r})
                    print(row(name, r), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
