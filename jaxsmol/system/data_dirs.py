"""Where jaxsmol keeps files on disk: one data directory, and the folders under it.

`$JAXSMOL_HOME` (default `~/.cache/jaxsmol`) holds `models/` (the bundled model, imported once:
jaxsmol/checkpoint/default_model.py) and `xla-cache/` (compiled programs: jaxsmol/runtime/compile_cache.py,
program_store.py). The compiled CPU kernels (jaxsmol/kernels/cpu_kernels.py) are a build of the installed
sources for this CPU, not data: they are kept per user, in `$JAXSMOL_KERNELS_DIR`, else
`~/.cache/jaxsmol/kernels`, whatever the home (as PyTorch keeps its C++ extensions in
`~/.cache/torch_extensions`), so a new home (a replica's, a test's) does not build them again (13 s
on 2 cores). Nothing else decides paths.
"""

from __future__ import annotations

import os
from pathlib import Path


def data_home() -> Path:
    """Where jaxsmol keeps its files: $JAXSMOL_HOME, else ~/.cache/jaxsmol."""
    return Path(os.environ.get("JAXSMOL_HOME") or Path.home() / ".cache" / "jaxsmol").expanduser()


def models_dir() -> Path:
    return data_home() / "models"


def kernels_dir() -> Path:
    """Where the compiled CPU kernels are kept: $JAXSMOL_KERNELS_DIR, else ~/.cache/jaxsmol/kernels
    (created here), else, where that cannot be created, the data directory's kernels/."""
    setting = os.environ.get("JAXSMOL_KERNELS_DIR")
    if setting:
        return Path(setting).expanduser()
    per_user = Path.home() / ".cache" / "jaxsmol" / "kernels"
    try:
        per_user.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home directory
        return data_home() / "kernels"
    return per_user


def xla_cache_dir() -> Path:
    """The default directory of compiled programs (compile_cache.py may be told another)."""
    return data_home() / "xla-cache"
