"""The prefix cache's device tier (cache/device_rows.py): free KV-arena rows found through the radix tree.
A row tagged with a spot of the tree serves what it shares with a later match after the tree split the
spot's node, after the spot's own node was evicted (its parent's positions), and never across trees;
an evicted or flushed node keeps no value. Every reused row reads back the bits a cold prefill writes."""

from __future__ import annotations

import numpy as np

from cache_runs import toks
from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.runtime.kv_arena import KVArena


def stored(cache, lease, prompt) -> tuple[int, int]:
    """Run `prompt` through a row as the scheduler does (a row from the device tier, the rest prefilled,
    the prompt stored) and give the row back: (the row, positions it held as it was)."""
    arena, before = lease.arena, cache.stats.device_tokens
    lk = cache.lookup(prompt)
    try:
        row = cache.device.row_for(lease, lk.match, lk.report.reused, len(prompt), lk.parts)
    finally:
        cache.release(lk)
    logits = arena.fill(row, prompt)
    cache.save_prompt(lk, arena.view(row), logits)
    cache.finish(lk, len(prompt) - lk.report.reused)
    lease.give(row)
    return row, cache.stats.device_tokens - before


def assert_cold(engine, arena, row, prompt):
    """The row's first len(prompt) positions have the bits of a cold prefill of prompt."""
    cold = KVArena(engine, 1)
    with cold.borrowed() as fresh:
        cold.fill(fresh, prompt)
        want = cold.segment(fresh, 0, len(prompt))
    got = arena.segment(row, 0, len(prompt))
    assert all(np.array_equal(got[n], want[n]) for n in ("k", "v"))


def test_a_row_serves_its_prefix_after_the_tree_splits_its_node(tiny_engine):
    cache = PrefixCache(tiny_engine, mode="radix")
    a, b = KVArena(tiny_engine, 2).lease(), KVArena(tiny_engine, 2).lease()
    p = toks(300, 1)
    row, held = stored(cache, a, p)
    assert held == 0 and a.arena.exact[row] == 300
    node = a.arena.tags[row].node
    stored(cache, b, p[:200] + toks(100, 2))  # another arena's row: the tree splits p's node at 200
    assert a.arena.tags[row].node is node and len(node.tokens) == 100 and node.parent.parent is not None
    again, held = stored(cache, a, p[:250] + toks(20, 3))
    assert (again, held) == (row, 250) and cache.stats.device_hits == 1
    assert_cold(tiny_engine, a.arena, row, p[:250] + toks(20, 3))


def test_a_row_whose_key_was_evicted_serves_what_the_tree_still_holds(tiny_engine):
    bpt, logits = tiny_engine.kv_bytes_per_token, 4 * tiny_engine.cfg.vocab_size
    cache = PrefixCache(tiny_engine, mode="radix", budget_bytes=450 * bpt + 2 * logits)
    a, b = KVArena(tiny_engine, 2).lease(), KVArena(tiny_engine, 2).lease()
    p = toks(300, 4)
    row, _ = stored(cache, a, p)
    spot = a.arena.tags[row]
    stored(cache, b, p[:100] + toks(300, 5))  # room for it: p's last 200 positions are evicted
    assert cache.stats.evictions == 1 and spot.node.segment is None and spot.node.payload is None
    again, held = stored(cache, a, p + toks(5, 6))
    assert (again, held) == (row, 100)  # the trunk the tree holds; the rest prefilled again
    assert_cold(tiny_engine, a.arena, row, p + toks(5, 6))


def test_a_row_tagged_by_another_tree_is_copied_into_not_trusted(tiny_engine):
    first, second = PrefixCache(tiny_engine, mode="radix"), PrefixCache(tiny_engine, mode="radix")
    lease = KVArena(tiny_engine, 1).lease()
    p = toks(200, 7)
    stored(first, lease, p)
    second.add_snapshot(first.snapshot_of(p))  # the same prefix in a tree of its own
    row, held = stored(second, lease, p + toks(10, 8))
    assert held == 0 and second.stats.device_hits == 0 and second.stats.tokens_reused == 200
    assert_cold(tiny_engine, lease.arena, row, p + toks(10, 8))
    row, held = stored(second, lease, p + toks(20, 9))  # now the row is this tree's
    assert held == 200


def test_a_flush_leaves_no_value_on_a_rows_spot(tiny_engine):
    cache = PrefixCache(tiny_engine, mode="radix")
    lease = KVArena(tiny_engine, 1).lease()
    row, _ = stored(cache, lease, toks(100, 10))
    spot = lease.arena.tags[row]
    cache.flush()
    assert cache.bytes_held == 0 and spot.node.segment is None and spot.node.payload is None
    assert stored(cache, lease, toks(100, 10))[1] == 0
