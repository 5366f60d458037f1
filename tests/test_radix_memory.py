"""The radix store counts the bytes it holds: every stored array owns its memory (no view keeps a
larger base alive), checked with tracemalloc. Values as in tests/radix_values.py."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxsmol.cache.store.radix import RadixStore
from jaxsmol.cache.scheduler.many import generate
from radix_values import BIG, BYTES_PER_POS, assert_owned, put, tree_bytes

# ---- bytes counted are bytes held ------------------------------------------------------------------

SLACK = 1 << 20  # tree nodes, token tuples and dicts: tens of KiB here; 1 MiB leaves room for allocator noise


def held_by(fn) -> tuple[int, object]:
    """(bytes still allocated by `fn()` after it returned, its result), traced by tracemalloc."""
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        out = fn()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - base, out
    finally:
        tracemalloc.stop()


def test_split_halves_own_their_memory_when_tails_are_evicted():
    """Long keys split by short ones sharing their first 2 tokens, the long tails
    evicted: views would keep every evicted tail's base alive (31 MiB counted, 512 MiB held)."""
    def repro():
        s = RadixStore(32 << 20, seq_axis=0)
        for i in range(40):
            s.insert("ns", [i] + list(range(1000, 1063)), lambda a, b: np.ones((b - a, 65536), np.float32))
            s.insert("ns", [i, 1000, 7], lambda a, b: np.ones((b - a, 1), np.float32))
            for j in range(i + 1):
                s.match("ns", [j, 1000, 7])
        return s

    held, s = held_by(repro)
    assert s.evictions > 0 and s.bytes_held <= s.budget_bytes
    assert s.bytes_held == tree_bytes(s)
    assert held <= s.bytes_held + SLACK, (held, s.bytes_held)
    assert_owned(s)


def test_views_given_to_insert_are_copied_and_keep_their_read_only_flag():
    big = np.ones((4096, 256), np.float32)  # 4 MiB: e.g. a loaded snapshot file
    big.flags.writeable = False
    s = RadixStore(BIG)
    held, _ = held_by(lambda: s.insert("ns", (1, 2, 3), lambda a, b: {"a": big[a:b]}, payload=big[0]))
    assert s.bytes_held == 3 * 256 * 4 + 256 * 4 == tree_bytes(s)
    assert held <= s.bytes_held + SLACK
    assert_owned(s)
    node = s.match("ns", (1, 2, 3)).path[0]
    assert not node.segment["a"].flags.writeable and not node.payload.flags.writeable
    assert np.array_equal(node.segment["a"], big[:3])
    mine = np.zeros((3, 2))  # an array that owns its memory is stored as is, not copied
    s.insert("other", (5, 6, 7), lambda a, b: {"a": mine})
    assert s.match("other", (5, 6, 7)).path[0].segment["a"] is mine


def test_an_empty_namespace_drops_its_root():
    s = RadixStore(budget_bytes=4 * BYTES_PER_POS)
    for salt in range(50):  # one tenant after another, each evicting the last
        put(s, ("fp", str(salt)), (1, 2, 3, 4))
    assert len(s._roots) == 1 and s.match(("fp", "49"), (1, 2, 3, 4)).length == 4
    assert s.insert(("fp", "none"), (), lambda a, b: None) == 0 and len(s._roots) == 1  # an empty key
    s.clear()
    assert not s._roots


def _traced_from(folder: str) -> int:
    """Bytes allocated since tracemalloc started and still held, by code under `folder` (anywhere in the
    allocation's stack): what other threads of the test process allocate meanwhile is not counted."""
    import tracemalloc

    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, folder + "/*", all_frames=True)])
    return sum(trace.size for trace in snapshot.traces)


def test_add_snapshot_of_a_loaded_file_holds_what_it_counts(tiny_engine, tmp_path):
    """A snapshot read from disk is inserted as copies, not as views that keep the whole file (and
    its logits) alive; evicting it then frees its bytes. Traced from the load through the eviction, so
    the eviction's frees are of arrays the trace saw allocated."""
    import gc
    import os
    import tracemalloc

    import jaxsmol.cache
    from jaxsmol.cache.store.disk import save_prompt_cache
    from jaxsmol.cache.store.snapshot import identity, load_snapshot
    from jaxsmol.cache.prefix_cache import PrefixCache
    from jaxsmol.runtime.sampling import SamplingParams

    P = [int(t) for t in np.random.default_rng(0).integers(3, 256, 300)]
    source = PrefixCache(tiny_engine)
    gen = generate(source, P, SamplingParams(max_tokens=4))
    path = tmp_path / "p.safetensors"
    save_prompt_cache(source, path, P + gen.output_ids)
    cache = PrefixCache(tiny_engine, budget_bytes=1 << 30)
    folder = os.path.dirname(jaxsmol.cache.__file__)

    def load_three_prefixes():  # three keys ending at 100, 200, 304: splits of the loaded arrays
        snap = load_snapshot(path, identity(tiny_engine))
        for n in (100, 200):
            cache.add_snapshot(dataclasses.replace(snap, tokens=snap.tokens[:n], k=snap.k[:, :, :, :n],
                                                   v=snap.v[:, :, :, :n], logits={}))
        cache.add_snapshot(snap)

    load_snapshot(path, identity(tiny_engine))  # a first read's one-time work (imports, caches) outside the trace
    gc.collect()
    tracemalloc.start(16)
    try:
        load_three_prefixes()
        gc.collect()
        held = _traced_from(folder)
        assert cache.bytes_held == 304 * tiny_engine.kv_bytes_per_token + 2 * 4 * tiny_engine.cfg.vocab_size
        assert cache.bytes_held <= held <= cache.bytes_held + SLACK, (held, cache.bytes_held)
        assert_owned(cache.store)
        counted = cache.bytes_held
        cache.store.budget_bytes = 150 * tiny_engine.kv_bytes_per_token
        cache.store._evict()
        gc.collect()
        freed = held - _traced_from(folder)
    finally:
        tracemalloc.stop()
    assert cache.bytes_held <= cache.store.budget_bytes
    assert freed >= counted - cache.bytes_held, (freed, counted - cache.bytes_held)  # really released
