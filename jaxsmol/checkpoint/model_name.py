"""The name a model is shown and served under (`/v1/models`, responses' `model`, `/health`, the bench
report): what the user knows it by, never the directory a GGUF file was imported into
(`models_dir()/STEM-KEY[.lean]`, gguf_weights.imported_dir) nor the bundled model's import
(`SmolLM2-135M-Instruct[.lean]`)."""

from __future__ import annotations

from pathlib import Path

from jaxsmol.checkpoint import default_model
from jaxsmol.errors import JaxsmolError

UNNAMED = "jaxsmol"  # an engine built from weights in memory, with no file behind it


def model_name(source: str | Path | None) -> str:
    """SmolLM2-135M-Instruct for the bundled model (its GGUF file or either of its imports), a GGUF
    file's stem, a checkpoint directory's name; UNNAMED for None."""
    if source is None:
        return UNNAMED
    path = Path(source).resolve()
    if path in _bundled_paths():
        return default_model.DEFAULT_MODEL_NAME
    return path.stem if path.is_file() else path.name


def _bundled_paths() -> set[Path]:
    """The bundled model's GGUF file (where installed) and the directories it is imported into."""
    full = default_model.default_model_path()
    paths = {full.resolve(), full.with_name(f"{default_model.DEFAULT_MODEL_NAME}.lean").resolve()}
    try:
        paths.add(default_model.bundled_gguf_path().resolve())
    except JaxsmolError:  # not installed: no file of it to recognize
        pass
    return paths
