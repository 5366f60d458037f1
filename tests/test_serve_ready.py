"""The daemon's readiness (cli/server/warmup.py, `jaxsmol serve --warmup`): /health and /ready answer 503
{"status": "warming"} while the programs compile in the background and 200 once they are; `none` is
ready at once; `block` opens its port only once ready; a failed warm-up still ends ready.
In process (Starlette's TestClient) with the batched compile held on an Event, so every state is
seen for certain; `block` as a real `jaxsmol serve` on the two-layer checkpoint."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from daemon import Server

STATE_TIMEOUT_S = 120


@pytest.fixture
def held_compile(monkeypatch):
    """Scheduler.compile_programs waits for the returned Event (or its stop), then compiles nothing;
    `.calls` lists its calls."""
    from jaxsmol.cache.scheduler.scheduler import Scheduler

    release, calls = threading.Event(), []

    def compile_programs(self, stop=None):
        calls.append(stop)
        while not release.wait(0.05) and not stop.is_set():  # a daemon shutting down stops it too
            pass
        return 0

    monkeypatch.setattr(Scheduler, "compile_programs", compile_programs)
    release.calls = calls
    return release


def _app(engine, warmup: str):
    from fastapi.testclient import TestClient

    from jaxsmol.cli.server.serve import create_app

    return TestClient(create_app(engine, model_name="tiny", warmup=warmup))


def _wait_for(client, path: str, status: int):
    deadline = time.monotonic() + STATE_TIMEOUT_S
    while (r := client.get(path)).status_code != status:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.05)
    return r


def test_background_warmup_answers_503_warming_until_compiled(tiny_engine, held_compile):
    with _app(tiny_engine, "background") as c:
        _wait_for(c, "/health", 503)  # the single-sequence programs, then the held batched ones
        assert not c.get("/health").json()["ready"]
        deadline = time.monotonic() + STATE_TIMEOUT_S
        while not held_compile.calls:  # the batched compile is held: it cannot be ready now
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for path in ("/health", "/ready"):
            r = c.get(path)
            assert r.status_code == 503, r.text
            assert r.json()["status"] == "warming" and r.json()["ready"] is False
            assert r.json()["warmup"] == "background"
        assert c.get("/v1/models").status_code == 200  # the daemon is alive and serves meanwhile
        held_compile.set()
        r = _wait_for(c, "/health", 200)
        assert r.json()["status"] == "ok" and r.json()["ready"] is True and r.json()["compiling"] is False
        r = c.get("/ready")
        assert r.status_code == 200 and r.json()["status"] == "ok"


def test_no_warmup_is_ready_at_once_and_compiles_nothing_ahead(tiny_engine, held_compile):
    with _app(tiny_engine, "none") as c:
        for path in ("/health", "/ready"):
            r = c.get(path)
            assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["warmup"] == "none", r.text
    assert held_compile.calls == []


def test_a_failed_warmup_still_ends_ready(tiny_engine, monkeypatch):
    """Only the head start is lost: the programs then compile on first use."""
    from jaxsmol.cache.scheduler.scheduler import Scheduler

    def fails(self, stop=None):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(Scheduler, "compile_programs", fails)
    with _app(tiny_engine, "background") as c:
        assert _wait_for(c, "/health", 200).json()["status"] == "ok"


def test_block_warmup_opens_the_port_only_once_ready(tiny_model_dir):
    """Every answer the daemon ever gives to /health is 200: it listens only after its warm-up."""
    server = Server("--model", str(tiny_model_dir), "--warmup", "block", compile_ahead=True)
    try:
        deadline = time.monotonic() + server.start_timeout
        while True:
            assert server.proc.poll() is None and time.monotonic() < deadline, server.output()
            try:
                first = httpx.get(server.url + "/health", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        assert first.status_code == 200 and first.json()["status"] == "ok", first.text
        assert first.json()["warmup"] == "block"
        log = server.output(None)
        compiled = re.search(r"programs ready ahead: (\d+) in", log)
        assert compiled and int(compiled.group(1)) > 0, log
        assert compiled.start() < log.index("jaxsmol serving"), log
    finally:
        server.stop()
