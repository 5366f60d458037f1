"""A `jaxsmol serve` daemon for the serving sections: started (`python -m jaxsmol.cli.main serve`) on a free
loopback port with the benchmark's model flags, ready once /health answers, stopped on exit. Its
output goes to a log file, whose tail an error quotes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxsmol.cli.replicas import PACKAGE_ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_flags(args, default_ctx: int | None = 2048) -> list[str]:
    """The benchmark's --model/--ctx/--dtype/--quantize/--kv-dtype/--matmul/--tp/--dp as a command's flags (ctx
    default_ctx unless given)."""
    out = ["--model", str(args.model)] if args.model else []
    ctx = args.ctx or default_ctx
    out += ["--ctx", str(ctx)] if ctx else []
    out += ["--dtype", args.dtype]
    for flag in ("quantize", "kv_dtype", "matmul"):
        if getattr(args, flag, None) not in (None, "auto"):
            out += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    for flag in ("tp", "dp"):
        if getattr(args, flag, 1) != 1:
            out += [f"--{flag}", str(getattr(args, flag))]
    return out


class Daemon:
    """`with Daemon(flags) as d:` a daemon serving at d.url, ready: d.up_s is the seconds until /health
    answered 200 (after its warm-up), d.listening_s until it first answered at all (503 while warming).
    `env`: variables set for the daemon beside this process's."""

    def __init__(self, flags: list[str], start_timeout_s: float = 600, env: dict[str, str] | None = None):
        self.flags, self.timeout, self.env = list(flags), start_timeout_s, env
        self.proc = self.url = self.up_s = self.listening_s = None

    def __enter__(self) -> Daemon:
        import httpx

        port = free_port()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="jaxsmol-bench-serve-", suffix=".log")
        cmd = [sys.executable, "-m", "jaxsmol.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port),
               *self.flags]
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=PACKAGE_ROOT, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT,
                                     env=None if self.env is None else {**os.environ, **self.env})
        self.url = f"http://127.0.0.1:{port}"
        while self.proc.poll() is None and time.perf_counter() - t0 < self.timeout:
            try:
                status = httpx.get(self.url + "/health", timeout=1).status_code
                if self.listening_s is None:
                    self.listening_s = time.perf_counter() - t0
                if status == 200:
                    self.up_s = time.perf_counter() - t0
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        tail = self.tail()
        self.__exit__(None, None, None)
        raise RuntimeError(f"`jaxsmol serve {' '.join(self.flags)}` did not start: {tail}")

    def tail(self, chars: int = 1500) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-chars:].strip()

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
