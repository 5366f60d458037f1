"""A small client for the daemon (httpx): one streamed completion, timed, and the cache probe."""

from __future__ import annotations

import json
import time

import httpx

from jaxsmol.errors import JaxsmolError


def _error_message(resp: httpx.Response) -> str:
    """The message of an OpenAI error body, else the status line."""
    try:
        return resp.json()["error"]["message"]
    except Exception:
        return resp.reason_phrase or "error"


def _events(resp: httpx.Response):
    """The JSON objects of a server-sent event stream (its `data:` lines), up to `[DONE]`."""
    for line in resp.iter_lines():
        line = line.strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise JaxsmolError(f"server error: {chunk['error']['message']}")
        yield chunk


def complete(url: str, prompt_ids: list[int], max_tokens: int, *, salt: str | None = None, timeout: float = 600,
             **sampling) -> dict:
    """POST /v1/completions with streaming; returns text, token_ids, cached_tokens, ttft_s, total_s."""
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}, "temperature": 0.0, **sampling}
    if salt is not None:
        body["cache_salt"] = salt
    t0 = time.perf_counter()
    ttft, text, ids, usage = None, "", [], {}
    try:
        with httpx.stream("POST", url.rstrip("/") + "/v1/completions", json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                resp.read()
                raise JaxsmolError(f"server answered {resp.status_code}: {_error_message(resp)}")
            for chunk in _events(resp):
                for choice in chunk.get("choices", []):
                    if ttft is None and choice.get("finish_reason") is None:
                        ttft = time.perf_counter() - t0
                    text += choice.get("text", "")
                    ids = choice.get("token_ids", ids)
                usage = chunk.get("usage") or usage
    except (httpx.HTTPError, httpx.InvalidURL) as e:  # cannot connect, a bad URL, a timeout, a broken stream
        raise JaxsmolError(f"cannot reach the daemon at {url}: {e}") from None
    total = time.perf_counter() - t0
    return {"prompt_ids": prompt_ids, "output_ids": ids, "text": text, "ttft_s": ttft or total, "total_s": total,
            "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
            "prompt_tokens": usage.get("prompt_tokens", len(prompt_ids))}


def remote_probe(url: str, prompt_ids: list[int], max_tokens: int, then_ids=None) -> dict:
    """The probe against a running daemon: two requests in a fresh cache namespace (a random salt)."""
    import uuid

    salt = "probe-" + uuid.uuid4().hex
    cold = complete(url, prompt_ids, max_tokens, salt=salt)
    warm = complete(url, then_ids or prompt_ids, max_tokens, salt=salt)
    reference = cold if not then_ids else complete(url, then_ids, max_tokens, salt=salt + "-ref")
    return {"url": url, "max_tokens": max_tokens, "cold": cold, "warm": warm,
            "identical": warm["output_ids"] == reference["output_ids"] and warm["text"] == reference["text"],
            "ttft_speedup": cold["ttft_s"] / max(warm["ttft_s"], 1e-9)}
