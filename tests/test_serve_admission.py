"""The daemon under pressure, end to end (cli/server/worker.py, cache/scheduler/scheduler.py): a client that leaves
frees the model, a full queue answers 503 with Retry-After, SIGTERM finishes the requests in flight.

Real `jaxsmol serve` daemons (on the two-layer checkpoint) shared with tests/test_serve.py (the `main_server`,
`queue_server` and `sigterm_server` fixtures in conftest).
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import threading
import time

import httpx
import pytest

from daemon import REQUEST_TIMEOUT_S
from daemon import assert_error_body as _assert_error_body
from daemon import assert_healthy as _assert_healthy
from daemon import complete as _complete
from daemon import metrics as _metrics
from daemon import post as _post

pytestmark = pytest.mark.real

_C = "/v1/completions"


# ---- a client that leaves -----------------------------------------------------------------------------
_LONG_STORY = "Once upon a time, in a land far away, there lived a dragon who"
# ~2000 tokens, never ended early: seconds even on the two-layer checkpoint (the abandoned job must still run)
_LONG = {"prompt": _LONG_STORY, "max_tokens": 2000, "ignore_eos": True, "temperature": 0}


def test_client_disconnect_mid_stream(main_server):
    before = _metrics(main_server)["jaxsmol_cancelled_total"]
    body = {**_LONG, "stream": True}
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as c:
        with c.stream("POST", main_server + _C, json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    assert json.loads(line[6:])["choices"][0]["finish_reason"] is None
                    break
    _assert_abandoned_job_cancelled(main_server, before)


def test_client_disconnect_before_a_non_streamed_answer(main_server):
    """A client that gives up on a non-streamed request (here: its read timeout) frees the model too."""
    before = _metrics(main_server)["jaxsmol_cancelled_total"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(main_server + _C, json=_LONG, timeout=httpx.Timeout(60, read=1))
    _assert_abandoned_job_cancelled(main_server, before)


def _assert_abandoned_job_cancelled(server: str, cancelled_before: float) -> None:
    # the server answers the next request and stops the abandoned generation long before its 2000 tokens
    after = _complete(server, "Hello", max_tokens=2)
    assert after.choices[0].finish_reason in ("length", "stop")
    deadline = time.monotonic() + 30
    while _metrics(server)["jaxsmol_cancelled_total"] <= cancelled_before:
        assert time.monotonic() < deadline, "the abandoned request's generation was never cancelled"
        time.sleep(0.25)
    _assert_healthy(server)


# ---- queue full ---------------------------------------------------------------------------------------
def test_queue_full_answers_503_with_retry_after(queue_server):
    n = 6
    barrier = threading.Barrier(n)

    def one(i):
        barrier.wait(timeout=60)
        return _post(queue_server, _C, {"prompt": f"Story number {i}: once upon a time", "max_tokens": 60,
                                        "temperature": 0}, timeout=300)

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(one, range(n)))
    statuses = [r.status_code for r in answers]
    assert set(statuses) <= {200, 503}, [r.text for r in answers]
    assert 200 in statuses and 503 in statuses, statuses
    for r in answers:
        if r.status_code == 503:
            _assert_error_body(r, 503)
            assert int(r.headers["retry-after"]) > 0
        else:
            assert r.json()["usage"]["completion_tokens"] > 0
    _assert_healthy(queue_server)
    assert _metrics(queue_server)["jaxsmol_rejected_total"] == statuses.count(503)
    assert _post(queue_server, _C, {"prompt": "hi", "max_tokens": 1}).status_code == 200


# ---- SIGTERM drains -----------------------------------------------------------------------------------
def test_sigterm_finishes_requests_in_flight(sigterm_server, main_server):
    url, proc = sigterm_server.url, sigterm_server.proc
    # the daemon has one decode row: the first request runs while the second waits for it
    bodies = [{"prompt": f"Chapter {i}. The old lighthouse keeper", "max_tokens": 120, "temperature": 0,
               "ignore_eos": True, "return_token_ids": True} for i in (1, 2)]
    results = [None, None]

    def one(i):
        try:
            results[i] = _post(url, _C, bodies[i], timeout=300)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    # both accepted: one decoding, one waiting (in the worker's queue or the scheduler's)
    deadline = time.monotonic() + 60
    while True:
        m = _metrics(url)
        if m["jaxsmol_batch_rows"] == 1 and m["jaxsmol_queue_depth"] + m["jaxsmol_batch_pending"] == 1:
            break
        assert time.monotonic() < deadline and all(r is None for r in results), (m, results)
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(300)
    try:
        rc = proc.wait(120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit within 120 s of SIGTERM:\n{sigterm_server.output()}")
    for body, r in zip(bodies, results):
        assert isinstance(r, httpx.Response), r
        assert r.status_code == 200, r.text
        ref = _post(main_server, _C, body).json()["choices"][0]  # the full answer, from the other server
        got = r.json()["choices"][0]
        assert (got["text"], got["token_ids"], got["finish_reason"]) == \
            (ref["text"], ref["token_ids"], ref["finish_reason"])
        assert r.json()["usage"]["completion_tokens"] == len(ref["token_ids"])
    assert rc == 0, f"exit status {rc}:\n{sigterm_server.output()}"
