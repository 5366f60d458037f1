"""The daemon's app in-process (Starlette's TestClient) on the tiny random config with the real tokenizer:
library errors for bad input (no chat template, a template that raises) are 400s on every route, never
500s; the app, worker and event contract work end to end without a model download or a subprocess."""

from __future__ import annotations

import json
import shutil

import pytest

pytestmark = pytest.mark.real  # the real tokenizer (from the bundled model), tiny random weights


@pytest.fixture(scope="module")
def make_client(tiny_cfg, model_dir, tmp_path_factory):
    """make_client(chat_template) -> a TestClient of create_app over a tiny engine whose tokenizer is the
    real one with this chat template (None: the tokenizer has none)."""
    from fastapi.testclient import TestClient

    from jaxsmol.cli.server.serve import create_app
    from jaxsmol.runtime.engine import Engine
    from jaxsmol.model.params import init_random
    from jaxsmol.checkpoint.tokenizer import Tokenizer

    params = init_random(tiny_cfg)
    clients = []

    def make(chat_template):
        d = tmp_path_factory.mktemp("tok")
        shutil.copy(model_dir / "tokenizer.json", d / "tokenizer.json")
        config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        config.pop("chat_template", None)
        if chat_template is not None:
            config["chat_template"] = chat_template
        (d / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
        engine = Engine(tiny_cfg, params, Tokenizer.load(d), ctx=512)
        client = TestClient(create_app(engine, model_name="tiny"))
        client.__enter__()  # runs the lifespan: the worker thread starts
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.__exit__(None, None, None)


def _error(r, status=400) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"]
    return err["message"]


def test_missing_chat_template_is_400(make_client):
    c = make_client(None)
    msgs = [{"role": "user", "content": "hi"}]
    assert "chat template" in _error(c.post("/v1/chat/completions", json={"messages": msgs}))
    assert "chat template" in _error(c.post("/tokenize", json={"messages": msgs}))
    # the rest of the API still works: token ids below the tiny vocabulary
    r = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "n": 2,
                                        "logprobs": 2, "echo": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1]
    assert body["choices"][0]["token_ids"] == body["choices"][1]["token_ids"]
    lp = body["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == 3 + len(body["choices"][0]["token_ids"])
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_template_raise_exception_is_400(make_client):
    c = make_client("{{ raise_exception('only one message, please') }}")
    msg = _error(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}))
    assert "only one message, please" in msg


def test_streamed_events_in_process(make_client):
    c = make_client(None)
    with c.stream("POST", "/v1/completions", json={"prompt": [9, 8, 7], "max_tokens": 4, "temperature": 0,
                                                   "stream": True, "stream_options": {"include_usage": True}}) as r:
        lines = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert r.status_code == 200
    assert lines[-1]["usage"]["prompt_tokens"] == 3 and lines[-1]["choices"] == []
    assert lines[-2]["choices"][0]["finish_reason"] in ("length", "stop")
