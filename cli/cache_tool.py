"""`jaxsmol cache ls|rm|pin|unpin DIR [KEY ...]`: the disk tier of `jaxsmol serve --cache-dir DIR`,
without loading a model (cache/store/disk.py `list_dir`, `remove_entry`, `mark_entry`).

  ls     every snapshot file, the largest first: key, namespace, cache_salt, tokens, bytes, last use,
         pinned, the name of a named cached content and its expiry (or the end of a retained file's
         `prompt_cache_retention`) (--json: one JSON object)
  rm     delete entries by key
  pin    mark entries pinned: the daemon pins them again when it starts (within --pinned-bytes)
  unpin  clear the mark

Keys are what `ls` prints (32 hex digits, the file's name without .safetensors; GET /v1/cache names
the daemon's entries the same way). Run it while no daemon uses DIR: a daemon writes its entries
there again at shutdown.
"""

from __future__ import annotations

import json
import time

ACTIONS = ("ls", "rm", "pin", "unpin")


def add_cache_parser(sub) -> None:
    c = sub.add_parser("cache", help="list, remove, pin or unpin the prefix snapshots in a --cache-dir (no model "
                       "needed)", description="The disk tier of `jaxsmol serve --cache-dir DIR`: ls lists its "
                       "snapshots, the largest first; rm deletes entries; pin / unpin marks them pinned or not (the "
                       "daemon pins a marked entry again when it starts). Run it while no daemon uses DIR.")
    c.add_argument("action", choices=ACTIONS, help="ls, rm KEY..., pin KEY... or unpin KEY...")
    c.add_argument("dir", metavar="DIR", help="the --cache-dir directory")
    c.add_argument("keys", nargs="*", metavar="KEY", help="entry keys, as ls prints them (rm, pin, unpin)")
    c.add_argument("--json", action="store_true", help="ls: print one JSON object")
    c.set_defaults(func=run_cache)


def _row(e) -> dict:
    from jaxsmol.cache.listing import split_salt

    tenant, salt = split_salt(e.salt)
    return {"key": e.key, "namespace": tenant, "cache_salt": salt, "tokens": len(e.tokens), "bytes": e.nbytes,
            "last_used": round(e.last_used, 3), "pinned": e.pinned, "name": (e.record or {}).get("name"),
            "expires_at": e.expires_at}


def _when(t: float | None) -> str:
    return "" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _ls(directory, as_json: bool) -> int:
    from jaxsmol.cache.store.disk import list_dir
    from jaxsmol.cli.tables import format_table

    entries, bad = list_dir(directory)
    rows = [_row(e) for e in entries]
    if as_json:
        print(json.dumps({"dir": str(directory), "entries": rows, "bytes": sum(r["bytes"] for r in rows),
                          "unreadable": [{"file": name, "reason": why} for name, why in bad]}))
        return 0
    table = [[r["key"], r["namespace"], r["cache_salt"] or "", r["tokens"], f"{r['bytes']:,}", _when(r["last_used"]),
              "yes" if r["pinned"] else "", r["name"] or "", _when(r["expires_at"])] for r in rows]
    print(format_table(["key", "namespace", "cache_salt", "tokens", "bytes", "last used", "pinned", "name",
                        "expires"], table,
                       title=f"{directory}: {len(rows)} entries, {sum(r['bytes'] for r in rows):,} bytes"))
    for name, why in bad:
        print(f"warning: {name} not read: {why}")
    return 0


def run_cache(args) -> int:
    from jaxsmol.cache.store.disk import mark_entry, remove_entry
    from jaxsmol.errors import JaxsmolError

    if args.action == "ls":
        if args.keys:
            raise JaxsmolError("cache ls takes no keys")
        return _ls(args.dir, args.json)
    if not args.keys:
        raise JaxsmolError(f"cache {args.action}: give the keys of the entries (jaxsmol cache ls {args.dir})")
    for key in args.keys:
        if args.action == "rm":
            path = remove_entry(args.dir, key)
            print(f"removed {path}")
        else:
            path = mark_entry(args.dir, key, pinned=args.action == "pin")
            print(f"{args.action}ned {path}")
    return 0
