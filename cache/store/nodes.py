"""The radix store's pieces (radix.py): a tree node (an edge of tokens and their segment of the value)
and what a lookup found (`Match`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxsmol.cache.store.values import tree_bytes


class Node:
    __slots__ = ("tokens", "segment", "payload", "children", "parent", "last_used", "leases", "pins", "hits",
                 "used_at")

    def __init__(self, tokens: tuple, segment, parent: Node | None):
        self.tokens = tokens  # the edge label: tokens from the parent's end to this node's end
        self.segment = segment  # value for exactly those positions (None at a root)
        self.payload = None
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.last_used = 0
        self.leases = 0
        self.pins = 0  # pinned keys whose path runs through this node (never evicted while > 0)
        self.hits = 0  # lookups that restored every position of this node
        self.used_at = 0.0  # wall time of the last use (time.time()), for inspection

    @property
    def nbytes(self) -> int:
        return tree_bytes(self.segment) + tree_bytes(self.payload)


@dataclasses.dataclass
class Match:
    """What a lookup found for a query of n tokens: `length` of them are stored."""
    length: int
    path: list  # nodes from the root's child to the node holding position length-1 (inclusive)
    payload: Any = None  # the payload of a stored key equal to the query, if any
    nearest_len: int = 0  # length of the nearest stored key (for miss diagnostics)
    reused: int = 0  # positions to restore: length, capped at n - 1 unless `payload` (an exact full hit)
    value: Any = None  # the state of the first `reused` positions (lookup with gather=True)
    held: bool = False  # acquired: its nodes stay until release(match)
