"""JAX's persistent compilation cache under the data directory, so a new process skips compiles."""

from __future__ import annotations

import os

from jaxsmol.default_model import data_home


def compilation_cache_dir():
    """Where compiled programs are kept: $JAXSMOL_COMPILE_CACHE (a directory, or `off` for none),
    else the data directory's xla-cache."""
    from pathlib import Path

    setting = os.environ.get("JAXSMOL_COMPILE_CACHE", "").strip()
    if setting.lower() == "off":
        return None
    return Path(setting).expanduser() if setting else data_home() / "xla-cache"


def enable_compilation_cache() -> None:
    """Keep compiled XLA programs on disk so the next process skips compiles (see compilation_cache_dir)."""
    import jax

    path = compilation_cache_dir()
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # every program: most take < 1 s
