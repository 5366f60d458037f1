"""The HTTP side of the serving sections: concurrent streaming /v1/completions clients, and one
prompt's time to its first token from a server with a prompt cache. Any OpenAI-compatible server
(`jaxsmol serve`, llama.cpp's llama-server, vLLM) is measured with the same code.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import numpy as np

WORDS = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()


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


def _pct(xs, q) -> float:
    return 1e3 * float(np.percentile(xs, q)) if len(xs) else float("nan")


def summarize(runs: list[dict], wall: float, long_waits: list[float]) -> dict:
    """The figures of one row of clients: tok/s over the wall time and while every client streams,
    time to first token and inter-token latency percentiles, the long prompts answered meanwhile."""
    ttft = [r["arrivals"][0] - r["t0"] for r in runs if r["arrivals"]]
    itl = [b - a for r in runs for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    n = sum(len(r["arrivals"]) for r in runs)
    # decode alone: the tokens that arrived while every client was streaming (after the last first
    # token, before the first last one), per second of that window; the wall figure adds the ramp
    # (every prompt prefilled) and the tail
    begin, end = max(r["arrivals"][0] for r in runs), min(r["arrivals"][-1] for r in runs)
    steady = sum(begin < t <= end for r in runs for t in r["arrivals"])
    return {"tokens": n, "tok_s": n / wall,
            "steady_tok_s": steady / (end - begin) if end > begin else float("nan"),
            "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
            "itl_p50_ms": _pct(itl, 50), "itl_p99_ms": _pct(itl, 99),
            # the long prompts answered while the clients ran (the last one may finish after them)
            "long_answered": len(long_waits),
            "long_ttft_ms": 1e3 * float(np.median(long_waits)) if long_waits else float("nan")}


async def run_clients(url: str, clients: int, tokens: int, with_long: bool, seed: int) -> dict:
    """`clients` concurrent streaming clients (each its own prompt, `tokens` tokens), with one more
    sending long prompts beside them when `with_long`."""
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
    return {"clients": clients, "long_prompts": with_long, **summarize(runs, wall, long_waits)}


def clients_row(url: str, clients: int, tokens: int, with_long: bool, seed: int) -> dict:
    return asyncio.run(run_clients(url, clients, tokens, with_long, seed))


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
    raise RuntimeError(f"{url} still busy after {timeout_s} s")


class PromptCacheServer:
    """A server with a prompt cache, asked for one token of a prompt of token ids: llama.cpp's native
    /completion route (`cache_prompt`, no text round trip); a server without it (404) is asked on
    /v1/completions with the ids as the prompt (`use_prefix_cache`, jaxsmol's switch, for
    `cache_prompt`). The time includes HTTP on loopback (~1 ms)."""

    def __init__(self, url: str):
        self.url, self.native = url.rstrip("/"), True

    def ask(self, ids: list[int], cache_prompt: bool = True) -> float:
        t0 = time.perf_counter()
        if self.native:
            r = httpx.post(self.url + "/completion", json={"prompt": ids, "n_predict": 1, "cache_prompt": cache_prompt,
                                                           "temperature": 0}, timeout=600)
            if r.status_code == 404:
                self.native = False
                return self.ask(ids, cache_prompt)
        else:
            r = httpx.post(self.url + "/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": 1,
                                                               "temperature": 0, "cache_prompt": cache_prompt,
                                                               "use_prefix_cache": cache_prompt}, timeout=600)
        r.raise_for_status()
        return time.perf_counter() - t0

    def cold_warm(self, prefix: list[int], suffix: list[int]) -> tuple[float, float]:
        """(cold s, warm s): prefix + suffix uncached, then the prefix sent (stored) and prefix + suffix timed."""
        cold = self.ask(prefix + suffix, cache_prompt=False)
        self.ask(prefix)
        return cold, self.ask(prefix + suffix)
