"""Where the shared KV store's values live (cache/store/shared.py says what a value is): a directory
several daemons share, or a Redis server. Both map a key (hex digits) to bytes and know nothing else.

`DirBackend`: one file per key, `DIR/<first 2 hex digits>/<key>.kv`, written to a temporary file in the
same directory and renamed over the name (`os.replace`): a reader sees the old file or the new one, never
half of one, so any number of writers on one filesystem (NFS included: rename is atomic there too) may
write the same key at once. No fsync: a value torn by a crash fails its length or checksum when read and
is refused. With `budget_bytes`, the oldest files (by mtime; a hit touches its file) go first once this
process's count of the directory's bytes passes the budget, recounted by a scan when it does.

`RedisBackend`: `redis://[:PASSWORD@]HOST:PORT[/DB]` (or `rediss://`), redis-py imported only here and
only then. Short socket timeouts and no retries: a dead server costs a request one refused connection,
and for `DOWN_S` after a failure no call is tried at all (each answers `Unavailable` at once); the first
call after that reconnects. A full server (maxmemory with noeviction answers SET with OOM) raises `Full`.

Both raise `BackendError` subclasses, never the client's own errors; SharedStore counts them. Both read a
value into pages of its own (an anonymous mapping, host_memory.read_pages; GET on Redis through
cache/store/resp.py), which the store's arrays view as it is: a value is copied once on its way in.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import time
from pathlib import Path
from urllib.parse import urlsplit

from jaxsmol.cache.store.resp import RespError, RespReader
from jaxsmol.errors import JaxsmolError
from jaxsmol.system import host_memory

REDIS_PREFIX = "jaxsmol:kv:"
SOCKET_TIMEOUT_S = 1.0  # per read or write on the socket: a 12 MB value takes ~10 ms on loopback
CONNECT_TIMEOUT_S = 0.5
DOWN_S = 1.0  # after a failed call, calls fail at once for this long (then one tries to reconnect)
_KEY = re.compile(r"[0-9a-f]{16,128}")


class BackendError(Exception):
    reason = "error"


class Unavailable(BackendError):
    reason = "unavailable"


class Full(BackendError):
    reason = "full"


def open_backend(spec: str, budget_bytes: int | None = None):
    """The backend that `spec` names (a redis:// URL or a directory); JaxsmolError naming what is wrong."""
    spec = str(spec)
    if spec.startswith(("redis://", "rediss://")):
        return RedisBackend(spec)
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", spec):
        raise JaxsmolError(f"shared cache {spec!r}: unknown scheme (use redis://HOST:PORT[/DB] or a directory)")
    if not spec:
        raise JaxsmolError("shared cache: empty location (use redis://HOST:PORT[/DB] or a directory)")
    return DirBackend(spec, budget_bytes)


class DirBackend:
    def __init__(self, directory, budget_bytes: int | None = None):
        if budget_bytes is not None and budget_bytes <= 0:
            raise JaxsmolError(f"shared cache budget must be > 0 bytes, got {budget_bytes}")
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise JaxsmolError(f"cannot use shared cache directory {self.dir}: {e.strerror or e}") from None
        self.budget_bytes = budget_bytes
        self.evicted = 0
        self._held = self._scan()[0] if budget_bytes is not None else 0

    def describe(self) -> str:
        return f"directory {self.dir}"

    def _path(self, key: str) -> Path:
        if not _KEY.fullmatch(key):
            raise ValueError(f"not a shared-store key: {key!r}")
        return self.dir / key[:2] / f"{key}.kv"

    def get(self, key: str):
        """The value (read into pages of its own: the store's arrays view it as it is), or None."""
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                data, got = host_memory.read_pages(f.readinto, os.fstat(f.fileno()).st_size)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise Unavailable(f"{path}: {e.strerror or e}") from None
        if got < len(data):  # cut short under the reader: what was read, for the store to refuse
            data = bytes(data[:got])
        if self.budget_bytes is not None:
            with contextlib.suppress(OSError):
                os.utime(path)  # a hit is recent: the oldest-first eviction keeps it
        return data

    def exists(self, keys: list[str]) -> list[bool]:
        return [self._path(k).is_file() for k in keys]

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            path.parent.mkdir(exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # tenants' token ids: the owner's only
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            error = Full if e.errno in (errno.ENOSPC, errno.EDQUOT) else BackendError
            raise error(f"{path}: {e.strerror or e}") from None
        self._held += len(data)
        if self.budget_bytes is not None and self._held > self.budget_bytes:
            self._shrink()

    def delete(self, key: str) -> None:
        with contextlib.suppress(OSError):
            self._path(key).unlink()

    def _scan(self) -> tuple[int, list]:
        """(bytes of the values, [(mtime, size, path)] of each); temporary files over a minute old (a
        writer that died mid-write) are removed."""
        held, files, now = 0, [], time.time()
        for p in self.dir.glob("??/*"):
            with contextlib.suppress(OSError):
                st = p.stat()
                if p.name.endswith(".tmp"):
                    if now - st.st_mtime > 60:
                        p.unlink()
                    continue
                held += st.st_size
                files.append((st.st_mtime, st.st_size, p))
        return held, files

    def _shrink(self) -> None:
        """The oldest values out until the directory holds 90% of the budget (room for the next writes)."""
        held, files = self._scan()
        for _, size, p in sorted(files, key=lambda f: f[0]):
            if held <= 0.9 * self.budget_bytes:
                break
            with contextlib.suppress(OSError):
                p.unlink()
                held -= size
                self.evicted += 1
        self._held = held

    def close(self) -> None:
        pass


def _redis_url_error(url: str) -> str | None:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        return str(e)
    if not parts.hostname:
        return "no host"
    if port is None:
        return "no port"
    if parts.path not in ("", "/") and not parts.path[1:].isdigit():
        return f"the database must be a number, got {parts.path[1:]!r}"
    return None


class RedisBackend:
    def __init__(self, url: str):
        problem = _redis_url_error(url)
        if problem:
            raise JaxsmolError(f"shared cache {url!r} is not redis://HOST:PORT[/DB]: {problem}")
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise JaxsmolError("a redis:// shared cache needs redis-py: pip install redis") from None
        self._errors = redis.exceptions
        parts = urlsplit(url)
        self.url = url.replace(f":{parts.password}@", ":***@") if parts.password else url
        self.client = redis.Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT_S,
                                           socket_connect_timeout=CONNECT_TIMEOUT_S, retry=Retry(NoBackoff(), 0))
        # GET into pages of its own (cache/store/resp.py) on plain connections; TLS through redis-py
        self._reader = RespReader(url, CONNECT_TIMEOUT_S, SOCKET_TIMEOUT_S) if parts.scheme == "redis" else None
        self._down_until = 0.0
        try:
            self.client.ping()
        except self._errors.RedisError as e:
            raise JaxsmolError(f"cannot reach the shared cache at {self.url}: {e}") from None

    def describe(self) -> str:
        return f"Redis at {self.url}"

    def _call(self, fn, *args):
        """fn(*args), its failures as BackendError: a dead server marks the backend down for DOWN_S."""
        if time.monotonic() < self._down_until:
            raise Unavailable(f"{self.url} was unreachable less than {DOWN_S} s ago")
        try:
            return fn(*args)
        except (self._errors.ConnectionError, self._errors.TimeoutError, OSError) as e:
            self._down_until = time.monotonic() + DOWN_S
            raise Unavailable(f"{self.url}: {e}") from None
        except RespError as e:
            raise BackendError(f"{self.url}: {e}") from None
        except self._errors.ResponseError as e:
            if isinstance(e, getattr(self._errors, "OutOfMemoryError", ())) or str(e).startswith("OOM"):
                raise Full(f"{self.url}: {e}") from None
            raise BackendError(f"{self.url}: {e}") from None
        except self._errors.RedisError as e:
            raise BackendError(f"{self.url}: {e}") from None

    def get(self, key: str):
        if self._reader is None:
            return self._call(self.client.get, REDIS_PREFIX + key)
        return self._call(self._reader.get, (REDIS_PREFIX + key).encode())

    def exists(self, keys: list[str]) -> list[bool]:
        def ask():
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(REDIS_PREFIX + k)
            return [bool(n) for n in pipe.execute()]

        return self._call(ask) if keys else []

    def put(self, key: str, data: bytes) -> None:
        self._call(self.client.set, REDIS_PREFIX + key, data)

    def delete(self, key: str) -> None:
        with contextlib.suppress(BackendError):
            self._call(self.client.delete, REDIS_PREFIX + key)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
