"""The benchmark's results as text tables (the JSON is the results dict itself; the plot is plot.py)."""

from __future__ import annotations

from jaxsmol.cli.bench.admission import format_admission
from jaxsmol.cli.bench.cluster import format_cluster
from jaxsmol.cli.bench.first_burst import format_first_burst
from jaxsmol.cli.bench.ready import format_ready
from jaxsmol.cli.bench.forks import format_forks
from jaxsmol.cli.bench.plans import HEADLINE
from jaxsmol.cli.bench.prompt_cache import format_prompt_cache
from jaxsmol.cli.bench.serve import format_serve
from jaxsmol.cli.bench.speculate import format_speculate
from jaxsmol.cli.bench.ttft_peer import format_ttft_peer
from jaxsmol.cli.tables import format_table


def _ms(s: float) -> str:
    return f"{s * 1000:.1f}"


def _compilations(c: dict) -> list[str]:
    return [format_table(["requests", "prompt", "max_tokens", "programs ahead", "compiled during", "closed"],
                         [[c["requests"], f"{c['prompt_min']}..{c['prompt_max']}", f"1..{c['max_tokens'][1]}",
                           c["programs_ahead"], c["programs_during"], "yes" if c["closed"] else "NO"]],
                         title="XLA programs over a mixed workload through the radix cache, after compile-ahead")]


def _prefill(rows: list[dict]) -> list[str]:
    return [format_table(["tokens", "ms", "tok/s"],
                         [[r["tokens"], _ms(r["seconds"]), f"{r['tok_s']:.0f}"] for r in rows],
                         title="prefill, cold (compile excluded)")]


def _decode(rows: list[dict]) -> list[str]:
    return [format_table(["position", "ms/token", "tok/s"],
                         [[r["position"], f"{r['ms_per_token']:.2f}", f"{r['tok_s']:.1f}"] for r in rows],
                         title="decode")]


def _mode_name(r: dict) -> str:
    return r["mode"] + ("" if r["exact"] or r["mode"] != "radix" else " exact=False")


def _ttft_cells(r: dict) -> list:
    return [f"{r['prefix']}+{r['suffix']}", _mode_name(r), _ms(r["cold_ttft_s"]), _ms(r["warm_ttft_s"]),
            f"{r['warm_over_cold']:.3f}", _ms(r["exact_hit_ttft_s"]), f"{r['exact_over_cold']:.3f}", r["warm_reused"]]


def _ttft(t: dict) -> list[str]:
    hdr = ["prefix+suffix", "mode", "cold ms", "warm ms", "warm/cold", "exact-hit ms", "exact/cold", "reused"]
    h = t["headline"]
    return [
        format_table(hdr, [_ttft_cells(r) for r in t["grid"]],
                     title="time to first token: cold (empty cache) vs warm (shared prefix) vs exact full hit"),
        format_table(hdr + ["cold wall ms"], [_ttft_cells(r) + [_ms(r["cold_wall_s"])] for r in t["modes"]],
                     title=f"headline: {HEADLINE[0]}-token shared prefix + {HEADLINE[1]} new tokens, by cache mode"),
        f"HEADLINE {h['prefix']}+{h['suffix']} (radix): cold {_ms(h['cold_ttft_s'])} ms, "
        f"warm {_ms(h['warm_ttft_s'])} ms, warm/cold {h['warm_over_cold']:.3f} ({h['speedup']:.1f}x faster)",
    ]


def _snapshot(sn: dict) -> list[str]:
    return [format_table(["n", "radix bytes held", "n full copies", "held/full"],
                         [[r["n"], f"{r['bytes_held']:,}", f"{r['full_copies_bytes']:,}", f"{r['held_over_full']:.3f}"]
                          for r in sn["rows"]],
                         title=f"snapshot memory: {sn['bytes_per_token']:,} bytes/token; n branches of {sn['branch']} "
                               f"tokens on a {sn['trunk']}-token trunk (held includes {sn['logits_payload_bytes']:,} "
                               "bytes of logits per prompt)")]


def _cli(c: dict) -> list[str]:
    def row(name, case):
        return [name, f"{c[case]['ttft_s']:.2f}", f"{c[case]['wall_s']:.2f}", c[case]["cache_files_after"]]
    return [format_table(["compilation cache", "ttft s", "process wall s", "cache files"],
                         [row("without (empty)", "without_cache"), row("with (warmed)", "with_cache")],
                         title=f"fresh `jaxsmol generate` process, {c['prompt']}-token prompt, 1 token")]


def _better(r: dict) -> str:
    x = r["jaxsmol_over_hf"]
    if not r["higher_is_better"]:
        if r["metric"].startswith("warm/cold"):
            return "-"
        x = 1 / x
    return f"{x:.2f}x {'faster' if x >= 1 else 'slower'}"


def _hf(h: dict) -> list[str]:
    return [format_table(["metric", "jaxsmol", "HF", "jaxsmol/HF", "jaxsmol is"],
                         [[r["metric"], f"{r['jaxsmol']:.4g}", f"{r['hf']:.4g}", f"{r['jaxsmol_over_hf']:.3f}",
                           _better(r)] for r in h["rows"]],
                         title=f"jaxsmol vs Hugging Face transformers {h['transformers']} (torch {h['torch']}, "
                               f"{h['torch_threads']} threads, float32), alternating")]


_SECTIONS = (("compilations", _compilations), ("prefill", _prefill), ("decode", _decode), ("ttft", _ttft),
             ("snapshot", _snapshot), ("cli", _cli), ("forks", format_forks), ("prompt-cache", format_prompt_cache),
             ("ttft-peer", format_ttft_peer), ("serve", format_serve), ("first-burst", format_first_burst),
             ("ready", format_ready), ("cluster", format_cluster), ("admission", format_admission),
             ("speculate", format_speculate), ("hf", _hf))


def format_results(res: dict) -> str:
    """Every section present in `res` as tables, between a line about the machine and the wall times."""
    m = res["meta"]
    out = [f"jaxsmol bench ({'quick' if m['quick'] else 'full'}): {m['model']}, "
           f"{m.get('weights', m['dtype'])} weights, ctx {m['ctx']}, "
           f"{m['cpus']} CPUs, jax {m['jax']} on {m['backend']}, load avg {m['loadavg_start']} -> {m['loadavg_end']}"]
    for name, fmt in _SECTIONS:
        if name in res:
            out += fmt(res[name])
    if m.get("section_wall_s"):
        out.append("section wall times (s): " + ", ".join(f"{k} {v}" for k, v in m["section_wall_s"].items())
                   + f"; total {m['wall_s']:.1f}")
    if m.get("peak_rss_bytes"):
        out.append(f"peak memory (RSS) {m['peak_rss_bytes'] / 2**30:.2f} GiB; "
                   f"weights {m['params_bytes'] / 2**30:.2f} GiB")
    if "programs_total" in res:
        out.append(f"programs made ready by this whole run: {res['programs_total']}")
    return "\n\n".join(out)
