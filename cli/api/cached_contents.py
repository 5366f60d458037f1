"""Named cached contents' requests and objects (Gemini's cachedContents, at /v1/cached_contents), as pure data.

A content is given as Gemini's `contents` (roles `user` and `model`, text parts) with an optional
`system_instruction`, as OpenAI's chat `messages`, or as a completion `prompt` (text or token ids). Its
lifetime is `ttl` (Gemini's duration, "300s" or "1.5s", or a number of seconds) or `expire_time` (RFC
3339), one hour by default, at most MAX_TTL_S. Field names are accepted in snake_case and, as Gemini's
REST API writes them, in camelCase; objects are answered in snake_case. Errors come in Gemini's shape
(`error_body`): code, message, status.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr

from jaxsmol.cli.api import protocol as P

PATH = "/v1/cached_contents"
DEFAULT_TTL_S = 3600.0  # Gemini's default
MAX_TTL_S = 7 * 86400.0
_DURATION = re.compile(r"(\d+(\.\d+)?)s")
_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
           408: "DEADLINE_EXCEEDED", 409: "ALREADY_EXISTS", 413: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED",
           499: "CANCELLED", 503: "UNAVAILABLE"}


class Part(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: StrictStr


class Content(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "model"] = "user"
    parts: list[Part] = Field(min_length=1)


class Instruction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str | None = None
    parts: list[Part] = Field(min_length=1)


class _Lifetime(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    ttl: StrictStr | StrictInt | StrictFloat | None = None
    expire_time: StrictStr | None = Field(default=None, alias="expireTime")


class CreateRequest(_Lifetime):
    model: StrictStr | None = None  # any value: the daemon serves one model
    display_name: StrictStr = Field(default="", alias="displayName", max_length=128)
    contents: list[Content] | None = Field(default=None, min_length=1)
    system_instruction: Instruction | None = Field(default=None, alias="systemInstruction")
    messages: list[P.Message] | None = Field(default=None, min_length=1)
    prompt: StrictStr | P.TokenIds | None = None
    cache_salt: StrictStr | None = Field(default=None, max_length=256)


class UpdateRequest(_Lifetime):
    """PATCH: a new lifetime, and nothing else (Gemini lets only the expiry change)."""


def gemini_error(status: int, message: str) -> dict:
    return {"error": {"code": status, "message": message, "status": _STATUS.get(status, "INTERNAL")}}


def speaks(path: str) -> bool:
    """Whether a request to `path` is this API's (its errors answered in Gemini's shape)."""
    return path == PATH or path.startswith(PATH + "/")


def ttl_seconds(body: _Lifetime, now: float, default: float | None = DEFAULT_TTL_S) -> float:
    """The lifetime a body asks for, in seconds from `now` (epoch seconds); ProtocolError naming the field."""
    if body.ttl is not None and body.expire_time is not None:
        raise P.ProtocolError("give ttl or expire_time, not both", param="ttl")
    if body.expire_time is not None:
        try:
            when = dt.datetime.fromisoformat(body.expire_time.replace("Z", "+00:00"))
        except ValueError:
            raise P.ProtocolError(f"expire_time: {body.expire_time!r} is not an RFC 3339 time", param="expire_time") \
                from None
        if when.tzinfo is None:
            raise P.ProtocolError("expire_time: give a time zone (Z or +HH:MM)", param="expire_time")
        seconds, where = when.timestamp() - now, "expire_time"
    elif body.ttl is not None:
        m = _DURATION.fullmatch(body.ttl) if isinstance(body.ttl, str) else None
        if isinstance(body.ttl, str) and m is None:
            raise P.ProtocolError(f"ttl: {body.ttl!r} is not a duration such as \"300s\"", param="ttl")
        seconds, where = float(m.group(1)) if m else float(body.ttl), "ttl"
    elif default is None:
        raise P.ProtocolError("give ttl or expire_time", param="ttl")
    else:
        return default
    if not 1.0 <= seconds <= MAX_TTL_S:
        raise P.ProtocolError(f"{where}: the lifetime must be 1 s to {MAX_TTL_S:.0f} s (7 days) from now, "
                              f"got {seconds:.3f} s", param=where)
    return seconds


def chat_messages(body: CreateRequest) -> list[dict] | None:
    """The content as chat-template messages (None for a prompt); ProtocolError naming the field."""
    given = [f for f in ("contents", "messages", "prompt") if getattr(body, f) is not None]
    if len(given) != 1:
        raise P.ProtocolError("give one of contents, messages or prompt", param="contents")
    if body.system_instruction is not None and body.contents is None:
        raise P.ProtocolError("system_instruction goes with contents (put a system message in messages)",
                              param="system_instruction")
    if body.messages is not None:
        return P.template_messages(body.messages)
    if body.contents is None:
        return None
    out = []
    if body.system_instruction is not None:
        out.append({"role": "system", "content": _text(body.system_instruction.parts, "system_instruction")})
    for i, c in enumerate(body.contents):
        out.append({"role": "assistant" if c.role == "model" else "user",
                    "content": _text(c.parts, f"contents.{i}")})
    return out


def _text(parts: list[Part], where: str) -> str:
    return "".join(P.check_text(p.text, f"{where}.parts.{i}.text") for i, p in enumerate(parts))


def rfc3339(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def content_object(name: str, model: str, display_name: str, tokens: int, created: float, updated: float,
                   expires: float, cache_salt: str | None) -> dict:
    out = {"name": name, "display_name": display_name, "model": model, "create_time": rfc3339(created),
           "update_time": rfc3339(updated), "expire_time": rfc3339(expires),
           "usage_metadata": {"total_token_count": tokens}}
    return out | ({"cache_salt": cache_salt} if cache_salt is not None else {})
