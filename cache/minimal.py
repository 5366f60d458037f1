"""The lab's minimal prefix cache: one snapshot of the first `prompt_n - 1` prompt tokens.

After a prefill it keeps the KV state of all prompt tokens but the last (the last one is always
computed, because its logits give the first generated token), with those token ids. A new request
reuses the common prefix of its prompt and the snapshot's tokens, capped at `prompt_n - 1`.
Like the radix store it knows nothing about the model: the snapshot is an opaque value.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cache.radix import common_prefix_len


@dataclasses.dataclass
class SavedPrefix:
    """The one saved prefix (not a cache/snapshot.py Snapshot: its value is opaque to this store)."""
    tokens: tuple  # the first prompt_n - 1 prompt tokens
    value: Any  # their state (for jaxsmol: a host KVCache with pos == len(tokens))
    namespace: Any  # the model fingerprint and salt it belongs to
    nbytes: int


class SingleSnapshotStore:
    """Holds at most one snapshot; saving replaces it."""

    def __init__(self):
        self.snapshot: SavedPrefix | None = None

    def reusable_len(self, namespace, prompt) -> int:
        """Tokens of `prompt` whose state the snapshot holds, capped at len(prompt) - 1."""
        s = self.snapshot
        if s is None or s.namespace != namespace:
            return 0
        return min(common_prefix_len(prompt, s.tokens), len(prompt) - 1)

    def save(self, namespace, tokens, value, nbytes: int) -> None:
        self.snapshot = SavedPrefix(tuple(tokens), value, namespace, nbytes)

    @property
    def bytes_held(self) -> int:
        return self.snapshot.nbytes if self.snapshot else 0

    def clear(self) -> None:
        self.snapshot = None
