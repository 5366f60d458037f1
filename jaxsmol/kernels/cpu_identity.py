"""What CPU this is, for the kernels: whether it can run them (x86-64 with AVX2 and FMA), and its model
and feature flags (part of the key of the compiled library and of stored programs)."""

from __future__ import annotations

import platform
from pathlib import Path


def unsupported_cpu(machine: str, flags: set[str] | None) -> str | None:
    """Why a CPU cannot run the kernels, or None: they are written for x86-64 with AVX2 and FMA (a
    narrower vector is emulated, slower than XLA). flags None: unknown (no /proc/cpuinfo), left to the compiler."""
    if machine.lower() not in ("x86_64", "amd64"):
        return f"the CPU is {machine}; they need x86-64 with AVX2 and FMA"
    missing = [f.upper() for f in ("avx2", "fma") if flags is not None and f not in flags]
    return f"the CPU lacks {' and '.join(missing)}" if missing else None


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo, None where it cannot be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return {f for ln in lines if ln.startswith("flags") for f in ln.partition(":")[2].split()}


def cpu_signature() -> str:
    """The CPU model and feature flags (a library built with -march=native runs only where they match)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [ln for ln in lines if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(wanted))
