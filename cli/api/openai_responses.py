"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}), as pure data: its
request (a pydantic model), its input items as chat-template messages, what is refused, and its
response object and stream events.

Nothing here touches a model or a server: the route driver (cli/server/responses_route.py) renders the
messages with the model's chat template and runs them on the completions' job driver. A `ProtocolError`
is a 400 naming the field at fault, in OpenAI's error shape.

Text parts are joined without a separator, as the chat route joins content parts (cli/api/protocol.py),
so a conversation sent to either route renders to the same prompt and gets the same tokens. A chained
request (`previous_response_id`) continues the stored conversation: its turns, then its answer, then
this request's input, so its prompt begins with exactly the tokens the earlier request computed.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from jaxsmol.cli.api.protocol import ProtocolError, check_text

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits
# input items other than messages, and why each is refused
REFUSED_ITEMS = {
    "function_call": "function calling is not supported", "function_call_output": "function calling is not supported",
    "custom_tool_call": "tools are not supported", "custom_tool_call_output": "tools are not supported",
    "reasoning": "reasoning items are not supported",
    "item_reference": "item references are not supported (previous_response_id continues a stored response)",
}
REFUSED_PARTS = {"input_image": "this model reads text only", "input_file": "this model reads text only",
                 "input_audio": "this model reads text only", "refusal": "refusal parts are not supported"}


# ---- the request ---------------------------------------------------------------------------------------
class ResponsesRequest(BaseModel):
    """POST /v1/responses. `seed` is jaxsmol's extension (an extra body field): the API has none, so a
    seeded sampling needs it. The standard fields after `seed` are refused unless neutral
    (refuse_unsupported); any other field is ignored."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None  # any value: the daemon serves one model
    input: Any  # a string or a list of input items (input_messages checks which)
    instructions: StrictStr | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: StrictStr | None = Field(default=None, max_length=256)
    metadata: dict[str, StrictStr] | None = None
    text: dict | None = None
    prompt_cache_key: StrictStr | None = Field(default=None, max_length=256)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    parallel_tool_calls: bool | None = None  # echoed: no tools run
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    tools: list | None = None
    tool_choice: Any = None
    reasoning: Any = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    include: list | None = None
    top_logprobs: int | None = None
    truncation: str | None = None


def _neutral_reasoning(reasoning) -> bool:
    """No reasoning asked for: null, or an object of nulls (an effort of "none" too)."""
    if reasoning is None:
        return True
    return isinstance(reasoning, dict) and all(v is None or (k == "effort" and v == "none")
                                               for k, v in reasoning.items())


def refuse_unsupported(body: ResponsesRequest) -> None:
    """Raise a ProtocolError naming the first field set to what the daemon does not implement."""
    checks = [
        ("tools", bool(body.tools), "tools are not supported (the model's chat template has no tool support)"),
        ("tool_choice", body.tool_choice not in (None, "none", "auto"), "tools are not supported (no tools)"),
        ("reasoning", not _neutral_reasoning(body.reasoning), "reasoning is not supported (not a reasoning model)"),
        ("background", bool(body.background), "background responses are not supported (send stream: true)"),
        ("conversation", body.conversation is not None,
         "the Conversations API is not supported (previous_response_id chains responses)"),
        ("prompt", body.prompt is not None, "reusable prompts are not supported"),
        ("include", bool(body.include), "no includable output is supported (no logprobs, no tools)"),
        ("top_logprobs", bool(body.top_logprobs), "log-probabilities are not supported on this route"),
        ("truncation", body.truncation not in (None, "disabled"),
         "only \"disabled\" (a conversation longer than the context is refused)"),
    ]
    for field, refused, message in checks:
        if refused:
            raise ProtocolError(f"{field}: {message}", param=field)
    check_metadata(body.metadata)
    check_echoed(body)


def check_echoed(body: ResponsesRequest) -> None:
    """The text fields the response object repeats are valid Unicode (a lone surrogate cannot be
    written as UTF-8)."""
    for field in ("instructions", "prompt_cache_key"):
        if getattr(body, field) is not None:
            check_text(getattr(body, field), field)
    if body.text is not None:
        check_text(json.dumps(body.text, ensure_ascii=False), "text")


def check_metadata(metadata: dict | None) -> None:
    """OpenAI's bounds on metadata: up to 16 pairs, keys up to 64 characters, values up to 512."""
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_KEYS:
        raise ProtocolError(f"metadata: at most {MAX_METADATA_KEYS} pairs, got {len(metadata)}", param="metadata")
    for key, value in metadata.items():
        check_text(key, "metadata")
        check_text(value, f"metadata.{key}")
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise ProtocolError(f"metadata: keys are at most {MAX_METADATA_KEY_CHARS} characters and values "
                                f"{MAX_METADATA_VALUE_CHARS}", param="metadata")


def structured_format(text) -> dict | None:
    """`text.format` as the chat route's response_format (None: free text)."""
    if text is None or text.get("format") is None:
        return None
    fmt = text["format"]
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise ProtocolError("text.format: an object with a \"type\" is expected", param="text.format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise ProtocolError(f"text.format.type: {json.dumps(kind)} is not one of \"text\", \"json_schema\", "
                            "\"json_object\"", param="text.format")
    if not isinstance(fmt.get("schema"), dict):
        raise ProtocolError("text.format.schema: a JSON schema (an object) is needed", param="text.format")
    name = fmt.get("name") if isinstance(fmt.get("name"), str) else "output"
    return {"type": "json_schema", "json_schema": {"name": name, "schema": fmt["schema"]}}


# ---- input items -> chat-template messages ----------------------------------------------------------------
def _text(content, where: str) -> str:
    """A message's content, a string or a list of text parts, as one string."""
    if isinstance(content, str):
        return check_text(content, where)
    if not isinstance(content, list):
        raise ProtocolError(f"{where}: a string or a list of content parts is expected", param=where)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise ProtocolError(f"{at}: a content part is an object with a \"type\"", param=at)
        if kind in REFUSED_PARTS:
            raise ProtocolError(f"{at}: {kind} parts are not supported ({REFUSED_PARTS[kind]})", param=at)
        if kind not in TEXT_PARTS:
            raise ProtocolError(f"{at}.type: unknown content part type {json.dumps(kind)} (only input_text and "
                                "output_text)", param=at)
        if not isinstance(part.get("text"), str):
            raise ProtocolError(f"{at}.text: a text part needs a string \"text\"", param=at)
        texts.append(check_text(part["text"], f"{at}.text"))
    return "".join(texts)


def _message(item, where: str) -> dict:
    """One input item, a message, as a chat-template message (`developer` rendered as `system`)."""
    kind = item.get("type", "message") if isinstance(item, dict) else None
    if kind != "message":
        if kind in REFUSED_ITEMS:
            raise ProtocolError(f"{where}: {kind} items are not supported ({REFUSED_ITEMS[kind]})", param=where)
        raise ProtocolError(f"{where}: an input item is a message object ({{\"role\", \"content\"}}), got "
                            f"{json.dumps(kind) if isinstance(kind, str) else 'no message'}", param=where)
    role = item.get("role")
    if role not in ROLES:
        raise ProtocolError(f"{where}.role: one of {', '.join(ROLES)} is expected", param=f"{where}.role")
    if "content" not in item:
        raise ProtocolError(f"{where}.content: a message needs content", param=f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": _text(item["content"], f"{where}.content")}


def input_messages(input_) -> list[dict]:
    """The request's input (a string: one user message; or a list of messages) as chat-template messages."""
    if isinstance(input_, str):
        return [{"role": "user", "content": check_text(input_, "input")}]
    if not isinstance(input_, list):
        raise ProtocolError("input: a string or a list of input items is expected", param="input")
    if not input_:
        raise ProtocolError("input: at least one input item is needed", param="input")
    return [_message(item, f"input.{i}") for i, item in enumerate(input_)]


def prompt_messages(instructions: str | None, turns: list[dict]) -> list[dict]:
    """The prompt's messages: this request's instructions as a system message (an empty one is none),
    then the conversation's turns."""
    return ([{"role": "system", "content": instructions}] if instructions else []) + turns


# ---- the response object ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Head:
    """What a response object knows before its answer: its ids, its time, its model, and the request's
    settings it echoes (`echo`)."""
    id: str
    item_id: str
    created_at: int
    model: str
    echo: dict


def echo(body: ResponsesRequest, cache_key: str | None) -> dict:
    """The request's settings as the response object repeats them (OpenAI's defaults where unset)."""
    text = {"format": (body.text or {}).get("format") or {"type": "text"}, "verbosity": "medium"}
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "prompt_cache_key": cache_key,
            "prompt_cache_retention": body.prompt_cache_retention, "reasoning": {"effort": None, "summary": None},
            "store": body.store, "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": text, "tool_choice": body.tool_choice or "auto", "tools": [],
            "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled", "background": False,
            "service_tier": "default", "top_logprobs": 0, "user": None}


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    """The Responses API's usage: cached_tokens are the prompt positions the prefix cache restored; no
    explicit cache write happens (every prompt is stored as it is), so cache_write_tokens is 0."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


def outcome(finish_reason: str) -> tuple[str, dict | None]:
    """(status, incomplete_details) of a finished answer: one cut by its token limit is incomplete."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, status: str, text: str | None) -> dict:
    """The answer's output item (None: no text yet, an empty content)."""
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if text is None else [text_part(text)]}


def response_object(head: Head, status: str = "in_progress", output: tuple = (), usage_: dict | None = None,
                    incomplete: dict | None = None, completed_at: int | None = None) -> dict:
    return {"id": head.id, "object": "response", "created_at": head.created_at, "status": status,
            "completed_at": completed_at, "error": None, "incomplete_details": incomplete, "model": head.model,
            "output": list(output), "usage": usage_, **head.echo}


def final_response(head: Head, text: str, finish_reason: str, usage_: dict, completed_at: int) -> dict:
    """The response object once its answer is done."""
    status, incomplete = outcome(finish_reason)
    return response_object(head, status, (message_item(head.item_id, status, text),), usage_, incomplete,
                           completed_at)


# ---- streaming ---------------------------------------------------------------------------------------------
class Events:
    """A response's server-sent events, numbered in order (`sequence_number`)."""

    def __init__(self):
        self.sequence = 0

    def event(self, kind: str, **fields) -> str:
        """One event: `event: TYPE`, then its data, an object whose type is TYPE."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def opening(self, head: Head) -> str:
        """The events before the first text: the response created and in progress, its message and
        text part added."""
        started = response_object(head)
        where = {"item_id": head.item_id, "output_index": 0}
        return (self.event("response.created", response=started) + self.event("response.in_progress", response=started)
                + self.event("response.output_item.added", output_index=0,
                             item=message_item(head.item_id, "in_progress", None))
                + self.event("response.content_part.added", **where, content_index=0, part=text_part("")))

    def delta(self, head: Head, text: str) -> str:
        return self.event("response.output_text.delta", item_id=head.item_id, output_index=0, content_index=0,
                          delta=text, logprobs=[])

    def closing(self, response: dict) -> str:
        """The events after the last text: the text, its part and its item done, then the response,
        `response.completed` (or `response.incomplete` when cut by max_output_tokens)."""
        item = response["output"][0]
        text = item["content"][0]["text"]
        where = {"item_id": item["id"], "output_index": 0}
        final = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return (self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[])
                + self.event("response.content_part.done", **where, content_index=0, part=text_part(text))
                + self.event("response.output_item.done", output_index=0, item=item)
                + self.event(final, response=response))

    def error(self, message: str, code: str, param: str | None) -> str:
        return self.event("error", code=code, message=message, param=param)


def deleted(response_id: str) -> dict:
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def input_items(response_id: str, messages: list[dict], limit: int, order: str, after: str | None) -> dict:
    """GET /v1/responses/{id}/input_items: the response's input messages as OpenAI's items, a page of
    `limit` (1-100) in `order` ("asc" or "desc", OpenAI's default), after the item `after`."""
    if not 1 <= limit <= 100:
        raise ProtocolError(f"limit: must be in [1, 100], got {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise ProtocolError(f"order: must be asc or desc, got {order!r}", param="order")
    base = "msg_" + response_id.removeprefix("resp_")[:24]
    items = [{"id": f"{base}{i:04d}", "type": "message", "role": m["role"], "status": "completed",
              "content": [{"type": "output_text" if m["role"] == "assistant" else "input_text", "text": m["content"]}]}
             for i, m in enumerate(messages)]
    items = items[::-1] if order == "desc" else items
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise ProtocolError(f"after: no input item {after!r} in response {response_id}", param="after")
        items = items[at + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
