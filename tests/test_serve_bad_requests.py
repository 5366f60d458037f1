"""Bad requests to a real `jaxsmol serve` daemon: each answers its status (400, 404, 405, 413) with an
OpenAI error object, and the daemon stays healthy; then the edge values that are valid. The daemon is
shared with tests/test_serve.py (the "main" one: the `main_server` fixture in conftest).
"""

from __future__ import annotations

import httpx
import pytest

from daemon import CTX
from daemon import assert_error_body as _assert_error_body
from daemon import assert_healthy as _assert_healthy
from daemon import post as _post

pytestmark = pytest.mark.real


# ---- bad requests -------------------------------------------------------------------------------------
_C, _CHAT = "/v1/completions", "/v1/chat/completions"
_OK_MSG = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    # (id, method, path, body: bytes | JSON-able | None, status)
    ("malformed-json", "POST", _C, b'{"prompt": "hi",', 400),
    ("body-is-a-list", "POST", _C, b"[1, 2, 3]", 400),
    ("body-is-a-string", "POST", _C, b'"hi"', 400),
    ("body-is-null", "POST", _C, b"null", 400),
    ("empty-body", "POST", _C, b"", 400),
    ("missing-prompt", "POST", _C, {"max_tokens": 1}, 400),
    ("prompt-is-a-number", "POST", _C, {"prompt": 5}, 400),
    ("prompt-is-an-object", "POST", _C, {"prompt": {"text": "hi"}}, 400),
    ("prompt-list-of-strings-and-ids", "POST", _C, {"prompt": ["a", 1]}, 400),
    ("prompt-empty-in-a-list", "POST", _C, {"prompt": ["a", ""]}, 400),
    ("lone-surrogate", "POST", _C, b'{"prompt": "hi \\ud800", "max_tokens": 1}', 400),
    ("chat-lone-surrogate", "POST", _CHAT, b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400),
    ("chat-image-part", "POST", _CHAT,
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
    ("too-many-stops", "POST", _C, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400),
    ("work-over-cap", "POST", _C, {"prompt": ["a", "b"], "n": 8, "max_tokens": 1100}, 400),
    ("token-id-too-large", "POST", _C, {"prompt": [1, 10**6]}, 400),
    ("token-id-huge", "POST", _C, {"prompt": [10**30]}, 400),
    ("token-id-negative", "POST", _C, {"prompt": [1, -1]}, 400),
    ("empty-string-prompt", "POST", _C, {"prompt": ""}, 400),
    ("empty-id-prompt", "POST", _C, {"prompt": []}, 400),
    ("prompt-over-context", "POST", _C, {"prompt": [1] * 3000, "max_tokens": 1}, 400),
    ("prompt-plus-max-tokens-over-context", "POST", _C, {"prompt": [1] * 100, "max_tokens": CTX}, 400),
    ("negative-max-tokens", "POST", _C, {"prompt": "hi", "max_tokens": -1}, 400),
    ("huge-max-tokens", "POST", _C, {"prompt": "hi", "max_tokens": 10**9}, 400),
    ("max-tokens-a-string", "POST", _C, {"prompt": "hi", "max_tokens": "ten"}, 400),
    ("n-zero", "POST", _C, {"prompt": "hi", "n": 0}, 400),
    ("n-100", "POST", _C, {"prompt": "hi", "n": 100}, 400),
    ("negative-temperature", "POST", _C, {"prompt": "hi", "temperature": -1}, 400),
    ("top-p-zero", "POST", _C, {"prompt": "hi", "top_p": 0}, 400),
    ("top-p-over-one", "POST", _C, {"prompt": "hi", "top_p": 1.5}, 400),
    ("negative-top-k", "POST", _C, {"prompt": "hi", "top_k": -1}, 400),
    ("huge-top-k", "POST", _C, {"prompt": "hi", "top_k": 10**12, "max_tokens": 1}, 400),
    ("negative-seed", "POST", _C, {"prompt": "hi", "seed": -1}, 400),
    ("logprobs-over-5", "POST", _C, {"prompt": "hi", "logprobs": 6}, 400),
    ("stop-wrong-type", "POST", _C, {"prompt": "hi", "stop": 5}, 400),
    ("bad-request-while-streaming", "POST", _C, {"prompt": [10**6], "stream": True}, 400),
    ("chat-missing-messages", "POST", _CHAT, {"max_tokens": 1}, 400),
    ("chat-empty-messages", "POST", _CHAT, {"messages": []}, 400),
    ("chat-bad-role", "POST", _CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("chat-content-not-a-string", "POST", _CHAT, {"messages": [{"role": "user", "content": 5}]}, 400),
    ("chat-message-not-an-object", "POST", _CHAT, {"messages": ["hi"]}, 400),
    ("chat-top-logprobs-over-20", "POST", _CHAT, {"messages": _OK_MSG, "logprobs": True, "top_logprobs": 21}, 400),
    ("chat-over-context", "POST", _CHAT,
     {"messages": [{"role": "user", "content": "word " * 2100}], "max_tokens": 1}, 400),
    ("chat-negative-max-completion-tokens", "POST", _CHAT, {"messages": _OK_MSG, "max_completion_tokens": -1}, 400),
    ("body-over-size-limit", "POST", _C, b'{"prompt": "' + b"a" * (5 << 20) + b'"}', 413),
    ("unknown-route", "POST", "/v1/nothing-here", {"prompt": "hi"}, 404),
    ("unknown-get-route", "GET", "/nope", None, 404),
    ("get-on-completions", "GET", _C, None, 405),
    ("post-on-models", "POST", "/v1/models", {}, 405),
]


@pytest.mark.parametrize("method,path,body,status", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request(main_server, method, path, body, status):
    kw = {}
    if isinstance(body, bytes):
        kw = {"content": body, "headers": {"content-type": "application/json"}}
    elif body is not None:
        kw = {"json": body}
    r = httpx.request(method, main_server + path, timeout=60, **kw)
    _assert_error_body(r, status)
    _assert_healthy(main_server)


def test_body_over_size_limit_without_content_length(main_server):
    """A chunked body carries no Content-Length: the limit must hold for it too."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(5):
            yield b"a " * (512 << 10)
        yield b'", "max_tokens": 1}'
    r = httpx.post(main_server + _C, content=chunks(), headers={"content-type": "application/json"}, timeout=120)
    _assert_error_body(r, 413)
    _assert_healthy(main_server)


def test_edge_values_that_are_valid(main_server):
    # the largest seed is valid, also for n > 1 (choice i samples with seed + i)
    r = _post(main_server, _C, {"prompt": "hi", "max_tokens": 2, "n": 2, "seed": 2**63 - 1, "temperature": 1.0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    # max_tokens 0: no tokens, no error
    r = _post(main_server, _C, {"prompt": "hi", "max_tokens": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "" and r.json()["usage"]["completion_tokens"] == 0
