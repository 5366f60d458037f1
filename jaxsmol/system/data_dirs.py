"""Where jaxsmol keeps files on disk: one data directory, and the folders under it.

`$JAXSMOL_HOME` (default `~/.cache/jaxsmol`) holds `models/` (the bundled model, imported once:
jaxsmol/checkpoint/default_model.py), `kernels/` (the compiled CPU kernels: jaxsmol/kernels/cpu_kernels.py) and
`xla-cache/` (compiled programs: jaxsmol/runtime/compile_cache.py, program_store.py). Nothing else decides paths.
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
    return data_home() / "kernels"


def xla_cache_dir() -> Path:
    """The default directory of compiled programs (compile_cache.py may be told another)."""
    return data_home() / "xla-cache"
