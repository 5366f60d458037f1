"""Checkable values for the radix store's tests (tests/test_radix*.py): pure NumPy, no model.

A value is a pytree whose leaves share a sequence axis. The row of position i of key `t` is a
function of `t[:i + 1]` only (as a causal model's KV state is), so any two stored keys sharing a
prefix agree on it, and `gather` can be compared against values recomputed from the tokens alone.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxsmol.system import host_memory

from jaxsmol.cache.store.radix import RadixStore

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


def assert_owned(store: RadixStore):
    """Every stored array owns its memory: no view keeps a larger base alive behind the count."""
    for node in all_nodes(store):
        for leaf in jax.tree.leaves((node.segment, node.payload)):
            assert not isinstance(leaf, np.ndarray) or host_memory.owns(leaf), node.tokens
