"""Where compiled programs are kept on disk, so a new process skips compiles: the program store
(program_store.py) under the data directory, switched on by `enable_compilation_cache`."""

from __future__ import annotations

import os

from jaxsmol.system.data_dirs import xla_cache_dir


def compilation_cache_dir():
    """Where compiled programs are kept: $JAXSMOL_COMPILE_CACHE (a directory, or `off` for none),
    else the data directory's xla-cache."""
    from pathlib import Path

    setting = os.environ.get("JAXSMOL_COMPILE_CACHE", "").strip()
    if setting.lower() == "off":
        return None
    return Path(setting).expanduser() if setting else xla_cache_dir()


def enable_compilation_cache(unless_set: bool = False) -> None:
    """Keep compiled programs on disk so the next process loads them (see compilation_cache_dir): the
    program store, in place of JAX's persistent cache, whose executables could not be stored again
    (program_store.py). unless_set (Engine.load, a library call): where a cache directory is set for
    JAX (by the user, JAX_COMPILATION_CACHE_DIR), JAX's cache stays the one in use and nothing is
    stored. Without unless_set (the command line), JAX's own is switched off."""
    import jax

    from jaxsmol.runtime import program_store

    if jax.config.jax_compilation_cache_dir is not None:
        if unless_set:
            return
        jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_enable_compilation_cache", False)
    program_store.enable(compilation_cache_dir())
