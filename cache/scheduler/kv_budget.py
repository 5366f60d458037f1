"""The KV budget of a scheduler's rows (`--kv-cache-bytes`, BatchSettings.kv_bytes), in positions: the
checks and grants scheduler.py makes against it (its module docstring tells the policy). A request is
admitted when its grant fits (`fits`), a decode row grows its grant GROW_SLOTS at a time where the budget
has room, the oldest request's rows always (`grow`), and free rows keep their pages within RETAIN_SHARE of
it (`keep_within`)."""

from __future__ import annotations

from jaxsmol.cache.scheduler.requests import GROW_SLOTS
from jaxsmol.cache.scheduler.state import Row

# The share of the KV budget free rows may keep their pages for: a row's pages faulted in afresh cost
# ~5 ms for a 1000-token prompt (its prefill: ~1 s), and a row kept holding a prompt spares its next
# turn a restore's copy (~10 ms), so few are kept, the most recently used
RETAIN_SHARE = 0.25


class KVBudget:
    def __init__(self, arena, kv_bytes: int, bytes_per_token: int):
        """bytes_per_token: a decode row's, the target's KV and a draft model's row where one drafts."""
        self.arena, self.kv_bytes, self.bytes_per_token = arena, kv_bytes, bytes_per_token

    @property
    def slots(self) -> int:
        """The budget in positions."""
        return self.kv_bytes // self.bytes_per_token

    def fits(self, positions: int) -> bool:
        return positions * self.bytes_per_token <= self.kv_bytes

    def keep_within(self, reserved: int) -> None:
        """Release free rows' pages (least recently used first) until they and `reserved` positions fit
        the budget and they hold at most RETAIN_SHARE of it: the arena's memory stays within
        max(kv_bytes, one request alone's)."""
        keep = min(int(RETAIN_SHARE * self.slots), self.slots - reserved)
        if self.arena.slots_held(free=True) > keep:
            self.arena.release_free(max(keep, 0))

    def grow(self, live: list[Row], granted: int, ahead: int) -> tuple[list[Row], int]:
        """(the live rows that decode this step, how many sit it out): each whose grant holds the `ahead`
        positions a step may write, granted GROW_SLOTS more where it does not and the budget (`granted`
        positions so far) has room; the rows of the oldest request (live[0]'s) always."""
        oldest, going, stalled = live[0].request, [], 0
        for r in live:
            need = min(r.final, r.position + ahead)
            if need > r.reserved:
                more = min(r.final, max(r.reserved + GROW_SLOTS, need)) - r.reserved
                if granted + more > self.slots and r.request is not oldest:
                    stalled += 1
                    continue
                r.reserved += more
                granted += more
            going.append(r)
        return going, stalled
