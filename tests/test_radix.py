"""The radix prefix store on its own: pure NumPy values, no model.

A value is a pytree whose leaves share a sequence axis. The values used here make every position
checkable: the row of position i of key `t` is a function of `t[:i + 1]` only (as a causal model's
KV state is), so any two stored keys sharing a prefix agree on it, and `gather` can be compared
against values recomputed from the tokens alone.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cache.radix import RadixStore

ROW = 3  # values per position per leaf


def row(prefix: tuple) -> np.ndarray:
    """The value of the last position of `prefix`: depends on the whole prefix, nothing else."""
    return np.array([hash(prefix) % (2**31), len(prefix), prefix[-1]], dtype=np.int64)


def value(tokens, start: int, stop: int, seq_axis: int = 0) -> dict:
    """The value of positions [start, stop) of `tokens`: {"a": rows, "b": -rows}, sequence on seq_axis."""
    tokens = tuple(tokens)
    rows = [row(tokens[: i + 1]) for i in range(start, stop)]
    rows = np.stack(rows) if rows else np.zeros((0, ROW), np.int64)
    a = np.moveaxis(rows[None], 1, seq_axis) if seq_axis else rows  # seq_axis 0: [n, ROW]; 1: [1, n, ROW]
    return {"a": a, "b": -a}


BYTES_PER_POS = 2 * ROW * 8  # two int64 leaves of ROW values


class Recorder:
    """A `value_of` that records the (start, stop) it is asked for."""

    def __init__(self, tokens, seq_axis: int = 0):
        self.tokens, self.seq_axis, self.calls = tuple(tokens), seq_axis, []

    def __call__(self, start, stop):
        self.calls.append((start, stop))
        return value(self.tokens, start, stop, self.seq_axis)


def put(store: RadixStore, ns, tokens, payload=None, seq_axis: int = 0) -> tuple[int, list]:
    rec = Recorder(tokens, seq_axis)
    added = store.insert(ns, tokens, rec, payload=payload)
    return added, rec.calls


def assert_tree_equal(x: dict, y: dict):
    assert x.keys() == y.keys()
    for k in x:
        assert x[k].shape == y[k].shape, (k, x[k].shape, y[k].shape)
        assert np.array_equal(x[k], y[k]), k


def tree_bytes(store: RadixStore) -> int:
    """Bytes of every segment and payload actually in the tree (what bytes_held must equal)."""
    total, stack = 0, list(store._roots.values())
    while stack:
        node = stack.pop()
        if node.parent is not None:
            total += node.nbytes
        stack.extend(node.children.values())
    return total


def all_nodes(store: RadixStore):
    stack = list(store._roots.values())
    while stack:
        node = stack.pop()
        if node.parent is not None:
            yield node
        stack.extend(node.children.values())


BIG = 1 << 40


# ---- longest match, gather, split ----------------------------------------------------------------

def test_longest_match_ends_inside_an_edge():
    s = RadixStore(BIG)
    put(s, "ns", (1, 2, 3, 4, 5, 6))
    m = s.match("ns", (1, 2, 3, 4, 9, 9))
    assert m.length == 4
    assert len(m.path) == 1 and m.path[0].tokens == (1, 2, 3, 4, 5, 6)  # inside the edge, not split
    assert m.payload is None
    assert_tree_equal(s.gather(m), value((1, 2, 3, 4), 0, 4))
    # a query shorter than the stored key: matched entirely, still inside the edge
    m = s.match("ns", (1, 2))
    assert m.length == 2
    assert_tree_equal(s.gather(m), value((1, 2), 0, 2))
    # a query longer than the stored key
    m = s.match("ns", (1, 2, 3, 4, 5, 6, 7, 8))
    assert m.length == 6
    assert_tree_equal(s.gather(m), value((1, 2, 3, 4, 5, 6), 0, 6))
    # first token unknown: no match
    assert s.match("ns", (7, 1, 2)).length == 0


def test_longest_among_several_keys_and_gather_prefix_lengths():
    s = RadixStore(BIG)
    keys = [(1, 2, 3), (1, 2, 3, 4, 5), (1, 2, 7, 8), (1, 9), (5, 5, 5, 5)]
    for k in keys:
        put(s, "ns", k)
    cases = {(1, 2, 3, 4, 5, 6): 5, (1, 2, 3, 4, 0): 4, (1, 2, 7, 0): 3, (1, 2, 0): 2, (1, 9, 9): 2,
             (1, 0): 1, (5, 5, 5, 5, 5): 4, (2,): 0, (1, 2, 3): 3}
    for q, n in cases.items():
        m = s.match("ns", q)
        assert m.length == n, q
        if n:
            assert_tree_equal(s.gather(m), value(q, 0, n))
            for k in range(1, n + 1):  # any shorter length of the same match
                assert_tree_equal(s.gather(m, k), value(q, 0, k))


def test_gather_with_a_nonzero_seq_axis():
    s = RadixStore(BIG, seq_axis=1)
    put(s, "ns", (1, 2, 3, 4), seq_axis=1)
    put(s, "ns", (1, 2, 8, 9, 10), seq_axis=1)  # splits after (1, 2)
    m = s.match("ns", (1, 2, 8, 9, 11))
    assert m.length == 4
    got = s.gather(m)
    assert got["a"].shape == (1, 4, ROW)
    assert_tree_equal(got, value((1, 2, 8, 9), 0, 4, seq_axis=1))
    assert_tree_equal(s.gather(m, 3), value((1, 2, 8), 0, 3, seq_axis=1))


def test_split_keeps_values_intact():
    s = RadixStore(BIG)
    a = tuple(range(10, 30))  # 20 tokens
    b = a[:7] + (99, 98, 97)
    put(s, "ns", a, payload="pa")
    before = s.bytes_held
    added, calls = put(s, "ns", b, payload="pb")
    assert added == 3 and calls == [(7, 10)]
    # the tree now has a 7-token trunk with two children
    root = s._roots["ns"]
    (trunk,) = root.children.values()
    assert trunk.tokens == a[:7] and len(trunk.children) == 2
    assert trunk.payload is None
    # both keys gather their exact values, and keep their own payloads
    for key, p in ((a, "pa"), (b, "pb")):
        m = s.match("ns", key)
        assert m.length == len(key) and m.payload == p
        assert_tree_equal(s.gather(m), value(key, 0, len(key)))
    # the split moved bytes, it did not add any: only b's 3 new positions were added (+ its payload)
    assert s.bytes_held == before + 3 * BYTES_PER_POS
    assert s.bytes_held == tree_bytes(s)


def test_split_by_a_shorter_key_ending_inside_an_edge():
    s = RadixStore(BIG)
    a = (1, 2, 3, 4, 5, 6)
    put(s, "ns", a)
    added, calls = put(s, "ns", a[:3], payload="short")
    assert added == 0 and calls == []  # nothing new: the positions are already held
    m = s.match("ns", a[:3])
    assert m.length == 3 and m.payload == "short"
    assert_tree_equal(s.gather(m), value(a, 0, 3))
    m = s.match("ns", a)
    assert m.length == 6 and m.payload is None
    assert_tree_equal(s.gather(m), value(a, 0, 6))
    assert s.bytes_held == 6 * BYTES_PER_POS + 0  # a str payload has no nbytes
    assert s.bytes_held == tree_bytes(s)


# ---- trimming and shared trunks ------------------------------------------------------------------

def test_shared_trunk_stored_once():
    s = RadixStore(BIG)
    trunk = tuple(range(100, 150))  # 50 tokens
    keys = [trunk + (1, 2, 3), trunk + (4, 5), trunk + (6,), trunk[:20] + (7, 7, 7, 7)]
    for k in keys:
        put(s, "ns", k)
    unique = len({k[: i + 1] for k in keys for i in range(len(k))})
    assert unique == 50 + 3 + 2 + 1 + 4
    assert s.bytes_held == unique * BYTES_PER_POS
    assert s.bytes_held == tree_bytes(s)
    for k in keys:
        m = s.match("ns", k)
        assert m.length == len(k)
        assert_tree_equal(s.gather(m), value(k, 0, len(k)))


def test_value_of_is_only_asked_for_new_positions():
    s = RadixStore(BIG)
    assert put(s, "ns", (1, 2, 3, 4, 5)) == (5, [(0, 5)])
    assert put(s, "ns", (1, 2, 3, 4, 5, 6, 7)) == (2, [(5, 7)])  # extends a leaf
    assert put(s, "ns", (1, 2, 3, 9)) == (1, [(3, 4)])  # diverges inside an edge
    assert put(s, "ns", (1, 2, 3, 4, 5)) == (0, [])  # already stored
    assert put(s, "ns", (1, 2)) == (0, [])  # a stored prefix
    assert put(s, "ns", (8,)) == (1, [(0, 1)])
    assert put(s, "other", (1, 2, 3)) == (3, [(0, 3)])  # another namespace shares nothing


def test_value_trimmed_to_its_length():
    """Memory grows with the key, not with the size of the array the value was cut from."""
    s = RadixStore(BIG)
    big = np.arange(1000 * ROW, dtype=np.int64).reshape(1000, ROW)  # e.g. a cache of 1000 slots
    s.insert("ns", (1, 2, 3), lambda a, b: {"a": big[a:b]})
    assert s.bytes_held == 3 * ROW * 8


# ---- payloads and namespaces ---------------------------------------------------------------------

def test_payload_only_on_an_exact_key():
    s = RadixStore(BIG)
    payload = np.arange(7, dtype=np.float32)
    put(s, "ns", (1, 2, 3, 4), payload=payload)
    assert s.match("ns", (1, 2, 3, 4)).payload is payload
    for q in [(1, 2, 3), (1, 2, 3, 4, 5), (1, 2, 3, 5), (1,)]:
        assert s.match("ns", q).payload is None, q
    # a key inserted without a payload has none, and a later payload does not replace the first
    put(s, "ns", (1, 2, 3, 4, 5, 6))
    assert s.match("ns", (1, 2, 3, 4, 5, 6)).payload is None
    put(s, "ns", (1, 2, 3, 4), payload=np.zeros(7, np.float32))
    assert s.match("ns", (1, 2, 3, 4)).payload is payload
    # the payload's bytes are held
    assert s.bytes_held == 6 * BYTES_PER_POS + payload.nbytes == tree_bytes(s)


def test_namespaces_never_hit_each_other():
    s = RadixStore(BIG)
    put(s, ("fp-a", ""), (1, 2, 3, 4), payload="a")
    put(s, ("fp-a", "salt"), (1, 2, 3, 9), payload="b")
    assert s.match(("fp-b", ""), (1, 2, 3, 4)).length == 0
    assert s.match(("fp-a", "other"), (1, 2, 3, 4)).length == 0
    m = s.match(("fp-a", "salt"), (1, 2, 3, 4))
    assert m.length == 3 and m.payload is None
    m = s.match(("fp-a", ""), (1, 2, 3, 4))
    assert m.length == 4 and m.payload == "a"
    assert s.bytes_held == 8 * BYTES_PER_POS  # nothing shared across namespaces


# ---- diagnostics ---------------------------------------------------------------------------------

def test_nearest_len_and_miss_diagnostics():
    s = RadixStore(BIG)
    assert s.match("ns", (1, 2, 3)).nearest_len == 0  # empty store
    put(s, "ns", tuple(range(1, 11)), payload="p10")  # 10 tokens
    m = s.match("ns", (1, 2, 3, 4, 0, 0))  # diverges at position 4, inside the edge
    assert (m.length, m.nearest_len) == (4, 10)
    m = s.match("ns", (1, 2))  # a prefix of the stored key
    assert (m.length, m.nearest_len) == (2, 10)
    m = s.match("ns", (9, 9))  # total miss
    assert (m.length, m.nearest_len) == (0, 0)
    put(s, "ns", (1, 2, 3, 4, 5), payload="p5")  # splits: (1..5) with payload, then (6..10)
    m = s.match("ns", (1, 2, 3, 4, 5, 0))  # diverges right after a stored key
    assert (m.length, m.nearest_len) == (5, 5)
    m = s.match("ns", (1, 2, 3, 4, 5, 6, 7, 0))
    assert (m.length, m.nearest_len) == (7, 10)


# ---- LRU under the budget, leases ---------------------------------------------------------------

def test_lru_evicts_least_recently_used_leaves_first():
    keys = [(k, 1, 2, 3, 4) for k in range(10, 15)]  # five disjoint 5-token keys
    s = RadixStore(budget_bytes=3 * 5 * BYTES_PER_POS)  # room for three
    for k in keys[:3]:
        put(s, "ns", k)
    assert s.evictions == 0
    s.match("ns", keys[0])  # touch 0: now 1 is the least recently used
    put(s, "ns", keys[3])
    assert s.evictions == 1
    assert s.match("ns", keys[1]).length == 0
    assert all(s.match("ns", keys[i]).length == 5 for i in (0, 2, 3))  # (touches 0, 2, 3 in that order)
    put(s, "ns", keys[4])
    assert s.evictions == 2
    assert s.match("ns", keys[0]).length == 0  # 0 was touched first of the three
    assert s.bytes_held == 3 * 5 * BYTES_PER_POS == tree_bytes(s)
    assert s.bytes_held <= s.budget_bytes


def test_lru_evicts_leaves_not_shared_trunks():
    trunk = tuple(range(100, 110))
    s = RadixStore(budget_bytes=(10 + 3 * 2) * BYTES_PER_POS)
    put(s, "ns", trunk + (1, 1))
    put(s, "ns", trunk + (2, 2))
    put(s, "ns", trunk + (3, 3))
    assert s.bytes_held == s.budget_bytes and s.evictions == 0
    put(s, "ns", trunk + (4, 4))  # evicts the leaf (1, 1) only
    assert s.evictions == 1
    assert s.match("ns", trunk + (1, 1)).length == 10  # the trunk is still there
    assert s.bytes_held == tree_bytes(s) <= s.budget_bytes


def test_leaf_evicted_then_its_parent_when_still_over_budget():
    s = RadixStore(budget_bytes=BIG)
    put(s, "ns", (1, 2, 3, 4))
    put(s, "ns", (1, 2, 3, 4, 5, 6))  # two nodes on one chain
    put(s, "ns", (9, 9))
    s.match("ns", (9, 9))  # the chain is older
    s.budget_bytes = 2 * BYTES_PER_POS
    s._evict()
    assert s.evictions == 2
    assert s.match("ns", (1, 2, 3, 4, 5, 6)).length == 0
    assert s.match("ns", (9, 9)).length == 2
    assert s.bytes_held == 2 * BYTES_PER_POS == tree_bytes(s)


def test_acquired_entry_is_never_evicted_and_is_evicted_after_release():
    keys = [(k, 1, 2, 3) for k in range(10, 14)]
    s = RadixStore(budget_bytes=2 * 4 * BYTES_PER_POS)  # room for two
    put(s, "ns", keys[0])
    lease = s.match("ns", keys[0])
    s.acquire(lease)
    for k in keys[1:]:  # keys[0] is the least recently used throughout
        put(s, "ns", k)
    assert s.match("ns", keys[0]).length == 4  # in use: kept
    assert_tree_equal(s.gather(lease), value(keys[0], 0, 4))
    s.match("ns", keys[3])  # keys[0] is least recently used again
    s.release(lease)  # over budget? not now: eviction already kept it within
    assert s.bytes_held <= s.budget_bytes
    put(s, "ns", (50, 1, 2, 3))
    assert s.match("ns", keys[0]).length == 0  # released: evictable


def test_over_budget_while_leased_evicts_on_release():
    s = RadixStore(budget_bytes=4 * BYTES_PER_POS)
    put(s, "ns", (1, 2, 3, 4))
    lease = s.match("ns", (1, 2, 3, 4))
    s.acquire(lease)
    put(s, "ns", (5, 6, 7, 8))  # over budget: only the new key is protected, the leased one cannot go
    assert s.bytes_held == 8 * BYTES_PER_POS > s.budget_bytes
    assert s.evictions == 0
    s.release(lease)  # now it can: the release evicts it
    assert s.evictions == 1
    assert s.bytes_held == 4 * BYTES_PER_POS == tree_bytes(s)
    assert s.match("ns", (1, 2, 3, 4)).length == 0
    assert s.match("ns", (5, 6, 7, 8)).length == 4


def test_lease_is_fully_released_after_its_node_was_split():
    """A request acquires a match that ends inside an edge, then saves its own prompt, which splits
    that edge (PrefixCache does exactly this on every partial hit). After release no node may stay
    leased: every node must become evictable again."""
    s = RadixStore(BIG)
    put(s, "ns", (1, 2, 3, 4, 5, 6))
    lease = s.match("ns", (1, 2, 3, 4, 9))
    assert lease.length == 4
    s.acquire(lease)
    put(s, "ns", (1, 2, 3, 4, 9))  # splits the leased node after 4 tokens
    s.release(lease)
    assert [n.tokens for n in all_nodes(s) if n.leases] == []
    s.budget_bytes = 0
    s._evict()
    assert s.bytes_held == 0, "a released trunk stayed pinned"
    assert s.match("ns", (1, 2, 3, 4)).length == 0


def test_len_counts_keys_no_other_extends():
    s = RadixStore(BIG)
    put(s, "ns", (1, 2, 3))
    put(s, "ns", (1, 2, 3, 4, 5))  # extends (1, 2, 3): that one is no longer counted
    put(s, "ns", (1, 2, 9))
    put(s, "other", (1, 2, 3))
    assert len(s) == 3


def test_common_prefix_len():
    from cache.radix import common_prefix_len

    assert common_prefix_len((1, 2, 3), [1, 2, 4]) == 2
    assert common_prefix_len((1, 2), [1, 2, 3]) == 2 and common_prefix_len((1, 2, 3), (1, 2)) == 2
    assert common_prefix_len((2, 3, 9), [1, 2, 3, 4], start=1) == 2
    assert common_prefix_len((5,), [1, 2], start=2) == 0 and common_prefix_len((), [1]) == 0


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


def assert_owned(store: RadixStore):
    """Every stored array owns its memory: no view keeps a larger base alive behind the count."""
    for node in all_nodes(store):
        for leaf in jax.tree.leaves((node.segment, node.payload)):
            assert not isinstance(leaf, np.ndarray) or leaf.base is None, node.tokens


def test_split_halves_own_their_memory_the_issue_repro():
    """Issue 11's repro: long keys split by short ones sharing their first 2 tokens, the long tails
    evicted. Views kept every evicted tail's base alive (31 MiB counted, 512 MiB held)."""
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


def test_add_snapshot_of_a_loaded_file_holds_what_it_counts(tiny_engine, tmp_path):
    """A snapshot read from disk is inserted as copies, not as views that keep the whole file (and
    its logits) alive; evicting it then frees its bytes."""
    from cache.disk import save_prompt_cache
    from cache.snapshot import identity, load_snapshot
    from cache.prefix_cache import PrefixCache
    from jaxsmol.sampling import SamplingParams

    P = [int(t) for t in np.random.default_rng(0).integers(3, 256, 300)]
    source = PrefixCache(tiny_engine)
    gen, _ = source.generate(P, SamplingParams(max_tokens=4))
    path = tmp_path / "p.safetensors"
    save_prompt_cache(source, path, P + gen.output_ids)
    cache = PrefixCache(tiny_engine, budget_bytes=1 << 30)

    def load_three_prefixes():  # three keys ending at 100, 200, 304: splits of the loaded arrays
        snap = load_snapshot(path, identity(tiny_engine))
        for n in (100, 200):
            cache.add_snapshot(dataclasses.replace(snap, tokens=snap.tokens[:n], k=snap.k[:, :, :n],
                                                   v=snap.v[:, :, :n], logits={}))
        cache.add_snapshot(snap)

    held, _ = held_by(load_three_prefixes)
    assert cache.bytes_held == 304 * tiny_engine.kv_bytes_per_token + 2 * 4 * tiny_engine.cfg.vocab_size
    assert held <= cache.bytes_held + SLACK, (held, cache.bytes_held)
    assert_owned(cache.radix)
    cache.radix.budget_bytes = 150 * tiny_engine.kv_bytes_per_token
    freed, _ = held_by(cache.radix._evict)
    assert cache.bytes_held <= cache.radix.budget_bytes
    assert -freed >= held - cache.bytes_held - SLACK  # the evicted bytes were really released


# ---- properties against a brute-force reference -------------------------------------------------

def lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


token_lists = st.lists(st.integers(0, 5), min_size=1, max_size=12)  # small alphabet: many shared prefixes
namespaces = st.sampled_from(["x", "y"])


class RadixVsReference(RuleBasedStateMachine):
    """No eviction (a huge budget): the store must answer exactly like a dict of all stored keys."""

    @initialize(seq_axis=st.sampled_from([0, 1]))
    def setup(self, seq_axis):
        self.seq_axis = seq_axis
        self.store = RadixStore(BIG, seq_axis=seq_axis)
        self.ref: dict = {}  # (ns, key) -> payload or None (the first payload given wins)

    def keys(self, ns):
        return [k for (n, k) in self.ref if n == ns]

    @rule(ns=namespaces, tokens=token_lists, with_payload=st.booleans())
    def insert(self, ns, tokens, with_payload):
        tokens = tuple(tokens)
        stored = max((lcp(tokens, k) for k in self.keys(ns)), default=0)
        payload = np.array([len(tokens), hash(tokens) % 1000], np.int64) if with_payload else None
        added, calls = put(self.store, ns, tokens, payload=payload, seq_axis=self.seq_axis)
        assert added == len(tokens) - stored
        assert calls == ([(stored, len(tokens))] if added else [])
        old = self.ref.get((ns, tokens))
        self.ref[(ns, tokens)] = old if old is not None else payload

    @rule(ns=namespaces, tokens=token_lists)
    def lookup(self, ns, tokens):
        tokens = tuple(tokens)
        keys = self.keys(ns)
        m = self.store.match(ns, tokens)
        assert m.length == max((lcp(tokens, k) for k in keys), default=0)
        expected_payload = self.ref.get((ns, tokens))
        if expected_payload is None:
            assert m.payload is None
        else:
            assert np.array_equal(m.payload, expected_payload)
        if m.length:
            assert_tree_equal(self.store.gather(m), value(tokens, 0, m.length, self.seq_axis))
            assert m.nearest_len >= m.length
            assert any(len(k) == m.nearest_len and k[: m.length] == tokens[: m.length] for k in keys)
        else:
            assert m.nearest_len == 0

    @rule(ns=namespaces, data=st.data())
    def gather_stored_key_prefix(self, ns, data):
        keys = self.keys(ns)
        if not keys:
            return
        key = data.draw(st.sampled_from(sorted(keys)))
        n = data.draw(st.integers(1, len(key)))
        m = self.store.match(ns, key)
        assert m.length == len(key)
        assert_tree_equal(self.store.gather(m, n), value(key, 0, n, self.seq_axis))

    @invariant()
    def bytes_are_unique_positions(self):
        if not hasattr(self, "store"):
            return
        unique = {(ns, k[: i + 1]) for (ns, k) in self.ref for i in range(len(k))}
        payload_bytes = sum(p.nbytes for p in self.ref.values() if p is not None)
        assert self.store.bytes_held == len(unique) * BYTES_PER_POS + payload_bytes
        assert self.store.bytes_held == tree_bytes(self.store)
        assert self.store.evictions == 0


RadixVsReference.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestRadixVsReference = RadixVsReference.TestCase


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["insert", "match", "lease", "release"]), token_lists),
                    min_size=1, max_size=40),
       budget_positions=st.integers(0, 30))
def test_under_a_budget_values_stay_exact_and_bytes_bounded(ops, budget_positions):
    """With eviction: a match is never longer than the reference's, its values are always exact,
    bytes_held always equals the bytes in the tree, and with no lease it never exceeds the budget
    except by the key just inserted."""
    s = RadixStore(budget_positions * BYTES_PER_POS)
    stored: set = set()
    leases = []
    for op, tokens in ops:
        tokens = tuple(tokens)
        if op == "insert":
            put(s, "ns", tokens)
            stored.add(tokens)
            if not leases:
                assert s.bytes_held <= max(s.budget_bytes, len(tokens) * BYTES_PER_POS)
        elif op == "release":
            if leases:
                s.release(leases.pop(0))
        else:
            m = s.match("ns", tokens)
            assert m.length <= max((lcp(tokens, k) for k in stored), default=0)
            if m.length:
                assert_tree_equal(s.gather(m), value(tokens, 0, m.length))
                if op == "lease":
                    s.acquire(m)
                    leases.append(m)
        assert s.bytes_held == tree_bytes(s)
        assert_owned(s)
    for m in leases:
        s.release(m)
    assert all(n.leases == 0 for n in all_nodes(s))
    s._evict()
    assert s.bytes_held <= s.budget_bytes
