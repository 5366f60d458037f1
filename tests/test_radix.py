"""The radix prefix store on its own: match, gather, split, trimming, payloads, namespaces, LRU and
leases. Pure NumPy values that make every position checkable (tests/radix_values.py), no model; the
memory it holds is in tests/test_radix_memory.py, properties against a reference in
tests/test_radix_properties.py.
"""

from __future__ import annotations

import numpy as np

from jaxsmol.cache.store.radix import RadixStore
from radix_values import BIG, BYTES_PER_POS, ROW, all_nodes, assert_tree_equal, put, tree_bytes, value


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


def test_continuation_follows_the_most_recent_branch():
    """What speculation drafts from the cache: the tokens stored after a query wholly stored."""
    s = RadixStore(BIG)
    put(s, "ns", (1, 2, 3, 4, 5, 6))
    put(s, "ns", (1, 2, 3, 7, 8))  # splits the edge at 3; the newer branch
    assert s.continuation("ns", (1, 2), 9) == [3, 7, 8]  # inside an edge, then the most recent child
    s.match("ns", (1, 2, 3, 4, 5, 6))  # now the older branch is the more recent
    assert s.continuation("ns", (1, 2, 3), 9) == [4, 5, 6]
    assert s.continuation("ns", (1, 2, 3), 2) == [4, 5]
    assert s.continuation("ns", (1, 2, 3, 4, 5, 6), 9) == []  # nothing stored past the whole key
    assert s.continuation("ns", (1, 9), 9) == [] and s.continuation("other", (1, 2), 9) == []


def test_a_pinned_match_gathers_its_positions_after_its_edges_split():
    """A lease read later (an answer's prefix is gathered at its first chunk, cache/records.py) still
    gives its own positions after inserts split the edges it runs through."""
    s = RadixStore(BIG)
    put(s, "ns", (1, 2, 3, 4, 5, 6))
    put(s, "ns", (1, 2, 3, 4, 5, 6, 7, 8, 9))
    m = s.match("ns", (1, 2, 3, 4, 5, 6, 7, 8, 9, 10))
    s.acquire(m)
    put(s, "ns", (1, 2, 8))  # splits (1..6) after 2
    put(s, "ns", (1, 2, 3, 4, 5, 6, 7, 1))  # splits (7, 8, 9) after 7
    for length in (9, 7, 4):
        assert_tree_equal(s.gather(m, length), value((1, 2, 3, 4, 5, 6, 7, 8, 9), 0, length))
    s.release(m)


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


def test_room_is_made_before_a_new_segment_is_read():
    keys = [(k, 1, 2, 3, 4) for k in range(10, 14)]  # four disjoint 5-token keys
    s = RadixStore(budget_bytes=3 * 5 * BYTES_PER_POS)  # room for three
    for k in keys[:3]:
        put(s, "ns", k)
    held_when_read = []

    def value_of(start, stop):
        held_when_read.append(s.bytes_held)
        return value(keys[3], start, stop)

    s.insert("ns", keys[3], value_of)
    # the oldest entry went before the new one was read: the budget held throughout, the new segment counted
    assert held_when_read == [2 * 5 * BYTES_PER_POS] and s.evictions == 1
    assert s.match("ns", keys[0]).length == 0 and s.match("ns", keys[3]).length == 5


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
    from jaxsmol.cache.store.values import common_prefix_len

    assert common_prefix_len((1, 2, 3), [1, 2, 4]) == 2
    assert common_prefix_len((1, 2), [1, 2, 3]) == 2 and common_prefix_len((1, 2, 3), (1, 2)) == 2
    assert common_prefix_len((2, 3, 9), [1, 2, 3, 4], start=1) == 2
    assert common_prefix_len((5,), [1, 2], start=2) == 0 and common_prefix_len((), [1]) == 0
