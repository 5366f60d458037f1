"""The OpenAI API's responses, as pure functions: choices, usage, logprobs and server-sent-event chunks.

Inputs are the worker's plain results (cli/api/events.py) and `decode`, a function from a token id to its
text; outputs are JSON-able dicts. Nothing here touches a model or a server.

A logprob entry is {"token": id, "logprob": float, "top": [(id, logprob), ...], "rank"?: int}, as in
`ChoiceResult.logprobs` and `jaxsmol.runtime.scoring.TokenScore.as_dict`; the first prompt position has none.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from jaxsmol.cache.scheduler.requests import ChoiceResult
from jaxsmol.cli.api.events import ChoiceSpec
from jaxsmol.runtime.stream import Step

Decode = Callable[[int], str]
SSE_DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def step_entry(step: Step) -> dict | None:
    """A streamed Step's logprob entry (None when logprobs were not asked for)."""
    if step.logprob is None:
        return None
    return {"token": step.token, "logprob": step.logprob, "top": step.top_logprobs or []}


# ---- usage -----------------------------------------------------------------------------------------------
def usage(results: list[ChoiceResult], n: int) -> dict:
    """Token counts of a request whose choices p*n .. p*n + n - 1 share prompt p: each prompt counts once
    (with the cache use of its first choice, the only one that could not reuse its siblings' work)."""
    prompt = cached = completion = 0
    for r in results:
        completion += len(r.output_ids)
        if r.index % n == 0:
            prompt += r.prompt_tokens
            cached += r.cached_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# ---- logprobs --------------------------------------------------------------------------------------------
def _top_dict(entry: dict, k: int, decode: Decode) -> dict:
    """The legacy API's top_logprobs for one position: the k most likely tokens plus the chosen one."""
    top = {decode(i): lp for i, lp in entry["top"][:k]}
    top.setdefault(decode(entry["token"]), entry["logprob"])
    return top


def completion_logprobs(pairs: list[tuple[int, dict | None]], k: int, decode: Decode, offset: int = 0) -> dict:
    """Legacy `logprobs` over (token id, entry or None) pairs: tokens, token_logprobs (null where there
    is no entry: the first prompt token), top_logprobs (likewise) and text_offset from `offset`."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in pairs:
        s = decode(token)
        out["tokens"].append(s)
        out["token_logprobs"].append(None if entry is None else entry["logprob"])
        out["top_logprobs"].append(None if entry is None else _top_dict(entry, k, decode))
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def chat_logprobs(entries: list[dict], k: int, decode: Decode) -> dict:
    """Chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [k entries]}]}."""
    def one(i, lp):
        s = decode(i)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", "replace"))}
    return {"content": [{**one(e["token"], e["logprob"]), "top_logprobs": [one(i, lp) for i, lp in e["top"][:k]]}
                        for e in entries]}


def vllm_prompt_logprobs(prompt_ids: list[int], entries: list, k: int, decode: Decode) -> list:
    """vLLM's `prompt_logprobs`: None, then per position {id: {logprob, rank, decoded_token}} for the
    prompt token and the k most likely tokens."""
    out = [None]
    for token, e in zip(prompt_ids[1:], entries[1:]):
        d = {str(i): {"logprob": lp, "rank": r + 1, "decoded_token": decode(i)}
             for r, (i, lp) in enumerate(e["top"][:k])}
        d.setdefault(str(token), {"logprob": e["logprob"], "rank": e.get("rank"), "decoded_token": decode(token)})
        out.append(d)
    return out


# ---- choices ---------------------------------------------------------------------------------------------
def completion_choice(result: ChoiceResult, spec: ChoiceSpec, decode: Decode, *, prompt_text: str,
                      logprobs: int | None, prompt_logprobs: int | None, return_token_ids: bool) -> dict:
    """One /v1/completions choice; with echo, the prompt (and its logprobs) come first."""
    text = (prompt_text if spec.echo else "") + result.text
    lp = None
    if logprobs is not None:
        pairs = [(e["token"], e) for e in result.logprobs]
        if spec.echo:
            pairs = list(zip(spec.prompt_ids, result.prompt_logprobs)) + pairs
        lp = completion_logprobs(pairs, logprobs, decode)
    choice = {"index": result.index, "text": text, "logprobs": lp, "finish_reason": result.finish_reason}
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(spec.prompt_ids, result.prompt_logprobs, prompt_logprobs,
                                                         decode)
    if return_token_ids:
        choice["token_ids"] = result.output_ids
    return choice


def chat_choice(result: ChoiceResult, decode: Decode, *, top_logprobs: int | None, return_token_ids: bool) -> dict:
    """One /v1/chat/completions choice (top_logprobs None: logprobs were not asked for)."""
    lp = None if top_logprobs is None else chat_logprobs(result.logprobs, top_logprobs, decode)
    choice = {"index": result.index, "message": {"role": "assistant", "content": result.text}, "logprobs": lp,
              "finish_reason": result.finish_reason}
    if return_token_ids:
        choice["token_ids"] = result.output_ids
    return choice


def completion_object(meta: dict, choices: list[dict], usage_: dict, chat: bool) -> dict:
    return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": choices, "usage": usage_}


# ---- streaming -------------------------------------------------------------------------------------------
def chunk(meta: dict, chat: bool, choices: list[dict], usage_: dict | None = None) -> dict:
    obj = {**meta, "object": "chat.completion.chunk" if chat else "text_completion", "choices": choices}
    if usage_ is not None:
        obj["usage"] = usage_
    return obj


def completion_token_choice(index: int, step: Step, decode: Decode, logprobs: int | None, offset: int) -> dict:
    """A streamed completion token; `offset` is where its text starts in the choice's text."""
    entry = step_entry(step)
    lp = None if logprobs is None or entry is None else completion_logprobs([(step.token, entry)], logprobs,
                                                                          decode, offset)
    return {"index": index, "text": step.text, "logprobs": lp, "finish_reason": None}


def chat_token_choice(index: int, step: Step, decode: Decode, top_logprobs: int | None, first: bool) -> dict:
    """A streamed chat token; the first delta of a choice carries the role."""
    delta = {"role": "assistant", "content": step.text} if first else {"content": step.text}
    entry = step_entry(step)
    lp = None if top_logprobs is None or entry is None else chat_logprobs([entry], top_logprobs, decode)
    return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": None}


def final_choice(result: ChoiceResult, chat: bool, return_token_ids: bool) -> dict:
    """The last chunk of a streamed choice: its finish_reason."""
    choice = {"index": result.index, "logprobs": None, "finish_reason": result.finish_reason}
    choice.update({"delta": {}} if chat else {"text": ""})
    if return_token_ids:
        choice["token_ids"] = result.output_ids
    return choice
