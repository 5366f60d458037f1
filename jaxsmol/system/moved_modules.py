"""Module paths of the previous release, kept one more release: importing one warns and gives the
module at its new path (the very same module object, so its state is shared)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

REMOVED_IN = "0.3.0"


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A finder for the old names in `moved` ({old dotted name: new dotted name})."""

    def __init__(self, moved: dict[str, str]):
        self.moved = dict(moved)

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in self.moved else None

    def create_module(self, spec):
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module) -> None:
        new = self.moved[module.__name__]
        warnings.warn(f"{module.__name__} has moved to {new}; the old path goes in {REMOVED_IN}",
                      DeprecationWarning, stacklevel=2)
        # the import system returns whatever sys.modules holds under the old name once this returns
        sys.modules[module.__name__] = importlib.import_module(new)


def keep_old_paths(moved: dict[str, str]) -> None:
    """Let `import OLD` (and `from PKG import old`) find each moved module, once per process."""
    if not any(isinstance(f, MovedModules) and f.moved == moved for f in sys.meta_path):
        sys.meta_path.append(MovedModules(moved))
