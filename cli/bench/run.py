"""The entry point of `jaxsmol bench` (cli/main.py): checks, the sections in order, the report."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from jaxsmol.cli.bench.hf import hf_available
from jaxsmol.cli.bench.measure import Warmup, log, loadavg, now, peak_rss_bytes
from jaxsmol.cli.bench.plans import EXTRA_SECTIONS, FULL, QUICK, SECTIONS, with_flags


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def command_line(argv: list[str]) -> str:
    """`jaxsmol bench ...` as typed, less the output files (--json, --plot) and --report."""
    out, skip = ["jaxsmol"], 0
    for i, arg in enumerate(argv):
        if skip or arg.startswith(("--json=", "--plot=")):
            skip = max(skip - 1, 0)
        elif arg in ("--json", "--plot"):
            skip = 1
        elif arg == "--report":
            skip = next((j for j, a in enumerate(argv[i + 1:]) if a.startswith("-")), len(argv) - i - 1)
        else:
            out.append(arg)
    return shlex.join(out)


def _meta(args, engine, plan, sections, load0) -> dict:
    import jax

    return {
        "model": engine.name, "model_path": str(engine.source), "dtype": args.dtype,
        "weights": engine.cfg.quant or args.dtype, "ctx": engine.ctx, "quick": bool(args.quick),
        "seed": args.seed, "jax": jax.__version__, "backend": jax.default_backend(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "machine": platform.machine(), "loadavg_start": load0,
        "cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"), "peer_name": getattr(args, "peer_name", None),
        "command": command_line(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else None,
        "kv_bytes_per_token": engine.kv_bytes_per_token,
        "sections": sections + (["hf"] if args.compare == "hf" else []),
        "peer_url": args.peer_url, "plan": dict(plan),
    }


def _calls(args, engine, plan, rng) -> dict:
    """Each section's function and its arguments."""
    from jaxsmol.cli.bench import sections as s
    from jaxsmol.cli.bench.admission import section_admission
    from jaxsmol.cli.bench.cluster import section_cluster
    from jaxsmol.cli.bench.first_burst import section_first_burst
    from jaxsmol.cli.bench.forks import section_forks
    from jaxsmol.cli.bench.hf import section_hf
    from jaxsmol.cli.bench.prompt_cache import section_prompt_cache
    from jaxsmol.cli.bench.ready import section_ready
    from jaxsmol.cli.bench.serve import section_serve
    from jaxsmol.cli.bench.speculate import section_speculate
    from jaxsmol.cli.bench.ttft_peer import section_ttft_peer
    from jaxsmol.cli.common import load_draft

    warm = Warmup(engine)
    return {"compilations": (s.section_compilations, engine, plan, rng),  # first: counts from a process
            "prefill": (s.section_prefill, engine, plan, rng, warm),      # that has compiled nothing yet
            "decode": (s.section_decode, engine, plan, warm),
            "ttft": (s.section_ttft, engine, plan, rng, warm),
            "snapshot": (s.section_snapshot, engine, plan, rng, warm),
            "cli": (s.section_cli, args, engine, plan, rng),
            "forks": (section_forks, engine, plan),
            "prompt-cache": (section_prompt_cache, engine, plan),
            "ttft-peer": (section_ttft_peer, engine, plan, args.peer_url),
            "serve": (section_serve, args, plan, args.peer_url),
            "first-burst": (section_first_burst, args, plan),
            "ready": (section_ready, args, plan),
            "cluster": (section_cluster, args, engine, plan),
            "admission": (section_admission, args, engine, plan),
            "speculate": (section_speculate, engine, plan, args.peer_url,
                          load_draft(args, engine) if "speculate" in (args.only or ()) else None),
            "hf": (section_hf, engine, plan, rng, warm)}


def _run_sections(args, engine, plan, rng, sections, res: dict) -> None:
    """Run the chosen sections in their fixed order into res, timing each."""
    calls = _calls(args, engine, plan, rng)
    timings = res["meta"]["section_wall_s"] = {}
    order = [n for n in SECTIONS + EXTRA_SECTIONS if n in sections] + (["hf"] if args.compare == "hf" else [])
    for name in order:
        if name == "compilations":
            log("compilations: mixed workload")
        fn, *a = calls[name]
        t0 = now()
        res[name] = fn(*a)
        timings[name] = round(now() - t0, 2)


def run_bench(args) -> int:
    from jaxsmol.errors import JaxsmolError

    if getattr(args, "report", None):  # earlier runs' results: print their table, run nothing
        from jaxsmol.cli.bench.performance import report_files

        print(report_files(args.report), end="")
        return 0
    if args.compare == "hf" and not hf_available():
        raise JaxsmolError("--compare hf needs torch and transformers: pip install -e '.[hf]'")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise JaxsmolError("--plot needs matplotlib: pip install matplotlib")
    sections = list(args.only or SECTIONS)
    if args.peer_url and not {"serve", "ttft-peer", "speculate"} & set(sections):
        raise JaxsmolError("--peer-url is measured by the serve, ttft-peer and speculate sections: "
                           "add --only serve, ttft-peer or speculate")
    if args.draft_model and "speculate" not in sections:
        raise JaxsmolError("--draft-model is measured by the speculate section: add --only speculate")

    import numpy as np

    from jaxsmol.cli.bench.report import format_results
    from jaxsmol.cli.common import load_engine
    from jaxsmol.runtime import programs

    plan = with_flags(QUICK if args.quick else FULL, args)
    rng = np.random.default_rng(args.seed)
    load0 = loadavg()
    t_start = now()
    engine = load_engine(args)
    _ = engine.fingerprint  # hashed once, outside every timing
    res: dict = {"meta": _meta(args, engine, plan, sections, load0)}
    _run_sections(args, engine, plan, rng, sections, res)
    res["programs_total"] = sum(p.prepared for p in programs.ALL.values())
    res["meta"]["loadavg_end"] = loadavg()
    res["meta"]["wall_s"] = now() - t_start
    res["meta"]["peak_rss_bytes"] = peak_rss_bytes()
    res["meta"]["params_bytes"] = engine.params.nbytes

    print(format_results(res))
    if getattr(args, "report", None) is not None:
        from jaxsmol.cli.bench.performance import markdown

        print("\n" + markdown([res]), end="")
    Path(args.json).write_text(json.dumps(res, indent=1))
    print(f"\nwrote {args.json}", file=sys.stderr)
    if args.plot:
        from jaxsmol.cli.bench.plot import write_plot

        write_plot(res, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
