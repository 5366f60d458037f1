"""Where jaxsmol keeps files on disk: one data directory, and the folders under it.

`$JAXSMOL_HOME` (default `~/.cache/jaxsmol`) holds `models/` (the bundled model, imported once:
jaxsmol/checkpoint/default_model.py), `xla-cache/` (compiled programs: jaxsmol/runtime/compile_cache.py,
program_store.py) and `kernels/` (the CPU kernels compiled for this CPU where the install holds no prebuilt
library that runs here: jaxsmol/kernels/cpu_kernels.py; `$JAXSMOL_KERNELS_DIR` puts them elsewhere, as the
tests do to compile them once for all the homes they make). Nothing else decides paths.
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
    """Where the CPU kernels compiled on first use are kept: $JAXSMOL_KERNELS_DIR, else the data
    directory's kernels/."""
    setting = os.environ.get("JAXSMOL_KERNELS_DIR")
    return Path(setting).expanduser() if setting else data_home() / "kernels"


def xla_cache_dir() -> Path:
    """The default directory of compiled programs (compile_cache.py may be told another)."""
    return data_home() / "xla-cache"
