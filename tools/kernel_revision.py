"""A git revision's C++ kernel built beside the current one, for the kernel timers' `--against REV`.

    PYTHONPATH=$PWD python tools/time_matmuls.py --against REV   (or tools/time_decode_attention.py; not run itself)

Side-by-side timing in one process: the machine's memory speed moves between runs, so only figures
taken alternately in one process compare two builds."""

from __future__ import annotations

import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jaxsmol.kernels import cpu_kernels


def _show(root: Path, rev: str, name: str) -> str | None:
    """A kernel file as of rev: under jaxsmol/kernels/, or jaxsmol/ in revisions before the move; None if neither."""
    for folder in ("jaxsmol/kernels", "jaxsmol"):
        r = subprocess.run(["git", "-C", str(root), "show", f"{rev}:{folder}/{name}"], capture_output=True, text=True)
        if r.returncode == 0:
            return r.stdout
    return None


def register(rev: str, source: str, symbol: str) -> str:
    """Build `jaxsmol/<source>` as of git revision rev with its handler `symbol` renamed, register it
    with XLA and return the new target's name for jax.ffi.ffi_call."""
    root = Path(__file__).resolve().parents[1]
    work = Path(tempfile.mkdtemp(prefix="jaxsmol-kernel-"))
    for name in (source, "cpu_kernels.h", "cpu_matmul.h"):
        text = _show(root, rev, name)
        if text is None and name == source:
            raise SystemExit(f"{rev} has no kernel source {name}")
        if text is not None:
            (work / name).write_text(text)
    renames = [f"-D{symbol}={symbol}Base", "-DJaxsmolVectorLanes=JaxsmolVectorLanesBase"]
    cxx = os.environ.get("CXX", "c++")  # as cpu_kernels builds the current one
    subprocess.run([cxx, *cpu_kernels.FLAGS, f"-I{jax.ffi.include_dir()}", *renames, str(work / source),
                    "-o", str(work / "base.so")], check=True, capture_output=True)
    lib = ctypes.cdll.LoadLibrary(str(work / "base.so"))
    target = f"{symbol.lower()}_base"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, f"{symbol}Base")), platform="cpu")
    return target


def side_by_side(programs: dict, call_args: tuple, runs: int, rev: str | None) -> tuple[float, str]:
    """Time programs {"now": f[, rev: g]} on call_args, alternating (each goes first half the time):
    (median seconds of "now", and with rev a " | rev ...: ratio, bitwise equal or not" suffix)."""
    outputs = [np.asarray(jax.tree.leaves(f(*call_args))) for f in programs.values()]
    times = {name: [] for name in programs}
    for run in range(runs):
        for name, f in list(programs.items())[::1 if run % 2 else -1]:
            t0 = time.perf_counter()
            jax.block_until_ready(f(*call_args))
            times[name].append(time.perf_counter() - t0)
    now = statistics.median(times["now"])
    if rev is None:
        return now, ""
    base = statistics.median(times[rev])
    return now, (f"  | {rev} {1e3 * base:7.2f} ms: now/{rev} {now / base:.3f}, "
                 f"bitwise {'equal' if np.array_equal(*outputs) else 'DIFFERENT'}")
