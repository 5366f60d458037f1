"""The daemon's HTTP edge, on uvicorn as `jaxsmol serve` runs it (cli/server/serve.py uvicorn_options) in a
thread of the test, over the tiny random engine (token ids, no tokenizer):

* a request whose headers or body do not arrive within the read timeout is answered 408 and its
  connection closed, counted in /metrics (cli/server/limits.py);
* one access-log line per request, with its tokens, times and tenant, and none of uvicorn's
  (cli/server/access_log.py); the probes are left out, and `access_log=False` prints none.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time

import httpx
import pytest

from daemon import free_port
from jaxsmol.cli.server.tenants import Tenants, parse_keys_file

READ_TIMEOUT_S = 0.5
COMPLETION = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def url(tiny_engine):
    """A daemon with a half-second read timeout and API keys (sk-a: tenant team-a)."""
    import uvicorn

    from jaxsmol.cli.server.serve import create_app, uvicorn_options

    app = create_app(tiny_engine, model_name="tiny", read_timeout_s=READ_TIMEOUT_S,
                     tenants=Tenants(parse_keys_file("sk-a team-a admin\n")))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, **uvicorn_options(app, "127.0.0.1", port,
                                                                  read_timeout_s=READ_TIMEOUT_S)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the daemon did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)


AUTH = {"authorization": "Bearer sk-a"}


def _timeouts(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers=AUTH).text
    return {m[1]: float(m[2]) for m in re.finditer(r'^jaxsmol_read_timeouts_total\{phase="(\w+)"\} (\S+)$', text, re.M)}


def _send_and_read(url: str, data: bytes) -> tuple[bytes, float]:
    """Send `data` on a new connection and read until the server closes it: (what came back, seconds)."""
    port = int(url.rsplit(":", 1)[1])
    t0 = time.monotonic()  # before the server's timer starts: when it accepts the connection
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out, time.monotonic() - t0


@pytest.mark.parametrize("phase,data", [
    ("headers", b""),  # a connection that sends nothing
    ("headers", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le"),  # headers never finished
    ("body", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: 100\r\n\r\n{\"prompt\": [5,"),  # a body that stops coming
], ids=["nothing sent", "half the headers", "half the body"])
def test_a_half_sent_request_is_answered_408_and_closed(url, phase, data):
    before = _timeouts(url)
    out, seconds = _send_and_read(url, data)
    assert out.startswith(b"HTTP/1.1 408 "), out
    assert b"connection: close" in out.lower() and b"--read-timeout" in out, out
    # the event loop runs a timer's callback up to a selector wake-up early (seen: 47 us): 10 ms of slack
    assert READ_TIMEOUT_S - 0.01 <= seconds < READ_TIMEOUT_S + 5
    after = _timeouts(url)
    assert after[phase] == before.get(phase, 0) + 1 and set(after) == {"headers", "body"}
    r = httpx.post(url + "/v1/completions", json=COMPLETION, headers=AUTH, timeout=60)  # the daemon goes on
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_a_slow_client_within_the_timeout_is_served(url):
    """Headers in two parts, each within the timeout: served as usual."""
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        time.sleep(READ_TIMEOUT_S / 3)
        s.sendall(b"Authorization: Bearer sk-a\r\nConnection: close\r\n\r\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    assert out.startswith(b"HTTP/1.1 200 ") and b'"tiny"' in out, out


def test_one_access_log_line_per_request(url, caplog):
    with caplog.at_level(logging.INFO):
        httpx.get(url + "/health")  # a probe: not logged
        r = httpx.post(url + "/v1/completions", json=COMPLETION, headers=AUTH, timeout=60)
        with httpx.stream("POST", url + "/v1/completions", json={**COMPLETION, "stream": True}, headers=AUTH,
                          timeout=60) as s:
            s.read()
        httpx.get(url + "/v1/models")  # no key: 401
        httpx.get(url + "/x%0AINFO%20forged")  # a path that would print a line of its own, decoded
        time.sleep(0.2)  # the server thread logs after the last byte is sent
    assert r.status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "jaxsmol.access"]
    assert not [rec for rec in caplog.records if rec.name.startswith("uvicorn.access")]
    assert len(lines) == 4, lines
    generation = (r'127\.0\.0\.1:\d+ "POST /v1/completions" 200 prompt=3 cached=\d generated=3 '
                  r'ttft=\d+\.\d{3}s total=\d+\.\d{3}s tenant=team-a')
    assert re.fullmatch(generation, lines[0]) and re.fullmatch(generation, lines[1]), lines
    assert re.fullmatch(r'127\.0\.0\.1:\d+ "GET /v1/models" 401 total=\d+\.\d{3}s', lines[2]), lines
    assert re.fullmatch(r'127\.0\.0\.1:\d+ "GET /x%0AINFO%20forged" 404 total=\d+\.\d{3}s', lines[3]), lines
    ttft, total = (float(x) for x in re.findall(r"=(\d+\.\d+)s", lines[0]))
    assert 0 < ttft <= total


def test_no_access_log_prints_none(tiny_engine, caplog):
    from fastapi.testclient import TestClient

    from jaxsmol.cli.server.serve import create_app

    with caplog.at_level(logging.INFO), TestClient(create_app(tiny_engine, access_log=False)) as client:
        assert client.get("/v1/models").status_code == 200
    assert not [rec for rec in caplog.records if rec.name == "jaxsmol.access"]


def test_the_command_line_options_reach_the_daemon(tiny_model_dir):
    """`jaxsmol serve --served-model-name --read-timeout --no-access-log` as typed: the name served, the
    timeout applied to a half-sent request, no access line in the daemon's output."""
    from daemon import Server

    server = Server("--model", str(tiny_model_dir), "--served-model-name", "my-model", "--read-timeout", "1",
                    "--no-access-log", ctx=None).wait_ready()
    try:
        assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "my-model"
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the headers never end
            assert s.recv(4096).startswith(b"HTTP/1.1 408")
        assert "GET /v1/models" not in server.output()
    finally:
        server.stop()
