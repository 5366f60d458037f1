"""A radix tree of token sequences whose nodes hold segments of a value: the prefix store.

The store knows nothing about models. A value is any pytree whose array leaves share a sequence
axis (`seq_axis`) of the same length as the token key; the store slices and concatenates it along
that axis, so a trunk shared by several keys is held once (in the node of the shared tokens).
A node may also hold a small `payload` for the whole key ending there (the model keeps the last
position's logits there).

Lookup is at token granularity: the match may end inside an edge, and any stored key that extends
the matched tokens provides the value of the match (the first `length` positions of a sequence only
depend on those positions' tokens, which is what a causal model's KV state is).

`lookup` returns a `Match` holding the positions to restore and their value, kept from eviction until
`release(match)`. `max_keys=1` makes it the single-snapshot store: an insert replaces the one key.

Memory is bounded: least-recently-used leaves are evicted while the bytes held exceed the budget;
nodes on the path of a lease (an entry in use) are never evicted. A pinned key (`pin`) is never
evicted either: its nodes' bytes are counted apart (`pinned_bytes`, bounded by the caller's pinned
budget) and not against `budget_bytes`, until `unpin` returns them to the LRU. `on_evict(namespace, match)`, when
set, is called with a victim's whole key before it goes (a second tier may keep it). A namespace's
root goes when its last key does. Victims come from a heap of leaves by last use, as SGLang's radix
cache takes them: an entry is pushed when a leaf is used or when a node becomes a leaf, and stale
entries (a node used since, extended, or gone) are skipped when popped, so an eviction costs
O(log n), not a scan of every leaf (docs/design.md; tests/test_radix_eviction.py checks the heap's
victims against a scan's).

Every stored segment and payload owns its memory (a NumPy view given to `insert` is copied, a split
copies both halves), so the bytes counted are the bytes held, and evicting a node frees what it counted.
Listing the keys and walking the tree are in radix_listing.py.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Hashable

import jax
import numpy as np

from jaxsmol.cache.store.nodes import Match, Node
from jaxsmol.cache.store.pinned_keys import PinnedKeys
from jaxsmol.cache.store.radix_listing import Listing
from jaxsmol.cache.store.values import common_prefix_len, owned, tree_bytes


class RadixStore(PinnedKeys, Listing):
    """Longest-prefix store for token-keyed, sequence-sliceable values, LRU under a byte budget."""

    def __init__(self, budget_bytes: int, seq_axis: int = 0, max_keys: int | None = None):
        if max_keys not in (None, 1):
            raise ValueError(f"max_keys must be None or 1, got {max_keys!r}")
        self.budget_bytes = int(budget_bytes)
        self.seq_axis, self.max_keys = seq_axis, max_keys
        self._roots: dict[Hashable, Node] = {}
        self._clock = itertools.count(1)
        self.bytes_held = 0
        self.pinned_bytes = 0  # bytes of nodes with pins > 0 (part of bytes_held, not under budget_bytes)
        self.pinned: set = set()  # (namespace, tokens) of the pinned keys
        self.evictions = 0
        self.on_evict = None  # callable(namespace, Match of the victim's whole key), or None
        self._heap: list = []  # (last_used, push order, node) of leaves; stale entries skipped when popped
        self._order = itertools.count()
        self._nodes = 0  # nodes below the roots: the heap is rebuilt when its stale entries outnumber them
        self._position_bytes = 0  # a stored position's bytes, learnt from the last insert: room made ahead

    # ---- helpers ---------------------------------------------------------------------------
    def _slice(self, value, start, stop):
        index = (slice(None),) * self.seq_axis + (slice(start, stop),)
        return jax.tree.map(lambda a: a[index], value)

    def _concat(self, values):
        return jax.tree.map(lambda *xs: np.concatenate(xs, axis=self.seq_axis), *values)

    def _root(self, namespace) -> Node:
        return self._roots.setdefault(namespace, Node((), None, None))

    def _touch(self, path):
        now, wall = next(self._clock), time.time()
        for node in path:
            node.last_used, node.used_at = now, wall
        if path and not path[-1].children:
            self._push(path[-1])

    def _push(self, node: Node) -> None:
        """An eviction candidate at its last use (a leaf now); rebuilt from the leaves when stale
        entries pile up (every use of a key pushes one)."""
        heapq.heappush(self._heap, (node.last_used, next(self._order), node))
        if len(self._heap) > 2 * self._nodes + 1024:
            self._heap = [(n.last_used, next(self._order), n) for n in self._leaves()]
            heapq.heapify(self._heap)

    # ---- lookup ------------------------------------------------------------------------------
    def continuation(self, namespace, tokens, most: int) -> list:
        """Up to `most` tokens that follow `tokens` in a stored key where all of `tokens` is stored (the
        most recently used branch at each fork), else []: what an earlier request went on with (its
        answer, stored for the next turn). A walk of the tree: nothing gathered, touched or held."""
        node, depth, edge = self._descend(namespace, tuple(tokens))
        if depth < len(tokens) or node is None:
            return []
        out = list(node.tokens[edge:]) if depth else []
        while len(out) < most and node.children:
            node = max(node.children.values(), key=lambda c: c.last_used)
            out += node.tokens
        return out[:most]

    def match(self, namespace, tokens, touch: bool = True) -> Match:
        """The longest stored prefix of `tokens` (at token granularity) and the nodes that hold it;
        touch=False leaves the LRU order as it is (a peek)."""
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
        if touch:
            self._touch(path)
        return Match(length=depth, path=path, payload=path[-1].payload if exact else None, nearest_len=nearest)

    def lookup(self, namespace, tokens, gather: bool = True, count: bool = True) -> Match:
        """The longest stored prefix of `tokens`, held (never evicted) until `release(match)` if it
        restores anything. gather=False leaves match.value None: `parts(match, match.reused)` or
        `gather(match, match.reused)` read it later. count: a hit on every node whose positions are all
        restored (what inspection reports)."""
        match = self.match(namespace, tokens)
        match.reused = len(tokens) if match.payload is not None else min(match.length, len(tokens) - 1)
        if match.reused:
            self.acquire(match)
            match.value = self.gather(match, match.reused) if gather else None
            depth = 0
            for node in match.path if count else ():
                depth += len(node.tokens)
                node.hits += depth <= match.reused
        return match

    def peek(self, namespace, tokens) -> int:
        """How many leading tokens of `tokens` are stored: a walk of the tree, nothing gathered or touched."""
        return self._descend(namespace, tuple(tokens))[1]

    def _descend(self, namespace, tokens: tuple):
        """(the node the walk down `tokens` ends in, tokens matched, tokens of that node's edge matched)."""
        node, depth, edge = self._roots.get(namespace), 0, 0
        while node is not None and depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            node, edge = child, common_prefix_len(child.tokens, tokens, depth)
            depth += edge
            if edge < len(child.tokens):
                break
        return node, depth, edge

    def gather(self, match: Match, length: int | None = None):
        """The value of the first `length` (default: match.length) positions, as one pytree (a copy
        where they span several nodes; `parts` gives them without one)."""
        parts = self.parts(match, length)
        return parts[0] if len(parts) == 1 else self._concat(parts)

    def parts(self, match: Match, length: int | None = None) -> list:
        """The value of the first `length` (default: match.length) positions as the nodes' segments, in
        order (views: nothing copied).

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
        return parts

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

    def _key_of(self, node: Node):
        """(namespace, Match) of the whole key that ends at `node`."""
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        namespace = next(ns for ns, root in self._roots.items() if root is node)
        path.reverse()
        return namespace, Match(length=sum(len(n.tokens) for n in path), path=path)

    # ---- insert ------------------------------------------------------------------------------
    def insert(self, namespace, tokens, value_of, payload=None) -> int:
        """Store the value of `tokens`; `value_of(start, stop)` gives the value of positions
        [start, stop) and is only asked for the positions not already stored (a shared trunk is
        neither copied nor stored twice). Returns the number of newly stored positions."""
        tokens = tuple(tokens)
        if not tokens:
            return 0
        if self.max_keys == 1:  # the single snapshot: saving replaces it
            self.clear()
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
        if added:  # room first: the new segment is read while the entries it evicts would still be held
            self._evict(protect=set(map(id, path)), room=added * self._position_bytes)
            node = node if path else self._root(namespace)  # an emptied root is dropped: insert under a live one
            leaf = Node(tokens[depth:], owned(value_of(depth, len(tokens))), node)
            self._position_bytes = leaf.nbytes // added
            node.children[tokens[depth]] = leaf
            self._nodes += 1
            self.bytes_held += leaf.nbytes
            node, path = leaf, path + [leaf]
        if payload is not None and node.payload is None and path:
            node.payload = owned(payload)
            self.bytes_held += tree_bytes(payload)
            self.pinned_bytes += tree_bytes(payload) if node.pins else 0
        self._touch(path)
        self._evict(protect=set(map(id, path)))
        return added

    def add(self, namespace, tokens, value_of, payloads: dict) -> None:
        """Store a key and an exact entry (a payload) for each of its prefixes in `payloads` (files, disk)."""
        for n in sorted(payloads) if self.max_keys is None else ():  # shorter first: each stores what is new
            self.insert(namespace, tokens[:n], value_of, payload=payloads[n])
        self.insert(namespace, tokens, value_of)

    def _split(self, node: Node, at: int) -> Node:
        """Split `node`'s edge after `at` tokens; return the new upper node."""
        # Both halves are copies: views would keep the whole old segment alive after either half goes.
        upper = Node(node.tokens[:at], owned(self._slice(node.segment, 0, at)), node.parent)
        self._nodes += 1
        # Leases stay on `node`: lease holders release the object they acquired. `upper` cannot be
        # evicted meanwhile, since it is not a leaf while that child exists.
        # Pins are copied: every pinned key through `node` runs through `upper` too.
        upper.last_used, upper.used_at, upper.pins, upper.hits = node.last_used, node.used_at, node.pins, node.hits
        node.parent.children[node.tokens[0]] = upper
        lower_segment = owned(self._slice(node.segment, at, len(node.tokens)))
        grown = tree_bytes(upper.segment) + tree_bytes(lower_segment) - tree_bytes(node.segment)
        self.bytes_held += grown
        self.pinned_bytes += grown if node.pins else 0
        node.tokens, node.segment, node.parent = node.tokens[at:], lower_segment, upper
        upper.children[node.tokens[0]] = node
        return upper

    # ---- leases and eviction -------------------------------------------------------------------
    def acquire(self, match: Match) -> None:
        """Pin the nodes of a match while a request uses them (they are never evicted meanwhile)."""
        for node in match.path:
            node.leases += 1
        match.held = True

    def release(self, match: Match | None) -> None:
        """Unpin what `acquire` (or `lookup`) pinned; once (a match not held: nothing to do)."""
        if match is None or not match.held:
            return
        match.held = False
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

    def _evict(self, protect=frozenset(), room: int = 0) -> None:
        """Evict least-recently-used leaves while over budget (with `room` bytes more held); leased,
        pinned or protected ones wait."""
        waiting = []  # live candidates that cannot go now: pushed back after
        while self.bytes_held + room - self.pinned_bytes > self.budget_bytes and self._heap:
            used, _, victim = heapq.heappop(self._heap)
            parent = victim.parent
            if (parent is None or parent.children.get(victim.tokens[0]) is not victim or victim.children
                    or victim.last_used != used):
                continue  # stale: gone, extended, or used since (a newer entry stands for it)
            if victim.leases or victim.pins or id(victim) in protect:
                waiting.append((used, next(self._order), victim))
                continue
            if self.on_evict is not None:
                self.on_evict(*self._key_of(victim))
            del parent.children[victim.tokens[0]]
            self._nodes -= 1
            self.bytes_held -= victim.nbytes
            victim.segment = victim.payload = None  # a spot (cache/device_rows.py) may keep the edge: never the value
            self.evictions += 1
            if parent.parent is None:
                if not parent.children:
                    self._drop_root(parent)
            elif not parent.children:
                self._push(parent)  # a leaf now
        for entry in waiting:
            heapq.heappush(self._heap, entry)

    def _drop_root(self, root: Node) -> None:
        """Forget an empty namespace (one root per salt ever seen would otherwise pile up)."""
        del self._roots[next(ns for ns, r in self._roots.items() if r is root)]

    def clear(self, keep_pinned: bool = False) -> None:
        """Forget every key (keep_pinned: every key but the pinned ones and the nodes they run through)."""
        for root in self._roots.values():
            self._drop_values(root, keep_pinned)
        if not keep_pinned:
            self._roots.clear()
            self.pinned.clear()
            self.bytes_held = self.pinned_bytes = self._nodes = 0
            self._heap = []
            return
        for ns, root in list(self._roots.items()):
            stack = [root]
            while stack:
                node = stack.pop()
                node.children = {t: c for t, c in node.children.items() if c.pins}
                stack.extend(node.children.values())
            if not root.children:
                del self._roots[ns]
        self.bytes_held = self.pinned_bytes
        self._nodes = sum(1 for _ in self.walk(keys_only=False))
        self._heap = [(n.last_used, next(self._order), n) for n in self._leaves()]
        heapq.heapify(self._heap)

    @staticmethod
    def _drop_values(root: Node, keep_pinned: bool) -> None:
        """Drop the values of the nodes `clear` forgets (those no request holds): a spot
        (cache/device_rows.py) may keep their edges, never their values."""
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not (node.leases or keep_pinned and node.pins):
                node.segment = node.payload = None
