"""Compiled programs kept on disk (jaxsmol/runtime/compile_cache.py, program_store.py) as a library user
gets them: Engine.load turns the program store on, so a notebook's or a script's next process loads its
programs instead of tracing and compiling them again, and leaves a cache the user set for JAX alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ("import json, sys, jax; from jaxsmol.runtime.engine import Engine; from jaxsmol.runtime import programs; "
       "from jaxsmol.runtime.sampling import SamplingParams; from jaxsmol.cache import generate; "
       "e = Engine.load(sys.argv[1], progress=False); "
       "ids = generate(e, [5, 6, 7], SamplingParams(max_tokens=3)).output_ids; "
       "print(json.dumps({'ids': ids, 'jax_cache': jax.config.jax_compilation_cache_dir, "
       "'min_time': jax.config.jax_persistent_cache_min_compile_time_secs, "
       "'prepared': sum(p.prepared for p in programs.ALL.values()), "
       "'loaded': sum(p.loaded for p in programs.ALL.values())}))")


def _run(model_dir, **env) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "JAXSMOL_COMPILE_CACHE")}
    done = subprocess.run([sys.executable, "-c", RUN, str(model_dir)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**clean, "PYTHONPATH": str(ROOT), **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_engine_load_keeps_compiled_programs_on_disk(tiny_model_dir, tmp_path):
    ours = tmp_path / "ours"
    first = _run(tiny_model_dir, JAXSMOL_COMPILE_CACHE=str(ours))
    stored = list((ours / "programs").glob("*/*.xla"))
    assert first["jax_cache"] is None and first["prepared"] == len(stored) > 0 and first["loaded"] == 0
    second = _run(tiny_model_dir, JAXSMOL_COMPILE_CACHE=str(ours))  # loads every program, compiles none
    assert second["ids"] == first["ids"] and second["loaded"] == second["prepared"] == first["prepared"]
    assert list((ours / "programs").glob("*/*.xla")) == stored


def test_engine_load_leaves_a_cache_set_for_jax_alone(tiny_model_dir, tmp_path):
    mine, ours = tmp_path / "mine", tmp_path / "x"
    got = _run(tiny_model_dir, JAX_COMPILATION_CACHE_DIR=str(mine), JAXSMOL_COMPILE_CACHE=str(ours))
    assert got["jax_cache"] == str(mine) and got["min_time"] == 1.0  # JAX's own default minimum compile time
    assert got["loaded"] == 0 and not ours.exists()  # nothing stored beside JAX's cache


def test_stored_programs_load_in_a_process_with_several_devices(tiny_model_dir, tmp_path):
    """A process with several devices (a mesh's, here 4 forced host devices) runs a lone engine's stored
    programs too: each loads onto the one device it was compiled for, not onto all of them."""
    ours, devices = tmp_path / "ours", {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    first = _run(tiny_model_dir, JAXSMOL_COMPILE_CACHE=str(ours), **devices)
    second = _run(tiny_model_dir, JAXSMOL_COMPILE_CACHE=str(ours), **devices)
    assert second["ids"] == first["ids"] and second["loaded"] == second["prepared"] == first["prepared"] > 0
