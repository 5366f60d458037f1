"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}) as the `openai` SDK
speaks it, against one real `jaxsmol serve` daemon on the bundled model: a conversation chained by
`previous_response_id`, sync and streamed, whose second turn reads the whole first turn from the prefix
cache and answers what /v1/chat/completions answers for the same conversation (greedy, bit for bit);
stored responses retrieved and deleted; tenants' responses apart (API keys); bad input a 400 naming
the field, never a 5xx.

Each test runs in a cache namespace of its own (`prompt_cache_key`), so that what it reads is its own.
"""

from __future__ import annotations

import json
import time
import uuid

import httpx
import openai
import pytest

from daemon import REQUEST_TIMEOUT_S, Server, assert_healthy, client
from jaxsmol.cli.server.response_store import ResponseStore

pytestmark = pytest.mark.real

ROOT, OTHER = "key-root", "key-b"
SYSTEM = "You are a helpful geography tutor. Answer in one sentence."
LONG = "You are a careful assistant. Here is a list of facts to use. " + " ".join(
    f"Fact {i}: {i} times 7 is {7 * i}." for i in range(40))  # ~670 tokens
STREAM_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added"]
CLOSING_EVENTS = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def url(tmp_path_factory, model_dir):  # model_dir: the bundled model imported once, unraced
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{ROOT} - admin\n{OTHER}\n")
    server = Server("--api-keys", str(keys))
    try:
        yield server.wait_ready().url
    finally:
        server.stop()


def greedy(**extra) -> dict:
    """Greedy, in a fresh cache namespace."""
    return {"temperature": 0, "prompt_cache_key": uuid.uuid4().hex, **extra}


def chat(url: str, messages: list[dict], key: str, max_tokens: int):
    """The same conversation through /v1/chat/completions (greedy, the same namespace)."""
    return client(url, ROOT).chat.completions.create(model="m", max_tokens=max_tokens, messages=messages,
                                                     temperature=0, extra_body={"cache_salt": key})


# ---- conversations -------------------------------------------------------------------------------------
def test_a_chained_conversation_reads_its_first_turn_and_equals_chat_completions(url):
    c, kw = client(url, ROOT), greedy(max_output_tokens=40, instructions=SYSTEM)
    ask1, ask2 = "Name the capital city of France.", "And of Italy?"
    first = c.responses.create(model="m", input=ask1, **kw)
    assert first.object == "response" and first.id.startswith("resp_") and first.status == "completed"
    assert first.model == "SmolLM2-135M-Instruct" and first.incomplete_details is None
    [item] = first.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_") and item.content[0].type == "output_text"
    text1 = first.output_text  # the SDK's join of the output's text parts
    assert text1 == item.content[0].text and "Paris" in text1
    u1 = first.usage
    assert u1.input_tokens_details.cached_tokens == 0 and u1.total_tokens == u1.input_tokens + u1.output_tokens
    assert (first.instructions, first.store, first.prompt_cache_key) == (SYSTEM, True, kw["prompt_cache_key"])

    # instructions are not carried over (as OpenAI): sent again, the prompt begins as the first one did;
    # prompt_cache_key is, so the second turn lies in the first one's namespace
    second = c.responses.create(model="m", input=ask2, previous_response_id=first.id, instructions=SYSTEM,
                                max_output_tokens=40, temperature=0)
    u2 = second.usage
    # the first turn's prompt and answer (its end-of-turn token too) were stored for this one
    assert u2.input_tokens_details.cached_tokens == u1.input_tokens + u1.output_tokens
    assert second.previous_response_id == first.id and second.prompt_cache_key == kw["prompt_cache_key"]
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask1},
                    {"role": "assistant", "content": text1}, {"role": "user", "content": ask2}]
    same = chat(url, conversation, kw["prompt_cache_key"], 40)
    assert same.choices[0].message.content == second.output_text
    assert (same.usage.prompt_tokens, same.usage.completion_tokens) == (u2.input_tokens, u2.output_tokens)
    assert chat(url, conversation[:2], kw["prompt_cache_key"], 40).choices[0].message.content == text1
    print(f"\nsecond turn: {u2.input_tokens_details.cached_tokens} of {u2.input_tokens} input tokens cached "
          f"(the first turn: {u1.input_tokens} in, {u1.output_tokens} out)")


def _stream(c, **kw) -> tuple[list, float]:
    """A streamed response's events, and the seconds to its first text delta."""
    started, first = time.perf_counter(), None
    events = []
    for event in c.responses.create(model="m", stream=True, **kw):
        if first is None and event.type == "response.output_text.delta":
            first = time.perf_counter() - started
        events.append(event)
    return events, first


def test_a_streamed_conversation_gives_the_apis_events_and_reads_its_first_turn(url):
    c, kw = client(url, ROOT), greedy(max_output_tokens=12, instructions=LONG)
    events, cold = _stream(c, input="What is 6 times 7?", **kw)
    kinds, final = [e.type for e in events], events[-1].response
    done = "response.completed" if final.status == "completed" else "response.incomplete"  # cut by the limit
    assert kinds[:4] == STREAM_EVENTS and kinds[-4:] == CLOSING_EVENTS + [done], kinds
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events[4:-4])
    assert final.output_text == text == events[-4].text
    assert final.id == events[0].response.id and events[0].response.status == "in_progress"
    whole = c.responses.create(model="m", input="What is 6 times 7?", store=False, **kw)
    assert whole.output_text == text and whole.usage.input_tokens == final.usage.input_tokens

    # the streamed response was stored at its end: a streamed second turn continues it
    events2, warm = _stream(c, input="And 9 times 7?", previous_response_id=final.id, max_output_tokens=12,
                            instructions=LONG, temperature=0)
    u1, u2 = final.usage, events2[-1].response.usage
    assert u2.input_tokens_details.cached_tokens == u1.input_tokens + u1.output_tokens
    print(f"\nstreamed, {u1.input_tokens}-token first turn: second turn {u2.input_tokens_details.cached_tokens} of "
          f"{u2.input_tokens} tokens cached; time to first text {cold * 1000:.0f} ms first turn, "
          f"{warm * 1000:.0f} ms second ({cold / warm:.1f}x)")
    assert warm < cold

    raw = httpx.post(url + "/v1/responses", headers={"authorization": f"Bearer {ROOT}"}, timeout=REQUEST_TIMEOUT_S,
                     json={"input": "Name a colour.", "stream": True, "max_output_tokens": 2, "temperature": 0})
    assert raw.headers["content-type"].startswith("text/event-stream")
    frames = [f.split("\n") for f in raw.text.split("\n\n") if f]
    names = [f[0].removeprefix("event: ") for f in frames]
    assert all(json.loads(f[1].removeprefix("data: "))["type"] == name for f, name in zip(frames, names))
    assert names[-1] == "response.incomplete"  # cut by max_output_tokens


def test_the_sdks_stream_helper_and_a_token_limit(url):
    c, kw = client(url, ROOT), greedy(max_output_tokens=2)
    with c.responses.stream(model="m", input="Name the capital city of France.", **kw) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    short = c.responses.create(model="m", input="Name the capital city of France.", **kw)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.usage.output_tokens == 2 and short.output[0].status == "incomplete" and short.output_text == text


def test_a_json_schema_text_format_is_enforced(url):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    got = client(url, ROOT).responses.create(
        model="m", input="Name the capital city of France, as JSON.", **greedy(max_output_tokens=40),
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    assert isinstance(json.loads(got.output_text)["city"], str) and got.text.format.type == "json_schema"


# ---- stored responses and tenants -----------------------------------------------------------------------------
def test_a_stored_response_is_retrieved_then_deleted_and_unstored_ones_are_not_kept(url):
    c = client(url, ROOT)
    made = c.responses.create(model="m", input="Name a river.", metadata={"run": "1"}, **greedy(max_output_tokens=4))
    got = c.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump() and got.metadata == {"run": "1"}
    assert c.responses.delete(made.id) is None
    for call in (lambda: c.responses.retrieve(made.id), lambda: c.responses.delete(made.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = c.responses.create(model="m", input="Name a lake.", store=False, **greedy(max_output_tokens=2))
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)


def test_a_responses_input_items_are_listed_in_pages_by_the_sdk(url):
    c, kw = client(url, ROOT), greedy(max_output_tokens=2)
    first = c.responses.create(model="m", input="Name a river.", **kw)
    turn = [{"role": "user", "content": "Name a lake."}, {"role": "assistant", "content": "Say one word."},
            {"role": "user", "content": "Now a sea."}]
    second = c.responses.create(model="m", input=turn, previous_response_id=first.id, **kw)
    newest = c.responses.input_items.list(second.id)  # its own input only, newest first (OpenAI's default)
    assert [(i.role, i.content[0].type, i.content[0].text) for i in newest.data] == [
        ("user", "input_text", "Now a sea."), ("assistant", "output_text", "Say one word."),
        ("user", "input_text", "Name a lake.")]
    page = c.responses.input_items.list(second.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["Name a lake.", "Say one word."] and page.has_more
    rest = c.responses.input_items.list(second.id, order="asc", after=page.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["Now a sea."] and not rest.has_more
    assert [i.content[0].text for i in c.responses.input_items.list(first.id).data] == ["Name a river."]
    for bad in ({"limit": 0}, {"order": "up"}, {"after": "msg_nope"}):
        with pytest.raises(openai.BadRequestError):
            c.responses.input_items.list(second.id, **bad)
    with pytest.raises(openai.NotFoundError):
        client(url, OTHER).responses.input_items.list(second.id)


def test_a_tenant_cannot_read_or_continue_another_tenants_response_nor_an_unknown_one(url):
    mine = client(url, ROOT).responses.create(model="m", input="Name a city.", **greedy(max_output_tokens=2))
    theirs = client(url, OTHER)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.delete(mine.id)
    for previous in (mine.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as e:
            theirs.responses.create(model="m", input="And another?", previous_response_id=previous,
                                    max_output_tokens=2)
        err = e.value.body
        assert err["param"] == "previous_response_id" and err["type"] == "invalid_request_error", err
        assert err["message"].startswith("previous_response_id:") and err["code"] == 404, err
    assert client(url, ROOT).responses.retrieve(mine.id).id == mine.id  # still the owner's


def test_stored_responses_are_counted_in_metrics(url):
    client(url, ROOT).responses.create(model="m", input="Name a sea.", **greedy(max_output_tokens=2))
    r = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {ROOT}"}, timeout=REQUEST_TIMEOUT_S)
    samples = dict(line.split(" ") for line in r.text.splitlines() if line.startswith("jaxsmol_responses_"))
    assert float(samples["jaxsmol_responses_stored"]) >= 1 and float(samples["jaxsmol_responses_stored_bytes"]) > 0
    assert samples["jaxsmol_responses_evicted_total"] == "0.0"


def test_the_store_is_bounded_in_count_and_bytes_and_evicts_the_oldest():
    def put(store, i, size=100, namespace=None):
        store.put(namespace, {"id": f"r{i}", "text": "a" * size}, [{"role": "user", "content": "q"}], None, 1)

    store = ResponseStore(max_count=3, max_bytes=10_000)
    for i in range(5):
        put(store, i)
    assert [store.get(None, f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert store.evicted == 2
    put(store, 5, size=6000)
    put(store, 6, size=6000)  # the two no longer fit 10 000 bytes: r5 goes, and the older ones before it
    assert [store.get(None, f"r{i}") is not None for i in (4, 5, 6)] == [False, False, True] and store.bytes < 10_000
    put(store, 7, size=20_000)  # alone over the bound: not kept
    assert store.get(None, "r7") is None and store.get(None, "r6") is not None
    put(store, 8, namespace="key:a")
    assert store.get("key:b", "r8") is None and not store.delete("key:b", "r8") and store.delete("key:a", "r8")
    assert store.get("key:a", "r8") is None


# ---- bad input -------------------------------------------------------------------------------------------
OK = {"model": "m", "input": "Hi", "max_output_tokens": 2}
BAD = [  # (body, the field the message names)
    ({"model": "m"}, "input"),
    ({**OK, "input": []}, "input"),
    ({**OK, "input": 7}, "input"),
    ({**OK, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content.0"),
    ({**OK, "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0"),
    ({**OK, "input": [{"role": "user", "content": [{"type": "bogus"}]}]}, "input.0.content.0.type"),
    ({**OK, "input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input.0.content.0.text"),
    ({**OK, "input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input.0"),
    ({**OK, "input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({**OK, "input": [{"role": "user"}]}, "input.0.content"),
    ({**OK, "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({**OK, "tool_choice": "required"}, "tool_choice"),
    ({**OK, "reasoning": {"effort": "high"}}, "reasoning"),
    ({**OK, "background": True}, "background"),
    ({**OK, "conversation": "conv_1"}, "conversation"),
    ({**OK, "include": ["message.output_text.logprobs"]}, "include"),
    ({**OK, "truncation": "auto"}, "truncation"),
    ({**OK, "temperature": 3}, "temperature"),
    ({**OK, "max_output_tokens": 0}, "max_output_tokens"),
    ({**OK, "max_output_tokens": 100_000}, "input"),  # past the context
    ({**OK, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({**OK, "text": {"format": {"type": "bogus"}}}, "text.format.type"),
    ({**OK, "prompt_cache_retention": "1h"}, "prompt_cache_retention"),
    ({**OK, "prompt_cache_key": 5}, "prompt_cache_key"),
    ({**OK, "metadata": {"k": 1}}, "metadata.k"),
    ({**OK, "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
]


@pytest.mark.parametrize("body, field", BAD, ids=[f for _, f in BAD])
def test_bad_input_is_a_400_naming_the_field(url, body, field):
    r = httpx.post(url + "/v1/responses", json=body, headers={"authorization": f"Bearer {ROOT}"},
                   timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"].startswith(field + ":"), err


def test_other_errors_and_the_daemon_unharmed(url):
    auth = {"authorization": f"Bearer {ROOT}", "content-type": "application/json"}
    for method, path, content, status in [("POST", "/v1/responses", b"{not json", 400),
                                          ("POST", "/v1/responses", b"[1]", 400),
                                          ("GET", "/v1/responses/resp_nope", b"", 404),
                                          ("DELETE", "/v1/responses/resp_nope", b"", 404),
                                          ("PUT", "/v1/responses", b"{}", 405)]:
        r = httpx.request(method, url + path, content=content, headers=auth, timeout=REQUEST_TIMEOUT_S)
        assert r.status_code == status and r.json()["error"]["message"], (method, path, r.text)
    r = httpx.post(url + "/v1/responses", json=OK, timeout=REQUEST_TIMEOUT_S)  # no key
    assert r.status_code == 401, r.text
    assert_healthy(url)
    assert client(url, ROOT).responses.create(**OK).output_text is not None
