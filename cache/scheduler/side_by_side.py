"""Prompts prefilled side by side: which of a step's prompt chunks share one forward.

A lone chunk of a few rows streams every weight for those rows alone. Measured on the real model
(2 cores, float32, tools-free: programs.forward at [P, T]): 8 prompts' 16-row chunks in one forward
took 404 ms against 8 x 76 ms alone (0.66x), 32-row chunks 541 against 8 x 94 ms (0.72x), but
64-row chunks are bound by arithmetic already: 1178 against 8 x 157 ms (0.94x), and gathering the
prompts' staging caches costs ~0.1 s for 8. So only chunks of at most MAX_ROWS share a forward.
A row's bits do not depend on the rows beside it with the CPU kernels (Engine.side_by_side).
"""

from __future__ import annotations

from typing import Callable, TypeVar

MAX_ROWS = 32  # the longest chunk run side by side

Item = TypeVar("Item")


def group_chunks(items: list[Item], shape: Callable[[Item], tuple[int, int]], most: int) -> list[list[Item]]:
    """items (prompt chunks, in order) in the groups that run in one forward each: chunks of one
    shape (padded rows, cache capacity) of at most MAX_ROWS rows, at most `most` to a group; every
    other chunk alone."""
    groups: list[list[Item]] = []
    by_shape: dict[tuple[int, int], list[Item]] = {}
    for item in items:
        rows, capacity = shape(item)
        if rows > MAX_ROWS or most < 2:
            groups.append([item])
            continue
        group = by_shape.setdefault((rows, capacity), [])
        if not group:
            groups.append(group)
        group.append(item)
        if len(group) == most:
            del by_shape[(rows, capacity)]  # full: the next of this shape starts another
    return groups
