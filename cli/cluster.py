"""`jaxsmol cluster`: N `jaxsmol serve` replicas on this machine behind sglang-router (cli/replicas.py).

Starts the replicas on free loopback ports, each pinned to its share of the CPUs, waits until every
one is ready (/health 200, after its warm-up), then starts the router on --host:--port with the
replicas as its workers and waits until it counts them all healthy. On SIGTERM or Ctrl-C it stops the
router first (it finishes the requests it holds), then the replicas (each finishes its own), and
exits 0; if a child exits on its own, the others are stopped and the command fails naming it.
The serve options are passed on to every replica as they were given (cli/serve_options.py): with API
keys, each replica checks them and keeps each key's prompts in its own namespace; the router passes
the client's Authorization header through. `--shared-cache redis` starts a redis-server on a free loopback
port first, which every replica's shared cache names, and stops it last; a directory or URL is passed on.
"""

from __future__ import annotations

import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

from jaxsmol.cli.replicas import (POLICIES, Replica, RedisServer, Router, start_redis, start_replicas, start_router,
                                  stop, usable_cpus, split_cpus, wait_until)
from jaxsmol.cli.serve_options import add_serve_options, serve_argv
from jaxsmol.errors import JaxsmolError


class Stopped(Exception):
    """SIGTERM or SIGINT arrived: stop everything and exit 0."""


def add_cluster_parser(sub) -> None:
    c = sub.add_parser("cluster", help="run N `jaxsmol serve` replicas on this machine behind sglang-router, "
                       "which routes requests sharing a prefix to the same replica (pip install 'jaxsmol[cluster]')")
    c.add_argument("--replicas", type=int, default=2, metavar="N", help="daemons to start (default 2)")
    c.add_argument("--policy", choices=POLICIES, default="cache_aware",
                   help="the router's policy: cache_aware (default: a prompt goes to the replica whose past prompts "
                        "share the longest prefix with it, or the least loaded when the loads differ much), "
                        "round_robin, power_of_two, random, manual (requests with the same x-smg-routing-key header, "
                        "e.g. a prompt_cache_key, go to one replica; those without one at random)")
    c.add_argument("--host", default="127.0.0.1", help="the router's address (the replicas listen on loopback)")
    c.add_argument("--port", type=int, default=8000, help="the router's port")
    c.add_argument("--no-pin", action="store_true", help="leave every replica on all the CPUs (default: each on its "
                   "own contiguous share of the CPUs this process may use)")
    c.add_argument("--router-args", metavar="ARGS", help="more sglang-router arguments, one string "
                   "(e.g. \"--cache-threshold 0.5\"; see python -m sglang_router.launch_router --help)")
    c.add_argument("--log-dir", metavar="DIR", help="where the replicas' and the router's logs go (default: a new "
                   "temporary directory, printed)")
    c.add_argument("--start-timeout", type=float, default=1800, metavar="S",
                   help="seconds to wait for the replicas to be ready, warm-up included (default 1800)")
    add_serve_options(c)


def _on_signal(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the first one stops everything; more would interrupt that
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise Stopped


def _check(args) -> None:
    from jaxsmol.cli.replicas import router_available
    from jaxsmol.cli.server.tenants import Tenants

    if args.replicas < 1:
        raise JaxsmolError(f"--replicas must be >= 1, got {args.replicas}")
    if not router_available():
        raise JaxsmolError("jaxsmol cluster needs sglang-router: pip install 'jaxsmol[cluster]'")
    tenants = Tenants.from_options(args.api_key, args.api_keys)  # a bad keys file fails before anything starts
    if not tenants.enabled and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {args.host} without API keys: anyone who can reach it shares the prefix "
              "cache (cached_tokens reveals what others sent) and may flush it", file=sys.stderr)


def replica_args(args, i: int, shared_url: str | None = None) -> list[str]:
    """Replica i's `jaxsmol serve` arguments: the serve options given, a --cache-dir of its own below the
    one given (two daemons must not share a disk tier's files), and one --shared-cache for all: `shared_url`
    (the redis-server started for `redis`), a URL as given, or the directory's absolute path (the replicas
    run in another directory)."""
    out = serve_argv(args)
    if args.cache_dir:
        at = out.index("--cache-dir") + 1
        out[at] = str(Path(args.cache_dir) / f"replica-{i}")
    if args.shared_cache:
        at = out.index("--shared-cache") + 1
        out[at] = shared_url or (args.shared_cache if "://" in args.shared_cache else
                                 str(Path(args.shared_cache).resolve()))
    return out


def _watch(processes) -> None:
    """Until a signal (Stopped); a JaxsmolError if a child exits on its own."""
    while True:
        for p in processes:
            if p.exited is not None:
                raise JaxsmolError(f"{p.name} exited with status {p.exited} (log {p.log}): {p.tail(600)}")
        time.sleep(0.5)


def run_cluster(args) -> int:
    _check(args)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="jaxsmol-cluster-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    shares = "all CPUs each" if args.no_pin else " | ".join(
        ",".join(map(str, s)) for s in split_cpus(args.replicas, usable_cpus()))
    print(f"jaxsmol cluster: {args.replicas} replicas (CPUs {shares}), policy {args.policy}, logs in {log_dir}",
          file=sys.stderr, flush=True)
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    replicas: list[Replica] = []
    routers: list[Router] = []
    servers: list[RedisServer] = []
    try:
        if args.shared_cache == "redis":
            servers.append(start_redis(log_dir / "redis.log"))
            wait_until(servers, RedisServer.ready, 30, "ready")
        shared_url = servers[0].url if servers else None
        replicas += start_replicas([replica_args(args, i, shared_url) for i in range(args.replicas)], log_dir,
                                   pin=not args.no_pin)
        wait_until(replicas, Replica.ready, args.start_timeout, "ready")
        urls = [r.url for r in replicas]
        routers.append(start_router(urls, args.policy, args.host, args.port, log_dir / "router.log",
                                    shlex.split(args.router_args or "")))
        wait_until(routers, Router.ready, 300, "ready with every replica healthy")
        print(f"jaxsmol cluster serving on http://{args.host}:{args.port} (sglang-router, {args.policy}) in front of "
              f"{' '.join(urls)}", file=sys.stderr, flush=True)
        _watch(routers + replicas + servers)
    except Stopped:
        print("jaxsmol cluster: stopping (the router, then the replicas, each finishing its requests)",
              file=sys.stderr, flush=True)
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop(routers, replicas, servers)
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0  # not reached: _watch returns only by raising
