"""The order waiting requests are admitted in (BatchSettings.admission, the daemon's --admission).

"lpm" (SGLang's longest-prefix-match order): first the request whose prompt has the longest prefix
stored in the prefix cache, the oldest among equals. Such a request prefills only the rest of its
prompt, so it reaches its first token soonest and frees its turn sooner; requests sharing a few-shot
block or a system prompt then go while it is in the cache. The length comes from a walk of the
store (`PrefixCache.cached_prefix`: nothing gathered, held or touched; the disk tier not consulted),
and the order only decides when a request starts, never which bits it gets.

Bounded: a request that `admission_bound` later requests have overtaken is admitted next (the
scheduler counts `Request.overtaken`); the oldest waiting request has always been overtaken at least
as often as any other, so it is the one to check. "fifo": by arrival. Either way only requests whose
lower tiers' reads are done (cache/fetch.py) are admitted: one still reading is overtaken meanwhile.
"""

from __future__ import annotations

from jaxsmol.cache.scheduler.settings import BatchSettings


def next_index(pending, settings: BatchSettings, cache, stored: dict, ready=lambda r: True) -> int | None:
    """The index in `pending` (oldest first) of the request to admit next, among those `ready` (their
    lower tiers' reads done: cache/fetch.py); None where none is, or where the oldest is owed its turn
    and is not. `stored` memoizes each request's stored prefix (id(request) -> tokens) for the caller's
    admission round."""
    if pending[0].overtaken >= settings.admission_bound:
        return 0 if ready(pending[0]) else None
    indices = [i for i, r in enumerate(pending) if ready(r)]
    if settings.admission == "fifo" or len(indices) <= 1:
        return indices[0] if indices else None
    for i in indices:
        if id(pending[i]) not in stored:
            stored[id(pending[i])] = cache.cached_prefix(pending[i].prompt_ids, salt=pending[i].salt,
                                                         bypass=pending[i].bypass)
    return max(indices, key=lambda i: (stored[id(pending[i])], -i))


def admitted(pending, index: int) -> None:
    """Count the overtaking: the request at `index` is admitted before every older one."""
    for j in range(index):
        pending[j].overtaken += 1
