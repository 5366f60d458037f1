"""The instruction sets a wheel ships the kernels prebuilt for: one library each, in jaxsmol/kernels/prebuilt/
(setup.py builds them; cpu_kernels.py loads the best one this CPU runs, else compiles for it). Nothing here
imports jax or the jaxsmol package: setup.py loads this file by its path.

Each variant is the source build's flags with `-march=native` replaced by x86-64 microarchitecture levels
(build.flags_for), and names the /proc/cpuinfo flags a CPU must list to run it. A variant's code is the
native build's for a CPU of that level: the kernels choose their paths by the compiler's macros (__AVX512F__,
__AVX512BW__, __AVX512VNNI__), not by tuning, so the bits are the native build's
(tests/test_wheel.py checks it).
"""

from __future__ import annotations

import dataclasses

PREBUILT = "prebuilt"  # the folder beside this file that holds a wheel's libraries
# /proc/cpuinfo's names for x86-64-v2 (SSE3 is "pni", LAHF "lahf_lm"), v3 (LZCNT is "abm") and v4
X86_64_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
X86_64_V3 = X86_64_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
X86_64_V4 = X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str  # KernelState.isa where it runs
    march: tuple[str, ...]  # in the place of -march=native
    needs: frozenset[str]  # the CPU flags it runs on

    @property
    def library(self) -> str:
        return f"cpu_kernels-{self.name}.so"


# Best first. avx512-vnni: cpu_matmul_int8.cc's integer dots (`--matmul int8`, the default) take one
# vpdpbusd a quad where plain AVX-512 takes two instructions and a 16-bit sum: the same integers, so the
# same bits. The model's matmuls with it against without, alternating in one process (tools/time_matmuls.py
# --format F --dot int8, 2-core AMD EPYC Zen 4): one row (a lone stream's decode step, bound by memory)
# 0.97-1.07x, 8 rows (a batched step) Q8_0 0.82x and Q4_1 0.94-1.03x, 16 rows 0.83-0.88x, 64 rows (prefill)
# 0.74-0.87x. It pays where the daemon batches and prefills, so it ships. AVX2 with AVX-VNNI (Alder Lake,
# no AVX-512) has no variant of its own: no machine here runs it to measure or test; it loads avx2.
VARIANTS = (
    Variant("avx512-vnni", ("-march=x86-64-v4", "-mavx512vnni"), X86_64_V4 | {"avx512_vnni"}),
    Variant("avx512", ("-march=x86-64-v4",), X86_64_V4),
    Variant("avx2", ("-march=x86-64-v3",), X86_64_V3),
)


def best(flags: set[str] | frozenset[str] | None, names: tuple[str, ...] | None = None) -> Variant | None:
    """The first variant (of `names`, else of all) whose flags the CPU lists; None where none fits or
    the flags are unknown (no /proc/cpuinfo): the kernels are then compiled for this CPU."""
    if flags is None:
        return None
    return next((v for v in VARIANTS if v.needs <= flags and (names is None or v.name in names)), None)


def named(names: str) -> tuple[Variant, ...]:
    """The variants a comma-separated list names (setup.py's JAXSMOL_WHEEL_VARIANTS); a ValueError
    for a name that is none of them."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in {v.name for v in VARIANTS}]
    if unknown:
        raise ValueError(f"unknown kernel variant {', '.join(unknown)}: the variants are "
                         f"{', '.join(v.name for v in VARIANTS)}")
    return tuple(v for v in VARIANTS if v.name in wanted)
