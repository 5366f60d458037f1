"""Redis GET straight into pages of its own: the RESP protocol over a socket, a value read with `readinto`
into an anonymous mapping of its size (host_memory.read_pages), which the shared store's arrays then
view as they are (cache/store/shared.py). redis-py reads a value into a bytes object, which the store
must then copy into memory of its own (a prefix store keeping replies would keep them in malloc's heap):
its GETs of a 2000-token prefix's 31 chunks (91 MB) on loopback took ~180 ms, these ~100 ms, and the
store's copy is gone too (docs/serving.md has the figures). Only GET is spoken here, on plain `redis://`
connections, one per reader thread; SET, EXISTS, DEL and TLS are redis-py's.
"""

from __future__ import annotations

import socket
import threading
from urllib.parse import unquote, urlsplit

from jaxsmol.system import host_memory

MAX_HEAD = 64  # a bulk reply's head: "$<length>\r\n"


class RespError(Exception):
    """An error reply (`-ERR ...`, `-NOAUTH ...`), or bytes that are not the reply asked for."""


class Closed(RespError):
    """The connection ended before a reply began."""


def command(*args: bytes) -> bytes:
    """A RESP array of bulk strings: how a client sends a command."""
    return b"".join([b"*%d\r\n" % len(args)] + [b"$%d\r\n%s\r\n" % (len(a), a) for a in args])


class RespReader:
    def __init__(self, url: str, connect_timeout: float, timeout: float):
        """A reader of the server `url` names (redis://[USER:PASSWORD@]HOST:PORT[/DB], checked already)."""
        parts = urlsplit(url)
        self.address, self.timeouts = (parts.hostname, parts.port), (connect_timeout, timeout)
        self.setup = []  # what a new connection sends first: AUTH, SELECT
        if parts.password is not None:
            user = [unquote(parts.username).encode()] if parts.username else []
            self.setup.append(command(b"AUTH", *user, unquote(parts.password).encode()))
        if parts.path.strip("/") not in ("", "0"):
            self.setup.append(command(b"SELECT", parts.path.strip("/").encode()))
        self._local = threading.local()

    def get(self, key: bytes):
        """The value of `key` (an anonymous mapping of its size, or bytes where empty), or None where there
        is none. OSError for the connection's faults, RespError for an error reply; either closes the
        connection (the next call opens another). A kept connection the server closed meanwhile (it
        restarted) is found closed before any reply: the call is made once more on a new one."""
        again = getattr(self._local, "conn", None) is not None  # a kept connection: one more try if found closed
        while True:
            try:
                return self._get(key)
            except BaseException as e:
                self.close()
                if not (again and isinstance(e, (Closed, ConnectionError))):
                    raise
                again = False

    def _get(self, key: bytes):
        sock, reply = self._connection()
        sock.sendall(command(b"GET", key))
        return self._bulk(reply)

    def _connection(self):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            sock = socket.create_connection(self.address, timeout=self.timeouts[0])
            sock.settimeout(self.timeouts[1])
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = self._local.conn = (sock, sock.makefile("rb"))
            for cmd in self.setup:
                sock.sendall(cmd)
                head = conn[1].readline(MAX_HEAD)
                if not head.startswith(b"+"):
                    raise RespError(head.decode(errors="replace").strip() or "connection closed")
        return conn

    @staticmethod
    def _bulk(reply):
        head = reply.readline(MAX_HEAD)
        if not head:
            raise Closed("the server closed the connection")
        if head.startswith(b"-"):
            raise RespError(head[1:].decode(errors="replace").strip())
        if not (head.startswith(b"$") and head.endswith(b"\r\n")):
            raise RespError(f"not a bulk reply: {head[:32]!r}")
        n = int(head[1:-2])
        if n < 0:
            return None
        value, got = host_memory.read_pages(reply.readinto, n)
        if got < n or reply.read(2) != b"\r\n":
            raise RespError(f"a reply cut short or malformed: {got} of {n} bytes, then no CRLF")
        return value

    def close(self) -> None:
        """Close this thread's connection, if any."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        for part in reversed(conn or ()):
            try:
                part.close()
            except OSError:
                pass
