"""The persistent compilation cache (jaxsmol/runtime/compile_cache.py) as a library user gets it: Engine.load
turns it on, so a notebook's or a script's next process loads its programs instead of compiling them
again (the real model's forward: ~1.5 s a shape), and leaves a cache the user set for JAX alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOAD = ("import sys, jax; from jaxsmol.runtime.engine import Engine; Engine.load(sys.argv[1], progress=False); "
        "print(jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)")


def _cache_after_load(model_dir, **env) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "JAXSMOL_COMPILE_CACHE")}
    done = subprocess.run([sys.executable, "-c", LOAD, str(model_dir)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**clean, "PYTHONPATH": str(ROOT), **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_engine_load_keeps_compiled_programs_on_disk(tiny_model_dir, tmp_path):
    ours = tmp_path / "ours"
    assert _cache_after_load(tiny_model_dir, JAXSMOL_COMPILE_CACHE=str(ours)) == [str(ours), "0"]


def test_engine_load_leaves_a_cache_set_for_jax_alone(tiny_model_dir, tmp_path):
    mine = tmp_path / "mine"
    got = _cache_after_load(tiny_model_dir, JAX_COMPILATION_CACHE_DIR=str(mine), JAXSMOL_COMPILE_CACHE=str(tmp_path / "x"))
    assert got == [str(mine), "1.0"]  # JAX's own default minimum compile time, untouched
