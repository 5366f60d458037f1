"""Listing the radix store (cache/store/radix.py): its keys, their state, and a walk of every node, for
inspection, the disk tier and persistence; none of them changes the tree. A part of `RadixStore`, apart
only to keep each file short: it uses the tree's `_roots`, `_leaves`, `_key_of`, `match`, `gather`,
`tokens` and `payloads`.
"""

from __future__ import annotations

from jaxsmol.cache.store.values import tree_bytes


class Listing:
    def keys(self):
        """(namespace, Match) of every stored key that no other extends (a leaf), least recently used first."""
        for leaf in sorted(self._leaves(), key=lambda n: n.last_used):
            yield self._key_of(leaf)

    def entries(self) -> list:
        """(namespace, tokens) of every stored key that no other extends, least recently used first."""
        return [(ns, self.tokens(m)) for ns, m in self.keys()]

    def state(self, namespace, tokens):
        """(tokens, value, {length: payload}) of the longest stored prefix of `tokens`, or None."""
        match = self.match(namespace, tokens)
        if match.length == 0:
            return None
        return self.tokens(match), self.gather(match), self.payloads(match)

    def walk(self, keys_only: bool = True):
        """(namespace, tokens, node, bytes of its whole state) of every stored key: a node that ends a
        key with a payload, or a leaf (keys_only=False: of every node). The state's bytes are its
        path's segments and its payload; a node's own bytes are `node.nbytes`."""
        for ns, root in list(self._roots.items()):
            stack = [(child, (), 0) for child in root.children.values()]
            while stack:
                node, above, above_bytes = stack.pop()
                tokens, nbytes = above + node.tokens, above_bytes + tree_bytes(node.segment)
                if not keys_only or node.payload is not None or not node.children:
                    yield ns, tokens, node, nbytes + tree_bytes(node.payload)
                stack.extend((c, tokens, nbytes) for c in node.children.values())

    def __len__(self) -> int:
        """Number of leaves: stored keys that no other stored key extends (a key that is a prefix of
        another, e.g. a prompt whose answer was stored after it, is not counted)."""
        return sum(1 for _ in self._leaves())
