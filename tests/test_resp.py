"""Redis GET into pages of their own (cache/store/resp.py), as the shared store's Redis backend reads: against
a real `redis-server` with a password and a database, and against a scripted server for the replies a
real one sends only when something breaks (cut short, silent): never a partial value, a clear error."""

from __future__ import annotations

import mmap
import socket
import threading

import numpy as np
import pytest

from jaxsmol.cache.store.resp import RespError, RespReader
from jaxsmol.cache.store.shared import decode, encode
from jaxsmol.cache.store.shared_backends import REDIS_PREFIX, BackendError, RedisBackend
from jaxsmol.system import host_memory
from test_shared_cache import RedisServer


def test_values_come_into_pages_of_their_own_with_a_password_and_a_database(tmp_path):
    import redis

    server = RedisServer(tmp_path)
    url = server.url.replace("redis://", "redis://:s3cret@").replace("/0", "/2")
    try:
        redis.Redis.from_url(server.url).config_set("requirepass", "s3cret")
        backend = RedisBackend(url)
        k, v = (np.random.default_rng(i).standard_normal((2, 1, 2, 32, 16), np.float32) for i in (1, 2))
        value = encode("ab" * 16, range(32), k, v)
        backend.put("ab" * 16, value)
        got = backend.get("ab" * 16)
        assert isinstance(got, mmap.mmap) and got[:] == value
        k2, v2 = decode(got, "ab" * 16, range(32), np.dtype(np.float32), k.shape)
        assert host_memory.owns(k2) and np.array_equal(k2, k) and np.array_equal(v2, v)
        assert backend.get("cd" * 16) is None
        assert redis.Redis.from_url(url).get(REDIS_PREFIX + "ab" * 16) == value  # database 2, not 0
        redis.Redis.from_url(url).rpush(REDIS_PREFIX + "ef" * 16, b"x")
        with pytest.raises(BackendError, match="WRONGTYPE"):
            backend.get("ef" * 16)
        assert backend.get("ab" * 16)[:] == value  # the reader connected again
        wrong = RespReader(url.replace("s3cret", "nope"), 0.5, 1.0)
        with pytest.raises(RespError, match="WRONGPASS|invalid"):
            wrong.get(b"x")
    finally:
        server.stop()


def scripted(reply: bytes):
    """A server on a free loopback port that answers one command with `reply`, then closes."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = listener.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(reply)
            if reply:
                conn.shutdown(socket.SHUT_WR)
            else:
                conn.recv(1024)  # silent until the client gives up
        listener.close()
    threading.Thread(target=serve, daemon=True).start()
    return f"redis://127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.parametrize("reply, says", [(b"$100\r\n" + b"x" * 50, "cut short or malformed: 50 of 100"),
                                         (b"$4\r\nabcdXY", "cut short"),
                                         (b"+OK\r\n", "not a bulk reply"),
                                         (b"-ERR no\r\n", "ERR no")])
def test_a_broken_reply_is_an_error_never_a_value(reply, says):
    reader = RespReader(scripted(reply), 0.5, 1.0)
    with pytest.raises(RespError, match=says):
        reader.get(b"key")
    assert reader._local.conn is None  # closed: the next call connects again


def test_a_silent_server_times_out():
    reader = RespReader(scripted(b""), 0.5, 0.2)
    with pytest.raises(TimeoutError):
        reader.get(b"key")


def test_a_connection_the_server_closed_is_opened_again_once():
    """A kept connection found closed before any reply (the server restarted): the GET is made again on a
    new connection; a new connection found closed is an error."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        first, _ = listener.accept()
        first.recv(1024)
        first.sendall(b"$1\r\na\r\n")
        first.close()  # as a restarted server's was
        second, _ = listener.accept()
        with second:
            second.recv(1024)
            second.sendall(b"$1\r\nb\r\n")
        third, _ = listener.accept()
        third.close()
    threading.Thread(target=serve, daemon=True).start()
    reader = RespReader(f"redis://127.0.0.1:{listener.getsockname()[1]}", 0.5, 1.0)
    assert reader.get(b"k")[:] == b"a" and reader.get(b"k")[:] == b"b"
    reader.close()
    with pytest.raises(RespError, match="closed"):
        reader.get(b"k")
    listener.close()
