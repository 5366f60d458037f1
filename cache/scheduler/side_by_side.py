"""Prompts prefilled side by side: which of a step's prompt chunks share one forward.

A lone chunk of a few rows streams every weight for those rows alone. Measured on the real model
(2 cores, float32, tools-free: programs.forward at [P, T]): 8 prompts' 16-row chunks in one forward
took 404 ms against 8 x 76 ms alone (0.66x), 32-row chunks 541 against 8 x 94 ms (0.72x), but
64-row chunks are bound by arithmetic already: 1178 against 8 x 157 ms (0.94x), and gathering the
prompts' staging caches costs ~0.1 s for 8. So only chunks of at most MAX_ROWS share a forward.
A row's bits do not depend on the rows beside it with the CPU kernels (Engine.side_by_side).

A group holds 2, 4 or 8 chunks (GROUP_SIZES), never 3, 5, 6 or 7: each group size is a program per
chunk length and window, compiled ahead by the daemon, and the odd sizes were 4 of the 7 (42
programs of seconds each on the real model, and their memory, for a burst's last few prompts). Five
chunks run as 4 + 1: the 1 is a lone chunk, whose program exists anyway.
"""

from __future__ import annotations

from typing import TypeVar
from collections.abc import Callable

MAX_ROWS = 32  # the longest chunk run side by side
GROUP_SIZES = (2, 4, 8)  # chunks in one side-by-side forward (the programs compiled ahead)

Item = TypeVar("Item")


def group_sizes(most: int) -> tuple[int, ...]:
    """The side-by-side group sizes used when at most `most` chunks may share a forward."""
    return tuple(n for n in GROUP_SIZES if n <= most)


def split_group(group: list[Item], most: int) -> list[list[Item]]:
    """group in parts of group_sizes(most), the largest first, and a last one alone if odd."""
    parts = []
    for n in sorted(group_sizes(most), reverse=True):
        while len(group) >= n:
            parts.append(group[:n])
            group = group[n:]
    return parts + [[item] for item in group]


def group_chunks(items: list[Item], shape: Callable[[Item], tuple[int, int]], most: int) -> list[list[Item]]:
    """items (prompt chunks, in order) in the groups that run in one forward each: chunks of one
    shape (padded rows, cache capacity) of at most MAX_ROWS rows, in groups of group_sizes(most);
    every other chunk alone."""
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
    return [part for group in groups for part in split_group(group, most)]
