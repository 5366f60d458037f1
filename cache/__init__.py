"""The prefix cache, in front of jaxsmol's engine: requests that share a prompt prefix reuse its KV state.

    from jaxsmol.cache import PrefixCache, generate, generate_many, run_probe

Here: `prefix_cache.py` (PrefixCache: bypass, lookup, restore, continue, save), `records.py` (what it
reports and pins), `pins.py` (pinned prefixes, out of LRU eviction under a budget of their own),
`listing.py` (what is stored, for inspection), `probe.py` (the cold vs warm probe). Two subpackages:
  store/       where prefixes are kept, model-agnostic: the radix tree (many keys, or the single
               snapshot), snapshot files and the disk tier (imports jaxsmol only)
  scheduler/   continuous batching on top of the cache: admission, prefill chunks side by side, forks,
               answers kept for the next turn, compile-ahead, and the library's calls generate and
               generate_many: every request runs through the scheduler (imports everything here)
Imports flow cli -> cache -> jaxsmol, never back.
"""

__all__ = ["PrefixCache", "generate", "generate_many", "run_probe"]
_PUBLIC = {"PrefixCache": "jaxsmol.cache.prefix_cache", "generate": "jaxsmol.cache.scheduler.many",
           "generate_many": "jaxsmol.cache.scheduler.many",
           "run_probe": "jaxsmol.cache.probe"}


def __getattr__(name):
    """The public names, imported when first asked for (`import jaxsmol.cache.store.radix` leaves the scheduler out)."""
    if name not in _PUBLIC:
        raise AttributeError(f"module 'cache' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_PUBLIC[name]), name)
