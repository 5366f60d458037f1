"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), as pure data: its requests
(pydantic models), their content blocks as chat-template messages, their `cache_control` breakpoints,
and its response, stream-event and error bodies.

Nothing here touches a model or a server: the route driver (cli/server/messages.py) renders what
`conversation` returns with the model's chat template, tokenizes it and runs it on the completions'
job driver. A `ProtocolError` is a 400 naming the field at fault, answered in Anthropic's error shape
(`error_body`).

Text blocks are joined without a separator, as the OpenAI routes join content parts (cli/api/protocol.py),
so a conversation sent to either API renders to the same prompt. A `cache_control` breakpoint (on a
system block, a message's content block, or at the top level: the end of the last message) keeps the
conversation up to and including its block: `Breakpoint.messages` is that conversation, which the
driver renders and tokenizes to find the breakpoint's position in the prompt.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from jaxsmol.cli.api.protocol import ProtocolError, check_text

PATHS = ("/v1/messages", "/v1/messages/count_tokens")
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
MAX_BREAKPOINTS = 4
PREFILL_MARK = "JAXSMOLPREFILLMARK"  # stands for a final assistant message's text while the template renders
# blocks Anthropic defines that a text-only model without tool support cannot take, and why
REFUSED_BLOCKS = {
    "image": "this model reads text only", "document": "this model reads text only",
    "search_result": "this model reads text only", "container_upload": "this model reads text only",
    "tool_use": "the model's chat template has no tool support",
    "tool_result": "the model's chat template has no tool support",
    "server_tool_use": "the model's chat template has no tool support",
    "web_search_tool_result": "the model's chat template has no tool support",
    "thinking": "extended thinking is not supported", "redacted_thinking": "extended thinking is not supported",
}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 529: "overloaded_error"}
OVERLOADED = 529  # Anthropic's status for a server too busy to take the request (the daemon's 503 elsewhere)


# ---- request models ------------------------------------------------------------------------------------
class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: StrictStr | list[Any]


class CountRequest(BaseModel):
    """POST /v1/messages/count_tokens: the conversation alone."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None  # any value: the daemon serves one model
    messages: list[Message] = Field(min_length=1)
    system: StrictStr | list[Any] | None = None
    cache_control: Any = None  # automatic placement: a breakpoint at the end of the last message
    tools: list | None = None  # refused (see refuse_unsupported)
    tool_choice: Any = None
    thinking: Any = None


class MessagesRequest(CountRequest):
    """POST /v1/messages. `seed`, `cache_salt` and `ignore_eos` are jaxsmol's extensions (extra body
    fields): Anthropic's API has no seed, so a seeded sampling (and its comparison with the OpenAI
    routes' `seed`) needs it."""
    max_tokens: int = Field(ge=1)
    stop_sequences: list[StrictStr] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, lt=2**31)  # 0: off, as the sampler takes it
    stream: bool = False
    metadata: Any = None  # ignored
    output_config: Any = None  # `format` {"type": "json_schema", "schema": ...}: structured output
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    cache_salt: str | None = Field(default=None, max_length=256)
    ignore_eos: bool = False


# ---- what is refused -------------------------------------------------------------------------------------
def refuse_unsupported(body: CountRequest) -> None:
    """Raise a ProtocolError naming the first field set to what the daemon does not implement."""
    choice = body.tool_choice.get("type") if isinstance(body.tool_choice, dict) else body.tool_choice
    thinking = body.thinking.get("type") if isinstance(body.thinking, dict) else body.thinking
    checks = [
        ("tools", bool(body.tools), "tool use is not supported (the model's chat template has no tool support)"),
        ("tool_choice", choice not in (None, "auto", "none"), "tool use is not supported (no tools)"),
        ("thinking", thinking not in (None, "disabled"), "extended thinking is not supported"),
    ]
    for field, refused, message in checks:
        if refused:
            raise ProtocolError(f"{field}: {message}", param=field)


def structured_format(output_config) -> dict | None:
    """`output_config.format` as the OpenAI routes' response_format (None: free text)."""
    fmt = output_config.get("format") if isinstance(output_config, dict) else None
    if output_config is not None and not isinstance(output_config, dict):
        raise ProtocolError("output_config: an object is expected", param="output_config")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ProtocolError("output_config.format: expected {\"type\": \"json_schema\", \"schema\": {...}}",
                            param="output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


# ---- blocks -> chat-template messages, breakpoints --------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Breakpoint:
    where: str  # the field that set it, e.g. "messages.2.content.0.cache_control"
    messages: tuple  # the chat-template messages up to and including its block
    ttl_s: float


@dataclasses.dataclass(frozen=True)
class Conversation:
    messages: list[dict]  # chat-template messages ({"role", "content"})
    prefill: bool  # the last message is the assistant's: the answer continues it
    breakpoints: list[Breakpoint]


def cache_ttl(control, where: str) -> float:
    """A cache_control object's TTL in seconds (`where`: its field)."""
    if not isinstance(control, dict) or control.get("type") != "ephemeral":
        raise ProtocolError(f"{where}: expected {{\"type\": \"ephemeral\"}} with an optional \"ttl\"", param=where)
    ttl = control.get("ttl", "5m")
    if not isinstance(ttl, str) or ttl not in TTL_SECONDS:
        raise ProtocolError(f"{where}.ttl: must be \"5m\" or \"1h\", got {json.dumps(ttl)}", param=where)
    return TTL_SECONDS[ttl]


def _text_blocks(content, where: str) -> list[tuple[str, float | None]]:
    """A string or a list of content blocks -> (text, ttl or None) per block; only text blocks."""
    if isinstance(content, str):
        return [(check_text(content, where), None)]
    out = []
    for j, block in enumerate(content):
        at = f"{where}.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(block, dict) or not isinstance(kind, str):
            raise ProtocolError(f"{at}: a content block is an object with a \"type\"", param=at)
        if kind in REFUSED_BLOCKS:
            raise ProtocolError(f"{at}: {kind} blocks are not supported ({REFUSED_BLOCKS[kind]})", param=at)
        if kind != "text":
            raise ProtocolError(f"{at}.type: unknown content block type {json.dumps(kind)} (only text)", param=at)
        if not isinstance(block.get("text"), str):
            raise ProtocolError(f"{at}.text: a text block needs a string \"text\"", param=at)
        control = block.get("cache_control")
        out.append((check_text(block["text"], f"{at}.text"),
                    None if control is None else cache_ttl(control, f"{at}.cache_control")))
    return out


def _marks(blocks: list[tuple[str, float | None]], where: str, before: list[dict], role: str) -> list[tuple]:
    """Each block's breakpoint, where it has one: (its cache_control field, the messages before its own,
    its message up to and including it, its TTL)."""
    texts = [t for t, _ in blocks]
    return [(f"{where}.{j}.cache_control", list(before), {"role": role, "content": "".join(texts[:j + 1])}, ttl)
            for j, (_, ttl) in enumerate(blocks) if ttl is not None]


def conversation(body: CountRequest) -> Conversation:
    """The request's system and messages as chat-template messages, with its breakpoints (at most
    MAX_BREAKPOINTS: a ProtocolError names the one past them)."""
    refuse_unsupported(body)
    messages, marks = [], []
    if body.system is not None:
        blocks = _text_blocks(body.system, "system")
        marks += _marks(blocks, "system", [], "system")
        text = "".join(t for t, _ in blocks)
        if text:  # an empty system prompt is none (the template's default, as without one)
            messages.append({"role": "system", "content": text})
    for i, m in enumerate(body.messages):
        blocks = _text_blocks(m.content, f"messages.{i}.content")
        marks += _marks(blocks, f"messages.{i}.content", messages, m.role)
        messages.append({"role": m.role, "content": "".join(t for t, _ in blocks)})
    if body.cache_control is not None:  # automatic placement: the end of the last message
        marks.append(("cache_control", messages[:-1], messages[-1], cache_ttl(body.cache_control, "cache_control")))
    if len(marks) > MAX_BREAKPOINTS:
        where = marks[MAX_BREAKPOINTS][0]
        raise ProtocolError(f"{where}: at most {MAX_BREAKPOINTS} cache_control breakpoints a request, this is "
                            f"the {MAX_BREAKPOINTS + 1}th", param=where)
    breakpoints = [Breakpoint(where, tuple(before) + (block,), ttl) for where, before, block, ttl in marks]
    prefill = messages[-1]["role"] == "assistant" and bool(messages[-1]["content"])
    if messages[-1]["role"] == "assistant" and not prefill:  # an empty assistant turn to continue: a new one
        messages.pop()
    return Conversation(messages, prefill, breakpoints)


def continue_final(render, messages: list[dict], where: str) -> str:
    """The conversation's prompt left open inside its final (assistant) message, right after its text,
    so that the answer continues it (Anthropic's prefill): `render(messages)` renders a conversation
    whole, and a marker standing for the final text shows where the template puts it (a search for
    the text itself could find it, or a character of it, in the template's own words after it)."""
    text = render(messages[:-1] + [{**messages[-1], "content": PREFILL_MARK}])
    if text.count(PREFILL_MARK) != 1:
        raise ProtocolError(f"{where}: the chat template does not keep this message's text as it is, so the answer "
                            "cannot continue it", param=where)
    return text[:text.index(PREFILL_MARK)] + messages[-1]["content"]


# ---- responses -------------------------------------------------------------------------------------------
def usage(prompt_tokens: int, read: int, created: int, output_tokens: int) -> dict:
    """Anthropic's usage: input_tokens counts the prompt's tokens neither read from the cache nor newly
    kept by its breakpoints, so the three sum to the prompt's."""
    return {"input_tokens": prompt_tokens - read - created, "cache_creation_input_tokens": created,
            "cache_read_input_tokens": read, "output_tokens": output_tokens}


def stop_reason(finish_reason: str, stop_string: str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if stop_string is not None:
        return "stop_sequence", stop_string
    return ("end_turn" if finish_reason == "stop" else "max_tokens"), None


def message(meta: dict, text: str, reason: tuple[str, str | None], usage_: dict) -> dict:
    """The Messages API's answer; meta: its id and model."""
    return {"id": meta["id"], "type": "message", "role": "assistant", "model": meta["model"],
            "content": [{"type": "text", "text": text}], "stop_reason": reason[0], "stop_sequence": reason[1],
            "usage": usage_}


# ---- streaming -------------------------------------------------------------------------------------------
def event(name: str, **fields) -> str:
    """One server-sent event: `event: NAME` and its data, an object whose type is NAME."""
    return f"event: {name}\ndata: {json.dumps({'type': name, **fields})}\n\n"


def stream_start(meta: dict, usage_: dict) -> str:
    """The events before the first text: message_start (with the prompt's usage), the text block's
    start, a ping."""
    started = {"id": meta["id"], "type": "message", "role": "assistant", "model": meta["model"], "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": usage_}
    return (event("message_start", message=started)
            + event("content_block_start", index=0, content_block={"type": "text", "text": ""})
            + event("ping"))


def text_delta(text: str) -> str:
    return event("content_block_delta", index=0, delta={"type": "text_delta", "text": text})


def stream_end(reason: tuple[str, str | None], usage_: dict) -> str:
    """The events after the last text: the block's stop, message_delta (the stop reason and the usage's
    cumulative counts), message_stop."""
    return (event("content_block_stop", index=0)
            + event("message_delta", delta={"stop_reason": reason[0], "stop_sequence": reason[1]}, usage=usage_)
            + event("message_stop"))


# ---- errors ----------------------------------------------------------------------------------------------
def speaks(path: str) -> bool:
    """Whether a request to `path` is the Messages API's (its errors answered in its shape)."""
    return path == PATHS[0] or path.startswith(PATHS[0] + "/")


def error_status(status: int) -> int:
    """The status Anthropic answers where the daemon's OpenAI routes answer `status`."""
    return OVERLOADED if status == 503 else status


def error_body(status: int, message_: str) -> dict:
    """Anthropic's error object; its type from the status."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message_}}
