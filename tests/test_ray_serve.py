"""jaxsmol replicas as a Ray Serve application behind PrefixCacheAffinityRouter (cli/ray_serve.py), on a
local Ray instance with the two-layer checkpoint: a tenant's repeated prefix reaches the replica that
has it (every repeat finds its prefix cached, whichever replica took the first), each API key's prompts
stay in its namespace, chat streams through, a bad body gets the daemon's own 400.

Marked `ray`: it needs `pip install -e '.[ray]'` and a Ray start (tens of seconds), so the default run
deselects it (pyproject.toml) and CI runs it in a step of its own (.ci/run: pytest -m ray)."""

from __future__ import annotations

import json

import httpx
import pytest

from daemon import free_port

pytestmark = pytest.mark.ray

KEYS = "sk-alice\nsk-bob\n"
TENANTS = ["Shipping help desk: questions about parcels, delivery windows and refunds get short answers. ",
           "Garden shop assistant: advice on soil, watering schedules and which plants suit shade. ",
           "Library helper: loans, renewals, reading rooms and the opening hours, explained briefly. ",
           "Bicycle repairs bot: brakes, gears, tyre pressure and the price of a service. "]


@pytest.fixture(scope="module")
def url(tiny_model_dir, tmp_path_factory):
    import ray
    from ray import serve

    from jaxsmol.cli.ray_serve import build_app

    keys = tmp_path_factory.mktemp("ray-keys") / "keys.txt"
    keys.write_text(KEYS)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = ["--model", str(tiny_model_dir), "--ctx", "2048", "--warmup", "none", "--api-keys", str(keys)]
    serve.run(build_app({"replicas": 2, "serve_args": args}), name="jaxsmol")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _complete(url: str, key: str, prompt: str) -> dict:
    r = httpx.post(url + "/v1/completions", headers={"authorization": f"Bearer {key}"}, timeout=300,
                   json={"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def _cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_every_repeat_of_a_prefix_reaches_the_replica_that_has_it(url):
    first = {t: _complete(url, "sk-alice", prefix + "Question 0: hello?") for t, prefix in enumerate(TENANTS)}
    assert all(_cached(a) == 0 for a in first.values())
    for round_ in range(1, 3):
        for t, prefix in enumerate(TENANTS):
            answer = _complete(url, "sk-alice", prefix + f"Question {round_}: what about number {round_ * 7}?")
            # the prefix's tokens, less the last one or two, which the question's first tokens may merge with
            assert _cached(answer) >= first[t]["usage"]["prompt_tokens"] - 8, (t, round_, answer["usage"])


def test_each_key_keeps_its_prompts_to_itself(url):
    prompt = "The old lighthouse keeper wrote in his log every evening, and on the last page he wrote"
    assert _cached(_complete(url, "sk-alice", prompt)) == 0
    assert _cached(_complete(url, "sk-alice", prompt)) > 0
    assert _cached(_complete(url, "sk-bob", prompt)) == 0  # the same replica, another namespace
    r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": prompt}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_chat_streams_and_a_bad_body_gets_the_daemons_400(url):
    body = {"model": "m", "messages": [{"role": "system", "content": TENANTS[0]}, {"role": "user", "content": "hi"}],
            "max_tokens": 3, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300,
                      headers={"authorization": "Bearer sk-bob"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 3

    r = httpx.post(url + "/v1/completions", content=b"{not json", timeout=60,
                   headers={"authorization": "Bearer sk-bob", "content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    models = httpx.get(url + "/v1/models", headers={"authorization": "Bearer sk-bob"}, timeout=60).json()
    assert models["data"][0]["object"] == "model"
