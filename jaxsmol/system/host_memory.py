"""The process's host memory: malloc's policy and figures, the resident set, pages handed back to the OS.

On CPU every device array is host memory from malloc. `one_malloc_arena` makes every thread allocate
from one arena: a thread's own arena grows in heaps of at most 64 MB and keeps what it freed apart
from the others' (glibc makes up to 8 per core), so a daemon's worker and HTTP threads would each
hold a high-water mark of their own. glibc's other defaults stay: a block above its mmap threshold
(adaptive, at most 32 MB) is a mapping of its own, returned to the OS when freed, and a freed block
below it is kept for reuse up to the trim threshold. The daemon's large buffers are allocated once
(the KV arena, runtime/kv_arena.py: never faulted in afresh per request), so nothing large is
refaulted request after request; keeping every freed block (an earlier policy here) made a freed
arena, or memory malloc_trim had handed back, count as free heap that holds no page. When the daemon
is idle, `release_freed` returns malloc's free pages; `give_back` hands the pages of a range (a
released arena row) back; `resident_in` reads which pages of a range are resident. The command line
calls `one_malloc_arena` at start; a library user may too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import mmap
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported where used: the command line's --help and info load none
    import numpy as np

M_ARENA_MAX = -8  # a mallopt parameter (malloc.h)

_done: bool | None = None


def one_malloc_arena() -> bool:
    """Ask glibc's malloc to serve every thread from one arena (idempotent; call it before other
    threads start). Returns whether that took effect (False off glibc: other allocators keep their own
    policy)."""
    global _done
    if _done is None:
        _done = sys.platform.startswith("linux") and _mallopt(M_ARENA_MAX, 1)
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
    tokenizer...; not Python's small objects, which live in its own arenas), of which `mapped` in
    mappings of their own (blocks over the mmap threshold), and `free` bytes it holds for reuse (some
    of them handed back to the OS by malloc_trim: see free_resident)."""
    in_use: int
    free: int
    mapped: int = 0


def heap() -> Heap | None:
    """malloc's figures now (glibc's mallinfo2), or None off glibc. Walks the free lists: call it per
    scrape, not per token."""
    try:
        fn = _libc().mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2
    m = fn()
    return Heap(in_use=m.uordblks + m.hblkhd, free=m.fordblks, mapped=m.hblkhd)


@functools.cache
def _heap_start() -> int | None:
    """Where the [heap] mapping (the program break's) begins; None where there is none."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if line.rstrip().endswith("[heap]"):
                    return int(line.split("-", 1)[0], 16)
    except (OSError, ValueError):
        pass
    return None


def free_resident(h: Heap | None = None) -> int | None:
    """The part of malloc's free memory that is resident: the [heap] mapping's resident pages (mincore)
    less what is in use there (in use counted as resident). malloc_trim hands free pages back without
    telling mallinfo, whose `free` then counts memory that holds no page. None where unknown."""
    h = h or heap()
    start = _heap_start()
    if h is None or start is None:
        return None
    try:
        sbrk = _libc().sbrk
    except (OSError, AttributeError):
        return None
    sbrk.restype, sbrk.argtypes = ctypes.c_void_p, (ctypes.c_ssize_t,)
    end = sbrk(0) or 0
    resident = resident_in(start, end - start) if end > start else None
    return None if resident is None else max(0, resident - (h.in_use - h.mapped))


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


def total_bytes() -> int:
    """The machine's memory, RAM and swap (/proc/meminfo MemTotal + SwapTotal); 0 where unknown."""
    total = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(("MemTotal:", "SwapTotal:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return total


def held_bytes() -> int | None:
    """The memory this process holds, less what malloc keeps free for reuse: its anonymous resident
    set (malloc's heap, Python's own arenas, other mappings) minus malloc's resident free bytes. None
    off glibc."""
    h = heap()
    if h is None:
        return None
    free = free_resident(h)
    return resident_bytes("RssAnon") - (h.free if free is None else free)


def release_freed() -> bool:
    """Give the heap's free pages back to the OS (malloc_trim): after a peak, such as the daemon's
    programs compiled ahead or a burst of requests, which malloc would otherwise keep for reuse."""
    try:
        return bool(_libc().malloc_trim(ctypes.c_size_t(0)))
    except (OSError, AttributeError):
        return False


MADV_DONTNEED, MADV_NOHUGEPAGE = 4, 15  # sys/mman.h (Linux)
# Arrays at least this large get pages of their own (`empty`): the prefix cache's snapshots, stored and
# evicted all the time in many sizes, fragmented malloc's heap by ~100 MB every few long prompts
PAGES_FROM = 1 << 20


def empty(shape, dtype) -> np.ndarray:
    """An array, not initialized; one of PAGES_FROM bytes or more in pages of its own (an anonymous
    mapping, returned to the OS when the array goes), so that large blocks stored and freed all the time
    never fragment malloc's heap."""
    import numpy as np

    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if nbytes < PAGES_FROM:
        return np.empty(shape, dtype)
    return np.ndarray(shape, dtype, buffer=mmap.mmap(-1, nbytes))


def read_pages(readinto, nbytes: int):
    """nbytes read by `readinto(buffer)` calls (a file's, a socket's) into pages of their own: (an anonymous
    mapping of nbytes, or bytes where nbytes is 0; how many were read before the source ran dry). Arrays
    over the mapping (np.ndarray(..., buffer=it)) own their memory as `empty`'s do: nothing is copied."""
    if nbytes <= 0:
        return b"", 0
    pages, got = mmap.mmap(-1, nbytes), 0
    view = memoryview(pages)
    try:
        while got < nbytes:
            n = readinto(view[got:])
            if not n:
                break
            got += n
    finally:
        view.release()  # a mapping with views exported cannot be closed when it goes
    return pages, got


def owns(a: np.ndarray) -> bool:
    """Whether the array owns its memory (malloc's, or pages of its own from `empty`), not a view."""
    return a.base is None or isinstance(a.base, mmap.mmap)


def copy(a: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of `a` that owns its memory (`empty`'s: pages of its own when large)."""
    import numpy as np

    out = empty(a.shape, a.dtype)
    np.copyto(out, a)
    return out


def give_back(address: int, nbytes: int) -> int:
    """Hand the whole pages of [address, address + nbytes) back to the OS: they then read as zeros and
    take memory again only once written (madvise MADV_DONTNEED; the memory must be this process's own,
    anonymous and private, as malloc's and XLA's CPU buffers are). Returns the bytes handed back (0 off
    Linux, or where the OS refused)."""
    page = mmap.PAGESIZE
    first, last = -(-address // page) * page, (address + nbytes) // page * page
    if last <= first or not sys.platform.startswith("linux"):
        return 0
    try:
        madvise = _libc().madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    # off transparent huge pages first: written again, a page must not come back as 2 MB
    madvise(first, last - first, MADV_NOHUGEPAGE)
    return last - first if madvise(first, last - first, MADV_DONTNEED) == 0 else 0


def resident_in(address: int, nbytes: int) -> int | None:
    """Bytes of [address, address + nbytes) that are resident (mincore), whole pages; None where that
    cannot be read."""
    import numpy as np

    page = mmap.PAGESIZE
    first = address // page * page
    pages = -(-(address + nbytes - first) // page)
    try:
        mincore = _libc().mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    vec = ctypes.create_string_buffer(pages)
    if mincore(first, pages * page, vec) != 0:
        return None
    return int(np.count_nonzero(np.frombuffer(vec.raw, np.uint8) & 1)) * page
