"""Programs compiled in a child process into the program store (jaxsmol/runtime/compile_apart.py), then
loaded by the caller: what compile_all does where many programs are missing from the store."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsmol.model.config import Config
from jaxsmol.model.kv import KVCache
from jaxsmol.runtime import compile_apart, program_store, programs


VOCABS = iter(range(352, 1024, 32))


@pytest.fixture
def engine():
    """An engine of a config no other test compiles (its programs are held nowhere, stored nowhere)."""
    from jaxsmol.model.params import init_random
    from jaxsmol.runtime.engine import Engine

    cfg = Config.tiny(n_layers=3, vocab_size=next(VOCABS))
    return Engine(cfg, init_random(cfg), None, ctx=1024)


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setattr(program_store, "_root", tmp_path)
    return tmp_path


def _calls(engine):
    """The one-sequence forward over chunks of 8..256 rows into a 512-slot cache, as (program, args, kwargs)."""
    kv = jax.eval_shape(lambda: KVCache.zeros(engine.cfg, 512, dtype=engine.cache_dtype))
    length = jax.ShapeDtypeStruct((), jnp.int32)
    return [(programs.forward, (engine.params, jax.ShapeDtypeStruct((1, T), jnp.int32), length, kv, engine.cfg), {})
            for T in (8, 16, 32, 64, 128, 256)]


def test_a_child_compiles_what_the_store_lacks_and_the_caller_loads_it(engine, store):
    calls = _calls(engine)
    assert len(calls) >= compile_apart.MIN_CALLS
    loaded, prepared = programs.forward.loaded, programs.forward.prepared
    assert programs.compile_all(calls) == len(calls)
    assert programs.forward.prepared - prepared == len(calls) == programs.forward.loaded - loaded  # none compiled here
    assert not any(p.missing(*args, **kwargs) for p, args, kwargs in calls)
    # what the child compiled computes what this process's own compile of the same function does
    kv = engine.new_cache(512)
    tokens, n = jnp.asarray(np.arange(1, 9, dtype=np.int32)[None]), jnp.int32(8)
    ours = jax.jit(programs.forward.jitted.__wrapped__, static_argnames=("cfg", "all_logits"),
                   compiler_options=programs.COMPILER_OPTIONS)(engine.params, tokens, n, kv, engine.cfg)[0]
    theirs = programs.forward(engine.params, tokens, n, engine.new_cache(512), engine.cfg)[0]
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_a_stopped_child_stores_nothing_and_the_caller_compiles_nothing(engine, store):
    stop = threading.Event()
    stop.set()
    assert compile_apart.compile_in_child(_calls(engine), stop) == 0
    assert programs.compile_all(_calls(engine), stop) == 0
    assert all(p.missing(*args, **kwargs) for p, args, kwargs in _calls(engine))


def test_a_child_of_another_environment_is_refused_and_the_caller_compiles(engine, store, monkeypatch):
    """A child whose store folder differs (here: other XLA_FLAGS, part of the environment's hash)
    stores nothing the caller would read; compile_all then compiles in process."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    calls = _calls(engine)
    assert compile_apart.compile_in_child(calls, None) == 0
    loaded, prepared = programs.forward.loaded, programs.forward.prepared
    assert programs.compile_all(calls) == len(calls)
    assert programs.forward.prepared - prepared == len(calls) and programs.forward.loaded == loaded


def test_a_jax_setting_made_in_code_keeps_the_child_out(engine, store):
    """A setting the caller made in code (here the default matmul precision, which changes what XLA's
    dots compute) is not in the child's environment: its store folder differs, so it is refused."""
    import jax

    from jaxsmol.runtime import program_store

    jax.config.update("jax_default_matmul_precision", "highest")
    program_store.environment.cache_clear()
    try:
        assert compile_apart.compile_in_child(_calls(engine), None) == 0
    finally:
        jax.config.update("jax_default_matmul_precision", None)
        program_store.environment.cache_clear()


def test_two_callers_at_once_compile_once(engine, store):
    """Replicas started together share the store: one child compiles, the other caller waits its turn
    and finds every program stored."""
    calls, results = _calls(engine), []
    before = compile_apart.rounds
    threads = [threading.Thread(target=lambda: results.append(compile_apart.compile_in_child(calls))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [len(calls), len(calls)] and compile_apart.rounds - before == 1
