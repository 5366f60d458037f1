"""jaxsmol/system/host_memory.py: one malloc arena for every thread, big blocks returned to the OS when
freed (glibc), and a range's pages handed back and counted.

The arena setting runs in a fresh interpreter, as the command line calls it: at start, before other
threads exist (a thread that already has an arena of its own keeps it)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import numpy as np

from jaxsmol.system import host_memory

PROBE = r"""
import ctypes, json, os, sys, threading, tempfile
import numpy as np
from jaxsmol.system.host_memory import one_malloc_arena, heap

one = one_malloc_arena() and one_malloc_arena() if sys.argv[1] == "one" else False
before = heap()
blocks = []  # allocated by other threads, as the daemon's worker and HTTP threads allocate
def work():
    blocks.append(np.ones(1 << 20, np.uint8))  # below the mmap threshold: from an arena's heap
    blocks.append(np.ones(64 << 20, np.uint8))  # above it: a mapping of its own
threads = [threading.Thread(target=work) for _ in range(4)]
[t.start() for t in threads]; [t.join() for t in threads]
held = heap()
del blocks[:]
freed = heap()
libc = ctypes.CDLL("libc.so.6")
err = tempfile.TemporaryFile()
saved = os.dup(2); os.dup2(err.fileno(), 2); libc.malloc_stats(); os.dup2(saved, 2)
err.seek(0)
arenas = sum(line.startswith(b"Arena ") for line in err.read().splitlines())
print(json.dumps({"one": one, "arenas": arenas, "before": before.in_use, "held": held.in_use, "freed": freed.in_use}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_every_thread_allocates_from_one_arena_and_big_blocks_go_back():
    assert platform.libc_ver()[0] == "glibc"  # where the daemon runs here; elsewhere it returns False
    r = _probe("one")
    assert r["one"] and r["arenas"] == 1
    assert r["held"] >= r["before"] + 4 * (65 << 20)
    assert r["freed"] < r["before"] + (16 << 20)  # the mapped blocks unmapped, the small ones freed
    plain = _probe("plain")  # glibc's defaults: threads get arenas of their own
    assert plain["arenas"] > 1


def test_pages_handed_back_read_zeros_and_leave_the_resident_set():
    block = np.ones(64 << 20, np.uint8)  # above the mmap threshold: pages of its own
    address = block.ctypes.data
    assert host_memory.resident_in(address, block.nbytes) >= block.nbytes - 8192
    given = host_memory.give_back(address + 100, block.nbytes - 200)
    assert block.nbytes - 3 * 4096 <= given <= block.nbytes
    assert host_memory.resident_in(address, block.nbytes) <= 3 * 4096
    block[5000:5010] = 7  # written again: backed again
    assert 4096 <= host_memory.resident_in(address, block.nbytes) <= 5 * 4096
    # (reading them maps the shared zero page, which mincore counts: read last)
    assert block[:100].all() and not block[8192:-8192].any() and block[-100:].all()  # its edges were kept
