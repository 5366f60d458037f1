"""How the C++ kernels become one shared library: the sources, the units one compiler process builds, the
flags, and the compile itself. Two callers: cpu_kernels.py on first use (`-march=native`, into the kernels
directory) and setup.py for a wheel (one library per variants.py entry). Neither jax nor the jaxsmol
package is imported here, so setup.py loads this file by its path, before jaxsmol can be imported.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

SOURCES = tuple(Path(__file__).with_name(n)
                for n in ("cpu_matmul.cc", "cpu_matmul_quant.cc", "cpu_attention.cc", "cpu_prefix.cc",
                          "cpu_matmul_int8.cc"))
HEADERS = tuple(Path(__file__).with_name(n) for n in ("cpu_kernels.h", "cpu_matmul.h"))
# What one compiler process builds: a source, with its own flags. The attention source once per cache
# type, so that two cores share its compile (a cold start's longest step).
UNITS = tuple((src, ()) for src in SOURCES if src.name != "cpu_attention.cc") + tuple(
    (SOURCES[2], (f"-DJAXSMOL_ATTENTION_CACHE={t}",)) for t in ("JAXSMOL_F32", "JAXSMOL_BF16"))
NATIVE = "-march=native"
FLAGS = ("-O3", NATIVE, "-std=gnu++17", "-shared", "-fPIC", "-fno-math-errno")


def flags_for(march: tuple[str, ...]) -> tuple[str, ...]:
    """FLAGS with `-march=native` replaced by `march` (a wheel's variant: the same code for a named
    instruction set instead of this machine's)."""
    return tuple(part for f in FLAGS for part in (march if f == NATIVE else (f,)))


def compile_library(cxx: str, flags: tuple[str, ...], include_dir: str, out: Path,
                    link_flags: tuple[str, ...] = ()) -> None:
    """Compile UNITS with `flags` (and the FFI headers of `include_dir`) and link them into `out`, which
    appears whole or not at all (a concurrent process never sees half a library). A RuntimeError names
    the compiler's first errors."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    with tempfile.TemporaryDirectory(dir=out.parent) as work:
        objects = _compile_each(cxx, flags, include_dir, Path(work))
        _run_compiler(cxx, [cxx, *flags, *link_flags, *map(str, objects), "-o", str(tmp)], tmp)
    os.replace(tmp, out)


def _compile_each(cxx: str, flags: tuple[str, ...], include_dir: str, work: Path) -> list[Path]:
    """Each unit to an object file in `work`, all at once (one compiler per unit: ~2x faster on two
    cores than one command compiling them in turn; the same translation units, so the same code)."""
    compile_flags = [f for f in flags if f != "-shared"]
    objects = [work / f"{src.stem}-{i}.o" for i, (src, _) in enumerate(UNITS)]
    try:
        running = [subprocess.Popen([cxx, *compile_flags, *defines, f"-I{include_dir}", "-c", str(src),
                                     "-o", str(obj)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                   for (src, defines), obj in zip(UNITS, objects)]
    except OSError as e:
        raise RuntimeError(f"cannot run the C++ compiler {cxx!r}: {e}") from None
    failures = []
    for proc in running:
        try:
            _, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
        if proc.returncode != 0:
            failures.append(stderr)
    if failures:
        raise RuntimeError(_compiler_failure(cxx, "\n".join(failures)))
    return objects


def _run_compiler(cxx: str, cmd: list[str], tmp: Path) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"cannot run the C++ compiler {cxx!r}: {e}") from None
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(_compiler_failure(cxx, done.stderr))


def _compiler_failure(cxx: str, stderr: str) -> str:
    errors = [ln for ln in stderr.splitlines() if "error" in ln][:3]
    return f"{cxx} failed on the kernel sources: {' | '.join(errors) or stderr[-300:]}"
