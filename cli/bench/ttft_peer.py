"""`--only ttft-peer`: time to first token, cold and warm (a stored `--prefix`-token prefix, 1008 by
default, + `--suffix` 16 new tokens), jaxsmol against a peer server (`--peer-url`).

jaxsmol in process (PrefixCache, bitwise-exact default and `exact=False`), and an OpenAI-style
server with a prompt cache (llama.cpp's llama-server: `cache_prompt`; see clients.PromptCacheServer),
alternated round by round (`--rounds`) in one process. Each round uses fresh random token ids, so
nothing is shared between rounds:
  cold   the whole prompt (prefix + suffix), nothing stored;
  warm   the prefix was sent before (stored), then prefix + suffix is timed.
Without --peer-url, jaxsmol's two rows alone.
"""

from __future__ import annotations

import random

from jaxsmol.cli.bench.measure import log, median
from jaxsmol.cli.tables import format_table


def ours(engine, prefix, suffix, exact: bool) -> tuple[float, float]:
    """(cold s, warm s) to the first token of prefix + suffix (the answer's save for the next turn,
    which follows the token, is not counted)."""
    from jaxsmol.cache.prefix_cache import PrefixCache
    from jaxsmol.cache.probe import timed_request
    from jaxsmol.cache.scheduler.many import generate
    from jaxsmol.runtime.sampling import SamplingParams

    one = SamplingParams(max_tokens=1)
    cold = timed_request(PrefixCache(engine, mode="off"), prefix + suffix, one).ttft_s
    cache = PrefixCache(engine, exact=exact)
    generate(cache, prefix, one)
    return cold, timed_request(cache, prefix + suffix, one).ttft_s


def section_ttft_peer(engine, plan, peer_url: str | None) -> dict:
    p, s, rounds = plan["peer_prefix"], plan["peer_suffix"], plan["peer_rounds"]
    if p + s + 1 > engine.ctx:
        from jaxsmol.errors import JaxsmolError

        raise JaxsmolError(f"ttft-peer: --prefix {p} + --suffix {s} does not fit ctx {engine.ctx}")
    rng = random.Random(0)
    hi = min(40000, engine.cfg.vocab_size)

    def ids(n):
        return [rng.randrange(min(1000, hi // 2), hi) for _ in range(n)]
    ways = {"jaxsmol exact": lambda a, b: ours(engine, a, b, True),
            "jaxsmol fast": lambda a, b: ours(engine, a, b, False)}
    if peer_url:
        from jaxsmol.cli.bench.clients import PromptCacheServer

        ways["peer"] = PromptCacheServer(peer_url).cold_warm
    for f in ways.values():  # compile / wake up
        f(ids(p), ids(s))
    times = {name: ([], []) for name in ways}
    for _ in range(rounds):
        for name, f in ways.items():
            cold, warm = f(ids(p), ids(s))
            times[name][0].append(cold)
            times[name][1].append(warm)
    rows = []
    for name, (cold, warm) in times.items():
        c, w = median(cold), median(warm)
        rows.append({"way": name, "cold_ttft_s": c, "warm_ttft_s": w, "cold_over_warm": c / w,
                     "cold_repeats": cold, "warm_repeats": warm})
        log(f"ttft-peer {name}: cold {1e3 * c:.0f} ms, warm {1e3 * w:.0f} ms")
    return {"prefix": p, "suffix": s, "rounds": rounds, "peer_url": peer_url, "rows": rows}


def format_ttft_peer(t: dict) -> list[str]:
    peer = f"; peer {t['peer_url']}" if t["peer_url"] else ""
    return [format_table(["way", "cold ms", "warm ms", "cold/warm"],
                         [[r["way"], f"{1e3 * r['cold_ttft_s']:.0f}", f"{1e3 * r['warm_ttft_s']:.0f}",
                           f"{r['cold_over_warm']:.1f}x"] for r in t["rows"]],
                         title=f"time to first token, {t['prefix']} stored + {t['suffix']} new tokens, medians of "
                               f"{t['rounds']} alternated rounds{peer}")]


def plot_ttft_peer(ax, res: dict) -> None:
    rows = res["ttft-peer"]["rows"]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [1e3 * r["cold_ttft_s"] for r in rows], 0.4, label="cold")
    ax.bar([x + 0.2 for x in xs], [1e3 * r["warm_ttft_s"] for r in rows], 0.4, label="warm (stored prefix)")
    ax.set_xticks(list(xs), [r["way"] for r in rows])
    ax.set(title="time to first token, stored prefix" + (" vs a peer" if res["ttft-peer"]["peer_url"] else ""),
           ylabel="ms", yscale="log")
    ax.legend(fontsize=8)
