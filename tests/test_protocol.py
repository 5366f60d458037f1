"""The OpenAI protocol as pure functions (cli/api/protocol.py, cli/api/responses.py), API keys
(cli/server/tenants.py) and the worker <-> HTTP event contract (cli/api/events.py): no model, no server."""

from __future__ import annotations

import asyncio
import threading

import pytest
from pydantic import ValidationError

from jaxsmol.cli.api import protocol as P
from jaxsmol.cli.api import responses as R
from jaxsmol.cache.scheduler.requests import ChoiceResult
from jaxsmol.cli.api.events import ChoiceSpec, Job, JobEnd, TokenEvent
from jaxsmol.cli.server.tenants import OPEN, Tenants, cache_salt, parse_keys_file
from jaxsmol.runtime.stream import Step
from jaxsmol.errors import JaxsmolError
from jaxsmol.runtime.sampling import SamplingParams


def _decode(i: int) -> str:
    return f"<{i}>"


def _refused(fn, *args) -> P.ProtocolError:
    with pytest.raises(P.ProtocolError) as e:
        fn(*args)
    assert e.value.status == 400
    return e.value


# ---- requests ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt,want", [
    ("hi", ["hi"]),
    ([5, 6], [[5, 6]]),
    (["a", "b"], ["a", "b"]),
    ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_completion_prompts_every_openai_form(prompt, want):
    body = P.CompletionRequest(prompt=prompt)
    assert P.completion_prompts(body.prompt) == want


@pytest.mark.parametrize("prompt", ["", [], ["a", ""], [[1], []]])
def test_empty_prompts_are_refused(prompt):
    assert "empty" in _refused(P.completion_prompts, P.CompletionRequest(prompt=prompt).prompt).message


@pytest.mark.parametrize("prompt", [["a", 1], [1, "a"], [[1], "a"], [True], 5, {"text": "hi"}])
def test_malformed_prompts_fail_validation(prompt):
    with pytest.raises(ValidationError):
        P.CompletionRequest(prompt=prompt)


def test_too_many_prompts():
    assert _refused(P.completion_prompts, ["x"] * (P.MAX_PROMPTS + 1)).param == "prompt"


def test_lone_surrogate_is_refused_everywhere():
    assert "surrogate" in _refused(P.completion_prompts, "a\ud800").message
    msgs = P.ChatRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]).messages
    assert _refused(P.template_messages, msgs).param == "messages.0.content"
    assert _refused(P.stop_strings, ["\udfff"]).param == "stop"


def test_chat_messages_content_parts_roles_and_names():
    body = P.ChatRequest(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}],
         "name": "ann"},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ])
    assert P.template_messages(body.messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, world", "name": "ann"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]


@pytest.mark.parametrize("message,param", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "messages.0.content"),
    ({"role": "user", "content": [{"type": "text"}]}, "messages.0.content"),
    ({"role": "user", "content": None}, "messages.0.content"),
    ({"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}, "messages.0"),
])
def test_bad_chat_messages(message, param):
    err = _refused(P.template_messages, P.ChatRequest(messages=[message]).messages)
    assert err.param == param


def test_bad_role_fails_validation():
    with pytest.raises(ValidationError):
        P.ChatRequest(messages=[{"role": "wizard", "content": "hi"}])


def test_stop_limits():
    assert P.stop_strings(None) == () and P.stop_strings("x") == ("x",)
    assert P.stop_strings(["a", "b", "c", "d"]) == ("a", "b", "c", "d")
    assert "at most 4" in _refused(P.stop_strings, ["a", "b", "c", "d", "e"]).message
    assert P.stop_strings(["s" * P.MAX_STOP_CHARS]) == ("s" * P.MAX_STOP_CHARS,)
    assert str(P.MAX_STOP_CHARS) in _refused(P.stop_strings, ["s" * (P.MAX_STOP_CHARS + 1)]).message


def test_work_cap():
    P.check_work(1, P.MAX_N, P.MAX_WORK_TOKENS // P.MAX_N)
    assert _refused(P.check_work, 1, P.MAX_N, P.MAX_WORK_TOKENS // P.MAX_N + 1).param == "max_tokens"
    assert _refused(P.check_work, P.MAX_CHOICES, 2, 1).param == "n"


UNSUPPORTED = [("best_of", 2), ("logit_bias", {"50": 1}), ("suffix", "end"), ("presence_penalty", 0.5),
               ("frequency_penalty", -1), ("tools", [{"type": "function"}]), ("tool_choice", "auto"),
               ("functions", [{"name": "f"}]), ("function_call", "auto"),
               ("audio", {"voice": "x"}), ("modalities", ["text", "audio"])]


@pytest.mark.parametrize("field,value", UNSUPPORTED, ids=[f for f, _ in UNSUPPORTED])
def test_unsupported_fields_are_refused_by_name(field, value):
    err = _refused(P.refuse_unsupported, P.CompletionRequest(prompt="hi", **{field: value}))
    assert err.param == field and field in err.message


def test_structured_output_fields_become_a_spec():
    chat = P.ChatRequest(messages=[{"role": "user", "content": "hi"}], response_format={"type": "json_object"})
    assert P.structured_spec(chat) is not None
    assert P.structured_spec(P.CompletionRequest(prompt="hi", response_format={"type": "text"})) is None
    assert P.structured_spec(P.CompletionRequest(prompt="hi", guided_regex="[0-9]+")) is not None
    bad = P.CompletionRequest(prompt="hi", response_format={"type": "json_schema",
                                                             "json_schema": {"schema": {"type": "objectx"}}})
    assert _refused(P.structured_spec, bad).param == "response_format"
    both = P.CompletionRequest(prompt="hi", response_format={"type": "json_object"}, guided_regex="a")
    assert "only one of" in _refused(P.structured_spec, both).message


def test_neutral_values_and_unknown_fields_are_accepted():
    body = P.CompletionRequest(prompt="hi", best_of=1, logit_bias={}, presence_penalty=0, frequency_penalty=0.0,
                               response_format={"type": "text"}, tool_choice="none", some_extension=True)
    P.refuse_unsupported(body)


def test_sampling_for_uses_seed_plus_sample_index():
    body = P.CompletionRequest(prompt="hi", temperature=0.5, top_k=3, top_p=0.9)
    sp = P.sampling_for(body, 7, 2, 2**63 - 1, 1, ("x",))
    assert sp == SamplingParams(max_tokens=7, temperature=0.5, top_k=3, top_p=0.9, seed=0, stop_strings=("x",),
                                logprobs=2)


# ---- responses ---------------------------------------------------------------------------------------
def _result(index, prompt=3, cached=0, out=(7, 8), logprobs=(), prompt_lp=None):
    return ChoiceResult(index=index, prompt_tokens=prompt, cached_tokens=cached, output_ids=list(out), text="ab",
                        finish_reason="length", logprobs=list(logprobs), prompt_logprobs=prompt_lp)


def test_usage_counts_each_prompt_once_with_its_first_choice():
    # 2 prompts x n=2; the second choice of a prompt reuses its sibling's work: not counted as cached
    results = [_result(0, 3, 0), _result(1, 3, 3), _result(2, 5, 2), _result(3, 5, 5)]
    assert R.usage(results, 2) == {"prompt_tokens": 8, "completion_tokens": 8, "total_tokens": 16,
                                   "prompt_tokens_details": {"cached_tokens": 2}}


def test_legacy_logprobs_with_echo():
    prompt_lp = [None, {"token": 11, "logprob": -1.5, "top": [(12, -0.5), (11, -1.5)], "rank": 2}]
    gen_lp = [{"token": 7, "logprob": -0.1, "top": [(7, -0.1), (9, -3.0)]},
              {"token": 8, "logprob": -2.0, "top": [(9, -1.0), (3, -1.2)]}]
    spec = ChoiceSpec(0, [10, 11], SamplingParams(), echo=True, prompt_logprobs=1)
    res = _result(0, 2, 0, (7, 8), gen_lp, prompt_lp)
    choice = R.completion_choice(res, spec, _decode, prompt_text="PQ", logprobs=1, prompt_logprobs=None,
                                 return_token_ids=True)
    assert choice["text"] == "PQab" and choice["token_ids"] == [7, 8]
    lp = choice["logprobs"]
    assert lp["tokens"] == ["<10>", "<11>", "<7>", "<8>"]
    assert lp["token_logprobs"] == [None, -1.5, -0.1, -2.0]
    # the k most likely plus the chosen token (up to k + 1 entries)
    assert lp["top_logprobs"] == [None, {"<12>": -0.5, "<11>": -1.5}, {"<7>": -0.1}, {"<9>": -1.0, "<8>": -2.0}]
    assert lp["text_offset"] == [0, 4, 8, 11]


def test_logprobs_zero_gives_the_chosen_tokens():
    res = _result(0, logprobs=[{"token": 7, "logprob": -0.25, "top": [(5, -0.1)]}])
    choice = R.completion_choice(res, ChoiceSpec(0, [1, 2, 3], SamplingParams()), _decode, prompt_text="",
                                 logprobs=0, prompt_logprobs=None, return_token_ids=False)
    assert choice["logprobs"]["token_logprobs"] == [-0.25]
    assert choice["logprobs"]["top_logprobs"] == [{"<7>": -0.25}]
    assert "token_ids" not in choice


def test_vllm_prompt_logprobs():
    entries = [None, {"token": 11, "logprob": -3.0, "top": [(12, -0.5)], "rank": 4}]
    assert R.vllm_prompt_logprobs([10, 11], entries, 1, _decode) == [
        None, {"12": {"logprob": -0.5, "rank": 1, "decoded_token": "<12>"},
               "11": {"logprob": -3.0, "rank": 4, "decoded_token": "<11>"}}]


def test_chat_logprobs_and_chunks():
    res = _result(1, logprobs=[{"token": 7, "logprob": -0.5, "top": [(7, -0.5), (8, -1.0)]}])
    choice = R.chat_choice(res, _decode, top_logprobs=1, return_token_ids=False)
    assert choice["message"] == {"role": "assistant", "content": "ab"}
    assert choice["logprobs"] == {"content": [{"token": "<7>", "logprob": -0.5, "bytes": list(b"<7>"),
                                               "top_logprobs": [{"token": "<7>", "logprob": -0.5,
                                                                 "bytes": list(b"<7>")}]}]}
    assert R.chat_choice(res, _decode, top_logprobs=None, return_token_ids=False)["logprobs"] is None
    step = Step(token=7, text="x", top_logprobs=[(7, -0.5)], logprob=-0.5)
    first = R.chat_token_choice(1, step, _decode, None, first=True)
    assert first["delta"] == {"role": "assistant", "content": "x"} and first["logprobs"] is None
    assert R.chat_token_choice(1, step, _decode, None, first=False)["delta"] == {"content": "x"}
    streamed = R.completion_token_choice(0, step, _decode, 0, offset=5)
    assert streamed["logprobs"] == {"tokens": ["<7>"], "token_logprobs": [-0.5], "top_logprobs": [{"<7>": -0.5}],
                                    "text_offset": [5]}
    assert R.final_choice(res, True, True) == {"index": 1, "delta": {}, "logprobs": None, "finish_reason": "length",
                                               "token_ids": [7, 8]}
    assert R.sse({"a": 1}) == 'data: {"a": 1}\n\n'


# ---- tenants -----------------------------------------------------------------------------------------
def test_keys_file_and_authentication():
    keys = parse_keys_file("# tenants\nka\nkb -\nkc team\nkd team  # shares kc's entries\nroot - admin\n")
    t = Tenants(keys)
    a, b = t.authenticate("Bearer ka"), t.authenticate("bearer kb")
    c, d = t.authenticate("Bearer kc"), t.authenticate("Bearer kd")
    assert len({a.namespace, b.namespace, c.namespace}) == 3 and c.namespace == d.namespace
    assert "ka" not in a.namespace  # namespaces (and so salts and disk files) never hold a key
    assert not a.admin and t.authenticate("Bearer root", admin=True).admin
    for header in (None, "", "Bearer", "Bearer nope", "Basic ka", "ka"):
        with pytest.raises(P.ProtocolError) as e:
            t.authenticate(header)
        assert e.value.status == 401
    with pytest.raises(P.ProtocolError) as e:
        t.authenticate("Bearer ka", admin=True)
    assert e.value.status == 403


def test_salts_partition_tenants_then_cache_salt():
    t = Tenants.from_options(["k1", "k2"])
    a, b = t.authenticate("Bearer k1", admin=True), t.authenticate("Bearer k2")
    assert cache_salt(a, None) != cache_salt(b, None)
    assert cache_salt(a, "x") != cache_salt(a, "y") != cache_salt(b, "y")
    assert cache_salt(OPEN, "x") == "x" and cache_salt(OPEN, None) is None
    assert Tenants().authenticate(None, admin=True) is OPEN


@pytest.mark.parametrize("text", ["k1 a b admin", "k1\nk1 other"])
def test_bad_keys_files(text):
    with pytest.raises(JaxsmolError, match="line"):
        parse_keys_file(text)


# ---- events ------------------------------------------------------------------------------------------
@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def _job(loop, **kw) -> Job:
    async def make():
        return Job(choices=[ChoiceSpec(0, [1, 2], SamplingParams())], salt=None, bypass=False, loop=loop, **kw)
    return asyncio.run_coroutine_threadsafe(make(), loop).result(10)


def test_emit_delivers_in_order(loop):
    job = _job(loop)
    events = [TokenEvent(0, Step(token=i, text=str(i))) for i in range(5)] + [JobEnd()]
    assert all(job.emit(e) for e in events)

    async def drain():
        return [job.events.get_nowait() for _ in range(job.events.qsize())]
    assert asyncio.run_coroutine_threadsafe(drain(), loop).result(10) == events


def test_a_client_that_stops_reading_is_cancelled(loop):
    """Emits never wait: past max_events they wait in a backlog; a client that leaves them unread for
    write_timeout_s is `stalled` (the worker then cancels the job); each read restarts the clock."""
    import time

    job = _job(loop, max_events=2, write_timeout_s=0.2)
    assert all(job.emit(TokenEvent(0, Step(token=i, text=str(i)))) for i in range(5))
    time.sleep(0.05)
    assert not job.stalled()
    time.sleep(0.3)
    assert job.stalled()

    async def read_all():
        return [(await job.next_event()).step.token for _ in range(5)]
    assert asyncio.run_coroutine_threadsafe(read_all(), loop).result(10) == [0, 1, 2, 3, 4]
    assert not job.stalled() and asyncio.run_coroutine_threadsafe(asyncio.sleep(0, job.idle()), loop).result(10)
    job.cancelled.set()
    assert not job.emit(JobEnd())  # a cancelled job's events are dropped
