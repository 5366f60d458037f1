"""The benchmark's sections (see cli/bench/__init__.py): each returns its rows for the JSON report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxsmol.cli.bench.measure import (Warmup, cold_warm_exact, log, measure_decode, measure_prefill, median, now,
                                       summarize_cells)
from jaxsmol.cli.bench.plans import HEADLINE, rand_ids, two_suffixes


def _mixed_prompt(rng, plan, docs, n: int, vocab: int) -> list[int]:
    """A prompt of n tokens: random (shares nothing), or a prefix of a document, its end changed half the time."""
    if rng.random() < plan["workload_random"]:
        return rand_ids(rng, n, vocab)
    prompt = list(docs[int(rng.integers(len(docs)))][:n])
    if rng.random() < 0.5:  # a different ending
        tail = min(int(rng.integers(1, 9)), n - 1)
        prompt[n - tail:] = rand_ids(rng, tail, vocab)
    return prompt


def section_compilations(engine, plan, rng) -> dict:
    """A mixed workload through the radix cache, after the programs its requests run were made ready
    (the closed set, compile_ahead.scheduler_calls): count the programs it makes ready itself (0 when
    the set is closed)."""
    from jaxsmol.cache.prefix_cache import PrefixCache
    from jaxsmol.cache.scheduler.compile_ahead import scheduler_calls
    from jaxsmol.cache.scheduler.many import generate
    from jaxsmol.cache.scheduler.scheduler import Scheduler
    from jaxsmol.runtime import programs
    from jaxsmol.runtime.sampling import SamplingParams

    vocab = engine.cfg.vocab_size
    max_prompt = max(2, min(plan["workload_max_prompt"], engine.ctx - plan["workload_max_tokens"]))
    docs = [rand_ids(rng, max_prompt, vocab) for _ in range(plan["workload_docs"])]
    cache = PrefixCache(engine)
    ahead = scheduler_calls(Scheduler(cache, max_batch=1))  # generate's
    programs.compile_all(ahead)
    before = _prepared()
    t0 = now()
    lengths = []
    for _ in range(plan["workload_requests"]):
        n = int(rng.integers(2, max_prompt + 1))
        prompt = _mixed_prompt(rng, plan, docs, n, vocab)
        max_tokens = int(rng.integers(1, plan["workload_max_tokens"] + 1))
        generate(cache, prompt, SamplingParams(max_tokens=max_tokens, logprobs=int(rng.integers(0, 3))))
        lengths.append(n)
    during = _prepared() - before
    s = cache.stats
    return {
        "requests": plan["workload_requests"], "prompt_min": min(lengths), "prompt_max": max(lengths),
        "max_tokens": [1, plan["workload_max_tokens"]], "programs_ahead": len(ahead), "programs_during": during,
        "closed": during == 0, "ctx": engine.ctx,
        "wall_s": now() - t0, "hits": s.hits, "exact_hits": s.exact_hits, "misses": s.misses,
        "tokens_reused": s.tokens_reused, "tokens_prefilled": s.tokens_prefilled,
    }


def _prepared() -> int:
    """Executables every program has made ready in this process (compiled, or loaded from the store)."""
    from jaxsmol.runtime import programs

    return sum(p.prepared for p in programs.ALL.values())


def section_prefill(engine, plan, rng, warm: Warmup) -> list[dict]:
    sizes = [n for n in plan["prefill"] if n + 1 <= engine.ctx]
    for n in sizes:
        warm.request(n)
    rows = []
    for n in sizes:
        ids = rand_ids(rng, n, engine.cfg.vocab_size)
        times = [measure_prefill(engine, ids) for _ in range(plan["prefill_repeats"])]
        s = median(times)
        rows.append({"tokens": n, "seconds": s, "tok_s": n / s, "repeats": times})
        log(f"prefill {n}: {n / s:.0f} tok/s")
    return rows


def section_decode(engine, plan, warm: Warmup) -> list[dict]:
    steps = plan["decode_steps"]
    positions = [p for p in plan["decode_positions"] if p + steps + 1 <= engine.ctx]
    for p in positions:
        warm.request(p, max_tokens=steps + 1)
    rows = []
    for p in positions:
        per_step = [measure_decode(engine, p, steps) for _ in range(plan["decode_repeats"])]
        s = median(per_step)
        rows.append({"position": p, "steps": steps, "ms_per_token": s * 1000, "tok_s": 1 / s, "repeats": per_step})
        log(f"decode at {p}: {1 / s:.1f} tok/s")
    return rows


def _ttft_row(engine, rng, repeats: int, p: int, s: int, mode: str, exact: bool) -> dict:
    """cold_warm_exact on fresh random prompts (a p-token prefix, two s-token suffixes), summarized."""
    vocab = engine.cfg.vocab_size
    runs = []
    for _ in range(repeats):
        prefix = rand_ids(rng, p, vocab)
        a, b = two_suffixes(rng, s, vocab)
        runs.append(cold_warm_exact(engine, mode, exact, prefix, a, b))
    return summarize_cells(runs, p, s, mode, exact)


def section_ttft(engine, plan, rng, warm: Warmup) -> dict:
    cells = [(p, s) for p in plan["ttft_prefixes"] for s in plan["ttft_suffixes"] if p + s + 1 <= engine.ctx]
    for p, s in cells + [HEADLINE]:
        warm.request(p + s, generated=1)
        for exact in (True, False):
            warm.request(p + s, start=p, generated=int(exact), exact=exact)
        warm.request(p + s, start=p + s - 1)  # single mode, same prompt again

    grid = []
    for exact in plan["ttft_exact"]:
        for p, s in cells:
            row = _ttft_row(engine, rng, plan["ttft_repeats"], p, s, "radix", exact)
            grid.append(row)
            log(f"ttft {p}+{s} exact={exact}: cold {row['cold_ttft_s'] * 1000:.1f} ms, "
                f"warm {row['warm_ttft_s'] * 1000:.1f} ms")
    p, s = HEADLINE
    headline_rows = []
    for mode, exact in plan["headline_modes"]:
        row = _ttft_row(engine, rng, plan["headline_repeats"], p, s, mode, exact)
        headline_rows.append(row)
        log(f"headline {mode} exact={exact}: warm/cold {row['warm_over_cold']:.3f}")
    h = headline_rows[0]
    headline = {"prefix": p, "suffix": s, "mode": "radix", "cold_ttft_s": h["cold_ttft_s"],
                "warm_ttft_s": h["warm_ttft_s"], "warm_over_cold": h["warm_over_cold"], "speedup": h["speedup"],
                "reused": h["warm_reused"], "prefilled": h["warm_prefilled"]}
    return {"grid": grid, "modes": headline_rows, "headline": headline}


def section_snapshot(engine, plan, rng, warm: Warmup) -> dict:
    from jaxsmol.cache.prefix_cache import PrefixCache
    from jaxsmol.cache.scheduler.many import generate
    from jaxsmol.runtime.sampling import SamplingParams

    vocab, trunk_n, branch_n = engine.cfg.vocab_size, plan["trunk"], plan["branch"]
    n_max = max(plan["branches"])
    trunk = rand_ids(rng, trunk_n, vocab)
    firsts = rng.choice(range(100, vocab), n_max, replace=False)
    branches = [[int(f)] + rand_ids(rng, branch_n - 1, vocab) for f in firsts]
    warm.request(trunk_n + branch_n)
    warm.request(trunk_n + branch_n, start=trunk_n)
    cache = PrefixCache(engine, save_generated=False)  # prompts only: trunk + one branch each
    bpt = engine.kv_bytes_per_token
    payload = 4 * vocab  # the last position's logits, kept per stored prompt for exact full hits
    rows = []
    for i, br in enumerate(branches, 1):
        generate(cache, trunk + br, SamplingParams(max_tokens=1))
        if i in plan["branches"]:
            held = cache.store.bytes_held
            full = i * (trunk_n + branch_n) * bpt
            rows.append({"n": i, "bytes_held": held, "kv_bytes_held": held - i * payload,
                         "full_copies_bytes": full, "held_over_full": held / full})
    return {"bytes_per_token": bpt, "trunk": trunk_n, "branch": branch_n, "logits_payload_bytes": payload,
            "rows": rows}


def _model_args(args) -> list[str]:
    from jaxsmol.cli.bench.daemon import model_flags

    return model_flags(args, default_ctx=None)


def _fresh_process(args, ids, cache_dir) -> dict:
    env = {**os.environ, "JAXSMOL_COMPILE_CACHE": str(cache_dir)}
    cmd = [sys.executable, "-m", "jaxsmol.cli.main", "generate", "--ids", *map(str, ids), "--max-tokens", "1", "--json",
           *_model_args(args)]
    t0 = now()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    wall = now() - t0
    if r.returncode != 0:
        raise RuntimeError(f"`jaxsmol generate` failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    t = json.loads(r.stdout)["timings"]
    entries = sum(1 for _ in Path(cache_dir).rglob("*") if _.is_file()) if str(cache_dir) != "off" else 0
    return {"wall_s": wall, "ttft_s": t["ttft_s"], "cache_files_after": entries}


def section_cli(args, engine, plan, rng) -> dict:
    ids = rand_ids(rng, min(plan["cli_prompt"], engine.ctx - 1), engine.cfg.vocab_size)
    without, with_ = [], []
    for _ in range(plan["cli_repeats"]):
        with tempfile.TemporaryDirectory(prefix="jaxsmol-xla-") as d:
            without.append(_fresh_process(args, ids, d))  # an empty cache: compiles, and fills it
            with_.append(_fresh_process(args, ids, d))  # the same cache, now warm

    def agg(rs):
        return {"wall_s": median([r["wall_s"] for r in rs]), "ttft_s": median([r["ttft_s"] for r in rs]),
                "cache_files_after": rs[-1]["cache_files_after"], "repeats": len(rs)}
    out = {"prompt": len(ids), "max_tokens": 1, "without_cache": agg(without), "with_cache": agg(with_)}
    out["ttft_with_over_without"] = out["with_cache"]["ttft_s"] / out["without_cache"]["ttft_s"]
    out["wall_with_over_without"] = out["with_cache"]["wall_s"] / out["without_cache"]["wall_s"]
    log(f"fresh process ttft: without {out['without_cache']['ttft_s']:.2f} s, with {out['with_cache']['ttft_s']:.2f} s")
    return out
