"""What the daemon refuses at the HTTP level, before a route sees a request: a body over the size
limit (413), and a request that does not arrive in time (408, `--read-timeout`).

A connection whose request headers have not arrived whole within the read timeout of its first byte
(or of the connection, for one that sends nothing) is answered 408 and closed by `ReadTimeoutProtocol`,
uvicorn's httptools protocol with a timer: uvicorn itself only times out idle keep-alive connections,
so a half-sent request held its connection forever. A body that stalls (no part of it for the read
timeout) is answered 408 and its connection closed by `RequestLimits`, where the app reads it. Both
are counted in /metrics (`jaxsmol_read_timeouts_total{phase}`).
"""

from __future__ import annotations

import asyncio
import functools
import json

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from jaxsmol.cli.api import anthropic as A
from jaxsmol.cli.api import cached_contents as G
from jaxsmol.cli.api import protocol as P

MAX_BODY_BYTES = 4 << 20
DEFAULT_READ_TIMEOUT_S = 30.0


def error_response(status: int, message: str, type_: str = "invalid_request_error", param=None,
                   headers=None, path: str = "") -> JSONResponse:
    """An error answer in the shape of the API `path` belongs to: Anthropic's on its Messages routes
    (its status for an overloaded server too), Gemini's on the cached contents', else OpenAI's."""
    if G.speaks(path):
        return JSONResponse(G.gemini_error(status, message), status_code=status, headers=headers)
    if A.speaks(path):
        status = A.error_status(status)
        return JSONResponse(A.error_body(status, message), status_code=status, headers=headers)
    return JSONResponse(P.error_body(status, message, type_, param), status_code=status, headers=headers)


class StatusSend:
    """An ASGI `send` that notes the status of the answer it sends: 500 until one starts (the app
    raised before it answered: the error middleware outside sends a 500)."""

    def __init__(self, send):
        self.send, self.status = send, 500

    async def __call__(self, message):
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self.send(message)


class RequestLimits:
    """ASGI middleware: counts requests by route and status; refuses bodies over `limit` bytes with
    413 (at once from the Content-Length, else when a chunked body's read passes the limit), and a
    body that stalls for `read_timeout_s` with 408, closing its connection.

    Plain ASGI on purpose: Starlette's BaseHTTPMiddleware (`@app.middleware("http")`) hides the
    client's disconnect from `Request.is_disconnected()`, which the handlers rely on to cancel jobs.
    A path that is no route is counted as "other" (Metrics.endpoint): clients cannot add label values.
    """

    def __init__(self, app, metrics, limit: int = MAX_BODY_BYTES, read_timeout_s: float = DEFAULT_READ_TIMEOUT_S):
        self.app, self.limit, self.metrics, self.read_timeout_s = app, limit, metrics, read_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        counted_send, seen, whole = StatusSend(send), 0, False

        async def limited_receive():
            nonlocal seen, whole
            if whole:  # the body is in: what follows is the wait for a disconnect, as long as the answer takes
                return await receive()
            message = await self._next_part(receive)
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                whole = not message.get("more_body", False)
                if seen > self.limit:
                    raise StarletteHTTPException(413, f"request body over {self.limit} bytes")
            return message

        length = dict(scope["headers"]).get(b"content-length")
        try:
            if length is not None and (not length.isdigit() or int(length) > self.limit):
                await error_response(413, f"request body over {self.limit} bytes", path=scope["path"])(
                    scope, receive, counted_send)
            else:
                await self.app(scope, limited_receive, counted_send)
        finally:
            self.metrics.request(scope["path"], counted_send.status)

    async def _next_part(self, receive):
        """The body's next part, or a 408 (its connection closed after) when none comes in time."""
        try:
            return await asyncio.wait_for(receive(), self.read_timeout_s)
        except asyncio.TimeoutError:
            self.metrics.read_timed_out("body")
            raise StarletteHTTPException(408, f"the request body did not arrive: nothing of it for "
                                              f"{self.read_timeout_s:g} s (--read-timeout)",
                                         headers={"connection": "close"}) from None


class ReadTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing a connection whose request headers do not arrive whole
    within `read_timeout_s` (with a 408): from the connection's start, then from each request's first
    byte. Between requests uvicorn's keep-alive timeout closes an idle connection, as before."""

    def __init__(self, *args, read_timeout_s: float, on_timeout, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout_s, self.on_timeout = read_timeout_s, on_timeout
        self.header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.header_timer is None:
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self.header_timer = self.loop.call_later(self.read_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _timed_out(self) -> None:
        self.header_timer = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # the server holds the bytes back (a pipelined request waits): not the client
            self._arm()
            return
        self.on_timeout("headers")
        body = json.dumps(P.error_body(408, f"the request headers did not arrive within {self.read_timeout_s:g} s "
                                            "(--read-timeout)")).encode()
        self.transport.write(b"".join([STATUS_LINE[408], b"content-type: application/json\r\n",
                                       b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body]))
        self.transport.close()


def read_timeout_protocol(read_timeout_s: float, metrics):
    """The `http` protocol to hand uvicorn: ReadTimeoutProtocol with this timeout, counting in `metrics`."""
    return functools.partial(ReadTimeoutProtocol, read_timeout_s=read_timeout_s, on_timeout=metrics.read_timed_out)
