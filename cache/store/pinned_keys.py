"""Pinned keys of the radix store (cache/store/radix.py): a pinned key, and every node it runs
through, is never evicted; its nodes' bytes are counted in `pinned_bytes` (bounded by the caller's
pinned budget, cache/pins.py) and not against the store's `budget_bytes`, until `unpin` returns them
to the LRU. A part of `RadixStore`, apart only to keep each file short: it uses the tree's own
`match`, `_split` and `_evict`.
"""

from __future__ import annotations


class PinnedKeys:
    def key_path(self, namespace, tokens) -> list | None:
        """The nodes of the stored key `tokens`, the last one ending where the key ends (its edge is
        split there if the key ends inside it); None if the key is not stored."""
        tokens = tuple(tokens)
        match = self.match(namespace, tokens, touch=False)
        if not tokens or match.length < len(tokens):
            return None
        path, end = match.path, sum(len(n.tokens) for n in match.path)
        if end > len(tokens):
            last = path[-1]
            path = path[:-1] + [self._split(last, len(last.tokens) - (end - len(tokens)))]
        return path

    def pin_cost(self, namespace, tokens) -> int | None:
        """The bytes pinning the stored key `tokens` would add to pinned_bytes (None: not stored)."""
        path = self.key_path(namespace, tokens)
        if path is None:
            return None
        return 0 if (namespace, tuple(tokens)) in self.pinned else sum(n.nbytes for n in path if not n.pins)

    def pin(self, namespace, tokens) -> bool:
        """Keep the stored key `tokens` (and every node it runs through) out of eviction until `unpin`;
        False if it is not stored. Pinning a pinned key again does nothing."""
        tokens = tuple(tokens)
        path = self.key_path(namespace, tokens)
        if path is None:
            return False
        if (namespace, tokens) not in self.pinned:
            self.pinned.add((namespace, tokens))
            for node in path:
                self.pinned_bytes += node.nbytes if node.pins == 0 else 0
                node.pins += 1
        return True

    def unpin(self, namespace, tokens) -> bool:
        """Return a pinned key to the LRU (evicted when its turn comes); False if it was not pinned."""
        tokens = tuple(tokens)
        if (namespace, tokens) not in self.pinned:
            return False
        self.pinned.discard((namespace, tokens))
        for node in self.key_path(namespace, tokens):  # pinned nodes stay: the key is still there
            node.pins -= 1
            self.pinned_bytes -= node.nbytes if node.pins == 0 else 0
        self._evict()
        return True
