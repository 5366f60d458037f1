"""Self-consistency: n samples of one long question, batched (forks) against one run at a time.

    PYTHONPATH=$PWD python tools/bench_forks.py [--prompt-tokens 500] [--n 8] [--tokens 64] [--rounds 3]

Three ways to get n sampled answers (`--tokens` each, ignore_eos so every answer has the same
length) to one `--prompt-tokens` question, alternated round by round in one process (compile time
excluded by a warm-up round):
  sequential  n runs of `Engine.generate`, each prefilling the question from zero;
  cached      n runs through a PrefixCache: the first prefills, the others restore the question;
  batched     `PrefixCache.generate_many(..., n=n)`: one prefill, n forks decoded together.
Prints the medians and the speedups over `sequential` and `cached`.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from cache.prefix_cache import PrefixCache
from jaxsmol.engine import Engine
from jaxsmol.sampling import SamplingParams


def sequential(engine, prompt, sp, n):
    for i in range(n):
        list(engine.generate(prompt, dataclasses.replace(sp, seed=sp.seed + i)))


def cached(engine, prompt, sp, n):
    cache = PrefixCache(engine)
    for i in range(n):
        cache.generate(prompt, dataclasses.replace(sp, seed=sp.seed + i))


def batched(engine, prompt, sp, n):
    PrefixCache(engine).generate_many([prompt], sp, n=n, max_batch=n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-tokens", type=int, default=500)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    engine = Engine.load(progress=False)
    question = engine.tokenizer.encode("Question: how many apples are left? Think step by step. " * 60)
    prompt = question[: args.prompt_tokens]
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.8, seed=1, ignore_eos=True)
    ways = {"sequential": sequential, "cached": cached, "batched": batched}
    for f in ways.values():  # compile every program the timed rounds run (the same lengths, so the
        f(engine, prompt, sp, args.n)  # same cache capacities: a shorter warm-up left some to round 1)
    times = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, f in ways.items():
            t0 = time.perf_counter()
            f(engine, prompt, sp, args.n)
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"{args.n} samples x {args.tokens} tokens of one {len(prompt)}-token question, medians of {args.rounds}:")
    for name, s in med.items():
        print(f"  {name:10} {s:7.2f} s  {args.n * args.tokens / s:6.1f} tok/s  "
              f"sequential/this {med['sequential'] / s:4.2f}x  cached/this {med['cached'] / s:4.2f}x")


if __name__ == "__main__":
    main()
