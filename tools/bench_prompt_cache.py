#!/usr/bin/env python
"""Time to first token of a 1024-token prompt: cold, against its first 1008 tokens loaded from a
snapshot file (cache/disk.py) plus a 16-token suffix prefilled. Real default model, float32.

    JAX_PLATFORMS=cpu python tools/bench_prompt_cache.py [--repeat 5] [--prefix 1008] [--suffix 16]

Everything is compiled first (engine.warmup), and the file is read once before timing, so the
numbers compare compute and a page-cache read, not compilation or a cold disk. "disk" is the time to
load and verify the file and put it in a PrefixCache, plus the request's time to first token (the
answer's state saved after it is not counted; nor is it for cold).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from cache.disk import identity, load_prompt_cache, load_snapshot, save_prompt_cache
from cache.prefix_cache import PrefixCache
from jaxsmol import Engine, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--prefix", type=int, default=1008)
    ap.add_argument("--suffix", type=int, default=16)
    args = ap.parse_args()

    engine = Engine.load(ctx=2048, progress=False)
    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.integers(100, engine.cfg.vocab_size, args.prefix + args.suffix)]
    prefix = ids[: args.prefix]
    sp = SamplingParams(max_tokens=1)
    engine.warmup(len(ids) + 1)

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "prefix.safetensors"
        writer = PrefixCache(engine)
        writer.generate(prefix, SamplingParams(max_tokens=0))
        t0 = time.perf_counter()
        save_prompt_cache(writer, path, prefix)
        save_s = time.perf_counter() - t0
        size = path.stat().st_size

        cold_s, warm_s, load_s, outputs = [], [], [], set()
        load_snapshot(path, identity(engine), ids)  # page cache warm
        for _ in range(args.repeat):
            gen = engine.generate(ids, sp)
            cold_s.append(gen.timings.ttft_s)
            cold_logits = gen.prompt_logits

            t0 = time.perf_counter()
            cache = PrefixCache(engine)
            assert load_prompt_cache(cache, path, ids).loaded == args.prefix
            t1 = time.perf_counter()
            warm, report = cache.generate(ids, sp)
            warm_s.append(t1 - t0 + warm.timings.ttft_s)
            load_s.append(t1 - t0)
            assert report.reused == args.prefix and report.prefilled == args.suffix
            outputs.add(bool(np.array_equal(warm.prompt_logits, cold_logits)))

    med = statistics.median
    print(f"snapshot: {args.prefix} tokens, {size / 2**20:.1f} MiB, written in {save_s * 1000:.0f} ms")
    print(f"time to first token, cold ({len(ids)} tokens prefilled): median {med(cold_s) * 1000:.0f} ms  {[round(x * 1000) for x in cold_s]}")
    print(f"load {args.prefix} from disk + prefill {args.suffix}, to first token: median {med(warm_s) * 1000:.0f} ms  {[round(x * 1000) for x in warm_s]}")
    print(f"  of which load + verify + insert: median {med(load_s) * 1000:.0f} ms")
    print(f"speedup cold / disk: {med(cold_s) / med(warm_s):.1f}x; warm logits == cold logits: {outputs == {True}}")


if __name__ == "__main__":
    main()
