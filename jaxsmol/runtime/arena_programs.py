"""The KV arena's programs as calls, from shapes alone: what compile-ahead makes ready before they run.

Each method gives one program of jaxsmol/runtime/programs.py over an arena of these shapes, as the
(program, args, kwargs) triple `programs.compile_all` takes, its arguments ShapeDtypeStructs laid out
exactly as the arena (runtime/kv_arena.py) calls it: static arguments by name, the arena as a
`KVCache` of the call's rows, sampling settings as `batch.row_settings` builds them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxsmol.model.config import Config
from jaxsmol.model.kv import KVCache
from jaxsmol.runtime import programs
from jaxsmol.runtime.batch import BLOCK, free_mask, row_settings
from jaxsmol.runtime.sampling import SamplingParams

_I32 = jnp.int32


def _ints(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, _I32)


class ArenaShapes:
    """What a program over an arena is compiled for: the weights' and the arena's shapes, the config."""

    def __init__(self, cfg: Config, params, shape: tuple[int, ...], dtype, kernel: bool):
        self.cfg, self.params, self.shape, self.dtype, self.kernel = cfg, params, shape, dtype, kernel

    @classmethod
    def of(cls, arena) -> ArenaShapes:
        return cls(arena.engine.cfg, arena.engine.params, arena.shape, arena.dtype, arena.kernel)

    def kv(self, rows: int) -> KVCache:
        cache = jax.ShapeDtypeStruct(self.shape, self.dtype)
        return KVCache(k=cache, v=cache, pos=_ints(rows))

    def prefill(self, P: int, T: int, all_logits: bool = False) -> tuple:
        return (programs.prefill_rows, (self.params, _ints(P, T), _ints(P), self.kv(P), _ints(P), self.cfg),
                {"all_logits": all_logits})

    def settings(self, W: int, positions: int | None = None) -> dict:
        free = row_settings([SamplingParams()] * W, [0] * W, [None] * W, free_mask(self.cfg.vocab_size, W))
        if positions is not None:  # a verify step's mask per position
            free["allowed"] = _ints(W, positions, free["allowed"].shape[-1])
        return free

    def decode(self, W: int) -> tuple:
        return programs.decode_step, (self.params, _ints(W), self.kv(W), _ints(W), self.settings(W), self.cfg), {}

    def verify(self, W: int, T: int) -> tuple:
        return (programs.verify_step, (self.params, _ints(W, T), _ints(W), self.kv(W), _ints(W), self.settings(W, T),
                                       self.cfg), {})

    def drafts(self, P: int, k: int) -> tuple:
        """A draft model's greedy_drafts: P tokens fed, k drafted."""
        return programs.greedy_drafts, (self.params, _ints(1, P), _ints(), self.kv(1), _ints(1), self.cfg), {"k": k}

    def first(self, N: int) -> tuple:
        return (programs.sample_first, (jax.ShapeDtypeStruct((1, self.cfg.vocab_size), jnp.float32),
                                        self.settings(N)), {})

    def copies(self) -> list:
        """write_slots, copy_row and read_slots."""
        cache, scalar = jax.ShapeDtypeStruct(self.shape, self.dtype), _ints()
        L, _, K, _, H = self.shape
        block = jax.ShapeDtypeStruct((L, 1, K, BLOCK, H), self.dtype)
        return [(programs.write_slots, (cache, cache, block, block, scalar, scalar, scalar), {"kernel": self.kernel}),
                (programs.copy_row, (cache, cache, scalar, scalar, scalar), {"kernel": self.kernel}),
                (programs.read_slots, (cache, cache, scalar, scalar, scalar), {"kernel": self.kernel})]
