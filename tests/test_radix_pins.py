"""Pinned keys of the radix store (cache/store/radix.py `pin` / `unpin`), hits, peeks and the walk
inspection reads: a pinned key's nodes are never evicted and their bytes are counted apart from the
LRU budget; unpinning returns them to the LRU. Pure NumPy values (tests/radix_values.py), no model.
"""

from __future__ import annotations

import random

from jaxsmol.cache.store.radix import RadixStore
from radix_values import BIG, BYTES_PER_POS, all_nodes, assert_tree_equal, put, tree_bytes, value


def pinned_tree_bytes(store: RadixStore) -> int:
    return sum(n.nbytes for n in all_nodes(store) if n.pins)


def test_a_pinned_key_is_never_evicted_and_is_not_counted_against_the_budget():
    s = RadixStore(40 * BYTES_PER_POS)
    system = tuple(range(1, 31))  # 30 positions: most of the LRU budget
    put(s, "ns", system)
    assert s.pin("ns", system)
    assert s.pinned_bytes == 30 * BYTES_PER_POS == pinned_tree_bytes(s)
    for i in range(20):  # 20 prompts of 30 more positions each: the LRU holds at most one of them
        put(s, "ns", system + tuple(range(100 + 30 * i, 130 + 30 * i)))
        assert s.match("ns", system, touch=False).length == 30
        assert s.bytes_held - s.pinned_bytes <= s.budget_bytes
        assert s.bytes_held == tree_bytes(s) and s.pinned_bytes == pinned_tree_bytes(s)
    assert s.evictions >= 18
    assert_tree_equal(s.gather(s.match("ns", system)), value(system, 0, 30))
    # a key pinned with more positions than the LRU budget still stays, the LRU empties around it
    big = tuple(range(500, 600))
    put(s, "other", big)
    assert s.pin("other", big) and s.match("other", big).length == 100
    put(s, "ns", (7, 7, 7))
    assert s.match("other", big).length == 100 and s.match("ns", system).length == 30


def test_unpin_returns_a_key_to_the_lru():
    s = RadixStore(20 * BYTES_PER_POS)
    key = tuple(range(1, 16))
    put(s, "ns", key)
    s.pin("ns", key)
    put(s, "ns", tuple(range(50, 65)))  # fits beside the pinned key: it is not under the budget
    assert s.match("ns", key, touch=False).length == 15 and s.evictions == 0
    assert s.unpin("ns", key) and not s.unpin("ns", key)  # once
    assert s.pinned_bytes == 0 and s.bytes_held <= s.budget_bytes  # over budget now: the LRU evicts
    assert s.evictions == 1 and s.match("ns", key, touch=False).length == 0  # the older key went


def test_pinning_a_key_that_ends_inside_an_edge_splits_it_there():
    s = RadixStore(BIG)
    put(s, "ns", tuple(range(1, 11)))
    assert s.pin_cost("ns", (1, 2, 3, 4)) == 4 * BYTES_PER_POS  # splits (1..10) after 4
    assert s.pin("ns", (1, 2, 3, 4))
    assert s.pinned_bytes == 4 * BYTES_PER_POS == pinned_tree_bytes(s)
    s.budget_bytes = 0
    put(s, "ns", (20, 21))  # an insert evicts every unpinned leaf but its own: the tail (5..10) goes
    assert s.match("ns", tuple(range(1, 11))).length == 4
    assert not s.pin("ns", (9, 9)) and s.pin_cost("ns", (1, 2, 3, 4, 5)) is None  # not stored
    assert s.unpin("ns", (1, 2, 3, 4)) and s.bytes_held == 0  # back in the LRU, with nothing allowed


def test_splits_and_payloads_below_and_on_pinned_nodes_keep_the_count():
    """Random inserts (splitting pinned edges, adding payloads to pinned nodes), pins and unpins:
    pinned_bytes is always the bytes of the nodes some pinned key runs through."""
    rng = random.Random(0)
    s = RadixStore(60 * BYTES_PER_POS)
    keys = []
    for step in range(400):
        key = tuple(rng.randrange(4) for _ in range(rng.randrange(1, 12)))
        action = rng.random()
        if action < 0.6:
            put(s, "ns", key, payload={"p": value(key, 0, 1)["a"]} if rng.random() < 0.5 else None)
            keys.append(key)
        elif action < 0.8 and keys:
            s.pin("ns", rng.choice(keys))
        elif s.pinned:
            s.unpin(*rng.choice(sorted(s.pinned)))
        assert s.pinned_bytes == pinned_tree_bytes(s), step
        assert s.bytes_held == tree_bytes(s), step
        assert s.bytes_held - s.pinned_bytes <= s.budget_bytes, step
        for ns, key in s.pinned:
            assert s.match(ns, key, touch=False).length == len(key), (step, key)
            assert_tree_equal(s.gather(s.match(ns, key, touch=False)), value(key, 0, len(key)))


def test_clear_keeping_pins_keeps_exactly_the_pinned_keys():
    s = RadixStore(BIG)
    for k in [(1, 2, 3), (1, 2, 3, 4, 5), (1, 2, 9), (7, 8)]:
        put(s, "ns", k)
    put(s, "other", (1, 2))
    s.pin("ns", (1, 2, 3))
    s.clear(keep_pinned=True)
    assert s.bytes_held == s.pinned_bytes == 3 * BYTES_PER_POS == tree_bytes(s)
    assert s.match("ns", (1, 2, 3, 4, 5)).length == 3 and s.match("ns", (7, 8)).length == 0
    assert s.match("other", (1, 2)).length == 0
    s.clear()
    assert s.bytes_held == s.pinned_bytes == 0 and not s.pinned


def test_peek_reads_the_match_length_without_touching_the_lru():
    s = RadixStore(BIG)
    put(s, "ns", (1, 2, 3, 4))
    put(s, "ns", (5, 6))
    before = {n.tokens: n.last_used for n in all_nodes(s)}
    for q, n in {(1, 2, 3, 4, 5): 4, (1, 2, 9): 2, (5, 6): 2, (9,): 0, (): 0}.items():
        assert s.peek("ns", q) == n == s.match("ns", q, touch=False).length
    assert s.peek("nobody", (1, 2)) == 0
    assert {n.tokens: n.last_used for n in all_nodes(s)} == before


def test_hits_count_the_nodes_a_lookup_restores_entirely_and_walk_lists_every_key():
    s = RadixStore(BIG)
    system, q1 = (1, 2, 3, 4), (1, 2, 3, 4, 5, 6)
    put(s, "ns", system, payload={"p": value(system, 0, 1)["a"]})
    put(s, "ns", q1, payload={"p": value(q1, 0, 1)["a"]})
    for _ in range(3):
        s.release(s.lookup("ns", (1, 2, 3, 4, 5, 9)))  # restores system and 5: q1 not entirely
    s.release(s.lookup("ns", q1 + (7,)))
    s.release(s.lookup("ns", q1 + (8,), count=False))  # e.g. an answer extending its prompt
    entries = {tokens: (node, nbytes) for ns, tokens, node, nbytes in s.walk()}
    assert set(entries) == {system, q1}
    assert entries[system][0].hits == 4 and entries[q1][0].hits == 1
    payload = value(system, 0, 1)["a"].nbytes
    assert entries[system][1] == 4 * BYTES_PER_POS + payload
    assert entries[q1][1] == 6 * BYTES_PER_POS + payload
    assert all(node.used_at > 0 for node, _ in entries.values())
