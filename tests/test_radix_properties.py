"""The radix store against a brute-force reference (hypothesis): with and without eviction.
Values as in tests/radix_values.py."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jaxsmol.cache.store.radix import RadixStore
from radix_values import BIG, BYTES_PER_POS, all_nodes, assert_owned, assert_tree_equal, put, tree_bytes, value

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
