"""Time to first token, cold and warm (a stored 1008-token prefix + 16 new tokens), against a peer.

    PYTHONPATH=$PWD python tools/bench_ttft_peer.py --peer-url http://127.0.0.1:8020 [--rounds 5]

jaxsmol in process (PrefixCache, bitwise-exact default and `exact=False`), and an OpenAI-style
server with a prompt cache (llama.cpp's llama-server: `cache_prompt`), alternated round by round in
one process. Each round uses fresh random token ids, so nothing is shared between rounds:
  cold   the whole prompt (prefix + suffix), nothing stored;
  warm   the prefix was sent before (stored), then prefix + suffix is timed.
A peer request is /completion with token ids and n_predict 1 (llama.cpp's native route: no text
round trip); its time includes HTTP on loopback (~1 ms).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import httpx

from cache.prefix_cache import PrefixCache
from cache.probe import timed_request
from jaxsmol.engine import Engine
from jaxsmol.sampling import SamplingParams

ONE = SamplingParams(max_tokens=1)


def ours(engine, prefix, suffix, exact: bool) -> tuple[float, float]:
    """(cold s, warm s) to the first token of prefix + suffix (the answer's save for the next turn,
    which follows the token, is not counted)."""
    cold = timed_request(PrefixCache(engine, mode="off"), prefix + suffix, ONE).ttft_s
    cache = PrefixCache(engine, exact=exact)
    cache.generate(prefix, ONE)
    return cold, timed_request(cache, prefix + suffix, ONE).ttft_s


def peer(url, prefix, suffix) -> tuple[float, float]:
    def ask(ids, cache_prompt=True):
        t0 = time.perf_counter()
        r = httpx.post(url + "/completion", json={"prompt": ids, "n_predict": 1, "cache_prompt": cache_prompt,
                                                  "temperature": 0}, timeout=600)
        r.raise_for_status()
        return time.perf_counter() - t0
    cold = ask(prefix + suffix, cache_prompt=False)
    ask(prefix)
    return cold, ask(prefix + suffix)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer-url")
    p.add_argument("--prefix", type=int, default=1008)
    p.add_argument("--suffix", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    engine = Engine.load(progress=False)
    rng = random.Random(0)

    def ids(n):
        return [rng.randrange(1000, 40000) for _ in range(n)]
    ways = {"jaxsmol exact": lambda a, b: ours(engine, a, b, True),
            "jaxsmol fast": lambda a, b: ours(engine, a, b, False)}
    if args.peer_url:
        ways["peer"] = lambda a, b: peer(args.peer_url, a, b)
    for f in ways.values():  # compile / wake up
        f(ids(args.prefix), ids(args.suffix))
    times = {name: ([], []) for name in ways}
    for _ in range(args.rounds):
        for name, f in ways.items():
            cold, warm = f(ids(args.prefix), ids(args.suffix))
            times[name][0].append(cold)
            times[name][1].append(warm)
    print(f"{args.prefix} stored + {args.suffix} new tokens, medians of {args.rounds} alternated rounds:")
    for name, (cold, warm) in times.items():
        c, w = statistics.median(cold), statistics.median(warm)
        print(f"  {name:14} cold {1e3 * c:7.0f} ms  warm {1e3 * w:6.0f} ms  cold/warm {c / w:5.1f}x")


if __name__ == "__main__":
    main()
