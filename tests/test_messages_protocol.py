"""The Messages API's pure parts (cli/api/anthropic.py) and its stream driver, without a model: content
blocks as chat-template messages, cache_control breakpoints (where each one's conversation ends, the 5th
refused by name), a prefill's prompt whatever the template writes after a message, usage, errors, and
a failure after a stream began as an `error` event (tests/test_messages.py runs the routes with the
anthropic SDK against a real daemon)."""

from __future__ import annotations

import asyncio
import json
import types

import pytest

from jaxsmol.cache.scheduler.requests import ChoiceResult
from jaxsmol.cli.api import anthropic as A
from jaxsmol.cli.api.events import ChoiceDone, ChoiceSpec, JobError, PromptDone, TokenEvent
from jaxsmol.cli.api.protocol import ProtocolError
from jaxsmol.cli.server.messages import Messages
from jaxsmol.runtime.sampling import SamplingParams
from jaxsmol.runtime.stream import Step

CC, HOUR = {"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"}


def conv(**body) -> A.Conversation:
    return A.conversation(A.MessagesRequest(**{"max_tokens": 4, **body}))


def text(t: str, control=None) -> dict:
    return {"type": "text", "text": t, **({"cache_control": control} if control else {})}


def test_blocks_are_joined_and_each_breakpoint_ends_its_conversation_at_its_block():
    c = conv(system=[text("You are "), text("terse.", HOUR)],
             messages=[{"role": "user", "content": [text("Hi", CC), text(" there")]},
                       {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
             cache_control=CC)
    system = {"role": "system", "content": "You are terse."}
    assert c.messages == [system, {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello."},
                          {"role": "user", "content": "Bye"}]
    assert not c.prefill
    assert [(b.where, b.messages, b.ttl_s) for b in c.breakpoints] == [
        ("system.1.cache_control", (system,), 3600.0),
        ("messages.0.content.0.cache_control", (system, {"role": "user", "content": "Hi"}), 300.0),
        ("cache_control", tuple(c.messages), 300.0)]
    # an empty system prompt is none (the template's default); an empty final assistant turn opens a new one
    c = conv(system="", messages=[{"role": "user", "content": "Q"}, {"role": "assistant", "content": ""}])
    assert c.messages == [{"role": "user", "content": "Q"}] and not c.prefill
    assert conv(messages=[{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]).prefill


@pytest.mark.parametrize("body, where", [
    ({"system": [text("s", CC)] * 5}, "system.4.cache_control"),
    ({"system": [text("s", CC)] * 4, "cache_control": CC}, "cache_control"),
    ({"cache_control": {"type": "ephemeral", "ttl": "10m"}}, "cache_control.ttl"),
    ({"cache_control": {"type": "ephemeral", "ttl": ["5m"]}}, "cache_control.ttl"),
    ({"cache_control": "ephemeral"}, "cache_control"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [7]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, "messages.0.content.0.text"),
    ({"tools": [{"name": "f"}]}, "tools"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2000}}, "thinking"),
])
def test_what_is_refused_is_named(body, where):
    with pytest.raises(ProtocolError) as e:
        conv(**{"messages": [{"role": "user", "content": "Q"}], **body})
    assert e.value.message.startswith(where + ":") and e.value.status == 400


def test_a_prefill_is_cut_where_the_template_puts_the_final_text():
    def render(messages):  # a template whose words after a message hold the final text's characters
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>>\n" for m in messages)

    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": ">"}]
    assert A.continue_final(render, messages, "messages.1.content") == "<user>Q</user>>\n<assistant>>"
    with pytest.raises(ProtocolError, match="messages.1.content: the chat template"):
        A.continue_final(lambda m: "".join(x["content"].lower() for x in m), messages, "messages.1.content")


def test_usage_reasons_and_errors():
    assert A.usage(100, 60, 30, 5) == {"input_tokens": 10, "cache_creation_input_tokens": 30,
                                       "cache_read_input_tokens": 60, "output_tokens": 5}
    assert A.stop_reason("stop", None) == ("end_turn", None)
    assert A.stop_reason("stop", "##") == ("stop_sequence", "##")
    assert A.stop_reason("length", None) == ("max_tokens", None)
    assert A.error_status(503) == 529 and A.error_body(529, "busy")["error"]["type"] == "overloaded_error"
    assert A.error_body(400, "x") == {"type": "error", "error": {"type": "invalid_request_error", "message": "x"}}
    assert A.error_body(500, "x")["error"]["type"] == "api_error" and A.speaks("/v1/messages/count_tokens")
    assert not A.speaks("/v1/messagesx") and not A.speaks("/v1/chat/completions")


class Events:
    """What an EventReader hands the stream driver: these events, then None."""

    def __init__(self, events):
        spec = ChoiceSpec(index=0, prompt_ids=list(range(10)), sampling=SamplingParams(max_tokens=4))
        self.events, self.job = list(events), types.SimpleNamespace(choices=[spec], cancelled=_Flag())
        self.access = types.SimpleNamespace(note_usage=lambda usage: None)

    async def next(self):
        return self.events.pop(0) if self.events else None


class _Flag:
    def __init__(self):
        self.is_set = False

    def set(self):
        self.is_set = True


def stream(events) -> list[tuple[str, dict]]:
    messages = Messages(types.SimpleNamespace(engine=None), authenticate=None, ttl_scale=1.0)
    got = Events(events)

    async def read():
        return "".join([chunk async for chunk in messages._stream(got, {"id": "msg_x", "model": "m"})])

    out = asyncio.run(read())
    assert got.job.cancelled.is_set  # the job is told to stop once the stream ends, however it ends
    frames = [f.split("\n") for f in out.split("\n\n") if f]
    return [(f[0].removeprefix("event: "), json.loads(f[1].removeprefix("data: "))) for f in frames]


def test_the_stream_reports_what_the_cache_did_first_and_a_failure_as_an_error_event():
    result = ChoiceResult(index=0, prompt_tokens=10, cached_tokens=6, kept_tokens=2, output_ids=[5, 2], text="Hi",
                          finish_reason="stop", logprobs=[])
    ok = stream([PromptDone([0], 6, 2), TokenEvent(0, Step(5, "Hi")), TokenEvent(0, Step(2, "")), ChoiceDone(result)])
    assert [name for name, _ in ok] == ["message_start", "content_block_start", "ping", "content_block_delta",
                                        "content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in ok)
    assert ok[0][1]["message"]["usage"] == {"input_tokens": 2, "cache_creation_input_tokens": 2,
                                            "cache_read_input_tokens": 6, "output_tokens": 0}
    assert ok[5][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert ok[5][1]["usage"]["output_tokens"] == 2
    failed = stream([PromptDone([0], 0, 0), TokenEvent(0, Step(5, "Hi")), JobError(RuntimeError("the arena"))])
    assert failed[-1] == ("error", {"type": "error", "error": {"type": "api_error",
                                                               "message": "internal error: RuntimeError: the arena"}})
