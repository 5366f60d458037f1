"""A radix tree of token sequences whose nodes hold segments of a value: the prefix store.

The store knows nothing about models. A value is any pytree whose array leaves share a sequence
axis (`seq_axis`) of the same length as the token key; the store slices and concatenates it along
that axis, so a trunk shared by several keys is held once (in the node of the shared tokens).
A node may also hold a small `payload` for the whole key ending there (the model keeps the last
position's logits there).

Lookup is at token granularity: the match may end inside an edge, and any stored key that extends
the matched tokens provides the value of the match (the first `length` positions of a sequence only
depend on those positions' tokens, which is what a causal model's KV state is).

Memory is bounded: least-recently-used leaves are evicted while the bytes held exceed the budget;
nodes on the path of a lease (an entry in use) are never evicted. `on_evict(namespace, match)`, when
set, is called with a victim's whole key before it goes (a second tier may keep it). A namespace's
root goes when its last key does.

Every stored segment and payload owns its memory (a NumPy view given to `insert` is copied, a split
copies both halves), so the bytes counted are the bytes held, and evicting a node frees what it counted.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Hashable

import jax
import numpy as np


def common_prefix_len(a, b, start: int = 0) -> int:
    """How many leading items of `a` equal the items of `b` from index `start` on (the one
    common-prefix helper of cache/)."""
    n, limit = 0, min(len(a), len(b) - start)
    while n < limit and a[n] == b[start + n]:
        n += 1
    return n


def _nbytes(tree) -> int:
    return sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(tree))


def _own(a):
    """`a` if it owns its memory, else a copy with the same read-only flag: a view would keep its
    whole base alive while only the view's bytes are counted."""
    if not isinstance(a, np.ndarray) or a.base is None:
        return a
    out = np.array(a)  # np.array copies: a C-contiguous array that owns its buffer
    out.flags.writeable = a.flags.writeable
    return out


def _owned(tree):
    return jax.tree.map(_own, tree)


class _Node:
    __slots__ = ("tokens", "segment", "payload", "children", "parent", "last_used", "leases")

    def __init__(self, tokens: tuple, segment, parent: "_Node | None"):
        self.tokens = tokens  # the edge label: tokens from the parent's end to this node's end
        self.segment = segment  # value for exactly those positions (None at a root)
        self.payload = None
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last_used = 0
        self.leases = 0

    @property
    def nbytes(self) -> int:
        return _nbytes(self.segment) + _nbytes(self.payload)


@dataclasses.dataclass
class Match:
    """The result of a lookup: `length` tokens of the query are stored."""
    length: int
    path: list  # nodes from the root's child to the node holding position length-1 (inclusive)
    payload: Any = None  # the payload of a stored key equal to the query, if any
    nearest_len: int = 0  # length of the nearest stored key (for miss diagnostics)


class RadixStore:
    """Longest-prefix store for token-keyed, sequence-sliceable values, LRU under a byte budget."""

    def __init__(self, budget_bytes: int, seq_axis: int = 0):
        self.budget_bytes = int(budget_bytes)
        self.seq_axis = seq_axis
        self._roots: dict[Hashable, _Node] = {}
        self._clock = itertools.count(1)
        self.bytes_held = 0
        self.evictions = 0
        self.on_evict = None  # callable(namespace, Match of the victim's whole key), or None

    # ---- helpers ---------------------------------------------------------------------------
    def _slice(self, value, start, stop):
        index = (slice(None),) * self.seq_axis + (slice(start, stop),)
        return jax.tree.map(lambda a: a[index], value)

    def _concat(self, values):
        return jax.tree.map(lambda *xs: np.concatenate(xs, axis=self.seq_axis), *values)

    def _root(self, namespace) -> _Node:
        return self._roots.setdefault(namespace, _Node((), None, None))

    def _touch(self, path):
        now = next(self._clock)
        for node in path:
            node.last_used = now

    # ---- lookup ------------------------------------------------------------------------------
    def match(self, namespace, tokens) -> Match:
        """The longest stored prefix of `tokens` (at token granularity) and the nodes that hold it."""
        tokens = tuple(tokens)
        node, depth, path = self._roots.get(namespace), 0, []
        at_node_end = False  # does the match end exactly at the end of path[-1]'s edge?
        while node is not None and depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            n = common_prefix_len(child.tokens, tokens, depth)
            path.append(child)
            depth += n
            at_node_end = n == len(child.tokens)
            if not at_node_end:
                break
            node = child
        exact = depth == len(tokens) and at_node_end and path[-1].payload is not None
        nearest = sum(len(p.tokens) for p in path)
        tail = path[-1] if path else None
        while tail is not None and tail.children and tail.payload is None:  # a full stored key below
            tail = next(iter(tail.children.values()))
            nearest += len(tail.tokens)
        self._touch(path)
        return Match(length=depth, path=path, payload=path[-1].payload if exact else None, nearest_len=nearest)

    def gather(self, match: Match, length: int | None = None):
        """The value of the first `length` (default: match.length) positions, as one pytree.

        Read from the match's deepest node up through its parents, so a match pinned earlier still
        gathers its own positions after inserts have split its edges (a split keeps the pinned node as
        the lower half and puts a new node above it)."""
        length = match.length if length is None else length
        assert 0 < length <= match.length
        chain, node = [], match.path[-1]
        while node is not None and node.tokens:  # up to the namespace's root (no tokens)
            chain.append(node)
            node = node.parent
        parts, depth = [], 0
        for node in reversed(chain):
            take = min(len(node.tokens), length - depth)
            parts.append(node.segment if take == len(node.tokens) else self._slice(node.segment, 0, take))
            depth += take
            if depth == length:
                break
        return parts[0] if len(parts) == 1 else self._concat(parts)

    @staticmethod
    def tokens(match: Match) -> tuple:
        """The first match.length tokens of the key a match follows."""
        return tuple(t for node in match.path for t in node.tokens)[: match.length]

    @staticmethod
    def payloads(match: Match) -> dict:
        """{prefix length: payload} of the stored keys that end on the match's path, within its length."""
        out, depth = {}, 0
        for node in match.path:
            depth += len(node.tokens)
            if depth <= match.length and node.payload is not None:
                out[depth] = node.payload
        return out

    def _key_of(self, node: _Node):
        """(namespace, Match) of the whole key that ends at `node`."""
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        namespace = next(ns for ns, root in self._roots.items() if root is node)
        path.reverse()
        return namespace, Match(length=sum(len(n.tokens) for n in path), path=path)

    def keys(self):
        """(namespace, Match) of every stored key that no other extends (a leaf), least recently used first."""
        for leaf in sorted(self._leaves(), key=lambda n: n.last_used):
            yield self._key_of(leaf)

    # ---- insert ------------------------------------------------------------------------------
    def insert(self, namespace, tokens, value_of, payload=None) -> int:
        """Store the value of `tokens`; `value_of(start, stop)` gives the value of positions
        [start, stop) and is only asked for the positions not already stored (a shared trunk is
        neither copied nor stored twice). Returns the number of newly stored positions."""
        tokens = tuple(tokens)
        if not tokens:
            return 0
        node, depth = self._root(namespace), 0
        path = []
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            n = common_prefix_len(child.tokens, tokens, depth)
            if n < len(child.tokens):
                child = self._split(child, n)
            path.append(child)
            node, depth = child, depth + n
        added = len(tokens) - depth
        if added:
            leaf = _Node(tokens[depth:], _owned(value_of(depth, len(tokens))), node)
            node.children[tokens[depth]] = leaf
            self.bytes_held += leaf.nbytes
            node, path = leaf, path + [leaf]
        if payload is not None and node.payload is None and path:
            node.payload = _owned(payload)
            self.bytes_held += _nbytes(payload)
        self._touch(path)
        self._evict(protect=set(map(id, path)))
        return added

    def _split(self, node: _Node, at: int) -> _Node:
        """Split `node`'s edge after `at` tokens; return the new upper node."""
        # Both halves are copies: views would keep the whole old segment alive after either half goes.
        upper = _Node(node.tokens[:at], _owned(self._slice(node.segment, 0, at)), node.parent)
        # Leases stay on `node`: lease holders release the object they acquired. `upper` cannot be
        # evicted meanwhile, since it is not a leaf while that child exists.
        upper.last_used = node.last_used
        node.parent.children[node.tokens[0]] = upper
        lower_segment = _owned(self._slice(node.segment, at, len(node.tokens)))
        self.bytes_held += _nbytes(upper.segment) + _nbytes(lower_segment) - _nbytes(node.segment)
        node.tokens, node.segment, node.parent = node.tokens[at:], lower_segment, upper
        upper.children[node.tokens[0]] = node
        return upper

    # ---- leases and eviction -------------------------------------------------------------------
    def acquire(self, match: Match) -> None:
        """Pin the nodes of a match while a request uses them (they are never evicted meanwhile)."""
        for node in match.path:
            node.leases += 1

    def release(self, match: Match) -> None:
        for node in match.path:
            node.leases -= 1
        self._evict()

    def _leaves(self):
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None and not node.children:
                yield node
            stack.extend(node.children.values())

    def _evict(self, protect=frozenset()) -> None:
        while self.bytes_held > self.budget_bytes:
            candidates = [n for n in self._leaves() if n.leases == 0 and id(n) not in protect]
            if not candidates:
                return  # everything left is in use: over budget until released
            victim = min(candidates, key=lambda n: n.last_used)
            if self.on_evict is not None:
                self.on_evict(*self._key_of(victim))
            del victim.parent.children[victim.tokens[0]]
            self.bytes_held -= victim.nbytes
            self.evictions += 1
            if victim.parent.parent is None and not victim.parent.children:
                self._drop_root(victim.parent)

    def _drop_root(self, root: _Node) -> None:
        """Forget an empty namespace (one root per salt ever seen would otherwise pile up)."""
        del self._roots[next(ns for ns, r in self._roots.items() if r is root)]

    def clear(self) -> None:
        self._roots.clear()
        self.bytes_held = 0

    def __len__(self) -> int:
        """Number of leaves: stored keys that no other stored key extends (a key that is a prefix of
        another, e.g. a prompt whose answer was stored after it, is not counted)."""
        return sum(1 for _ in self._leaves())
