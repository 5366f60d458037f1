"""jaxsmol/system/host_memory.py: big host blocks come from malloc's heap and stay there once freed (glibc).

Run in a fresh interpreter, as the command line calls it: at start, before other threads exist (a
thread that already has an arena of its own keeps it)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

PROBE = r"""
import ctypes, json, sys, threading
import numpy as np
from jaxsmol.system.host_memory import keep_freed_memory

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
info = lambda: {f: getattr(libc.mallinfo2(), f) for f in ("arena", "hblkhd", "uordblks", "fordblks")}
kept = keep_freed_memory() and keep_freed_memory() if sys.argv[1] == "keep" else False
before = info()
blocks = []  # allocated by another thread, as the daemon's worker allocates its batch
worker = threading.Thread(target=lambda: blocks.append(np.ones(64 << 20, np.uint8)))
worker.start(); worker.join()
held = info()
del blocks[:]
print(json.dumps({"kept": kept, "before": before, "held": held, "freed": info()}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_a_freed_big_block_is_kept_for_the_next_one():
    assert platform.libc_ver()[0] == "glibc"  # where the daemon runs here; elsewhere it returns False
    r = _probe("keep")
    mb64 = 64 << 20  # above glibc's largest mmap threshold (32 MB)
    assert r["kept"]
    assert r["held"]["hblkhd"] == r["before"]["hblkhd"]  # not a fresh mapping: from the heap
    assert r["held"]["uordblks"] >= r["before"]["uordblks"] + mb64
    assert r["freed"]["arena"] >= r["held"]["arena"]  # not trimmed: the next big block reuses those pages
    assert r["freed"]["fordblks"] >= mb64
    plain = _probe("plain")  # glibc's defaults: a fresh mapping, unmapped when freed
    assert plain["held"]["hblkhd"] >= plain["before"]["hblkhd"] + mb64
    assert plain["freed"]["hblkhd"] == plain["before"]["hblkhd"]
