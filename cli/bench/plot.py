"""`--plot`: the benchmark's results drawn into one PNG (matplotlib): six panels for the default
sections (and --compare hf), one more for each extra section that ran."""

from __future__ import annotations

import math

from jaxsmol.cli.bench.first_burst import plot_first_burst
from jaxsmol.cli.bench.forks import plot_forks
from jaxsmol.cli.bench.plans import SECTIONS
from jaxsmol.cli.bench.prompt_cache import plot_prompt_cache
from jaxsmol.cli.bench.serve import plot_serve
from jaxsmol.cli.bench.ttft_peer import plot_ttft_peer


def _prefill(ax, res: dict) -> None:
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


def _decode(ax, res: dict) -> None:
    if "decode" in res:
        ax.bar([str(r["position"]) for r in res["decode"]], [r["tok_s"] for r in res["decode"]])
    ax.set(title="decode", xlabel="position", ylabel="tok/s")


def _ttft(ax, res: dict) -> None:
    if "ttft" not in res:
        return
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


def _snapshot(ax, res: dict) -> None:
    if "snapshot" not in res:
        return
    rows = res["snapshot"]["rows"]
    ax.plot([r["n"] for r in rows], [r["bytes_held"] / 2**20 for r in rows], "o-", label="radix (shared trunk)")
    ax.plot([r["n"] for r in rows], [r["full_copies_bytes"] / 2**20 for r in rows], "s--", label="n full copies")
    ax.set(title="snapshot memory", xlabel="branches", ylabel="MiB")
    ax.legend()


def _cli(ax, res: dict) -> None:
    if "cli" not in res:
        return
    c = res["cli"]
    ax.bar(["ttft\nwithout", "ttft\nwith", "wall\nwithout", "wall\nwith"],
           [c["without_cache"]["ttft_s"], c["with_cache"]["ttft_s"], c["without_cache"]["wall_s"],
            c["with_cache"]["wall_s"]], color=["C3", "C2", "C3", "C2"])
    ax.set(title="fresh process: persistent compilation cache", ylabel="s")


def _hf_or_compilations(ax, res: dict) -> None:
    if "hf" in res:
        rows = [r for r in res["hf"]["rows"] if not r["metric"].startswith("warm/cold")]
        ax.barh([r["metric"] for r in rows],
                [r["jaxsmol_over_hf"] if r["higher_is_better"] else 1 / r["jaxsmol_over_hf"] for r in rows])
        ax.axvline(1, color="k", lw=0.8)
        ax.set(title="jaxsmol speed / HF speed (>1: jaxsmol faster)")
        ax.tick_params(axis="y", labelsize=7)
    elif "compilations" in res:
        c = res["compilations"]
        ax.bar(["ready ahead", "during"], [c["programs_ahead"], c["programs_during"]])
        ax.set(title=f"forward programs over {c['requests']} mixed requests")


EXTRA_PANELS = (("forks", plot_forks), ("prompt-cache", plot_prompt_cache), ("ttft-peer", plot_ttft_peer),
                ("serve", plot_serve), ("first-burst", plot_first_burst))


def _panels(res: dict) -> list:
    """The default six when a default section (or hf) ran, then one per extra section that ran."""
    base = [_prefill, _decode, _ttft, _snapshot, _cli, _hf_or_compilations]
    panels = base if any(name in res for name in SECTIONS + ("hf",)) else []
    return panels + [draw for name, draw in EXTRA_PANELS if name in res]


def write_plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(res)
    cols = min(3, max(1, len(panels)))
    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(16 if cols == 3 else 5.5 * cols, 4.5 * rows), squeeze=False)
    for ax, draw in zip(axes.flat, panels):
        draw(ax, res)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    m = res["meta"]
    fig.suptitle(f"jaxsmol bench: {m['model']} ({m['dtype']}), {m['cpus']} CPUs, load {m['loadavg_start']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
