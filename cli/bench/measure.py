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
    """Before a measurement, compile what it will run, so that its timings exclude compilation:
    `Engine.warmup` for each cache capacity it uses, a restore into that capacity, and once the small
    programs around a request (sampling, an exact full hit). Each capacity is warmed once per process."""

    def __init__(self, engine):
        self.engine, self.capacities, self.requests_warm = engine, set(), False

    def request(self, n: int, start: int = 0, max_tokens: int = 1, generated: int = 0, exact: bool = True) -> None:
        """A request of n prompt tokens restored at `start`, generating max_tokens (exact=False: the
        cache's fast path); with `generated`, also the re-prefill of that many generated tokens that
        an exact radix cache runs to save them."""
        eng = self.engine
        exact = exact or start == 0  # a cold prefill is always exact
        slots = [eng.slots_needed(start, n, max_tokens, exact)]
        if generated:
            slots.append(eng.slots_needed(n, n + generated, 0))
        for s in slots:
            self.capacity(s)
        if not self.requests_warm:
            self.requests_warm = True
            from jaxsmol.cache.prefix_cache import PrefixCache
            from jaxsmol.cache.scheduler.many import generate
            from jaxsmol.runtime.sampling import SamplingParams

            cache = PrefixCache(eng)
            for _ in range(2):  # cold, then an exact full hit
                generate(cache, [100, 101, 102], SamplingParams(max_tokens=2))

    def capacity(self, slots: int) -> None:
        import numpy as np

        from jaxsmol.runtime.chunks import capacity_for
        from jaxsmol.model.kv import KVCache

        eng, cap = self.engine, capacity_for(slots)
        if cap in self.capacities:
            return
        eng.warmup(cap)
        c = eng.cfg
        one = np.zeros((c.n_layers, 1, c.n_kv_heads, 1, c.head_dim), eng.cache_dtype)  # [L, B, K, S, H]
        eng.restore(KVCache(k=one, v=one, pos=np.int32(1)), cap).k.block_until_ready()  # host -> this capacity
        self.capacities.add(cap)


def measure_prefill(engine, ids) -> float:
    """Seconds to prefill ids into a fresh cache (allocation included), logits on the host."""
    import numpy as np

    t0 = now()
    kv = engine.new_cache(engine.slots_needed(0, len(ids), 1))
    logits, kv = engine.prefill(ids, kv)
    np.asarray(logits)
    return now() - t0


def measure_decode(engine, position: int, steps: int) -> float:
    """Seconds per decode step at `position` (greedy, each token read back like a generation does).

    The cache is a zero state with pos = position in the capacity a real request of that length
    gets: a step's cost depends on the position and capacity, not on the values held."""
    import jax.numpy as jnp
    import numpy as np

    kv = engine.new_cache(engine.slots_needed(0, position, steps + 1))
    kv = kv.replace(pos=jnp.asarray(position, jnp.int32))
    token = 100
    t0 = now()
    for _ in range(steps):
        logits, kv = engine.decode(token, kv)
        token = int(np.argmax(np.asarray(logits[0])))
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
