"""Traffic whose fields vary as real clients' do, against a running daemon, and what it did to the daemon.

python tools/profile_mixed_traffic.py URL [--pid PID] [--requests 200] [--leavers 64] [--clients 8]
    [--seed 0] [--words-seed S] [--plain] [--itl] [--idle 60]

Sends --requests bodies over --clients threads, each picking its own route (completions or chat), prompt
length (3-1500 tokens of text), n, max_tokens, temperature, top_k, top_p, seed, stop strings, logprobs /
top_logprobs, echo, prompt_logprobs, a JSON schema, and stream; then --leavers streams that leave after
three chunks. --plain sends plain bodies instead (a prompt and max_tokens of the same lengths, a
temperature). --words-seed draws the prompts' words apart from the fields: two runs with one --seed and
two --words-seed send the same field combinations with other prompts (a daemon that compiled for new
combinations stalls in the first alone). --itl also runs one long greedy stream beside the traffic and
prints its inter-token latencies (p50, p99, max). Prints
/metrics' programs and memory gauges, and the resident set and its peak read from /proc/PID/status
(--pid: the daemon's process), before, after the requests, after the leavers and after --idle seconds idle. Each
phase's 5xx count too. A maintainer's measurement (docs/performance.md), not a test.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import re
import threading
import time

import httpx

WORDS = ("the of and a to in is you that it he was for on are as with his they at be this have from or one had "
         "by word but not what all were we when your can said there use an each which she do how their if will "
         "up other about out many then them these so some her would make like him into time has look two more "
         "write go see number no way could people my than first water been call who its now find long down day").split()
LENGTHS = (3, 5, 10, 30, 60, 120, 250, 400, 700, 1000, 1500)  # words of a prompt
MAX_TOKENS = (1, 2, 5, 16, 32, 64)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
GAUGES = ("programs", "programs_after_ready", "resident_bytes", "unaccounted_bytes", "cache_bytes", "batch_kv_bytes",
          "batch_kv_reserved_bytes", "pool_bytes", "heap_free_bytes", "programs_bytes")


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def varied(rng: random.Random, words_rng: random.Random) -> tuple[str, dict]:
    """A (route, body) with every field drawn as a client might send it."""
    chat = rng.random() < 0.5
    body = {"max_tokens": rng.choice(MAX_TOKENS), "temperature": rng.choice([0, 0.5, 1.0, 1.3])}
    if rng.random() < 0.3:
        body["top_k"] = rng.choice([1, 5, 40, 200])
    if rng.random() < 0.3:
        body["top_p"] = rng.choice([0.5, 0.9, 0.99])
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(1000)
    if rng.random() < 0.3:
        body["n"] = rng.choice([2, 3, 4, 5, 8])
    if rng.random() < 0.2:
        body["stop"] = rng.choice(["\n", [".", "the"], "zzz"])
    if rng.random() < 0.1:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    stream = rng.random() < 0.4
    if stream:
        body["stream"] = True
    words = rng.choice(LENGTHS)
    if chat:
        body["messages"] = [{"role": "user", "content": text(words_rng, words)}]
        if rng.random() < 0.4:
            body.update(logprobs=True, top_logprobs=rng.choice([0, 1, 3, 5, 20]))
        return "/v1/chat/completions", body
    body["prompt"] = text(words_rng, words)
    if rng.random() < 0.4:
        body["logprobs"] = rng.choice([0, 1, 2, 5])
    if rng.random() < 0.2 and not stream:
        body["echo"] = True
    if rng.random() < 0.1 and not stream:
        body["prompt_logprobs"] = rng.choice([0, 1, 5])
    return "/v1/completions", body


def plain(rng: random.Random, words_rng: random.Random) -> tuple[str, dict]:
    """The same prompt lengths and answer lengths as `varied`, no other field."""
    return "/v1/completions", {"prompt": text(words_rng, rng.choice(LENGTHS)), "max_tokens": rng.choice(MAX_TOKENS),
                               "temperature": 0.8}


def send(url: str, route: str, body: dict, leave_after: int | None = None) -> int:
    with httpx.Client(timeout=600) as client:
        if not body.get("stream"):
            return client.post(url + route, json=body).status_code
        with client.stream("POST", url + route, json=body) as r:
            for i, _ in enumerate(r.iter_lines()):
                if leave_after is not None and i >= leave_after:
                    break
            return r.status_code


def snapshot(url: str, pid: int | None) -> dict:
    page = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for name in GAUGES:
        m = re.search(rf"^jaxsmol_{name} (\S+)$", page, re.M)
        out[name] = float(m.group(1)) if m else None
    if pid is not None:  # the resident set and its peak since the daemon started, as the OS reads them
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        out["proc_rss"], out["proc_peak_rss"] = (int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))
    return out


def show(tag: str, snap: dict) -> None:
    mb = {k: (round(v / 2**20) if k.endswith(("bytes", "rss")) and v is not None else v) for k, v in snap.items()}
    print(f"{tag}: {json.dumps(mb)} (MB)", flush=True)


def itl_stream(url: str, stop: threading.Event, out: list) -> None:
    """One long greedy stream after another until `stop`, recording the gaps between its tokens."""
    body = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 200, "temperature": 0,
            "stream": True, "ignore_eos": True}
    while not stop.is_set():
        with httpx.Client(timeout=600) as client, client.stream("POST", url + "/v1/completions", json=body) as r:
            last = None
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                if last is not None:
                    out.append(now - last)
                last = now


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("--pid", type=int)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--leavers", type=int, default=64)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--words-seed", type=int, help="the prompts' words drawn apart from the fields (default: --seed): "
                   "the same field combinations again with other prompts")
    p.add_argument("--plain", action="store_true")
    p.add_argument("--itl", action="store_true")
    p.add_argument("--idle", type=float, default=0)
    args = p.parse_args()
    url, rng = args.url.rstrip("/"), random.Random(args.seed)
    words_rng = rng if args.words_seed is None else random.Random(args.words_seed)
    bodies = [(plain if args.plain else varied)(rng, words_rng) for _ in range(args.requests)]
    show("before", snapshot(url, args.pid))
    gaps, stop = [], threading.Event()
    streamer = threading.Thread(target=itl_stream, args=(url, stop, gaps), daemon=True) if args.itl else None
    if streamer:
        streamer.start()
    t0, statuses = time.perf_counter(), {}
    with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
        for status in pool.map(lambda rb: send(url, *rb), bodies):
            statuses[status] = statuses.get(status, 0) + 1
    print(f"{args.requests} requests in {time.perf_counter() - t0:.1f} s: statuses {statuses}", flush=True)
    stop.set()
    if streamer:
        streamer.join()
        gaps.sort()
        q = lambda f: 1000 * gaps[min(len(gaps) - 1, int(f * len(gaps)))]  # noqa: E731
        print(f"the long stream beside them: {len(gaps)} gaps, ITL p50 {q(0.5):.1f} ms, p99 {q(0.99):.1f} ms, "
              f"max {1000 * gaps[-1]:.1f} ms", flush=True)
    show("after the requests", snapshot(url, args.pid))
    leaving = {"prompt": text(rng, 50), "max_tokens": 64, "stream": True, "temperature": 1.0}
    with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(lambda _: send(url, "/v1/completions", dict(leaving, prompt=text(rng, rng.choice([5, 50, 300]))),
                                     leave_after=3), range(args.leavers)))
    time.sleep(1)
    show(f"after {args.leavers} streams that left after 3 chunks", snapshot(url, args.pid))
    if args.idle:
        time.sleep(args.idle)
        show(f"after {args.idle:.0f} s idle", snapshot(url, args.pid))


if __name__ == "__main__":
    main()
