"""`--only forks`: self-consistency, n samples of one long question, batched (forks) against one run
at a time.

Three ways to get `--samples` sampled answers (`--tokens` each, ignore_eos so every answer has the
same length) to one `--prompt-tokens` question, alternated round by round (`--rounds`) in one
process (compile time excluded by a warm-up round):
  sequential  n runs of `Engine.generate`, each prefilling the question from zero;
  cached      n runs through a PrefixCache: the first prefills, the others restore the question;
  batched     `generate_many(cache, ..., n=n)`: one prefill, n forks decoded together.
Reports the medians and the speedups over `sequential` and `cached`.
"""

from __future__ import annotations

import dataclasses

from jaxsmol.cache.scheduler.many import generate
from jaxsmol.cli.bench.measure import log, median, now
from jaxsmol.cli.tables import format_table


def sequential(engine, prompt, sp, n):
    for i in range(n):
        generate(engine, prompt, dataclasses.replace(sp, seed=sp.seed + i))


def cached(engine, prompt, sp, n):
    from jaxsmol.cache.prefix_cache import PrefixCache

    cache = PrefixCache(engine)
    for i in range(n):
        generate(cache, prompt, dataclasses.replace(sp, seed=sp.seed + i))


def batched(engine, prompt, sp, n):
    from jaxsmol.cache.scheduler.many import generate_many
    from jaxsmol.cache.prefix_cache import PrefixCache

    generate_many(PrefixCache(engine), [prompt], sp, n=n, max_batch=n)


WAYS = {"sequential": sequential, "cached": cached, "batched": batched}


def section_forks(engine, plan) -> dict:
    from jaxsmol.runtime.sampling import SamplingParams

    n, tokens, rounds = plan["forks_n"], plan["forks_tokens"], plan["forks_rounds"]
    question = engine.tokenizer.encode("Question: how many apples are left? Think step by step. " * 60)
    prompt = question[: min(plan["forks_prompt"], engine.ctx - tokens - 1)]
    sp = SamplingParams(max_tokens=tokens, temperature=0.8, seed=1, ignore_eos=True)
    for f in WAYS.values():  # compile every program the timed rounds run (the same lengths, so the
        f(engine, prompt, sp, n)  # same cache capacities: a shorter warm-up left some to round 1)
    times = {name: [] for name in WAYS}
    for _ in range(rounds):
        for name, f in WAYS.items():
            t0 = now()
            f(engine, prompt, sp, n)
            times[name].append(now() - t0)
    med = {name: median(t) for name, t in times.items()}
    rows = [{"way": name, "seconds": s, "tok_s": n * tokens / s, "sequential_over_this": med["sequential"] / s,
             "cached_over_this": med["cached"] / s, "repeats": times[name]} for name, s in med.items()]
    log(f"forks: batched {med['batched']:.2f} s, sequential {med['sequential']:.2f} s, cached {med['cached']:.2f} s")
    return {"prompt": len(prompt), "samples": n, "tokens": tokens, "rounds": rounds, "rows": rows}


def format_forks(f: dict) -> list[str]:
    return [format_table(["way", "s", "tok/s", "sequential/this", "cached/this"],
                         [[r["way"], f"{r['seconds']:.2f}", f"{r['tok_s']:.1f}", f"{r['sequential_over_this']:.2f}x",
                           f"{r['cached_over_this']:.2f}x"] for r in f["rows"]],
                         title=f"self-consistency: {f['samples']} samples x {f['tokens']} tokens of one "
                               f"{f['prompt']}-token question, medians of {f['rounds']} alternated rounds")]


def plot_forks(ax, res: dict) -> None:
    f = res["forks"]
    ax.bar([r["way"] for r in f["rows"]], [r["seconds"] for r in f["rows"]], color=["C3", "C1", "C2"])
    ax.set(title=f"{f['samples']} samples of one {f['prompt']}-token question", ylabel="s")
