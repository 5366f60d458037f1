"""Reading the lower tiers ahead (cache/tiers.py): a waiting request's prefix read from the disk tier and the
shared store on a thread of its own while the request waits for admission, so that the scheduler's thread,
which runs every stream's next step, never waits for a file or a network, and the read overlaps the wait.

`PrefixCache.plan_fetch` decides on the scheduler's thread, from what is cheap to know there (memory's
match, a walk; the disk tier's index; the measured read and prefill rates), the scheduler starts the
`Fetch` (`PrefixCache.read_ahead` on the fetch thread), and the request is admitted once it is done; its
lookup takes what was read instead of reading it (`PrefixCache.lookup(fetched=...)`). Only the
scheduler's thread touches the radix store and the disk tier's index: the fetch thread reads files and
values, which are verified as on any read, and nothing else. At most FETCH_AHEAD fetches are held at
once (their bytes count in `jaxsmol_cache_fetched_bytes` until their requests are admitted): what is
read ahead is bounded, not a queue's worth.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import weakref
from typing import Any

FETCH_AHEAD = 2  # fetches started and not yet taken by their lookup
WAIT_S = 0.05  # a scheduler with nothing else to do waits this long on a fetch before it looks again


@dataclasses.dataclass(eq=False)
class Fetch:
    """One prompt's reads from the lower tiers: a disk entry's snapshot (or the error it was refused
    with), and the shared store's whole chunks from chunk `first` on."""
    ns: tuple
    prompt: tuple
    disk_entry: Any = None  # the disk tier's entry to read, or None
    shared_first: int | None = None  # the first shared chunk to read, or None
    snapshot: Any = None  # what the disk read gave: a Snapshot, or the SnapshotError it raised
    chunks: list = dataclasses.field(default_factory=list)
    future: concurrent.futures.Future | None = None

    @property
    def empty(self) -> bool:
        """Nothing to read: its lookup reads nothing from the lower tiers either."""
        return self.disk_entry is None and self.shared_first is None

    @property
    def done(self) -> bool:
        return self.empty or self.future is not None and self.future.done()

    def wait(self, seconds: float) -> None:
        if self.future is not None:
            concurrent.futures.wait([self.future], timeout=seconds)

    @property
    def nbytes(self) -> int:
        """Bytes read and held for its request (until its lookup takes them)."""
        if not self.done:
            return 0
        held = getattr(self.snapshot, "nbytes", 0)
        return held + sum(int(c["k"].nbytes) + int(c["v"].nbytes) for c in self.chunks)


class Fetcher:
    """The fetch thread, and the fetches started and not yet taken (held weakly: a request dropped while it
    waited takes its fetch with it)."""

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxsmol-cache-fetch")
        self.held: weakref.WeakSet[Fetch] = weakref.WeakSet()
        self._lock = threading.Lock()  # /metrics counts `held` from another thread

    @property
    def room(self) -> bool:
        with self._lock:
            return len(self.held) < FETCH_AHEAD

    def start(self, fetch: Fetch, read) -> Fetch:
        """Run read(fetch) on the fetch thread (an empty one: nothing to run); it is held until `taken`."""
        if fetch.empty:
            return fetch
        with self._lock:
            self.held.add(fetch)
        fetch.future = self._pool.submit(read, fetch)
        return fetch

    def taken(self, fetch: Fetch | None) -> None:
        """Its request was admitted (or dropped): it no longer counts against FETCH_AHEAD."""
        if fetch is not None:
            with self._lock:
                self.held.discard(fetch)

    @property
    def nbytes(self) -> int:
        with self._lock:
            fetches = list(self.held)
        return sum(f.nbytes for f in fetches)

    def ready(self, fetch: Fetch | None) -> bool:
        """Whether a request with this fetch (None: nothing to read) may be admitted: its reads are done."""
        return fetch is None or fetch.done
