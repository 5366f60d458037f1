"""What an arena's users hold of it (runtime/kv_arena.py): a Lease of the rows one scheduler took, and a
RowView of one row as the prefix cache reads a prompt's state."""

from __future__ import annotations


class Lease:
    """The rows one user of an arena (a scheduler) took: `take` and `give` as the arena's, and `close`
    hands back whatever is still held (a scheduler abandoned mid-run, or replaced after a failure)."""

    def __init__(self, arena):
        self.arena, self.rows = arena, set()

    def take(self, row: int | None = None, held: int = 0, expect: int | None = None) -> int:
        row = self.arena.take(row, held, expect)
        self.rows.add(row)
        return row

    def give(self, row: int) -> None:
        self.rows.discard(row)
        self.arena.give(row)

    def close(self) -> None:
        while self.rows:
            self.arena.give(self.rows.pop())


class RowView:
    """One row of the arena as the prefix cache reads a prompt's state: `segment(start, stop)`, `pos`."""

    def __init__(self, arena, row: int):
        self.arena, self.row = arena, row

    @property
    def pos(self) -> int:
        return self.arena.pos[self.row]

    def segment(self, start: int, stop: int) -> dict:
        return self.arena.segment(self.row, start, stop)
