"""The options of `jaxsmol serve` (but its address), shared by `jaxsmol cluster` (cli/cluster.py), which
passes them on to every replica: `serve_argv` turns the parsed values back into `jaxsmol serve`
arguments."""

from __future__ import annotations

import argparse
import sys

from jaxsmol.cli.common import ArgumentParser, add_model_args, add_speculate_args
from jaxsmol.errors import JaxsmolError


def add_serve_options(s: argparse.ArgumentParser) -> None:
    """Every `jaxsmol serve` option but --host and --port, with the model's (cli/common.py)."""
    s.add_argument("--cache-bytes", type=int, default=2 << 30, help="prefix cache budget in bytes (default 2 GiB)")
    s.add_argument("--cache-mode", default="radix", choices=["radix", "single"],
                   help="radix: many prefixes in a radix tree (default); "
                        "single: one snapshot of the first prompt_n - 1 tokens")
    s.add_argument("--no-prefix-cache", action="store_true", help="serve every request cold")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond this get 503")
    s.add_argument("--cache-dir", metavar="DIR", help="keep prefix snapshots in DIR too: entries evicted from "
                   "memory, and all of them at shutdown; loaded back at start and on a memory miss")
    s.add_argument("--disk-cache-bytes", type=int, default=4 << 30, help="byte budget of --cache-dir (default 4 GiB)")
    s.add_argument("--shared-cache", metavar="URL|DIR",
                   help="a prefix store several daemons share, below memory and --cache-dir: redis://HOST:PORT[/DB] "
                        "or a directory (on one filesystem, NFS too); a prompt's whole 64-token chunks are read "
                        "from it when memory lacks them and written to it after a prompt is computed (jaxsmol "
                        "cluster: `redis` starts a redis-server for its replicas)")
    s.add_argument("--shared-cache-write", choices=("through", "back"), default="through",
                   help="when a prompt's chunks reach the --shared-cache: through (default: once it is computed, "
                        "on a writer thread: other daemons find it at once) or back (when memory evicts it, at a "
                        "flush and at shutdown: fewer writes, found later)")
    s.add_argument("--shared-cache-bytes", type=int, default=None, metavar="BYTES",
                   help="with a --shared-cache directory: its byte budget, the oldest chunks removed beyond it "
                        "(default: no limit; a Redis server's is its own maxmemory)")
    s.add_argument("--pinned-bytes", type=int, default=512 << 20, metavar="BYTES",
                   help="budget of the prefixes pinned with POST /v1/cache/pin, apart from --cache-bytes: they are "
                        "never evicted; a pin beyond it is refused (default 512 MiB)")
    s.add_argument("--api-key", action="append", metavar="KEY",
                   help="require Authorization: Bearer KEY (repeatable; these are admin keys, each with its own "
                        "cache namespace)")
    s.add_argument("--api-keys", metavar="FILE", help="API keys, one a line: 'KEY [NAMESPACE] [admin]' (keys naming "
                   "the same NAMESPACE share cache entries; '-' or none: a namespace of the key's own)")
    s.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="connections served at once; more get 503 (default: no limit)")
    s.add_argument("--write-timeout", type=float, default=30.0, metavar="S",
                   help="cancel a request whose client has not read its output for S seconds (default 30)")
    s.add_argument("--read-timeout", type=float, default=30.0, metavar="S",
                   help="answer 408 and close the connection of a request whose headers have not arrived whole "
                        "S seconds after its first byte (or after the connection opened), or whose body has sent "
                        "nothing for S seconds (default 30)")
    s.add_argument("--served-model-name", metavar="NAME",
                   help="the model's name in /v1/models, /health and responses (default: SmolLM2-135M-Instruct "
                        "for the bundled model, a GGUF file's name without .gguf, a checkpoint directory's name)")
    s.add_argument("--no-access-log", action="store_true",
                   help="print no line per request on stderr (by default: client, method, path, status, tokens, "
                        "time to first token, total time, tenant; /health and /ready are not logged)")
    s.add_argument("--max-batch", type=int, default=16, metavar="N",
                   help="decode rows: requests (and choices) decoded together in one step (default 16)")
    s.add_argument("--kv-cache-bytes", type=int, default=160 << 20, metavar="BYTES",
                   help="the KV memory requests in flight may be granted, each row its prompt and 128 tokens at a "
                        "time as it grows: a request that does not fit waits, a row sits steps out (default 160 "
                        "MiB: 3,640 positions of the bundled 135M's float32 KV; one request alone is always "
                        "admitted); the KV arena's resident memory stays within it")
    s.add_argument("--batch-invariant", action="store_true",
                   help="decode always at the full --max-batch width, so a request's tokens and logprobs "
                        "do not depend on the other requests (slower when few are in flight)")
    s.add_argument("--prefill-chunk", type=int, default=48, metavar="ROWS",
                   help="prompt rows prefilled between two decode steps while others decode: 32, 48, 64, 128, 256 "
                        "or 512 (default 48; a long prompt gets half of it, at least 32 rows, per step, a prompt "
                        "it finishes all of it; smaller keeps their inter-token latency lower while long prompts "
                        "arrive, larger gives a burst of newcomers their first tokens sooner)")
    s.add_argument("--admission", choices=["lpm", "fifo"], default="lpm",
                   help="the order waiting requests start in: lpm = the longest prefix stored in the prefix cache "
                        "first (default; never one passed over more than --admission-bound times), fifo = by arrival")
    s.add_argument("--admission-bound", type=int, default=8, metavar="N",
                   help="with --admission lpm, a waiting request that N later ones have overtaken starts next "
                        "(default 8)")
    s.add_argument("--warmup", choices=["block", "background", "none"], default="background",
                   help="when the programs requests run are compiled: block = before the port opens; background "
                        "(default) = the port opens at once, /health and /ready answer 503 'warming' until they are "
                        "compiled, then 200; none = nothing ahead, ready at once (each program compiles on first "
                        "use, holding every stream)")
    s.add_argument("--no-compile-ahead", dest="warmup", action="store_const", const="none",
                   help="the same as --warmup none")
    add_speculate_args(s)
    add_model_args(s)


def daemon_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of cli/server/serve.py `serve` that --read-timeout, --served-model-name and
    --no-access-log give; a JaxsmolError for a value out of range."""
    if not args.read_timeout > 0:
        raise JaxsmolError(f"--read-timeout must be > 0 seconds, got {args.read_timeout}")
    return {"read_timeout_s": args.read_timeout, "model_name": args.served_model_name,
            "access_log": not args.no_access_log}


def shared_backend(args: argparse.Namespace):
    """The backend of --shared-cache (cache/store/shared_backends.py), None without one; a JaxsmolError
    naming what is wrong (a bad URL, an unreachable server, an unusable directory, a combination)."""
    if not args.shared_cache or args.no_prefix_cache:
        return None
    if args.shared_cache == "redis":
        raise JaxsmolError("--shared-cache redis is jaxsmol cluster's (it starts a redis-server); jaxsmol serve "
                           "takes redis://HOST:PORT[/DB] or a directory (./redis for one named so)")
    if args.shared_cache_bytes is not None and "://" in args.shared_cache:
        raise JaxsmolError("--shared-cache-bytes bounds a --shared-cache directory; a Redis server's bound is its "
                           "own maxmemory")
    if args.cache_mode != "radix":
        raise JaxsmolError("--shared-cache needs --cache-mode radix (the single snapshot keeps one prefix)")
    from jaxsmol.cache.store.shared_backends import open_backend

    backend = open_backend(args.shared_cache, args.shared_cache_bytes)
    print(f"shared cache: {backend.describe()}", file=sys.stderr, flush=True)
    return backend


def serve_argv(args: argparse.Namespace) -> list[str]:
    """The serve options of `args` whose values are not their defaults, as `jaxsmol serve` arguments (an
    option sharing its destination with an earlier one, --no-compile-ahead with --warmup, is given
    through the earlier one)."""
    parser = ArgumentParser(add_help=False)
    add_serve_options(parser)
    out, seen = [], set()
    for a in parser._actions:
        if a.dest in seen or not a.option_strings:
            continue
        seen.add(a.dest)
        value, flag = getattr(args, a.dest), a.option_strings[-1]
        if value == a.default:
            continue
        if isinstance(a, argparse._StoreTrueAction):
            out.append(flag)
        elif isinstance(a, argparse._AppendAction):
            out += [x for v in value for x in (flag, str(v))]
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out
