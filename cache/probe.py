"""The cache probe (`aitest --cacheprobe`): one request cold (empty cache), then warm, side by side, in one process."""

from __future__ import annotations

import dataclasses
import time

from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.records import CacheReport
from jaxsmol.cache.scheduler.many import generate
from jaxsmol.cache.scheduler.requests import ChoiceResult
from jaxsmol.cache.store.disk import load_prompt_cache, save_prompt_cache
from jaxsmol.runtime.engine import Engine
from jaxsmol.runtime.sampling import SamplingParams


def _run(cache: PrefixCache, prompt, sp, speculate: str) -> dict:
    r = generate(cache, prompt, sp, speculate=speculate)
    report, t = r.report, r.timings
    return {
        "prompt_ids": list(prompt), "prompt_tokens": len(prompt), "tokens_reused": report.reused,
        "tokens_prefilled": report.prefilled, "exact_hit": report.exact_hit, "bypass": report.bypass,
        "ttft_s": t.ttft_s, "total_s": t.total_s, "output_ids": r.output_ids, "text": r.text,
        "snapshot_bytes": report.snapshot_bytes, "prompt_logits": r.prompt_logits,
    }


def _first_run(engine: Engine, prompt, sp, mode: str, budget_bytes: int, speculate: str) -> float:
    """Seconds of a request of other tokens, cold then warm, on a cache of its own: the process's
    first-run costs (programs loaded or compiled, buffers and pages first touched) paid before the probe,
    so that its cold run against its warm run measures the cache alone."""
    other = [(t + 1) % engine.cfg.vocab_size for t in prompt]
    scratch = PrefixCache(engine, mode=mode, budget_bytes=budget_bytes)
    t0 = time.perf_counter()
    generate(scratch, other, sp, speculate=speculate)
    generate(scratch, other, sp, speculate=speculate)
    return time.perf_counter() - t0


def run_probe(engine: Engine, prompt_ids, max_tokens: int = 1, *, mode: str = "single",
              then_ids=None, budget_bytes: int = 2 << 30, warmup: bool = True, prompt_cache=None,
              speculate: str = "auto", **sampling) -> dict:
    """Cold run on an empty cache, then a warm run of the same prompt (or of `then_ids`).

    With `then_ids`, the warm prompt differs, so its output is compared with an uncached run of
    the same prompt. Compilation and the first run's costs are paid beforehand (`warmup`: a request of
    other tokens, cold then warm, on a cache of its own; its time is `first_run_s`), so that the cold and
    warm times differ by what the cache saves alone.

    With `prompt_cache` (a file path), the cache starts from the snapshot saved there (so the first run
    may reuse it: that is its point), the outputs are compared with an uncached run, and the state of
    the second prompt (and its answer) is saved back to the file. `speculate`: every run's mode (generate's).
    """
    sp = SamplingParams(max_tokens=max_tokens, **sampling)
    prompt = engine.check_prompt(prompt_ids, max_tokens)
    second = engine.check_prompt(then_ids, max_tokens) if then_ids else prompt
    first_run_s = None
    if warmup:
        t0 = time.perf_counter()
        engine.warmup(max(len(prompt), len(second)))
        first_run_s = time.perf_counter() - t0 + _first_run(engine, prompt, sp, mode, budget_bytes, speculate)
    cache = PrefixCache(engine, mode=mode, budget_bytes=budget_bytes)
    pc = load_prompt_cache(cache, prompt_cache, prompt) if prompt_cache else None
    cold = _run(cache, prompt, sp, speculate)
    warm = _run(cache, second, sp, speculate)
    if second is prompt and not cold["tokens_reused"]:
        reference = cold
    else:
        reference = _run(PrefixCache(engine, mode="off"), second, sp, speculate)
    if pc is not None:
        save_prompt_cache(cache, prompt_cache, second + warm["output_ids"], pc)
    identical = (warm["output_ids"] == reference["output_ids"]
                 and (warm["prompt_logits"] == reference["prompt_logits"]).all())
    for r in (cold, warm, reference):
        r.pop("prompt_logits", None)
    return {
        "mode": mode, "max_tokens": max_tokens, "cold": cold, "warm": warm,
        "identical": bool(identical), "ttft_speedup": cold["ttft_s"] / max(warm["ttft_s"], 1e-9),
        "first_run_s": first_run_s, "stats": cache.stats.as_dict(),
        **({"prompt_cache": pc.as_dict()} if pc is not None else {}),
    }


@dataclasses.dataclass(frozen=True)
class TimedRequest:
    """One request through a prefix cache, timed as its caller sees it."""
    result: ChoiceResult
    ttft_s: float  # from the call (lookup, gather, restore) to the first token
    seconds: float  # from the call to the end, the saves after the last token included

    @property
    def report(self) -> CacheReport:
        return self.result.report


def timed_request(cache: PrefixCache, prompt_ids, sp: SamplingParams) -> TimedRequest:
    """Run one request through `cache` to the end, timed (with no token, ttft_s is the whole time)."""
    t0 = time.perf_counter()
    first: list[float] = []  # the first token's time

    def on_token(_) -> None:
        if not first:
            first.append(time.perf_counter() - t0)

    result = generate(cache, prompt_ids, sp, on_token=on_token)
    seconds = time.perf_counter() - t0
    return TimedRequest(result, first[0] if first else seconds, seconds)


def compare_modes(engine: Engine, workload, modes=("off", "radix")) -> dict:
    """Run `workload(cache)` (a list of `timed_request` results) once per cache mode, each on a
    fresh cache. Returns the runs, a per-mode summary (prefilled tokens, wall seconds, summed time
    to first token), the first mode's wall time over the last's, and whether every request's
    tokens and prompt logits were identical in all modes."""
    import numpy as np

    runs = {mode: workload(PrefixCache(engine, mode=mode)) for mode in modes}
    first = runs[modes[0]]
    identical = all(len(rs) == len(first) and all(
        t.result.output_ids == t0.result.output_ids
        and np.array_equal(t.result.prompt_logits, t0.result.prompt_logits)
        for t, t0 in zip(rs, first)) for rs in runs.values())
    summary = {mode: {"prefilled": sum(t.report.prefilled for t in rs), "seconds": sum(t.seconds for t in rs),
                      "ttft": sum(t.ttft_s for t in rs)} for mode, rs in runs.items()}
    return {"runs": runs, "summary": summary, "identical": identical,
            "speedup": summary[modes[0]]["seconds"] / summary[modes[-1]]["seconds"]}
