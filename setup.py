"""The wheel's prebuilt CPU kernels: one shared library per variant of jaxsmol/kernels/variants.py, built by
setuptools' build_ext into jaxsmol/kernels/prebuilt/ (everything else is in pyproject.toml).

Each library is the source build's units and flags (jaxsmol/kernels/build.py) with `-march=native` replaced
by the variant's levels, linked with libstdc++ and libgcc inside it (LINK), so that it needs only glibc: the wheel
is tagged py3-none-<platform> (no Python ABI is used) and `auditwheel repair` makes it manylinux
(tools/make_wheels.py). An editable install builds nothing: the kernels compile on first use for the CPU.
`JAXSMOL_WHEEL_VARIANTS=avx2,...` builds only those (the tests build the one their CPU runs); `CXX` names
the compiler (default c++, as at first use). The FFI headers are jaxlib's, found without importing jax
(build_backend.py makes jaxlib a requirement of a wheel's build).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

KERNELS = Path(__file__).resolve().parent / "jaxsmol" / "kernels"
# libstdc++ and libgcc linked in and their symbols kept inside (so the library needs only glibc: manylinux,
# and it never binds the process's libstdc++), the parts of them the kernels do not reach left out (1.9 MB,
# not 3.0; and glibc 2.35's symbols at most, not 2.36's, where built on Debian 12). Link flags only: the
# code is compiled as the first use compiles it.
LINK = ("-static-libstdc++", "-static-libgcc", "-Wl,--gc-sections", "-Wl,--exclude-libs,ALL")


def _load(name: str):
    """A module of jaxsmol/kernels by its path: importing the package would import jax."""
    spec = importlib.util.spec_from_file_location(f"jaxsmol_setup_{name}", KERNELS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's names through it
    spec.loader.exec_module(module)
    return module


build, variants = _load("build"), _load("variants")


def _ffi_include_dir() -> str:
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("building the wheel's CPU kernels needs jaxlib (its FFI headers): pip install jaxlib")
    return str(Path(spec.submodule_search_locations[0]) / "include")


class KernelLibrary(Extension):
    """A variant's library: the kernel sources (their headers as its dependencies) under prebuilt/."""

    def __init__(self, variant):
        root = KERNELS.parents[1]
        super().__init__(f"jaxsmol.kernels.{variants.PREBUILT}.{variant.library.removesuffix('.so')}",
                         [str(src.relative_to(root)) for src in build.SOURCES],
                         depends=[str(h.relative_to(root)) for h in build.HEADERS])
        self.variant = variant


class BuildKernels(build_ext):
    """Each Extension is a variant's library, compiled by build.compile_library as the first use compiles."""

    def run(self) -> None:
        if not self.editable_mode:  # pip install -e: compiled on first use, for this CPU
            super().run()

    def get_outputs(self) -> list[str]:
        return [] if self.editable_mode else super().get_outputs()

    def get_output_mapping(self) -> dict[str, str]:
        return {} if self.editable_mode else super().get_output_mapping()

    def get_ext_filename(self, fullname: str) -> str:
        return os.path.join(*fullname.split(".")) + ".so"  # a plain library, not a CPython extension module

    def build_extension(self, ext: KernelLibrary) -> None:
        variant = ext.variant
        out = Path(self.get_ext_fullpath(ext.name))
        print(f"building the CPU kernels for {variant.name}: {out}", flush=True)
        try:
            build.compile_library(os.environ.get("CXX", "c++"), build.flags_for(variant.march), _ffi_include_dir(),
                                  out, LINK)
        except RuntimeError as e:
            raise SystemExit(f"the {variant.name} kernels did not build: {e}") from None


class PlatformWheel(bdist_wheel):
    """py3-none-<platform>: the libraries are tied to the platform, not to a Python version or ABI."""

    def get_tag(self) -> tuple[str, str, str]:
        return ("py3", "none", super().get_tag()[2])


def _libraries() -> list[KernelLibrary]:
    """The variants' libraries to build: none off x86-64 (the kernels run there only; the wheel is then pure)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    names = os.environ.get("JAXSMOL_WHEEL_VARIANTS") or ",".join(v.name for v in variants.VARIANTS)
    try:
        return [KernelLibrary(v) for v in variants.named(names)]
    except ValueError as e:
        raise SystemExit(f"JAXSMOL_WHEEL_VARIANTS: {e}") from None


setup(ext_modules=_libraries(), cmdclass={"build_ext": BuildKernels, "bdist_wheel": PlatformWheel})
