"""The course exercise's prefix cache: one snapshot of the first `prompt_n - 1` prompt tokens.

After a prefill it keeps the KV state of all prompt tokens but the last (the last one is always
computed, because its logits give the first generated token), with those token ids. A new request
reuses the common prefix of its prompt and the snapshot's tokens, capped at `prompt_n - 1`.
Like the radix store it knows nothing about the model: the snapshot is an opaque value (for
jaxsmol, the {"k", "v"} segment of the KV pytree), behind the store interface (cache/store/interface.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxsmol.cache.store.values import common_prefix_len
from jaxsmol.cache.store.interface import Hit


@dataclasses.dataclass
class SavedPrefix:
    """The one saved prefix (not a cache/store/snapshot.py Snapshot: its value is opaque to this store)."""
    tokens: tuple  # the first prompt_n - 1 prompt tokens
    value: Any  # their state (for jaxsmol: {"k", "v"} host arrays [L, 1, len(tokens), K, H])
    namespace: Any  # the model fingerprint and salt it belongs to
    nbytes: int


class SingleSnapshotStore:
    """Holds at most one snapshot; saving replaces it."""
    keeps_last_position = False  # the snapshot leaves out the prompt's last token
    max_keys = 1
    evictions = 0

    def __init__(self):
        self.snapshot: SavedPrefix | None = None

    def reusable_len(self, namespace, prompt) -> int:
        """Tokens of `prompt` whose state the snapshot holds, capped at len(prompt) - 1."""
        s = self.snapshot
        if s is None or s.namespace != namespace:
            return 0
        return min(common_prefix_len(prompt, s.tokens), len(prompt) - 1)

    def lookup(self, namespace, tokens, gather: bool = True, count: bool = True) -> Hit:
        reused = self.reusable_len(namespace, tokens)  # one snapshot, already whole: nothing to defer
        return Hit(matched=reused, reused=reused, value=self.snapshot.value if reused else None,
                   nearest_len=len(self.snapshot.tokens) if self.snapshot else 0)

    def peek(self, namespace, tokens) -> int:
        s = self.snapshot
        return common_prefix_len(tuple(tokens), s.tokens) if s is not None and s.namespace == namespace else 0

    def release(self, lease) -> None:
        pass  # one snapshot, replaced only by a save: nothing to pin

    def insert(self, namespace, tokens, value_of, payload=None) -> int:
        value = value_of(0, len(tokens))
        nbytes = sum(int(a.nbytes) for a in jax.tree.leaves(value))
        self.snapshot = SavedPrefix(tuple(tokens), value, namespace, nbytes)
        return len(tokens)

    def state(self, namespace, tokens):
        s = self.snapshot
        if s is None or s.namespace != namespace or not s.tokens:
            return None
        return s.tokens, s.value, {}

    def add(self, namespace, tokens, value_of, payloads: dict) -> None:
        self.insert(namespace, tokens, value_of)

    def entries(self) -> list:
        return [] if self.snapshot is None else [(self.snapshot.namespace, self.snapshot.tokens)]

    @property
    def bytes_held(self) -> int:
        return self.snapshot.nbytes if self.snapshot else 0

    def clear(self) -> None:
        self.snapshot = None
