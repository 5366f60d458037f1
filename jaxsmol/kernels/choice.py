"""Which CPU kernels library a process uses, decided from files alone (no jax imported): the switch
(JAXSMOL_KERNELS), whether this CPU runs the kernels, a wheel's prebuilt variant, or the library compiled
for this CPU and its path. cpu_kernels.py loads what this chooses; `jaxsmol info` reports it without
loading anything (`--load` loads it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import shutil
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from jaxsmol.errors import JaxsmolError
from jaxsmol.kernels import variants
from jaxsmol.kernels.build import FLAGS, HEADERS, SOURCES, UNITS
from jaxsmol.kernels.cpu_identity import _cpu_flags, cpu_signature, unsupported_cpu
from jaxsmol.system.data_dirs import kernels_dir

MODES = ("auto", "on", "off")  # JAXSMOL_KERNELS's values
_MODE_WORDS = {"": "auto", "1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}
ENV, OLD_ENV = "JAXSMOL_KERNELS", "JAXSMOL_CPU_KERNELS"  # the switch, and its old name (still read)
ISAS = {16: "avx512", 8: "avx2"}  # the library's vector width in floats -> the instruction set it was built for
PREBUILT = Path(__file__).with_name(variants.PREBUILT)  # a wheel's libraries, one a variant (setup.py)


@dataclasses.dataclass(frozen=True)
class KernelState:
    """What became (or, before loading, would become) of the kernels in this process (`jaxsmol info`)."""

    mode: str  # the switch: auto, on or off
    switch: str | None  # the variable that set it (JAXSMOL_KERNELS, or its old name); None: the default, auto
    in_use: bool  # built and registered (expected: would be): an engine on one CPU device whose shapes fit uses them
    # "prebuilt" (the wheel's), "compiled" (by this process), "cache" (built before), or, before loading, "to
    # compile" (on first use); None when not in use
    source: str | None = None
    isa: str | None = None  # its instruction set: a prebuilt variant's name, else "avx512" (16 floats) or "avx2" (8)
    lanes: int = 0  # its vector width in floats
    library: str | None = None  # the shared library's path
    reason: str | None = None  # why they are not in use
    loaded: bool = True  # False: what loading would give, read from files (expected())


def kernel_switch(environ=os.environ) -> tuple[str, str | None]:
    """(mode, variable): JAXSMOL_KERNELS, else its old name JAXSMOL_CPU_KERNELS, else (auto, None);
    a JaxsmolError naming the variable for a value other than auto, on, off (or 1/true/yes, 0/false/no)."""
    for name in (ENV, OLD_ENV):
        raw = environ.get(name, "").strip()
        if raw:
            mode = _MODE_WORDS.get(raw.lower(), raw.lower())
            if mode not in MODES:
                raise JaxsmolError(f"{name} must be one of {', '.join(MODES)}, got {raw!r}")
            return mode, name
    return "auto", None


def prebuilt_variant(flags: set[str] | None) -> variants.Variant | None:
    """The best variant whose library this install holds and this CPU runs (None: an editable install
    or a source build, which hold none, or a CPU none fits)."""
    present = tuple(v.name for v in variants.VARIANTS if (PREBUILT / v.library).is_file())
    return variants.best(flags, present) if present else None


def compiler() -> str:
    return os.environ.get("CXX", "c++")


def compiled_library() -> Path:
    """Where the library compiled for this CPU is kept: its name keyed by the sources, flags, units,
    compiler, jax version and CPU, so a change of any builds a new one."""
    missing = [f.name for f in (*SOURCES, *HEADERS) if not f.is_file()]
    if missing:  # a broken install (a wheel without a source)
        raise RuntimeError(f"kernel sources missing from {SOURCES[0].parent}: {', '.join(missing)}")
    key = hashlib.blake2b(digest_size=12)
    for part in (*(f.read_bytes() for f in (*SOURCES, *HEADERS)), " ".join(FLAGS).encode(),
                 repr([(src.name, defines) for src, defines in UNITS]).encode(), compiler().encode(),
                 _jax_version().encode(), cpu_signature().encode()):
        key.update(part)
    return kernels_dir() / f"cpu_kernels-{key.hexdigest()}.so"


def _jax_version() -> str:
    try:
        return version("jax")
    except PackageNotFoundError:  # a jax run from a checkout
        import jax

        return jax.__version__


def expected() -> KernelState:
    """What loading the kernels would give, from files alone (loaded=False): nothing is compiled, loaded or
    registered. Where the library is still to compile, in_use says whether a compiler is there to do it."""
    mode, switch = kernel_switch()
    if mode == "off":
        return KernelState(mode, switch, False, reason=f"switched off ({switch}=off): XLA's ops only", loaded=False)
    flags = _cpu_flags()
    why = unsupported_cpu(platform.machine(), flags)
    if why is not None:
        return KernelState(mode, switch, False, reason=why, loaded=False)
    variant = prebuilt_variant(flags)
    if variant is not None:
        lanes = 16 if "avx512f" in variant.needs else 8
        return KernelState(mode, switch, True, "prebuilt", variant.name, lanes, str(PREBUILT / variant.library),
                           loaded=False)
    lanes = 16 if flags is not None and "avx512f" in flags else 8
    try:
        path = compiled_library()
    except RuntimeError as e:
        return KernelState(mode, switch, False, reason=str(e), loaded=False)
    if path.is_file():
        return KernelState(mode, switch, True, "cache", ISAS[lanes], lanes, str(path), loaded=False)
    if shutil.which(compiler()) is None:
        return KernelState(mode, switch, False, reason=f"no prebuilt library fits, and no C++ compiler "
                           f"{compiler()!r} to build one", loaded=False)
    return KernelState(mode, switch, True, "to compile", ISAS[lanes], lanes, str(path), loaded=False)
