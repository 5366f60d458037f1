"""The lab's cache probe: one request cold (empty cache), then warm, side by side, in one process."""

from __future__ import annotations

from jaxsmol.engine import Engine
from jaxsmol.sampling import SamplingParams

from cache.disk import load_prompt_cache, save_prompt_cache
from cache.prefix_cache import PrefixCache


def _run(cache: PrefixCache, prompt, sp, bypass=False) -> dict:
    gen, report = cache.generate(prompt, sp, bypass=bypass)
    t = gen.timings
    return {
        "prompt_ids": list(prompt), "prompt_tokens": len(prompt), "tokens_reused": report.reused,
        "tokens_prefilled": report.prefilled, "exact_hit": report.exact_hit, "bypass": report.bypass,
        "ttft_s": t.ttft_s, "total_s": t.total_s, "output_ids": gen.output_ids, "text": gen.text,
        "snapshot_bytes": report.snapshot_bytes, "prompt_logits": gen.prompt_logits,
    }


def run_probe(engine: Engine, prompt_ids, max_tokens: int = 1, *, mode: str = "minimal",
              then_ids=None, budget_bytes: int = 2 << 30, warmup: bool = True, prompt_cache=None,
              **sampling) -> dict:
    """Cold run on an empty cache, then a warm run of the same prompt (or of `then_ids`).

    With `then_ids`, the warm prompt differs, so its output is compared with an uncached run of
    the same prompt. Compilation is done beforehand (`warmup`) so that times compare compute only.

    With `prompt_cache` (a file path), the cache starts from the snapshot saved there (so the first run
    may reuse it: that is its point), the outputs are compared with an uncached run, and the state of
    the second prompt (and its answer) is saved back to the file.
    """
    sp = SamplingParams(max_tokens=max_tokens, **sampling)
    prompt = engine.check_prompt(prompt_ids, max_tokens)
    second = engine.check_prompt(then_ids, max_tokens) if then_ids else prompt
    if warmup:
        engine.warmup(max(len(prompt), len(second)) + max_tokens)
    cache = PrefixCache(engine, mode=mode, budget_bytes=budget_bytes)
    pc = load_prompt_cache(cache, prompt_cache, prompt) if prompt_cache else None
    cold = _run(cache, prompt, sp)
    warm = _run(cache, second, sp)
    if second is prompt and not cold["tokens_reused"]:
        reference = cold
    else:
        reference = _run(PrefixCache(engine, mode="off"), second, sp)
    if pc is not None:
        save_prompt_cache(cache, prompt_cache, second + warm["output_ids"], pc)
    identical = (warm["output_ids"] == reference["output_ids"]
                 and (warm["prompt_logits"] == reference["prompt_logits"]).all())
    for r in (cold, warm, reference):
        r.pop("prompt_logits", None)
    return {
        "mode": mode, "max_tokens": max_tokens, "cold": cold, "warm": warm,
        "identical": bool(identical), "ttft_speedup": cold["ttft_s"] / max(warm["ttft_s"], 1e-9),
        "stats": cache.stats.as_dict(), **({"prompt_cache": pc.as_dict()} if pc is not None else {}),
    }
