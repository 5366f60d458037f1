"""jaxsmol as pip installs it: the
sdist, and the wheel built from it, hold every module and kernel source of the checkout; that wheel,
installed (not editable) into a fresh virtual environment, compiles the kernels and generates on them.

Built offline (`--no-build-isolation`, `--no-index`: the test extra brings setuptools >= 70.1) from a
copy of the checkout, so a stale build/ folder cannot leak into the archives. The fresh environment
gets the dependencies (jax, ...) by a .pth line naming this environment's site-packages; that line
does not run the .pth files there, so an editable install of the checkout stays out of it.
"""

from __future__ import annotations

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

from jaxsmol.kernels import cpu_kernels

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxsmol", "cache", "cli")  # the repository's folders; installed as jaxsmol, jaxsmol.cache, jaxsmol.cli
KERNEL_FILES = (*cpu_kernels.SOURCES, *cpu_kernels.HEADERS)


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


def run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, f"{cmd[:4]} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done


@pytest.fixture(scope="module")
def archives(tmp_path_factory) -> tuple[Path, Path]:
    """(sdist, wheel): the sdist built from a copy of the checkout, the wheel built from the sdist."""
    tmp = tmp_path_factory.mktemp("packaging")
    src, dist = tmp / "src", tmp / "dist"
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    run([sys.executable, "-c", "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])",
         dist], cwd=src)
    (sdist,) = dist.glob("jaxsmol-*.tar.gz")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist, sdist],
        cwd=tmp, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    (wheel,) = dist.glob("jaxsmol-*.whl")
    return sdist, wheel


def test_the_sdist_and_the_wheel_hold_every_module_and_kernel_source(archives):
    sdist, wheel = archives
    with tarfile.open(sdist) as tar:
        in_sdist = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    with zipfile.ZipFile(wheel) as whl:
        in_wheel = set(whl.namelist())
    expected = checkout_files()
    assert {f"jaxsmol/kernels/{f.name}" for f in KERNEL_FILES} <= expected
    assert expected - in_sdist == set() and {"pyproject.toml", "README.md"} <= in_sdist
    assert {installed(f) for f in expected} - in_wheel == set()
    assert {name.split("/")[0] for name in in_wheel if not name.startswith("jaxsmol-")} == {"jaxsmol"}


def test_the_installed_wheel_compiles_and_uses_the_kernels(archives, tmp_path, tiny_model_dir):
    """`jaxsmol info --json` from the installed wheel with JAXSMOL_KERNELS=on: the kernels compiled
    from the installed sources and in use; then a generation on them, without the kernels' warning."""
    _, wheel = archives
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel],
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    purelib = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    (purelib / "jaxsmol-test-dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(JAXSMOL_KERNELS="on", JAXSMOL_HOME=str(tmp_path / "home"), JAX_PLATFORMS="cpu",
               JAXSMOL_KERNELS_DIR=str(tmp_path / "home" / "kernels"))  # a fresh build, not the user's
    info = json.loads(run([venv / "bin" / "jaxsmol", "info", "--json"], cwd=tmp_path, env=env).stdout)
    assert Path(info["jaxsmol"]["path"]) == purelib / "jaxsmol"  # the wheel's copy, not the checkout
    kernels = info["kernels"]
    assert kernels["in_use"] and kernels["source"] == "compiled" and kernels["isa"] in ("avx2", "avx512")
    assert Path(kernels["library"]).parent == tmp_path / "home" / "kernels"
    done = run([venv / "bin" / "jaxsmol", "generate", "--model", tiny_model_dir, "--ids", 1, 2, 3, "--max-tokens", 4,
                "--json"], cwd=tmp_path, env=env)
    assert json.loads(done.stdout)["output_ids"] and "kernels" not in done.stderr
