"""Any request, one closed set of programs: once a daemon is ready, requests of every field the API
accepts (n, logprobs and top_logprobs, echo, prompt_logprobs, sampling settings, seeds, stop strings,
response formats and guided decoding, streaming, clients that leave mid-stream, chat and completions,
prompts of 1 to 1,500 tokens) make no program: each runs on the set the daemon made ready at start
(cache/scheduler/compile_ahead.py), and /metrics' jaxsmol_programs_after_ready stays 0 (it counts every
XLA compile of the process, eager operations included). No answer is a 5xx.

A property test: hypothesis draws the request bodies (derandomized, a fixed number of examples, so CI
sees the same bodies every run) and sends them to the shared "main" daemon of tests/test_serve*.py
(default flags, programs compiled ahead; the two-layer checkpoint with the real tokenizer)."""

from __future__ import annotations

import collections

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon import REQUEST_TIMEOUT_S, metrics

pytestmark = pytest.mark.real  # the real tokenizer (from the bundled model), tiny random weights

EXAMPLES = 70
SETTINGS = dict(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
STATUSES: collections.Counter = collections.Counter()

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"]}
lengths = st.sampled_from([1, 2, 3, 7, 30, 65, 130, 300, 520, 1000, 1500])
token_prompts = st.builds(lambda n, seed: [(seed * 7919 + i * 104729) % 49000 + 100 for i in range(n)],
                          lengths, st.integers(0, 10_000))
text_prompts = st.builds(lambda n, word: " ".join([word] * n), st.integers(1, 300),
                         st.sampled_from(["the", "Paris", "cat sat", "12,", "é"]))
common = {
    "max_tokens": st.integers(0, 24), "temperature": st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    "top_p": st.sampled_from([1.0, 0.9, 0.3]), "top_k": st.sampled_from([0, 1, 5, 50, 500]),
    "seed": st.integers(0, 2**63 - 1), "n": st.integers(1, 8),
    "stop": st.none() | st.sampled_from(["\n", ".", "the"]) | st.lists(st.sampled_from(["a", "zz", ","]), max_size=3),
    "ignore_eos": st.booleans(), "use_prefix_cache": st.booleans(), "cache_salt": st.sampled_from(["a", "b"]),
    "return_token_ids": st.booleans(),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"},
                                        {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}]),
    "guided_regex": st.just("[0-9]{2,4}"), "guided_choice": st.just(["yes", "no", "maybe"]),
}
completion_fields = {**common, "prompt": token_prompts | text_prompts | st.lists(token_prompts, min_size=2, max_size=3),
                     "logprobs": st.integers(0, 5), "echo": st.booleans(), "prompt_logprobs": st.integers(0, 5),
                     "stream": st.booleans()}
chat_fields = {**common, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20), "stream": st.booleans(),
               "max_completion_tokens": st.integers(1, 24)}


def _bodies(fields: dict, required: dict):
    optional = {k: v for k, v in fields.items() if k not in required}
    return st.fixed_dictionaries(required, optional=optional)


def _messages(system: str, user: str) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


completions = _bodies(completion_fields, {"prompt": completion_fields["prompt"]})
chats = _bodies(chat_fields, {"messages": st.builds(
    _messages, st.sampled_from(["", "Be brief.", "You answer in JSON. " * 20]), text_prompts)})
requests = st.tuples(st.just("/v1/completions"), completions) | st.tuples(st.just("/v1/chat/completions"), chats)


def _fit(route: str, body: dict) -> dict:
    """A body the API accepts: the work caps (prompts x n <= 32, choices x max_tokens <= 16,384), and
    no streamed prompt log-probabilities (refused by name: tests/test_serve_bad_requests.py)."""
    body = dict(body)
    if body.get("stream") and (body.get("prompt_logprobs") is not None or body.get("echo")):
        body.pop("prompt_logprobs", None)
        body.pop("echo", None)
    for guided in ("guided_regex", "guided_choice"):  # one structured-output field at a time
        if guided in body and "response_format" in body:
            body.pop(guided)
    if "guided_regex" in body and "guided_choice" in body:
        body.pop("guided_choice")
    return body


def _send(url: str, route: str, body: dict, leave_after: int | None) -> int:
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        if not body.get("stream"):
            return client.post(url + route, json=body).status_code
        with client.stream("POST", url + route, json=body) as r:
            for i, _ in enumerate(r.iter_lines()):
                if leave_after is not None and i >= leave_after:
                    break  # a client that leaves mid-stream
            return r.status_code


def test_any_request_runs_on_the_programs_made_before_ready(main_server):
    server = main_server  # the "main" daemon alone: this test asks no other (conftest's main_server)
    before = metrics(server)
    assert before["jaxsmol_programs_after_ready"] == 0

    @settings(**SETTINGS)
    @given(requests, st.none() | st.integers(1, 3))
    def one(request, leave_after):
        route, body = request
        status = _send(server, route, _fit(route, body), leave_after)
        STATUSES[status] += 1
        assert status < 500

    one()
    after = metrics(server)
    print(f"\nstatuses: {dict(STATUSES)}; programs {before['jaxsmol_programs']:.0f} -> {after['jaxsmol_programs']:.0f}")
    assert STATUSES[200] >= EXAMPLES // 2  # most bodies are valid: the set is exercised, not refused
    assert after["jaxsmol_programs_after_ready"] == 0
    assert after["jaxsmol_programs"] == before["jaxsmol_programs"]
    five = {k: v for k, v in after.items() if k.startswith("jaxsmol_requests_total") and 'status="5' in k
            and "/v1/" in k}  # (/health answers 503 while the daemon warms)
    assert not five, five
