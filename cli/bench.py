"""`jaxsmol bench`: prefill and decode speed, prefix-cache time to first token, snapshot memory,
compilations and a fresh process's first token; optionally side by side with Hugging Face.

Every timed section runs after the programs it needs are compiled (compile time is excluded, except
in the fresh-process section, whose point is compile time), and reports the median of its repeats.
Sections:

  compilations  forward programs compiled by a mixed workload through the radix cache, vs compile_bound.
                Runs first, so that the count starts from a process that has compiled nothing.
  prefill       tokens/s of a cold prefill (no cache) of n tokens
  decode        tokens/s of decode steps at a short and a long position
  ttft          time to first token, cold (first request on an empty cache) vs warm (a prompt sharing a
                prefix with it) vs an exact full hit (the same prompt again), and the headline row
                (1008-token shared prefix + 16 new tokens) for each cache mode
  snapshot      bytes held by the radix store for n branches sharing a trunk, vs n full copies
  cli           a fresh `jaxsmol generate` process, without and with the persistent compilation cache
  hf            (--compare hf) the same prefill, decode and prefix reuse with Hugging Face transformers

TTFT here is what a caller sees: from `PrefixCache.start` (lookup, gather, restore) to the first
token, the snapshot save of a cold request included. Timings on a shared machine are noisy: the JSON
records the load average before and after.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SECTIONS = ("compilations", "prefill", "decode", "ttft", "snapshot", "cli")
HEADLINE = (1008, 16)  # the lab's question: a 1008-token shared prefix, then 16 new tokens

FULL = dict(
    prefill=(128, 512, 1024, 2048), prefill_repeats=3,
    decode_positions=(64, 2000), decode_steps=32, decode_repeats=3,
    ttft_prefixes=(128, 512, 1024, 2048), ttft_suffixes=(1, 16, 128), ttft_repeats=3, headline_repeats=5,
    ttft_exact=(True, False),
    headline_modes=(("radix", True), ("radix", False), ("minimal", True), ("off", True)),
    trunk=512, branch=32, branches=(1, 2, 4, 8),
    workload_requests=100, workload_docs=4, workload_random=0.25, workload_max_prompt=1500, workload_max_tokens=8,
    cli_prompt=1024, cli_repeats=2,
    hf_prefill=(512, 1024), hf_repeats=3,
)
QUICK = dict(
    FULL,
    prefill=(128, 512), prefill_repeats=2,
    decode_steps=8, decode_repeats=1,
    ttft_prefixes=(128,), ttft_repeats=1, headline_repeats=1,
    headline_modes=(("radix", True), ("radix", False), ("minimal", True)),
    workload_requests=12, workload_docs=1, workload_random=0.0,
    cli_prompt=128, cli_repeats=1,
    hf_repeats=1,
)


def _log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def _median(xs) -> float:
    return float(statistics.median(xs))


def _now() -> float:
    return time.perf_counter()


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ---- preparation ----------------------------------------------------------------------------------


class _Warm:
    """Compiles (by running once, on zeros) exactly the forward programs a measurement will use, so
    that its timings exclude compilation. Like Engine.warmup, but per (chunk length, capacity) pair
    and only for pairs not run yet in this process: warming every bucket of every capacity costs
    more compute than the quick benchmark itself."""

    def __init__(self, engine):
        self.engine, self.done = engine, set()

    def request(self, n: int, start: int = 0, max_tokens: int = 1, generated: int = 0, exact: bool = True) -> None:
        """A request of n prompt tokens restored at `start`, generating max_tokens (exact=False: the
        cache's fast path); with `generated`, also the re-prefill of that many generated tokens that
        an exact radix cache runs to save them."""
        from jaxsmol.engine import capacity_for, chunk_plan

        eng = self.engine
        exact = exact or start == 0  # a cold prefill is always exact
        cap = capacity_for(eng.slots_needed(start, n, max_tokens, exact))
        pairs = {(T, cap) for T in chunk_plan(n - start, exact)}
        if max_tokens > 1:
            pairs.add((1, cap))
        if generated:
            cap = capacity_for(eng.slots_needed(n, n + generated, 0))
            pairs |= {(T, cap) for T in chunk_plan(generated)}
        self.pairs(pairs)

    def pairs(self, pairs) -> None:
        import jax
        import jax.numpy as jnp
        import numpy as np

        from jaxsmol.programs import forward as _forward, sample as _sample
        from jaxsmol.kv import KVCache

        eng = self.engine
        dtype = eng.params.embed.dtype
        for T, cap in sorted(set(pairs) - self.done):
            kv = eng.new_cache(cap)
            tokens = jnp.asarray(np.zeros((1, T), np.int32))  # host -> device of this shape, as prefill does
            _forward(eng.params, tokens, jnp.int32(T), kv, eng.cfg)[0].block_until_ready()
            self.done.add((T, cap))
            if ("restore", cap) not in self.done:  # host snapshot -> device cache of this capacity
                c = eng.cfg
                one = np.zeros((c.n_layers, 1, 1, c.n_kv_heads, c.head_dim), dtype)
                eng.restore(KVCache(k=one, v=one, pos=np.int32(1)), cap).k.block_until_ready()
                self.done.add(("restore", cap))
        if "generation" not in self.done:  # the small programs around a request (sampling, keys, exact hit)
            from cache.prefix_cache import PrefixCache
            from jaxsmol.sampling import SamplingParams

            _sample(jnp.zeros((1, eng.cfg.vocab_size)), jax.random.key(0), jnp.float32(0), jnp.int32(0),
                    jnp.float32(1)).block_until_ready()
            cache = PrefixCache(eng)
            for _ in range(2):  # cold, then an exact full hit
                cache.generate([100, 101, 102], SamplingParams(max_tokens=2))
            self.done.add("generation")


def _rand_ids(rng, n: int, vocab: int) -> list[int]:
    """n ordinary token ids (cost does not depend on which ones)."""
    return [int(x) for x in rng.integers(100, vocab, n)]


def _two_suffixes(rng, n: int, vocab: int) -> tuple[list[int], list[int]]:
    """Two suffixes of n tokens whose first tokens differ, so a prompt ending in one shares with a
    prompt ending in the other exactly the prefix before them."""
    a = _rand_ids(rng, n, vocab)
    b = _rand_ids(rng, n, vocab)
    while b[0] == a[0]:
        b[0] = int(rng.integers(100, vocab))
    return a, b


# ---- measurements ----------------------------------------------------------------------------------


def measure_prefill(engine, ids) -> float:
    """Seconds to prefill ids into a fresh cache (allocation included), logits on the host."""
    import numpy as np

    t0 = _now()
    kv = engine.new_cache(engine.slots_needed(0, len(ids), 1))
    logits, kv = engine.prefill(ids, kv)
    np.asarray(logits)
    return _now() - t0


def measure_decode(engine, position: int, steps: int) -> float:
    """Seconds per decode step at `position` (greedy, each token read back like a generation does).

    The cache is a zero state with pos = position in the capacity a real request of that length
    gets: a step's cost depends on the position and capacity, not on the values held."""
    import jax.numpy as jnp
    import numpy as np

    kv = engine.new_cache(engine.slots_needed(0, position, steps + 1))
    kv = kv.replace(pos=jnp.asarray(position, jnp.int32))
    token = 100
    t0 = _now()
    for _ in range(steps):
        logits, kv = engine.decode(token, kv)
        token = int(np.argmax(np.asarray(logits[0])))
    return (_now() - t0) / steps


def timed_request(cache, prompt, max_tokens: int = 1) -> dict:
    """One request through the cache; TTFT from start() (lookup, restore) to the first token."""
    from jaxsmol.sampling import SamplingParams

    t0 = _now()
    req = cache.start(prompt, SamplingParams(max_tokens=max_tokens))
    it = iter(req)
    next(it)
    ttft = _now() - t0
    for _ in it:  # the rest, and the saves after the last token
        pass
    wall = _now() - t0
    r = req.report
    return {"ttft_s": ttft, "wall_s": wall, "engine_ttft_s": req.gen.timings.ttft_s, "reused": r.reused,
            "prefilled": r.prefilled, "exact_hit": r.exact_hit}


def _cold_warm_exact(engine, mode, exact, prefix, sfx_a, sfx_b) -> dict:
    """On a fresh cache: prefix+sfx_a cold, prefix+sfx_b warm (shares the prefix), prefix+sfx_b again."""
    from cache.prefix_cache import PrefixCache

    cache = PrefixCache(engine, mode=mode, exact=exact)
    cold = timed_request(cache, prefix + sfx_a)
    warm = timed_request(cache, prefix + sfx_b)
    again = timed_request(cache, prefix + sfx_b)
    return {"cold": cold, "warm": warm, "exact": again}


def _summarize_cells(runs: list[dict], prefix: int, suffix: int, mode: str, exact: bool) -> dict:
    med = {k: _median([r[k]["ttft_s"] for r in runs]) for k in ("cold", "warm", "exact")}
    wall = {k: _median([r[k]["wall_s"] for r in runs]) for k in ("cold", "warm", "exact")}
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


# ---- sections ------------------------------------------------------------------------------------


def section_compilations(engine, plan, rng) -> dict:
    """A mixed workload through the radix cache; count the forward programs it compiles."""
    from cache.prefix_cache import PrefixCache
    from jaxsmol.engine import compile_bound
    from jaxsmol.programs import forward as _forward
    from jaxsmol.sampling import SamplingParams

    vocab = engine.cfg.vocab_size
    max_prompt = max(2, min(plan["workload_max_prompt"], engine.ctx - plan["workload_max_tokens"]))
    docs = [_rand_ids(rng, max_prompt, vocab) for _ in range(plan["workload_docs"])]
    cache = PrefixCache(engine)
    before = _forward._cache_size()
    t0 = _now()
    lengths = []
    for _ in range(plan["workload_requests"]):
        n = int(rng.integers(2, max_prompt + 1))
        if rng.random() < plan["workload_random"]:
            prompt = _rand_ids(rng, n, vocab)  # shares nothing
        else:
            prompt = list(docs[int(rng.integers(len(docs)))][:n])
            if rng.random() < 0.5:  # a different ending
                tail = min(int(rng.integers(1, 9)), n - 1)
                prompt[n - tail:] = _rand_ids(rng, tail, vocab)
        max_tokens = int(rng.integers(1, plan["workload_max_tokens"] + 1))
        cache.generate(prompt, SamplingParams(max_tokens=max_tokens))
        lengths.append(n)
    after = _forward._cache_size()
    s = cache.stats
    return {
        "requests": plan["workload_requests"], "prompt_min": min(lengths), "prompt_max": max(lengths),
        "max_tokens": [1, plan["workload_max_tokens"]], "forward_programs": after - before,
        "bound": compile_bound(engine.ctx), "ctx": engine.ctx, "within_bound": after - before <= compile_bound(engine.ctx),
        "wall_s": _now() - t0, "hits": s.hits, "exact_hits": s.exact_hits, "misses": s.misses,
        "tokens_reused": s.tokens_reused, "tokens_prefilled": s.tokens_prefilled,
    }


def section_prefill(engine, plan, rng, warm: _Warm) -> list[dict]:
    sizes = [n for n in plan["prefill"] if n + 1 <= engine.ctx]
    for n in sizes:
        warm.request(n)
    rows = []
    for n in sizes:
        ids = _rand_ids(rng, n, engine.cfg.vocab_size)
        times = [measure_prefill(engine, ids) for _ in range(plan["prefill_repeats"])]
        s = _median(times)
        rows.append({"tokens": n, "seconds": s, "tok_s": n / s, "repeats": times})
        _log(f"prefill {n}: {n / s:.0f} tok/s")
    return rows


def section_decode(engine, plan, warm: _Warm) -> list[dict]:
    steps = plan["decode_steps"]
    positions = [p for p in plan["decode_positions"] if p + steps + 1 <= engine.ctx]
    for p in positions:
        warm.request(p, max_tokens=steps + 1)
    rows = []
    for p in positions:
        per_step = [measure_decode(engine, p, steps) for _ in range(plan["decode_repeats"])]
        s = _median(per_step)
        rows.append({"position": p, "steps": steps, "ms_per_token": s * 1000, "tok_s": 1 / s, "repeats": per_step})
        _log(f"decode at {p}: {1 / s:.1f} tok/s")
    return rows


def section_ttft(engine, plan, rng, warm: _Warm) -> dict:
    vocab = engine.cfg.vocab_size
    cells = [(p, s) for p in plan["ttft_prefixes"] for s in plan["ttft_suffixes"] if p + s + 1 <= engine.ctx]
    for p, s in cells + [HEADLINE]:
        warm.request(p + s, generated=1)
        for exact in (True, False):
            warm.request(p + s, start=p, generated=int(exact), exact=exact)
        warm.request(p + s, start=p + s - 1)  # minimal mode, same prompt again

    grid = []
    for exact in plan["ttft_exact"]:
        for p, s in cells:
            runs = []
            for _ in range(plan["ttft_repeats"]):
                prefix = _rand_ids(rng, p, vocab)
                a, b = _two_suffixes(rng, s, vocab)
                runs.append(_cold_warm_exact(engine, "radix", exact, prefix, a, b))
            row = _summarize_cells(runs, p, s, "radix", exact)
            grid.append(row)
            _log(f"ttft {p}+{s} exact={exact}: cold {row['cold_ttft_s'] * 1000:.1f} ms, "
                 f"warm {row['warm_ttft_s'] * 1000:.1f} ms")

    p, s = HEADLINE
    headline_rows = []
    for mode, exact in plan["headline_modes"]:
        runs = []
        for _ in range(plan["headline_repeats"]):
            prefix = _rand_ids(rng, p, vocab)
            a, b = _two_suffixes(rng, s, vocab)
            runs.append(_cold_warm_exact(engine, mode, exact, prefix, a, b))
        row = _summarize_cells(runs, p, s, mode, exact)
        headline_rows.append(row)
        _log(f"headline {mode} exact={exact}: warm/cold {row['warm_over_cold']:.3f}")
    h = headline_rows[0]
    headline = {"prefix": p, "suffix": s, "mode": "radix", "cold_ttft_s": h["cold_ttft_s"],
                "warm_ttft_s": h["warm_ttft_s"], "warm_over_cold": h["warm_over_cold"], "speedup": h["speedup"],
                "reused": h["warm_reused"], "prefilled": h["warm_prefilled"]}
    return {"grid": grid, "modes": headline_rows, "headline": headline}


def section_snapshot(engine, plan, rng, warm: _Warm) -> dict:
    from cache.prefix_cache import PrefixCache
    from jaxsmol.sampling import SamplingParams

    vocab, trunk_n, branch_n = engine.cfg.vocab_size, plan["trunk"], plan["branch"]
    n_max = max(plan["branches"])
    trunk = _rand_ids(rng, trunk_n, vocab)
    firsts = rng.choice(range(100, vocab), n_max, replace=False)
    branches = [[int(f)] + _rand_ids(rng, branch_n - 1, vocab) for f in firsts]
    warm.request(trunk_n + branch_n)
    warm.request(trunk_n + branch_n, start=trunk_n)
    cache = PrefixCache(engine, save_generated=False)  # prompts only: trunk + one branch each
    bpt = engine.kv_bytes_per_token
    payload = 4 * vocab  # the last position's logits, kept per stored prompt for exact full hits
    rows = []
    for i, br in enumerate(branches, 1):
        cache.generate(trunk + br, SamplingParams(max_tokens=1))
        if i in plan["branches"]:
            held = cache.radix.bytes_held
            full = i * (trunk_n + branch_n) * bpt
            rows.append({"n": i, "bytes_held": held, "kv_bytes_held": held - i * payload,
                         "full_copies_bytes": full, "held_over_full": held / full})
    return {"bytes_per_token": bpt, "trunk": trunk_n, "branch": branch_n, "logits_payload_bytes": payload,
            "rows": rows}


def _model_args(args) -> list[str]:
    out = []
    if args.model:
        out += ["--model", str(args.model)]
    if args.ctx:
        out += ["--ctx", str(args.ctx)]
    out += ["--dtype", args.dtype]
    return out


def _fresh_process(args, ids, cache_dir) -> dict:
    env = {**os.environ, "JAXSMOL_COMPILE_CACHE": str(cache_dir)}
    cmd = [sys.executable, "-m", "cli.main", "generate", "--ids", *map(str, ids), "--max-tokens", "1", "--json",
           *_model_args(args)]
    t0 = _now()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    wall = _now() - t0
    if r.returncode != 0:
        raise RuntimeError(f"`jaxsmol generate` failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    t = json.loads(r.stdout)["timings"]
    entries = sum(1 for _ in Path(cache_dir).rglob("*") if _.is_file()) if str(cache_dir) != "off" else 0
    return {"wall_s": wall, "ttft_s": t["ttft_s"], "cache_files_after": entries}


def section_cli(args, engine, plan, rng) -> dict:
    ids = _rand_ids(rng, min(plan["cli_prompt"], engine.ctx - 1), engine.cfg.vocab_size)
    without, with_ = [], []
    for _ in range(plan["cli_repeats"]):
        with tempfile.TemporaryDirectory(prefix="jaxsmol-xla-") as d:
            without.append(_fresh_process(args, ids, d))  # an empty cache: compiles, and fills it
            with_.append(_fresh_process(args, ids, d))  # the same cache, now warm
    def agg(rs):
        return {"wall_s": _median([r["wall_s"] for r in rs]), "ttft_s": _median([r["ttft_s"] for r in rs]),
                "cache_files_after": rs[-1]["cache_files_after"], "repeats": len(rs)}
    out = {"prompt": len(ids), "max_tokens": 1, "without_cache": agg(without), "with_cache": agg(with_)}
    out["ttft_with_over_without"] = out["with_cache"]["ttft_s"] / out["without_cache"]["ttft_s"]
    out["wall_with_over_without"] = out["with_cache"]["wall_s"] / out["without_cache"]["wall_s"]
    _log(f"fresh process ttft: without {out['without_cache']['ttft_s']:.2f} s, with {out['with_cache']['ttft_s']:.2f} s")
    return out


# ---- Hugging Face comparison -----------------------------------------------------------------------


def hf_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


class _HF:
    def __init__(self, model_dir):
        import inspect

        import warnings

        import torch
        import transformers
        from transformers import LlamaForCausalLM

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        warnings.filterwarnings("ignore", category=FutureWarning)
        self.torch = torch
        self.model = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
        params = inspect.signature(self.model.forward).parameters
        # only the last position's logits, like jaxsmol (and HF's own generate) computes
        self.last = ({"logits_to_keep": 1} if "logits_to_keep" in params else
                     {"num_logits_to_keep": 1} if "num_logits_to_keep" in params else {})
        # the KV cache argument: `cache` in recent transformers, `past_key_values` before
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    def forward(self, ids, past=None):
        with self.torch.inference_mode():
            out = self.model(input_ids=self.torch.tensor([ids]), use_cache=True, **{self.cache_arg: past}, **self.last)
        past = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        return int(out.logits[0, -1].argmax()), past

    def prefill(self, ids) -> float:
        t0 = _now()
        self.forward(ids)
        return _now() - t0

    def decode(self, position: int, steps: int, rng, vocab) -> float:
        token, past = self.forward(_rand_ids(rng, position, vocab))
        t0 = _now()
        for _ in range(steps):
            token, past = self.forward([token], past)
        return (_now() - t0) / steps

    def reuse(self, prefix, suffix) -> tuple[float, float]:
        """(cold TTFT of prefix + suffix, warm TTFT from a copy of the prefix's DynamicCache)."""
        t0 = _now()
        self.forward(prefix + suffix)
        cold = _now() - t0
        _, past = self.forward(prefix)
        t0 = _now()
        self.forward(suffix, copy.deepcopy(past))
        return cold, _now() - t0


def section_hf(engine, plan, rng, warm: _Warm) -> dict:
    import torch
    import transformers

    from cache.prefix_cache import PrefixCache

    vocab = engine.cfg.vocab_size
    hf = _HF(engine.model_dir)
    steps = plan["decode_steps"]
    sizes = [n for n in plan["hf_prefill"] if n + 1 <= engine.ctx]
    positions = [p for p in plan["decode_positions"] if p + steps + 1 <= engine.ctx]
    p, s = HEADLINE
    for n in sizes:
        warm.request(n)
    for q in positions:
        warm.request(q, max_tokens=steps + 1)
    warm.request(p + s, generated=1)
    warm.request(p + s, start=p, generated=1)
    hf.forward([100, 101])  # torch's first call sets things up
    samples: dict[str, dict[str, list]] = {}

    def add(name, j, h):
        d = samples.setdefault(name, {"jaxsmol": [], "hf": []})
        d["jaxsmol"].append(j)
        d["hf"].append(h)

    for _ in range(plan["hf_repeats"]):  # alternate the two engines, measurement by measurement
        for n in sizes:
            ids = _rand_ids(rng, n, vocab)
            add(f"prefill {n} (tok/s)", n / measure_prefill(engine, ids), n / hf.prefill(ids))
        for q in positions:
            add(f"decode at {q} (tok/s)", 1 / measure_decode(engine, q, steps), 1 / hf.decode(q, steps, rng, vocab))
        prefix = _rand_ids(rng, p, vocab)
        a, b = _two_suffixes(rng, s, vocab)
        cache = PrefixCache(engine)
        j_cold = timed_request(cache, prefix + a)["ttft_s"]
        j_warm = timed_request(cache, prefix + b)["ttft_s"]
        h_cold, h_warm = hf.reuse(prefix, b)
        add(f"ttft cold {p}+{s} (ms)", j_cold * 1000, h_cold * 1000)
        add(f"ttft warm {p}+{s} (ms)", j_warm * 1000, h_warm * 1000)
        add(f"warm/cold {p}+{s}", j_warm / j_cold, h_warm / h_cold)
    rows = []
    for name, d in samples.items():
        j, h = _median(d["jaxsmol"]), _median(d["hf"])
        rows.append({"metric": name, "jaxsmol": j, "hf": h, "jaxsmol_over_hf": j / h,
                     "higher_is_better": "tok/s" in name})
        _log(f"hf {name}: jaxsmol {j:.4g}, hf {h:.4g}")
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(), "dtype": "float32", "repeats": plan["hf_repeats"],
            "rows": rows}


# ---- output ------------------------------------------------------------------------------------------


def _table(title: str, header: list[str], rows: list[list]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title]
    for k, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _ms(s: float) -> str:
    return f"{s * 1000:.1f}"


def format_results(res: dict) -> str:
    out = []
    m = res["meta"]
    out.append(f"jaxsmol bench ({'quick' if m['quick'] else 'full'}): {m['model']}, {m['dtype']}, ctx {m['ctx']}, "
               f"{m['cpus']} CPUs, jax {m['jax']} on {m['backend']}, load avg {m['loadavg_start']} -> {m['loadavg_end']}")
    if "compilations" in res:
        c = res["compilations"]
        out.append(_table("XLA compilations (forward programs) over a mixed workload through the radix cache",
                          ["requests", "prompt", "max_tokens", "programs", "compile_bound(ctx)", "within"],
                          [[c["requests"], f"{c['prompt_min']}..{c['prompt_max']}", "1..%d" % c["max_tokens"][1],
                            c["forward_programs"], c["bound"], "yes" if c["within_bound"] else "NO"]]))
    if "prefill" in res:
        out.append(_table("prefill, cold (compile excluded)", ["tokens", "ms", "tok/s"],
                          [[r["tokens"], _ms(r["seconds"]), f"{r['tok_s']:.0f}"] for r in res["prefill"]]))
    if "decode" in res:
        out.append(_table("decode", ["position", "ms/token", "tok/s"],
                          [[r["position"], f"{r['ms_per_token']:.2f}", f"{r['tok_s']:.1f}"] for r in res["decode"]]))
    if "ttft" in res:
        t = res["ttft"]
        hdr = ["prefix+suffix", "mode", "cold ms", "warm ms", "warm/cold", "exact-hit ms", "exact/cold", "reused"]

        def mode_name(r):
            return r["mode"] + ("" if r["exact"] or r["mode"] != "radix" else " exact=False")
        out.append(_table("time to first token: cold (empty cache) vs warm (shared prefix) vs exact full hit",
                          hdr, [[f"{r['prefix']}+{r['suffix']}", mode_name(r), _ms(r["cold_ttft_s"]),
                                 _ms(r["warm_ttft_s"]), f"{r['warm_over_cold']:.3f}", _ms(r["exact_hit_ttft_s"]),
                                 f"{r['exact_over_cold']:.3f}", r["warm_reused"]] for r in t["grid"]]))
        out.append(_table(f"headline: {HEADLINE[0]}-token shared prefix + {HEADLINE[1]} new tokens, by cache mode",
                          hdr + ["cold wall ms"],
                          [[f"{r['prefix']}+{r['suffix']}", mode_name(r), _ms(r["cold_ttft_s"]), _ms(r["warm_ttft_s"]),
                            f"{r['warm_over_cold']:.3f}", _ms(r["exact_hit_ttft_s"]), f"{r['exact_over_cold']:.3f}",
                            r["warm_reused"], _ms(r["cold_wall_s"])] for r in t["modes"]]))
        h = t["headline"]
        out.append(f"HEADLINE {h['prefix']}+{h['suffix']} (radix): cold {_ms(h['cold_ttft_s'])} ms, "
                   f"warm {_ms(h['warm_ttft_s'])} ms, warm/cold {h['warm_over_cold']:.3f} ({h['speedup']:.1f}x faster)")
    if "snapshot" in res:
        sn = res["snapshot"]
        out.append(_table(f"snapshot memory: {sn['bytes_per_token']:,} bytes/token; n branches of {sn['branch']} "
                          f"tokens on a {sn['trunk']}-token trunk (held includes {sn['logits_payload_bytes']:,} "
                          "bytes of logits per prompt)",
                          ["n", "radix bytes held", "n full copies", "held/full"],
                          [[r["n"], f"{r['bytes_held']:,}", f"{r['full_copies_bytes']:,}", f"{r['held_over_full']:.3f}"]
                           for r in sn["rows"]]))
    if "cli" in res:
        c = res["cli"]
        out.append(_table(f"fresh `jaxsmol generate` process, {c['prompt']}-token prompt, 1 token",
                          ["compilation cache", "ttft s", "process wall s", "cache files"],
                          [["without (empty)", f"{c['without_cache']['ttft_s']:.2f}", f"{c['without_cache']['wall_s']:.2f}",
                            c["without_cache"]["cache_files_after"]],
                           ["with (warmed)", f"{c['with_cache']['ttft_s']:.2f}", f"{c['with_cache']['wall_s']:.2f}",
                            c["with_cache"]["cache_files_after"]]]))
    if "hf" in res:
        h = res["hf"]
        out.append(_table(f"jaxsmol vs Hugging Face transformers {h['transformers']} (torch {h['torch']}, "
                          f"{h['torch_threads']} threads, float32), alternating",
                          ["metric", "jaxsmol", "HF", "jaxsmol/HF", "jaxsmol is"],
                          [[r["metric"], f"{r['jaxsmol']:.4g}", f"{r['hf']:.4g}", f"{r['jaxsmol_over_hf']:.3f}",
                            _better(r)] for r in h["rows"]]))
    if m.get("section_wall_s"):
        out.append("section wall times (s): " + ", ".join(f"{k} {v}" for k, v in m["section_wall_s"].items())
                   + f"; total {m['wall_s']:.1f}")
    if "forward_programs_total" in res:
        out.append(f"forward programs compiled by this whole run: {res['forward_programs_total']} "
                   f"(compile_bound {res['meta']['compile_bound']}, with the exact=False fast path "
                   f"{res['meta']['compile_bound_fast']})")
    return "\n\n".join(out)


def _better(r: dict) -> str:
    x = r["jaxsmol_over_hf"]
    if not r["higher_is_better"]:
        if r["metric"].startswith("warm/cold"):
            return "-"
        x = 1 / x
    return f"{x:.2f}x {'faster' if x >= 1 else 'slower'}"


def write_plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    ax = axes[0, 0]
    if "prefill" in res:
        ax.plot([r["tokens"] for r in res["prefill"]], [r["tok_s"] for r in res["prefill"]], "o-", label="jaxsmol")
    for r in res.get("hf", {}).get("rows", []):
        if r["metric"].startswith("prefill"):
            n = int(r["metric"].split()[1])
            ax.plot([n], [r["jaxsmol"]], "D", color="C0", mfc="none", label="jaxsmol (alternating with HF)")
            ax.plot([n], [r["hf"]], "s", color="C1", label="HF")
    ax.set(title="prefill (cold)", xlabel="tokens", ylabel="tok/s", xscale="log")
    ax.set_ylim(bottom=0)
    handles, names = ax.get_legend_handles_labels()
    if handles:
        keep = {n: h for h, n in zip(handles, names)}  # one entry per label
        ax.legend(keep.values(), keep.keys())
    ax = axes[0, 1]
    if "decode" in res:
        ax.bar([str(r["position"]) for r in res["decode"]], [r["tok_s"] for r in res["decode"]])
    ax.set(title="decode", xlabel="position", ylabel="tok/s")
    ax = axes[0, 2]
    if "ttft" in res:
        rows = res["ttft"]["grid"] + res["ttft"]["modes"]
        labels = [f"{r['prefix']}+{r['suffix']}" + ("" if r in res["ttft"]["grid"] else f"\n{r['mode']}")
                  + ("" if r["exact"] else "\nexact=False") for r in rows]
        xs = range(len(rows))
        w = 0.28
        ax.bar([x - w for x in xs], [r["cold_ttft_s"] * 1000 for r in rows], w, label="cold")
        ax.bar(list(xs), [r["warm_ttft_s"] * 1000 for r in rows], w, label="warm (prefix)")
        ax.bar([x + w for x in xs], [r["exact_hit_ttft_s"] * 1000 for r in rows], w, label="exact hit")
        ax.set_xticks(list(xs), labels, rotation=60, fontsize=7)
        ax.set(title="time to first token", ylabel="ms", yscale="log")
        ax.legend(fontsize=8)
    ax = axes[1, 0]
    if "snapshot" in res:
        rows = res["snapshot"]["rows"]
        ax.plot([r["n"] for r in rows], [r["bytes_held"] / 2**20 for r in rows], "o-", label="radix (shared trunk)")
        ax.plot([r["n"] for r in rows], [r["full_copies_bytes"] / 2**20 for r in rows], "s--", label="n full copies")
        ax.set(title="snapshot memory", xlabel="branches", ylabel="MiB")
        ax.legend()
    ax = axes[1, 1]
    if "cli" in res:
        c = res["cli"]
        ax.bar(["ttft\nwithout", "ttft\nwith", "wall\nwithout", "wall\nwith"],
               [c["without_cache"]["ttft_s"], c["with_cache"]["ttft_s"], c["without_cache"]["wall_s"],
                c["with_cache"]["wall_s"]], color=["C3", "C2", "C3", "C2"])
        ax.set(title="fresh process: persistent compilation cache", ylabel="s")
    ax = axes[1, 2]
    if "hf" in res:
        rows = res["hf"]["rows"]
        vals = [(r["jaxsmol_over_hf"] if r["higher_is_better"] else 1 / r["jaxsmol_over_hf"]) for r in rows
                if not r["metric"].startswith("warm/cold")]
        names = [r["metric"] for r in rows if not r["metric"].startswith("warm/cold")]
        ax.barh(names, vals)
        ax.axvline(1, color="k", lw=0.8)
        ax.set(title="jaxsmol speed / HF speed (>1: jaxsmol faster)")
        ax.tick_params(axis="y", labelsize=7)
    elif "compilations" in res:
        c = res["compilations"]
        ax.bar(["programs", "bound"], [c["forward_programs"], c["bound"]])
        ax.set(title=f"forward programs over {c['requests']} mixed requests")
    m = res["meta"]
    fig.suptitle(f"jaxsmol bench: {m['model']} ({m['dtype']}), {m['cpus']} CPUs, load {m['loadavg_start']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- entry point ---------------------------------------------------------------------------------------


def run_bench(args) -> int:
    from jaxsmol.errors import JaxsmolError

    if args.compare == "hf" and not hf_available():
        raise JaxsmolError("--compare hf needs torch and transformers: pip install -e '.[hf]'")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise JaxsmolError("--plot needs matplotlib: pip install matplotlib")
    sections = list(args.only or SECTIONS)

    import jax
    import numpy as np

    from cli.common import load_engine
    from jaxsmol.engine import compile_bound
    from jaxsmol.programs import forward as _forward

    plan = QUICK if args.quick else FULL
    rng = np.random.default_rng(args.seed)
    load0 = _loadavg()
    t_start = _now()
    engine = load_engine(args)
    engine.fingerprint  # hashed once, outside every timing
    warm = _Warm(engine)
    res: dict = {"meta": {
        "model": str(engine.model_dir), "dtype": args.dtype, "ctx": engine.ctx, "quick": bool(args.quick),
        "seed": args.seed, "jax": jax.__version__, "backend": jax.default_backend(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "machine": platform.machine(), "loadavg_start": load0,
        "kv_bytes_per_token": engine.kv_bytes_per_token, "compile_bound": compile_bound(engine.ctx),
        "compile_bound_fast": compile_bound(engine.ctx, exact=False),
        "sections": sections + (["hf"] if args.compare == "hf" else []),
        "plan": {k: v for k, v in plan.items()},
    }}
    timings = res["meta"]["section_wall_s"] = {}

    def run(name, fn, *a):
        t0 = _now()
        res[name] = fn(*a)
        timings[name] = round(_now() - t0, 2)

    if "compilations" in sections:  # first: counts from a process that has compiled nothing yet
        _log("compilations: mixed workload")
        run("compilations", section_compilations, engine, plan, rng)
    if "prefill" in sections:
        run("prefill", section_prefill, engine, plan, rng, warm)
    if "decode" in sections:
        run("decode", section_decode, engine, plan, warm)
    if "ttft" in sections:
        run("ttft", section_ttft, engine, plan, rng, warm)
    if "snapshot" in sections:
        run("snapshot", section_snapshot, engine, plan, rng, warm)
    if "cli" in sections:
        run("cli", section_cli, args, engine, plan, rng)
    if args.compare == "hf":
        run("hf", section_hf, engine, plan, rng, warm)
    res["forward_programs_total"] = _forward._cache_size()
    res["meta"]["loadavg_end"] = _loadavg()
    res["meta"]["wall_s"] = _now() - t_start

    print(format_results(res))
    Path(args.json).write_text(json.dumps(res, indent=1))
    print(f"\nwrote {args.json}", file=sys.stderr)
    if args.plot:
        write_plot(res, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
