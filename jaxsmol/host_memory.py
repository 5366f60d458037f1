"""Keep freed host memory for reuse (glibc's malloc), so big buffers are not faulted in afresh.

On CPU every device array is host memory from malloc. glibc serves a request above its mmap
threshold (at most 32 MB) with a fresh mmap and unmaps it when freed, so each new batch, staging
cache or stacked chunk of the continuous batch (a 16-row x 512-slot batch is 377 MB) is faulted in
page by page, zeroed by the kernel, before XLA writes it. Measured in a burst of 16 requests
(tools/bench_serve.py shapes, in process): the batch's first relayout took 332-700 ms with fresh
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
