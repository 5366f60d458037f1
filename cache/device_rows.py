"""The prefix cache's device tier: rows of the KV arena (jaxsmol/runtime/kv_arena.py) that hold a stored
prefix's exact state, found through the radix tree itself (cache/store/radix.py), the one index of
prefixes.

A row's tag (`KVArena.tags`) is a `Spot` of the tree: the node the row's tokens run down to and how
many positions they are. The arena counts how many of the row's first positions hold exact state
(`KVArena.exact`: trims and releases lower it), so a free row serves a match the positions they share
and the arena still holds exactly, taken as it is, and the restore copies only the rest.

A spot names nodes, never tokens. A split keeps the node object as the lower half (the tokens on the way
down to it are the same), and an evicted node keeps its edge and parent but drops its value (radix.py),
so a spot holds a chain of edges at most, and a row whose key was evicted still serves the part the tree
holds. The tiers stay inclusive: a row serves only positions a lookup matched in memory.
"""

from __future__ import annotations

import dataclasses

from jaxsmol.cache.store.nodes import Match, Node
from jaxsmol.runtime.arena_handles import Lease, RowView


@dataclasses.dataclass(frozen=True)
class Spot:
    node: Node  # the node whose edge holds the row's last position
    depth: int  # the row's positions: the tokens from the root down to there


def spot_of(match: Match, length: int) -> Spot | None:
    """The spot of the first `length` positions of a match (None for none)."""
    depth = 0
    for node in match.path if length else ():
        depth += len(node.tokens)
        if depth >= length:
            return Spot(node, length)
    return None


def shared_len(spot: Spot | None, match: Match) -> int:
    """How many leading positions a spot shares with a match: up to the end of the deepest node of the
    match's path that the spot runs through (a node's children differ in their first token, so the two
    part there), within both lengths."""
    if spot is None:
        return 0
    ends, depth = {}, 0
    for node in match.path:
        depth += len(node.tokens)
        ends[id(node)] = depth
    node = spot.node
    while node is not None:
        end = ends.get(id(node))
        if end is not None:
            return min(end, spot.depth, match.length)
        node = node.parent
    return 0


class DeviceRows:
    """Rows for a prefix cache's requests, a free row holding their stored prefix taken as it is."""

    def __init__(self, cache):
        self.cache = cache

    def row_for(self, lease: Lease, match: Match | None, length: int, expect: int, parts=None) -> int:
        """A row taken by `lease` holding the first `length` positions of a held match: the free row that
        holds the most of them as they are (an exact cache's), the rest copied from `parts` (the match's
        segments). `expect`: the positions its sequence is granted."""
        arena, held, row = lease.arena, 0, None
        with arena.lock:  # chosen and taken at once: another user of the arena takes no row between
            if length and self.cache.exact:
                held, row = max(((min(shared_len(arena.tags[r], match), length, arena.exact[r]), r)
                                 for r in arena.free), default=(0, None))
            row = lease.take(row if held else None, held, expect)
        try:
            if held < length:
                arena.restore(row, parts, held, length, exact=self.cache.exact)
        except BaseException:
            lease.give(row)
            raise
        stats = self.cache.stats
        stats.device_hits += held > 0
        stats.device_tokens += held
        arena.tags[row] = spot_of(match, length) if length else None
        return row

    def tag(self, kv, ns, tokens) -> None:
        """Where `kv` is an arena row that now holds `tokens`, just stored: tag it with their spot."""
        if isinstance(kv, RowView):
            match = self.cache.store.match(ns, tokens, touch=False)
            kv.arena.tags[kv.row] = spot_of(match, min(match.length, len(tokens), kv.arena.pos[kv.row]))
