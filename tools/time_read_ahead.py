"""Time what a shared-cache read costs the streams already running (cache/fetch.py: the lower tiers read ahead).

    python tools/time_read_ahead.py [--prefix 2000] [--suffix 16] [--rounds 3] [--backend dir|redis] [--model PATH]

Replica A (an engine over the bundled model's weights) computes a prefix, its whole chunks written to a
shared store (a directory in a temporary folder, or a redis-server started on a free loopback port). Replica
B (a second engine over the same weights) runs one greedy stream; once it decodes, a request for the prefix
plus new tokens is submitted. Each round runs that twice, alternated, on empty memories: the prefix read
ahead on the fetch thread (the default), and read at admission on the scheduler's thread (plan_fetch off).
Per way, medians of the rounds: the stream's longest and median gap between two tokens from the request's
submission to its first token, the request's time to first token, and whether its tokens and logprobs equal
B's cold run's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def one_run(b, store_b, prompt, stream_ids, ahead: bool) -> dict:
    """B's stream, and the request for `prompt` submitted once the stream decodes: the stream's gaps
    while the request waits for its first token, its time to first token, its result."""
    from jaxsmol.cache.prefix_cache import PrefixCache
    from jaxsmol.cache.scheduler.requests import Collector, Request
    from jaxsmol.cache.scheduler.scheduler import Scheduler
    from jaxsmol.runtime.sampling import SamplingParams

    cache = PrefixCache(b, shared=store_b)
    if not ahead:  # as before reading ahead: the lookup reads at admission, on this thread
        cache.plan_fetch = lambda *args, **kwargs: None
    sched = Scheduler(cache, max_batch=4)
    times: list[float] = []
    stream = Request(stream_ids, [SamplingParams(max_tokens=150, ignore_eos=True)],
                     Collector(on_token=lambda _, step: times.append(time.perf_counter())))
    sched.submit(stream)
    while len(times) < 8:
        sched.step()
    warm = Request(prompt, [SamplingParams(max_tokens=4, logprobs=2)], Collector(), detail=True)
    submitted = time.perf_counter()
    sched.submit(warm)
    while not warm.sink.results:
        sched.step()
    first = submitted + warm.sink.results[0].timings.ttft_s
    stream.sink.cancel = True
    sched.run()
    during = [t for t in times if submitted <= t <= first]
    spans = [b_ - a_ for a_, b_ in zip([submitted] + during, during + [first])]
    return {"worst": max(spans), "median": statistics.median(spans), "ttft": first - submitted,
            "result": warm.sink.results[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", type=int, default=2000)
    ap.add_argument("--suffix", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="dir", choices=["dir", "redis"])
    ap.add_argument("--model", help="default: the bundled SmolLM2-135M-Instruct")
    args = ap.parse_args()

    from jaxsmol.cache.prefix_cache import PrefixCache
    from jaxsmol.cache.scheduler.many import generate
    from jaxsmol.cache.store.shared import SharedStore, model_identity
    from jaxsmol.cache.store.shared_backends import open_backend
    from jaxsmol.cli.replicas import RedisServer, start_redis, stop, wait_until
    from jaxsmol.runtime.engine import Engine
    from jaxsmol.runtime.sampling import SamplingParams

    ctx = args.prefix + args.suffix + 256
    a = Engine.load(args.model, ctx=ctx, progress=False)
    b = Engine(a.cfg, a.params, a.tokenizer, ctx=ctx, model_dir=a.model_dir, source=a.source)
    ident, server = model_identity(a), None
    if args.backend == "redis":
        server = start_redis(Path(tempfile.mkdtemp(prefix="jaxsmol-redis-")) / "redis.log")
        wait_until([server], RedisServer.ready, 30, "answering")
    where = server.url if server else tempfile.mkdtemp(prefix="jaxsmol-shared-")
    rng = random.Random(0)

    def ids(n):
        return [rng.randrange(1000, 40000) for _ in range(n)]

    sp = SamplingParams(max_tokens=4, logprobs=2)
    runs: dict[bool, list[dict]] = {True: [], False: []}
    same = True
    try:
        for r in range(args.rounds + 1):  # the first compiles and touches: not counted
            for ahead in (True, False) if r % 2 else (False, True):
                prefix = ids(args.prefix)
                generate(PrefixCache(a, shared=SharedStore(open_backend(where), ident)), prefix, sp)
                prompt = prefix + ids(args.suffix)
                run = one_run(b, SharedStore(open_backend(where), ident), prompt, ids(32), ahead)
                cold = generate(PrefixCache(b, mode="off"), prompt, sp)
                res = run["result"]
                same &= res.output_ids == cold.output_ids and res.logprobs == cold.logprobs
                if r:
                    runs[ahead].append(run)
    finally:
        if server is not None:
            stop([server])
    print(f"prefix {args.prefix} + suffix {args.suffix} tokens from a shared {args.backend}, {args.rounds} rounds "
          f"(medians), {a.name}; a greedy stream decoding beside it")
    print(f"{'read':24} {'stream worst gap':>16} {'stream median gap':>17} {'request TTFT':>12} {'restored':>8}"
          "   (the stream's gaps while the request waits)")
    for ahead, label in ((True, "ahead (fetch thread)"), (False, "at admission (inline)")):
        worst = statistics.median(x["worst"] for x in runs[ahead]) * 1e3
        median = statistics.median(x["median"] for x in runs[ahead]) * 1e3
        ttft = statistics.median(x["ttft"] for x in runs[ahead]) * 1e3
        loaded = runs[ahead][-1]["result"].report.shared_loaded
        print(f"{label:24} {worst:14.0f}ms {median:15.1f}ms {ttft:10.0f}ms {loaded:8}")
    print(f"tokens and logprobs equal to B's cold run's: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
