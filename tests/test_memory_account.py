"""Where memory goes: the compiled programs measured as they are made (jaxsmol/system/program_memory.py),
malloc's figures (jaxsmol/system/host_memory.py), and the daemon's account that /metrics exports
(cli/server/memory.py). The daemon-level check (the gauges explain RSS growth) is in tests/test_soak.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxsmol.cli.server.memory import MemoryAccount
from jaxsmol.cli.server.metrics import MEMORY_GAUGES, Metrics
from jaxsmol.system import host_memory, program_memory
from jaxsmol.model.kv import KVCache

pytestmark = pytest.mark.skipif(host_memory.heap() is None, reason="malloc's figures need glibc (mallinfo2)")


def test_malloc_figures_see_an_allocation_and_its_release():
    """The figures are the whole process's, and other threads of a test worker (an earlier test's
    background work) allocate and free a few MB meanwhile: a block large against that, and a margin."""
    margin = 32 << 20
    before = host_memory.heap()
    block = np.ones(256 << 20, np.uint8)  # 256 MB from malloc
    during = host_memory.heap()
    assert during.in_use - before.in_use >= (256 << 20) - margin
    del block
    assert host_memory.heap().in_use - before.in_use < margin


def test_each_program_made_is_counted_with_its_memory(tiny_cfg, params):
    """A new shape of the forward makes one executable (traced, lowered, compiled): one more program
    and bytes for it; the same shape again comes from JAX's caches and makes none."""
    from jaxsmol.runtime import programs

    assert program_memory.watch() and program_memory.watch()  # idempotent
    before = program_memory.held()
    kv = KVCache.zeros(tiny_cfg, 512)
    tokens = jnp.ones((1, 7), jnp.int32)  # a chunk length no other test compiles at this capacity
    jax.block_until_ready(programs.forward(params, tokens, jnp.int32(7), kv, tiny_cfg))
    after = program_memory.held()
    assert after.count - before.count >= 1
    assert after.bytes > before.bytes
    kv = KVCache.zeros(tiny_cfg, 512)
    jax.block_until_ready(programs.forward(params, tokens, jnp.int32(7), kv, tiny_cfg))
    assert program_memory.held() == after


def test_the_account_explains_what_it_is_shown(params):
    """After `start`, memory the account is told about (here a cache of 96 MB) is not unaccounted;
    memory nobody reports is (the same 96 MB, unreported)."""
    account = MemoryAccount(params)
    assert account.weights == sum(x.nbytes for x in jax.tree.leaves(params))
    freed = np.ones(128 << 20, np.uint8)  # a block freed before, as a long process has (kept or returned)
    del freed
    account.start()
    before = account.figures(cache=0, pool=0, batch_kv=0)
    held = np.ones(96 << 20, np.uint8)
    told = account.figures(cache=held.nbytes, pool=0, batch_kv=0)
    untold = account.figures(cache=0, pool=0, batch_kv=0)
    assert abs(told["unaccounted_bytes"]) < 32 << 20, told
    # the two readings are moments apart: another thread may allocate a little in between
    assert untold["unaccounted_bytes"] - told["unaccounted_bytes"] == pytest.approx(held.nbytes, abs=4 << 20)
    # the 96 MB are new resident pages, or free memory malloc kept for reuse (host_memory.py keeps big
    # blocks: in a process that freed one before, the resident set need not grow at all)
    grown = told["resident_bytes"] - before["resident_bytes"] + before["heap_free_bytes"] - told["heap_free_bytes"]
    assert grown >= 64 << 20, (before, told)
    del held


def test_metrics_render_the_memory_gauges(params):
    account = MemoryAccount(params)
    account.start()
    from jaxsmol.cache.records import CacheStats

    text = Metrics().render(CacheStats().as_dict(), 0, memory=account.figures(0, 0, 0))
    names = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    assert {f"jaxsmol_{key}" for key, _ in MEMORY_GAUGES} <= names

