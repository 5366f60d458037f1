"""Timers, warming up before a measurement, and the single measurements the sections repeat."""

from __future__ import annotations

import os
import statistics
import sys
import time


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def median(xs) -> float:
    return float(statistics.median(xs))


def now() -> float:
    return time.perf_counter()


def peak_rss_bytes() -> int | None:
    """This process's peak resident memory so far (weights, caches, compiled programs, Python)."""
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux (bytes on macOS)
    return kb if sys.platform == "darwin" else kb * 1024


def loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


class Warmup:
    """Before a measurement, compile what it will run, so that its timings exclude compilation: the
    programs a lone request runs (Engine.warmup: its prompt chunks in a row of the KV arena, its first
    token, a decode step), once per process, and once the small programs around a request (a restore,
    a save, an exact full hit)."""

    def __init__(self, engine):
        self.engine, self.requests_warm = engine, False

    def request(self, n: int, start: int = 0, max_tokens: int = 1, generated: int = 0, exact: bool = True) -> None:
        """A request of n prompt tokens restored at `start`, generating max_tokens (the arena's programs
        serve every length, exact or not; `generated`: the re-prefill that stores an answer)."""
        if not self.requests_warm:
            self.requests_warm = True
            from jaxsmol.cache.prefix_cache import PrefixCache
            from jaxsmol.cache.scheduler.many import generate
            from jaxsmol.runtime.sampling import SamplingParams

            self.engine.warmup()
            cache = PrefixCache(self.engine)
            for prompt in ([100, 101, 102], [100, 101, 102], [100, 101, 102, 103]):  # cold, exact hit, restore
                generate(cache, prompt, SamplingParams(max_tokens=2))


def measure_prefill(engine, ids) -> float:
    """Seconds to prefill ids into a row of the KV arena (as a request's prompt is), logits on the host."""
    import numpy as np

    arena = engine.arena()
    with arena.borrowed() as row:
        t0 = now()
        np.asarray(arena.fill(row, ids))
        return now() - t0


def measure_decode(engine, position: int, steps: int) -> float:
    """Seconds per decode step at `position` (greedy, sampled in the step and read back like a
    generation's), in a row of the KV arena holding a zero state up to that position: a step's cost
    depends on the position, not on the values held."""
    import numpy as np

    from jaxsmol.runtime.batch import free_mask, row_settings
    from jaxsmol.runtime.sampling import SamplingParams

    arena = engine.arena()
    settings = row_settings([SamplingParams()], [0], [None], free_mask(engine.cfg.vocab_size, 1))
    L, _, K, _, H = arena.shape
    zeros = np.zeros((L, 1, K, position, H), arena.dtype)  # written, so that its pages are real memory
    with arena.borrowed() as row:
        arena.restore(row, [{"k": zeros, "v": zeros}], 0, position)
        token = 100
        t0 = now()
        for _ in range(steps):
            token = int(arena.decode([row], np.array([token], np.int32), settings)["tokens"][0])
        return (now() - t0) / steps


def timed(cache, prompt) -> dict:
    """One request of one token through the cache (cache.probe.timed_request), as a plain row."""
    from jaxsmol.cache.probe import timed_request
    from jaxsmol.runtime.sampling import SamplingParams

    t = timed_request(cache, prompt, SamplingParams(max_tokens=1))
    return {"ttft_s": t.ttft_s, "wall_s": t.seconds, "engine_ttft_s": t.result.timings.ttft_s,
            "reused": t.report.reused, "prefilled": t.report.prefilled, "exact_hit": t.report.exact_hit}


def cold_warm_exact(engine, mode, exact, prefix, sfx_a, sfx_b) -> dict:
    """On a fresh cache: prefix+sfx_a cold, prefix+sfx_b warm (shares the prefix), prefix+sfx_b again."""
    from jaxsmol.cache.prefix_cache import PrefixCache

    cache = PrefixCache(engine, mode=mode, exact=exact)
    cold = timed(cache, prefix + sfx_a)
    warm = timed(cache, prefix + sfx_b)
    again = timed(cache, prefix + sfx_b)
    return {"cold": cold, "warm": warm, "exact": again}


def summarize_cells(runs: list[dict], prefix: int, suffix: int, mode: str, exact: bool) -> dict:
    """The medians over repeats of cold_warm_exact, and the reuse of the last repeat."""
    med = {k: median([r[k]["ttft_s"] for r in runs]) for k in ("cold", "warm", "exact")}
    wall = {k: median([r[k]["wall_s"] for r in runs]) for k in ("cold", "warm", "exact")}
    last = runs[-1]
    return {
        "mode": mode, "exact": exact, "prefix": prefix, "suffix": suffix, "prompt": prefix + suffix,
        "cold_ttft_s": med["cold"], "warm_ttft_s": med["warm"], "exact_hit_ttft_s": med["exact"],
        "warm_over_cold": med["warm"] / med["cold"], "exact_over_cold": med["exact"] / med["cold"],
        "speedup": med["cold"] / med["warm"],
        "cold_wall_s": wall["cold"], "warm_wall_s": wall["warm"], "exact_wall_s": wall["exact"],
        "warm_reused": last["warm"]["reused"], "warm_prefilled": last["warm"]["prefilled"],
        "exact_reused": last["exact"]["reused"], "exact_is_full_hit": last["exact"]["exact_hit"],
        "repeats": len(runs),
    }
