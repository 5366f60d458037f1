"""One line per HTTP request on stderr, as llama-server and vLLM print them: the client, method, path,
status, and for a generation its prompt, cached and generated tokens, time to first token and total
time, and the tenant when API keys are on. `--no-access-log` turns it off; uvicorn's own access log
stays off (one line a request, not two). The probes (/health, /ready), polled every few seconds by
balancers, are left out, as llama-server leaves out its /health.

`AccessLog` (ASGI middleware) starts a request's `AccessRecord` and logs it once the answer is sent
(a stream's last event included); the handlers fill it in through `record(request)`.

    127.0.0.1:40312 "POST /v1/completions" 200 prompt=5 cached=0 generated=8 ttft=0.041s total=0.212s tenant=team-b
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import time

from jaxsmol.cli.server.limits import StatusSend

LOGGER = logging.getLogger("jaxsmol.access")
PROBES = ("/health", "/ready")
MAX_PATH = 200  # characters of a path in a line
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SCOPE_KEY = "jaxsmol.access"


@dataclasses.dataclass
class AccessRecord:
    """What one request's line says beyond its method, path and status; None: not a generation."""
    start: float  # time.monotonic() when it arrived
    tenant: str | None = None  # the cache namespace of its API key
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    generated_tokens: int | None = None
    first_token: float | None = None  # time.monotonic() of its first token's event

    def note_tenant(self, namespace: str | None) -> None:
        """The tenant's name from its cache namespace (cli/server/tenants.py): a keys file's NAMESPACE,
        or the start of the key's digest for a key with a namespace of its own (never the key)."""
        if namespace is not None:
            kind, _, name = namespace.partition(":")
            self.tenant = name if kind == "ns" else f"key:{name[:8]}"

    def note_usage(self, usage: dict) -> None:
        """A generation's token counts, as its response's `usage` gives them."""
        self.prompt_tokens, self.generated_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        self.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]

    def note_token(self) -> None:
        """An event of the generation reached the handler: the first one is its first token."""
        if self.first_token is None:
            self.first_token = time.monotonic()

    def line(self, scope, status: int, end: float) -> str:
        host, port = scope.get("client") or ("-", 0)
        words = [f"{host}:{port}", f'"{scope["method"]} {_printable(scope)}"', str(status)]
        if self.prompt_tokens is not None:
            words += [f"prompt={self.prompt_tokens}", f"cached={self.cached_tokens}",
                      f"generated={self.generated_tokens}"]
        if self.first_token is not None:
            words.append(f"ttft={self.first_token - self.start:.3f}s")
        words.append(f"total={end - self.start:.3f}s")
        if self.tenant is not None:
            words.append(f"tenant={self.tenant}")
        return " ".join(words)


def _printable(scope) -> str:
    """The request's path as the client sent it (percent-escapes kept: a %0A decoded would forge a line),
    other bytes escaped, at most MAX_PATH characters."""
    raw = scope.get("raw_path") or scope["path"].encode("utf-8", "backslashreplace")
    text = _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", raw.decode("ascii", "backslashreplace"))
    return text if len(text) <= MAX_PATH else text[:MAX_PATH] + "..."


def record(request) -> AccessRecord:
    """The request's record (a throwaway one when the access log is off)."""
    return request.scope.get(_SCOPE_KEY) or AccessRecord(0.0)


class AccessLog:
    """ASGI middleware: logs each request's line (LOGGER, INFO) once its answer is sent."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in PROBES:
            return await self.app(scope, receive, send)
        rec = scope[_SCOPE_KEY] = AccessRecord(time.monotonic())
        noted_send = StatusSend(send)
        try:
            await self.app(scope, receive, noted_send)
        finally:
            LOGGER.info(rec.line(scope, noted_send.status, time.monotonic()))


def log_to_stderr() -> None:
    """The daemon's log records (the access log's, the prefix cache's warnings) on stderr, with the time."""
    logger = logging.getLogger("jaxsmol")
    if not any(getattr(h, "jaxsmol_stderr", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
        handler.jaxsmol_stderr = True
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # printed once, whatever the root logger does
