"""`--only prompt-cache`: time to first token of a 1024-token prompt: cold, against its first 1008
tokens (`--prefix`) loaded from a snapshot file (cache/store/disk.py) plus a 16-token suffix (`--suffix`)
prefilled.

Everything is compiled first (engine.warmup), and the file is read once before timing, so the
numbers compare compute and a page-cache read, not compilation or a cold disk. "disk" is the time to
load and verify the file and put it in a PrefixCache, plus the request's time to first token (the
answer's state saved after it is not counted; nor is it for cold). `--rounds` repeats (median).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from jaxsmol.cli.bench.measure import log, median, now
from jaxsmol.cli.tables import format_table


def _rounds(engine, path, ids, prefix_n: int, repeats: int) -> dict:
    """`repeats` times: a cold request, then the prefix loaded from `path` and the request again."""
    import numpy as np

    from jaxsmol.cache.prefix_cache import PrefixCache
    from jaxsmol.cache.scheduler.many import generate
    from jaxsmol.cache.store.disk import load_prompt_cache
    from jaxsmol.runtime.sampling import SamplingParams

    sp = SamplingParams(max_tokens=1)
    cold_s, warm_s, load_s, outputs = [], [], [], set()
    for _ in range(repeats):
        gen = generate(engine, ids, sp)
        cold_s.append(gen.timings.ttft_s)
        cold_logits = gen.prompt_logits

        t0 = now()
        cache = PrefixCache(engine)
        assert load_prompt_cache(cache, path, ids).loaded == prefix_n
        t1 = now()
        warm = generate(cache, ids, sp)
        report = warm.report
        warm_s.append(t1 - t0 + warm.timings.ttft_s)
        load_s.append(t1 - t0)
        assert report.reused == prefix_n and report.prefilled == len(ids) - prefix_n
        outputs.add(bool(np.array_equal(warm.prompt_logits, cold_logits)))
    return {"cold_ttft_s": median(cold_s), "disk_ttft_s": median(warm_s), "load_s": median(load_s),
            "cold_repeats": cold_s, "disk_repeats": warm_s, "load_repeats": load_s,
            "same_logits": outputs == {True}}


def section_prompt_cache(engine, plan) -> dict:
    import numpy as np

    from jaxsmol.cache.prefix_cache import PrefixCache
    from jaxsmol.cache.scheduler.many import generate
    from jaxsmol.cache.store.disk import save_prompt_cache
    from jaxsmol.cache.store.snapshot import identity, load_snapshot
    from jaxsmol.runtime.sampling import SamplingParams

    p, s = plan["pc_prefix"], plan["pc_suffix"]
    if p + s + 1 > engine.ctx:
        from jaxsmol.errors import JaxsmolError

        raise JaxsmolError(f"prompt-cache: --prefix {p} + --suffix {s} does not fit ctx {engine.ctx}")
    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.integers(100, engine.cfg.vocab_size, p + s)]
    prefix = ids[:p]
    engine.warmup(len(ids) + 1)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "prefix.safetensors"
        writer = PrefixCache(engine)
        generate(writer, prefix, SamplingParams(max_tokens=0))
        t0 = now()
        save_prompt_cache(writer, path, prefix)
        save_s = now() - t0
        size = path.stat().st_size
        load_snapshot(path, identity(engine), ids)  # page cache warm
        out = _rounds(engine, path, ids, p, plan["pc_repeats"])
    out = {"prefix": p, "suffix": s, "file_bytes": size, "save_s": save_s, "repeats": plan["pc_repeats"], **out}
    out["cold_over_disk"] = out["cold_ttft_s"] / out["disk_ttft_s"]
    log(f"prompt-cache: cold {out['cold_ttft_s'] * 1000:.0f} ms, from disk {out['disk_ttft_s'] * 1000:.0f} ms")
    return out


def format_prompt_cache(c: dict) -> list[str]:
    p, s = c["prefix"], c["suffix"]
    return [format_table(
        ["to first token", "ms"],
        [[f"cold ({p + s} tokens prefilled)", f"{c['cold_ttft_s'] * 1000:.0f}"],
         [f"{p} loaded from disk + {s} prefilled", f"{c['disk_ttft_s'] * 1000:.0f}"],
         ["  of which load + verify + insert", f"{c['load_s'] * 1000:.0f}"]],
        title=f"prompt cache on disk: a {p}-token snapshot of {c['file_bytes'] / 2**20:.1f} MiB, written in "
              f"{c['save_s'] * 1000:.0f} ms; medians of {c['repeats']}"),
        f"speedup cold / disk: {c['cold_over_disk']:.1f}x; warm logits == cold logits: {c['same_logits']}"]


def plot_prompt_cache(ax, res: dict) -> None:
    c = res["prompt-cache"]
    ax.bar(["cold", "from disk", "load only"], [1e3 * c["cold_ttft_s"], 1e3 * c["disk_ttft_s"], 1e3 * c["load_s"]],
           color=["C3", "C2", "C0"])
    ax.set(title=f"prompt cache on disk: {c['prefix']}+{c['suffix']} tokens", ylabel="ms to first token")
