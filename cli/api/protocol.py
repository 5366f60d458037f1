"""The OpenAI API's requests, as pure data: pydantic models, what is refused, and limits.

Nothing here touches a model or a server: the handlers in cli/server/serve.py validate a body with these
models, then call the functions below to turn it into prompts, chat-template messages and sampling
settings. A `ProtocolError` is a 400 naming the field at fault (see `error_body`).

Standard fields the daemon does not implement are refused by name (`refuse_unsupported`); unknown
extension fields are ignored, as OpenAI does.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from jaxsmol.cli.api.structured_request import GUIDED_FIELDS, structured_from_request
from jaxsmol.errors import JaxsmolError
from jaxsmol.runtime.sampling import SamplingParams

# Per-request limits (each stated in docs/serving.md).
MAX_N = 8  # choices per prompt
MAX_PROMPTS = 32  # prompts in one /v1/completions request
MAX_CHOICES = 32  # prompts x n
MAX_WORK_TOKENS = 16384  # sum of max_tokens over all choices of one request (n=8 x 2048)
MAX_STOP = 4  # stop strings, as OpenAI
MAX_STOP_CHARS = 128  # characters per stop string (the held-back tail is checked per token)
MAX_COMPLETION_LOGPROBS = 5  # the legacy API's limit
MAX_TOP_LOGPROBS = 20
DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 256}


class ProtocolError(Exception):
    """A request the API cannot serve; `param` names the field; `headers` go with the answer."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.headers = message, param, status, type_, headers


def error_body(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None) -> dict:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


# ---- request models -----------------------------------------------------------------------------------
TokenIds = list[StrictInt]  # StrictInt: true/false are not token ids


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[dict] | None = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None
    tool_calls: list | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, lt=2**31)  # the sampler takes it as an int32 (>= vocab = off)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: StrictStr | list[StrictStr] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: dict | None = None
    cache_salt: str | None = Field(default=None, max_length=256)  # partitions the cache within a tenant
    prompt_cache_key: StrictStr | None = Field(default=None, max_length=256)  # OpenAI's: cache_salt when that is unset
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None  # 24h: kept in the disk tier that long
    cached_content: StrictStr | None = Field(default=None, max_length=128)  # a named cached content to start from
    use_prefix_cache: bool = True  # false: this request bypasses the cache
    return_token_ids: bool = False  # add `token_ids` (generated ids) to each choice, as vLLM does
    # standard fields that are refused unless neutral (see refuse_unsupported)
    best_of: int | None = None
    logit_bias: dict | None = None
    suffix: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None
    response_format: Any = None  # structured output (jaxsmol/runtime/structured.py), as are the guided_* fields
    guided_json: Any = None  # vLLM's extensions
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    ignore_eos: bool = False  # vLLM's extension: keep generating past end-of-sequence (benchmarks)
    audio: Any = None
    modalities: list | None = None


class CompletionRequest(_Common):
    prompt: StrictStr | TokenIds | list[StrictStr] | list[TokenIds]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM's extension


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize: a prompt, or chat messages through the chat template."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[Message] | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: TokenIds


RETENTION_S = {"in_memory": None, "24h": 86400.0, None: None}


def request_salt(body: _Common, content_salt: str | None = None) -> str | None:
    """The request's cache namespace within its tenant: cache_salt, else prompt_cache_key, else its
    cached content's (ProtocolError where a given one differs from the content's: its KV lies there)."""
    salt = body.cache_salt if body.cache_salt is not None else body.prompt_cache_key
    if body.cached_content is None or salt is None or salt == content_salt:
        return content_salt if body.cached_content is not None else salt
    raise ProtocolError(f"cached_content: {body.cached_content} lies in another cache namespace (cache_salt "
                        f"{content_salt!r}); send the same cache_salt or prompt_cache_key, or none",
                        param="cached_content")


# ---- what is refused ---------------------------------------------------------------------------------
def refuse_unsupported(body: _Common) -> None:
    """Raise a ProtocolError naming the first standard field set to a value the daemon does not implement."""
    checks = [
        ("best_of", body.best_of not in (None, 1), "values other than 1 are not supported"),
        ("logit_bias", bool(body.logit_bias), "not supported"),
        ("suffix", bool(body.suffix), "not supported (no insertion)"),
        ("presence_penalty", bool(body.presence_penalty), "not supported (only 0)"),
        ("frequency_penalty", bool(body.frequency_penalty), "not supported (only 0)"),
        ("tools", bool(body.tools), "function calling is not supported"),
        ("tool_choice", body.tool_choice not in (None, "none"), "function calling is not supported"),
        ("functions", bool(body.functions), "function calling is not supported"),
        ("function_call", body.function_call not in (None, "none"), "function calling is not supported"),
        ("audio", body.audio is not None, "audio output is not supported"),
        ("modalities", body.modalities not in (None, ["text"]), "only the text modality is supported"),
    ]
    for field, refused, message in checks:
        if refused:
            raise ProtocolError(f"{field}: {message}", param=field)


# ---- requests -> prompts, messages, sampling -------------------------------------------------------------
def check_text(text: str, where: str) -> str:
    """`text` if it is valid Unicode (encodable as UTF-8); a lone surrogate such as "\\ud800" is refused."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ProtocolError(f"{where}: the text is not valid Unicode (it holds a lone surrogate)",
                            param=where) from None
    return text


def completion_prompts(prompt) -> list[str | list[int]]:
    """The prompt in any OpenAI form -> a list of prompts, each a text or a list of token ids."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and isinstance(prompt[0], list):
        prompts = list(prompt)
    elif prompt and isinstance(prompt[0], str):
        prompts = list(prompt)
    else:  # a list of token ids (possibly empty)
        prompts = [prompt]
    if len(prompts) > MAX_PROMPTS:
        raise ProtocolError(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        if len(p) == 0:
            raise ProtocolError(f"{where}: the prompt is empty", param="prompt")
        if isinstance(p, str):
            check_text(p, where)
    return prompts


def _content_text(m: Message, i: int) -> str:
    """A message's content as one string: a string, or the concatenated text of its text parts."""
    where = f"messages.{i}.content"
    if m.content is None:
        if m.role == "assistant":
            return ""
        raise ProtocolError(f"{where}: a {m.role} message needs content", param=where)
    if isinstance(m.content, str):
        return check_text(m.content, where)
    texts = []
    for j, part in enumerate(m.content):
        kind = part.get("type")
        if kind != "text":
            raise ProtocolError(f"{where}.{j}: only text content parts are supported, got type {kind!r}",
                                param=where)
        if not isinstance(part.get("text"), str):
            raise ProtocolError(f"{where}.{j}.text: a text part needs a string 'text'", param=where)
        texts.append(check_text(part["text"], where))
    return "".join(texts)


def template_messages(messages: list[Message]) -> list[dict]:
    """Chat messages -> the dicts the chat template renders. `developer` is rendered as `system`."""
    out = []
    for i, m in enumerate(messages):
        if m.tool_calls:
            raise ProtocolError(f"messages.{i}.tool_calls: tool calls are not supported", param=f"messages.{i}")
        d = {"role": "system" if m.role == "developer" else m.role, "content": _content_text(m, i)}
        for key in ("name", "tool_call_id"):
            if getattr(m, key) is not None:
                d[key] = check_text(getattr(m, key), f"messages.{i}.{key}")
        out.append(d)
    return out


def stop_strings(stop, where: str = "stop") -> tuple[str, ...]:
    """`stop` as OpenAI defines it: a string or up to MAX_STOP strings, each up to MAX_STOP_CHARS
    (`where`: the field's name in the request)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP:
        raise ProtocolError(f"{where}: at most {MAX_STOP} stop strings, got {len(stops)}", param=where)
    for s in stops:
        check_text(s, where)
        if len(s) > MAX_STOP_CHARS:
            raise ProtocolError(f"{where}: a stop string is at most {MAX_STOP_CHARS} characters, got {len(s)}",
                                param=where)
    return tuple(stops)


def request_seed(seed: int | None) -> int:
    """A request's seed, or a random one where it gives none (its choices then sample afresh)."""
    return seed if seed is not None else int.from_bytes(os.urandom(7), "little")


def check_work(n_prompts: int, n: int, max_tokens: int) -> None:
    """The per-request work cap: prompts x n choices, and max_tokens summed over them."""
    choices = n_prompts * n
    if choices > MAX_CHOICES:
        raise ProtocolError(f"n: {n_prompts} prompts x n={n} is {choices} choices, over the limit of "
                            f"{MAX_CHOICES} per request", param="n")
    if choices * max_tokens > MAX_WORK_TOKENS:
        raise ProtocolError(f"max_tokens: {choices} choices x max_tokens={max_tokens} is over the limit of "
                            f"{MAX_WORK_TOKENS} generated tokens per request", param="max_tokens")


def structured_spec(body: _Common) -> str | None:
    """The structured-output spec of `response_format` or a guided_* field (None: free text), or a
    ProtocolError naming the field."""
    fields = ("response_format",) + GUIDED_FIELDS
    try:
        return structured_from_request({f: getattr(body, f) for f in fields})
    except JaxsmolError as e:
        field = next((f for f in fields if f in str(e)), "response_format")
        raise ProtocolError(f"{e}", param=field) from None


def sampling_for(body: _Common, max_tokens: int, logprobs: int, seed: int, sample: int,
                 stops: tuple[str, ...], structured: str | None = None) -> SamplingParams:
    """The sampling settings of a prompt's `sample`-th choice (seed + sample: n choices differ, and a
    request with one choice and seed s + i repeats choice i)."""
    return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                          seed=(seed + sample) % 2**63, stop_strings=stops, logprobs=logprobs,
                          structured=structured, ignore_eos=body.ignore_eos)
