"""jaxsmol/host_memory.py: big host blocks come from malloc's heap and stay there once freed (glibc)."""

from __future__ import annotations

import ctypes
import platform
import threading

import numpy as np

from jaxsmol.host_memory import keep_freed_memory


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo() -> _Mallinfo2:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    return libc.mallinfo2()


def test_a_freed_big_block_is_kept_for_the_next_one():
    assert platform.libc_ver()[0] == "glibc"  # where the daemon runs here; elsewhere it returns False
    assert keep_freed_memory() and keep_freed_memory()  # idempotent
    before = _mallinfo()
    blocks = []  # 64 MB, above glibc's largest mmap threshold (32 MB), allocated by another thread as
    # the daemon's worker allocates its batch (a thread's own arena would map anything over 64 MB afresh)
    worker = threading.Thread(target=lambda: blocks.append(np.ones(64 << 20, np.uint8)))
    worker.start()
    worker.join()
    held = _mallinfo()
    assert held.hblkhd == before.hblkhd  # not a fresh mapping: from the heap
    assert held.arena >= before.arena and held.uordblks >= before.uordblks + (64 << 20)
    del blocks[:]
    freed = _mallinfo()
    assert freed.arena >= held.arena  # the heap is not trimmed: the next big block reuses those pages
    assert freed.fordblks >= 64 << 20
