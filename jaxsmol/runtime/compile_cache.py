"""Where compiled programs are kept on disk, so a new process skips compiles: the program store
(program_store.py) under the data directory, switched on by `enable_compilation_cache`."""

from __future__ import annotations

import os

from jaxsmol.model.config import Config
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


def compile_cold_request(cfg: Config, dtype: str, n_prompt: int, max_tokens: int, structured: bool = False) -> None:
    """Compile the programs a cold request of n_prompt tokens generating max_tokens runs (its prefill
    chunk lengths and decode at its cache capacity, and sampling) from shapes alone, so it can run
    while the weights load; the jitted functions then find them compiled (or in the disk cache)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxsmol.runtime import programs
    from jaxsmol.runtime.chunks import capacity_for, chunk_plan, prefill_buckets
    from jaxsmol.runtime.sampling import seed_key
    from jaxsmol.model.kv import KVCache
    from jaxsmol.model.params import abstract_params
    from jaxsmol.runtime.structured import all_allowed

    params = abstract_params(cfg, getattr(jnp, dtype))
    cache_dtype = cfg.cache_dtype(params.compute_dtype)  # float32 under the kernels unless --kv-dtype says
    plan = chunk_plan(n_prompt, prefill_buckets(True, cfg.cpu_kernels))
    cap = capacity_for(max(sum(plan), n_prompt + max_tokens))  # Engine.slots_needed(0, ...)
    kv = jax.eval_shape(lambda: KVCache.zeros(cfg, cap, dtype=cache_dtype))
    lengths = sorted(set(plan) | ({1} if max_tokens > 1 else set()))
    calls = [(programs.forward, (params, jax.ShapeDtypeStruct((1, T), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32),
                                 kv, cfg), {})
             for T in lengths]
    allowed = all_allowed(1, cfg.vocab_size) if structured else None
    logits = jax.ShapeDtypeStruct((1, cfg.vocab_size), jnp.float32)
    calls.append((programs.sample, (logits, jax.random.key(0), jnp.float32(0), jnp.int32(0), jnp.float32(1),
                                    allowed), {}))
    calls.append((programs.step_key, (seed_key(0), np.int32(0)), {}))
    programs.compile_all(calls)
    for T in lengths:
        jnp.asarray(np.zeros((1, T), np.int32)).block_until_ready()  # the host -> device copy of a chunk
    # the small programs a generation runs around them (its seed's key, each step's key, a cache's
    # zeros) are compiled on first use as well: 15-150 ms each on a loaded machine, so run them once here
    jax.block_until_ready((programs.step_key(seed_key(0), np.int32(0)), KVCache.zeros(cfg, cap, dtype=cache_dtype)))
