"""jaxsmol as pip installs it: the sdist, and the wheel built from it, hold every module and kernel source of
the checkout and the build files; the wheel is a platform wheel holding the kernels prebuilt
(jaxsmol/kernels/variants.py, setup.py), and installed (not editable) into a fresh virtual environment it
runs them with no compiler to be found, with the bits of the kernels compiled from its sources.

Built offline (`--no-build-isolation`, `--no-index`: the test extra brings setuptools >= 70.1) from a
copy of the checkout, so a stale build/ folder cannot leak into the archives; only the variant this CPU
runs is built (JAXSMOL_WHEEL_VARIANTS: each takes ~15-40 s on 2 cores). The fresh environment gets the
dependencies (jax, ...) by a .pth line naming this environment's site-packages; that line does not run
the .pth files there, so an editable install of the checkout stays out of it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from fnmatch import fnmatch
from pathlib import Path

import pytest

from jaxsmol.kernels import cpu_kernels, variants
from jaxsmol.system.data_dirs import kernels_dir

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxsmol", "cache", "cli")  # the repository's folders; installed as jaxsmol, jaxsmol.cache, jaxsmol.cli
BUILD_FILES = ("pyproject.toml", "README.md", "setup.py", "build_backend.py", "MANIFEST.in")
KERNEL_FILES = (*cpu_kernels.SOURCES, *cpu_kernels.HEADERS)
BEST = variants.best(cpu_kernels._cpu_flags())  # the variant this CPU runs: the one the test wheel holds


def installed(folder: str) -> str:
    """A path under the repository's folders -> its path in the wheel (cache/x.py -> jaxsmol/cache/x.py)."""
    return folder if folder.split("/")[0] == "jaxsmol" else f"jaxsmol/{folder}"


def checkout_files() -> set[str]:
    """Every module and kernel file of the three folders in the checkout, as paths in the sdist."""
    return {p.relative_to(ROOT).as_posix() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*")
            if p.suffix in (".py", ".cc", ".h") and "__pycache__" not in p.parts}


def test_pyproject_packages_every_folder_and_kernel_source():
    """The fast guard: setuptools' reading of pyproject.toml finds every package folder, and its
    package-data patterns match every file cpu_kernels compiles (and it compiles every .cc there is)."""
    from setuptools.config.pyprojecttoml import read_configuration

    config = read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]
    folders = {installed(p.parent.relative_to(ROOT).as_posix()).replace("/", ".") for pkg in PACKAGES
               for p in (ROOT / pkg).rglob("__init__.py")}
    assert set(config["packages"]) == folders
    patterns = config["package-data"]["jaxsmol.kernels"]
    assert [f.name for f in KERNEL_FILES if not any(fnmatch(f.name, pat) for pat in patterns)] == []
    assert {f.name for f in cpu_kernels.SOURCES} == {p.name for p in (ROOT / "jaxsmol" / "kernels").glob("*.cc")}


def test_the_best_variant_a_cpu_runs_is_chosen_from_its_flags():
    vnni = variants.X86_64_V4 | {"avx512_vnni", "avx512_bf16"}
    assert variants.best(vnni).name == "avx512-vnni"
    assert variants.best(variants.X86_64_V4).name == "avx512"
    assert variants.best(variants.X86_64_V3 | {"avx512f"}).name == "avx2"  # AVX-512 without BW, CD, DQ, VL
    assert variants.best(variants.X86_64_V4 - {"bmi2"}) is None  # below x86-64-v3: compiled for the CPU
    assert variants.best(None) is None  # no /proc/cpuinfo
    assert variants.best(vnni, ("avx2", "avx512")).name == "avx512"  # the best of those a wheel holds
    assert [v.name for v in variants.named(" avx2,avx512-vnni")] == ["avx512-vnni", "avx2"]
    with pytest.raises(ValueError, match="unknown kernel variant sse4: the variants are avx512-vnni, avx512, avx2"):
        variants.named("avx2,sse4")


def run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, f"{cmd[:4]} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done


@pytest.fixture(scope="module")
def archives(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the copy of the checkout, the sdist built from it, the wheel built from the sdist with BEST's kernels)."""
    tmp = tmp_path_factory.mktemp("packaging")
    src, dist = tmp / "src", tmp / "dist"
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in BUILD_FILES:
        shutil.copy(ROOT / name, src / name)
    run([sys.executable, "-c", "import sys, build_backend; build_backend.build_sdist(sys.argv[1])", dist], cwd=src,
        env={**os.environ, "PYTHONPATH": str(src)})
    (sdist,) = dist.glob("jaxsmol-*.tar.gz")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist, sdist],
        cwd=tmp, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                      "JAXSMOL_WHEEL_VARIANTS": BEST.name if BEST else "avx2"})
    (wheel,) = dist.glob("jaxsmol-*.whl")
    return src, sdist, wheel


def test_the_sdist_and_the_wheel_hold_every_module_and_kernel_source(archives):
    _, sdist, wheel = archives
    with tarfile.open(sdist) as tar:
        in_sdist = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    with zipfile.ZipFile(wheel) as whl:
        in_wheel = set(whl.namelist())
    expected = checkout_files()
    assert {f"jaxsmol/kernels/{f.name}" for f in KERNEL_FILES} <= expected
    assert expected - in_sdist == set() and set(BUILD_FILES) <= in_sdist
    assert {installed(f) for f in expected} - in_wheel == set()
    assert {name.split("/")[0] for name in in_wheel if not name.startswith("jaxsmol-")} == {"jaxsmol"}


def test_the_wheel_is_a_platform_wheel_holding_the_prebuilt_kernels(archives):
    """Tagged py3-none-linux_x86_64 (the libraries use no Python ABI), the variant built in prebuilt/, and
    where auditwheel is installed it accepts the wheel as manylinux (the libraries need only glibc)."""
    _, _, wheel = archives
    assert wheel.name.endswith("-py3-none-linux_x86_64.whl")
    with zipfile.ZipFile(wheel) as whl:
        prebuilt = {n for n in whl.namelist() if n.startswith(f"jaxsmol/kernels/{variants.PREBUILT}/")}
    assert prebuilt == {f"jaxsmol/kernels/{variants.PREBUILT}/{BEST.library if BEST else 'cpu_kernels-avx2.so'}"}
    if importlib.util.find_spec("auditwheel") is not None:  # the test extra brings it
        shown = run([sys.executable, "-m", "auditwheel", "show", wheel])
        assert "is consistent with the following platform tag" in " ".join(shown.stdout.split())
        assert "manylinux_2_" in shown.stdout


def test_the_build_backend_needs_jaxlib_for_a_wheel_alone(archives):
    """jaxlib's FFI headers build a wheel's kernels; an editable install and an sdist compile nothing."""
    src = archives[0]
    code = ("import json, build_backend as b; print(json.dumps([b.get_requires_for_build_wheel(), "
            "b.get_requires_for_build_editable(), b.get_requires_for_build_sdist()]))")
    wheel, editable, sdist = json.loads(run([sys.executable, "-c", code], cwd=src,
                                            env={**os.environ, "PYTHONPATH": str(src)}).stdout.splitlines()[-1])
    assert [r for r in wheel if r.startswith("jaxlib")] == ["jaxlib>=0.4.35"]
    assert not any(r.startswith("jaxlib") for r in editable + sdist)


@pytest.fixture
def installed_wheel(archives, tmp_path) -> tuple[Path, Path]:
    """(the fresh environment's bin folder, its site-packages) with the wheel installed."""
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", archives[2]],
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    purelib = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    (purelib / "jaxsmol-test-dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return venv / "bin", purelib


# The kernels' state, then ids and log-probabilities of the tiny model in float32 and at q4_1 (the
# integer-dot kernel's class), in one process: a `jaxsmol generate` each took 3x as long (its compile ahead).
GENERATIONS = """
import dataclasses, json, sys
from jaxsmol.cache import generate
from jaxsmol.kernels import cpu_kernels
from jaxsmol.runtime.engine import Engine
from jaxsmol.runtime.sampling import SamplingParams
outputs = []
for quantize in (None, "q4_1"):
    g = generate(Engine.load(sys.argv[1], quantize=quantize, progress=False), [1, 2, 3],
                 SamplingParams(max_tokens=6, logprobs=3))
    outputs.append([g.output_ids, g.logprobs])
print(json.dumps([dataclasses.asdict(cpu_kernels.state()), outputs]))
"""


def generations(bin_dir: Path, tiny_model_dir: Path, env: dict) -> tuple[dict, list]:
    """(the installed jaxsmol's KernelState as a dict, GENERATIONS' outputs)."""
    done = run([bin_dir / "python", "-c", GENERATIONS, tiny_model_dir], cwd=bin_dir, env=env)
    assert "kernels" not in done.stderr
    return tuple(json.loads(done.stdout))


@pytest.mark.skipif(BEST is None, reason="this CPU runs none of the prebuilt variants")
def test_the_installed_wheel_runs_its_prebuilt_kernels_without_a_compiler(installed_wheel, tmp_path, tiny_model_dir):
    """No c++, g++ or cc on PATH and CXX a missing file: `jaxsmol info` says the kernels run, prebuilt, the
    best variant this CPU runs, and generation runs on them. Then, the wheel's prebuilt/ removed, the same
    install compiles them from its sources for this CPU (or finds them built in the tests' kernels
    directory): both give the same ids and log-probabilities, float32 and integer-dot alike."""
    bin_dir, purelib = installed_wheel
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    base.update(JAXSMOL_KERNELS="on", JAXSMOL_HOME=str(tmp_path / "home"), JAX_PLATFORMS="cpu")
    bare = {**base, "PATH": str(bin_dir), "CXX": str(tmp_path / "no-such-compiler"),
            "JAXSMOL_KERNELS_DIR": str(tmp_path / "kernels")}
    assert [c for c in ("c++", "g++", "cc", "gcc") if shutil.which(c, path=bare["PATH"])] == []
    info = json.loads(run([bin_dir / "jaxsmol", "info", "--load", "--json"], cwd=bin_dir, env=bare).stdout)
    assert Path(info["jaxsmol"]["path"]).is_relative_to(bin_dir.parent)  # the wheel's copy, not the checkout
    library = purelib / "jaxsmol" / "kernels" / variants.PREBUILT / BEST.library
    kernels = info["kernels"]
    assert (kernels["in_use"], kernels["loaded"], kernels["source"], kernels["isa"], kernels["library"]) == (
        True, True, "prebuilt", BEST.name, str(library))
    expected = json.loads(run([bin_dir / "jaxsmol", "info", "--json"], cwd=bin_dir, env=bare).stdout)["kernels"]
    assert expected == {**kernels, "loaded": False}  # read from files alone, the same choice
    done = run([bin_dir / "jaxsmol", "generate", "--model", tiny_model_dir, "--ids", 1, 2, 3, "--max-tokens", 4,
                "--json"], cwd=bin_dir, env=bare)
    assert json.loads(done.stdout)["output_ids"] and "kernels" not in done.stderr
    kernels, prebuilt = generations(bin_dir, tiny_model_dir, bare)
    assert kernels["source"] == "prebuilt" and not (tmp_path / "kernels").exists()  # nothing compiled
    shutil.rmtree(library.parent)
    kernels, compiled = generations(bin_dir, tiny_model_dir, base)
    assert kernels["in_use"] and kernels["source"] in ("compiled", "cache") and kernels["isa"] in ("avx2", "avx512")
    assert Path(kernels["library"]).parent == kernels_dir()  # the tests' (conftest.py)
    assert prebuilt == compiled
