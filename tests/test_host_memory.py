"""jaxsmol/host_memory.py: big host blocks come from malloc's heap and stay there once freed (glibc)."""

from __future__ import annotations

import ctypes
import platform

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
    block = np.ones(64 << 20, np.uint8)  # 64 MB: above glibc's largest mmap threshold (32 MB)
    held = _mallinfo()
    assert held.hblkhd == before.hblkhd  # not a fresh mapping: from the heap
    assert held.arena >= before.arena and held.uordblks >= before.uordblks + (64 << 20)
    del block
    freed = _mallinfo()
    assert freed.arena >= held.arena  # the heap is not trimmed: the next big block reuses those pages
    assert freed.fordblks >= 64 << 20
