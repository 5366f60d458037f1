"""Helpers for tests that run real `jaxsmol serve` daemons (tests/test_serve*.py, test_openai_api.py,
test_disk_tier.py, test_soak.py): a daemon subprocess on a free loopback port, named daemons shared by
test files (`Daemons`, the `serve_daemons` fixture in conftest), requests, /metrics, checks."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parents[1]
CTX = 2048
START_TIMEOUT_S = 180  # two servers start at once on a small, shared machine
WARMUP_TIMEOUT_S = 600  # and one compiles its programs before it is ready (cold, on 2 busy cores: minutes)
REQUEST_TIMEOUT_S = 120


# ---- servers ------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `jaxsmol serve` subprocess on a free loopback port; its stdout+stderr go to a temporary file."""

    def __init__(self, *extra: str, compile_ahead: bool = False, ctx: int | None = CTX):
        """compile_ahead: the daemon's default (--warmup background), compiling its programs in the
        background at start, ready once they are; off (--warmup none, ready at once) in the tests'
        daemons but the "main" one (tests/test_serve.py checks it), since those compiles only compete
        with each test's own requests for the two cores. ctx: --ctx (None: the model's own)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        self.cmd = [sys.executable, "-m", "jaxsmol.cli.main", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                    *(["--ctx", str(ctx)] if ctx else []), *extra] + ([] if compile_ahead else ["--no-compile-ahead"])
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.ready = False
        self.start_timeout = START_TIMEOUT_S + (WARMUP_TIMEOUT_S if compile_ahead else 0)

    def output(self, tail: int | None = 6000) -> str:
        self.log.flush()
        self.log.seek(0)
        text = self.log.read().decode(errors="replace")
        return text if tail is None else text[-tail:]

    def wait_ready(self, timeout: float | None = None) -> Server:
        """Until /health answers 200: the daemon listens and has warmed up (503 "warming" until then)."""
        timeout = self.start_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not self.ready:
            rc = self.proc.poll()
            if rc is not None:
                pytest.fail(f"server {self.cmd} exited with {rc} before it was ready:\n{self.output()}")
            try:
                self.ready = httpx.get(self.url + "/health", timeout=5).status_code == 200
            except httpx.TransportError:
                pass
            if not self.ready:
                if time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"server {self.cmd} not ready after {timeout} s:\n{self.output()}")
                time.sleep(0.25)
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if not self.log.closed:
            self.log.close()


class Daemons:
    """The named daemons of tests/test_serve*.py, started on first use (without waiting for them) and
    shared by those files; `stop_all` ends them (conftest does when the run moves on to other tests)."""

    CONFIGS = {"main": (), "nocache": ("--no-prefix-cache",), "queue1": ("--max-queue", "1", "--max-batch", "1"),
               "sigterm": ("--max-batch", "1")}

    def __init__(self, model: Path):
        self.model = model  # the two-layer checkpoint (conftest's tiny_model_dir): see conftest.serve_daemons
        self.servers: dict[str, Server] = {}

    def launch(self, *names: str) -> dict[str, Server]:
        """Starts the named servers not launched yet (one that was stopped by its test stays stopped)."""
        for name in names:
            if name not in self.servers:
                self.servers[name] = Server("--model", str(self.model), *self.CONFIGS[name],
                                            compile_ahead=name == "main")
        return self.servers

    def stop_all(self) -> None:
        for s in self.servers.values():
            s.stop()
        self.servers.clear()


def client(url: str, key: str = "x") -> openai.OpenAI:
    # max_retries=0: the client must not hide a 503 (or anything else) behind a retry
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=REQUEST_TIMEOUT_S)


def complete(url: str, prompt, *, salt: str | None = None, max_tokens: int = 4, **extra):
    """A greedy completion through the openai client, asking for the token ids; `salt`: its cache_salt."""
    body = {"return_token_ids": True, **extra}
    if salt is not None:
        body["cache_salt"] = salt
    return client(url).completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          extra_body=body)


def post(url: str, path: str, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=timeout)


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$')


def metrics(url: str) -> dict[str, float]:
    """Prometheus text -> {name{labels}: value}; fails on a line that is not a valid sample or comment."""
    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for line in r.text.splitlines():
        if not line or line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        out[m[1] + (m[2] or "")] = float(m[3])
    return out


def assert_healthy(url: str) -> None:
    r = httpx.get(url + "/health", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text


def assert_error_body(r: httpx.Response, status: int) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err.get("type"), str), err
