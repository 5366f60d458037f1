"""Keep freed host memory for reuse (glibc's malloc), so big buffers are not faulted in afresh.

On CPU every device array is host memory from malloc. glibc serves a request above its mmap
threshold (at most 32 MB) with a fresh mmap and unmaps it when freed, so each new batch, staging
cache or stacked chunk of the continuous batch (a 16-row x 512-slot batch is 377 MB) is faulted in
page by page, zeroed by the kernel, before XLA writes it. Measured in a burst of 16 requests
(the shapes of jaxsmol bench --only serve, in process): the batch's first relayout took 332-700 ms with fresh
pages and ~50 ms with reused ones. `keep_freed_memory` makes malloc take every block from its heap
and never give the heap back, as long-running servers configure tcmalloc or jemalloc. One arena for
all threads: a thread's own arena grows in heaps of at most 64 MB and serves anything larger with
a fresh mmap whatever M_MMAP_MAX says (the daemon's worker thread allocates the batch). The process
then holds its peak (which the daemon bounds: --kv-bytes, the prefix store's budget) instead of
returning and refaulting it. The command line calls it at start; a library user may too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # mallopt parameters (malloc.h)
INT_MAX = 2 ** 31 - 1

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to serve big blocks from its heap and keep freed memory (idempotent).
    Returns whether that took effect (False off glibc: other allocators keep their own policy)."""
    global _done
    if _done is None:
        _done = (sys.platform.startswith("linux") and _mallopt(M_ARENA_MAX, 1) and _mallopt(M_MMAP_MAX, 0)
                 and _mallopt(M_TRIM_THRESHOLD, INT_MAX))
    return _done


def _mallopt(param: int, value: int) -> bool:
    try:
        return bool(_libc().mallopt(ctypes.c_int(param), ctypes.c_int(value)))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


class _Mallinfo2(ctypes.Structure):  # struct mallinfo2 (glibc >= 2.33), every field a size_t
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@dataclasses.dataclass(frozen=True)
class Heap:
    """malloc's own figures: `in_use` bytes handed out (every CPU array, compiled programs, the
    tokenizer...; not Python's small objects, which live in its own arenas), `free` bytes it holds
    for reuse (kept, not returned, under keep_freed_memory)."""
    in_use: int
    free: int


def heap() -> Heap | None:
    """malloc's figures now (glibc's mallinfo2), or None off glibc. Walks the free lists: call it per
    scrape, not per token."""
    try:
        fn = _libc().mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2
    m = fn()
    return Heap(in_use=m.uordblks + m.hblkhd, free=m.fordblks)


def resident_bytes(kind: str = "VmRSS") -> int:
    """This process's resident set size (`kind` VmRSS), or its anonymous part (RssAnon: everything
    but mapped files), from /proc/self/status; 0 where that is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(kind + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def held_bytes() -> int | None:
    """The memory this process holds, less what malloc keeps free for reuse: its anonymous resident
    set (malloc's heap, Python's own arenas, other mappings) minus malloc's free bytes. None off glibc."""
    h = heap()
    return None if h is None else resident_bytes("RssAnon") - h.free


def release_freed() -> bool:
    """Give the heap's free pages back to the OS (malloc_trim): after a one-time peak, such as the
    daemon's programs compiled ahead, that keep_freed_memory would otherwise hold for good."""
    try:
        return bool(_libc().malloc_trim(ctypes.c_size_t(0)))
    except (OSError, AttributeError):
        return False
