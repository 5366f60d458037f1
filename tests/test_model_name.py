"""The name a model is served under (jaxsmol/checkpoint/model_name.py): the bundled model's name
whichever of its files or imports runs, a GGUF file's stem (never the directory it is imported into),
a checkpoint directory's name; the daemon's /v1/models, /health and responses use it, and
--served-model-name overrides it. Tiny synthetic GGUF files (tests/gguf_writer.py)."""

from __future__ import annotations

import argparse

import pytest

from jaxsmol.checkpoint import default_model
from jaxsmol.checkpoint.model_name import UNNAMED, model_name


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """A data directory of the test's own (the imports land there), the CPU kernels built once kept."""
    from jaxsmol.system.data_dirs import kernels_dir

    monkeypatch.setenv("JAXSMOL_KERNELS_DIR", str(kernels_dir()))
    monkeypatch.setenv("JAXSMOL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_the_bundled_model_is_named_as_itself_whichever_form_runs(tiny_gguf, monkeypatch):
    monkeypatch.setattr(default_model, "bundled_gguf_path", lambda: tiny_gguf[0])
    full = default_model.default_model_path()
    lean = full.with_name(full.name + ".lean")
    for d in (full, lean):
        d.mkdir(parents=True)
    for source in (tiny_gguf[0], full, lean):
        assert model_name(source) == "SmolLM2-135M-Instruct", source


def test_a_file_is_named_by_its_stem_a_directory_by_its_name(tmp_path):
    f = tmp_path / "my-model.Q8_0.gguf"
    f.write_bytes(b"")
    d = tmp_path / "checkpoints" / "SmolLM-360M"
    d.mkdir(parents=True)
    assert model_name(f) == "my-model.Q8_0" and model_name(d) == "SmolLM-360M" and model_name(None) == UNNAMED


def test_the_daemon_serves_a_gguf_file_under_its_stem(tmp_path):
    """The file is imported into models/STEM-KEY.lean; the daemon says STEM everywhere a name shows
    (responses' `model` is the same attribute: tests/test_serve.py)."""
    from fastapi.testclient import TestClient

    from gguf_writer import write_tiny_gguf
    from jaxsmol import Engine
    from jaxsmol.cli.server.serve import create_app

    path = tmp_path / "tiny-chat.gguf"
    write_tiny_gguf(path, matrix_type="Q8_0", vocab=320)
    engine = Engine.load(path, ctx=64, progress=False)
    assert engine.model_dir.name.startswith("tiny-chat-") and engine.name == "tiny-chat"
    with TestClient(create_app(engine, access_log=False)) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny-chat"]
        assert client.get("/health").json()["model"] == client.get("/ready").json()["model"] == "tiny-chat"
        assert client.get("/server_info").json()["served_model_name"] == "tiny-chat"
    with TestClient(create_app(engine, model_name="chat", access_log=False)) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "chat"


def test_served_model_name_is_the_daemons_model_name():
    from jaxsmol.cli.serve_options import add_serve_options, daemon_options
    from jaxsmol.errors import JaxsmolError

    parser = argparse.ArgumentParser()
    add_serve_options(parser)
    assert daemon_options(parser.parse_args([])) == {"read_timeout_s": 30.0, "model_name": None, "access_log": True}
    args = parser.parse_args(["--served-model-name", "chat", "--read-timeout", "5", "--no-access-log"])
    assert daemon_options(args) == {"read_timeout_s": 5.0, "model_name": "chat", "access_log": False}
    with pytest.raises(JaxsmolError, match="--read-timeout must be > 0"):
        daemon_options(parser.parse_args(["--read-timeout", "0"]))
