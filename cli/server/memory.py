"""Where the daemon's memory is: the parts /metrics exports, and the growth they leave unexplained.

Every large holding has a gauge: the weights, the prefix cache (--cache-bytes), restores' staging
buffers, the KV arena's resident pages (--kv-cache-bytes bounds them; a draft model's weights, prefix
cache and arena counted with the model's), the compiled programs (jaxsmol/system/program_memory.py)
and the free memory malloc keeps for reuse, its resident part (jaxsmol/system/host_memory.py).
At start the resident set minus those parts is the baseline (the interpreter, libraries, the
tokenizer); afterwards `unaccounted` = resident - baseline - parts is the growth no gauge explains,
which stays near zero unless something holds memory nobody counts (a leak shows up there).
"""

from __future__ import annotations

import dataclasses

import jax

from jaxsmol.system import program_memory
from jaxsmol.system.host_memory import free_resident, heap, resident_bytes


@dataclasses.dataclass(frozen=True)
class MemoryParts:
    """Bytes of each counted holding."""
    weights: int
    cache: int
    pool: int
    batch_kv: int
    programs: int
    heap_free: int

    def total(self) -> int:
        return sum(dataclasses.astuple(self))


class MemoryAccount:
    """The daemon's memory parts; `start` takes the baseline (call it before the first request)."""

    def __init__(self, params, draft_params=None):
        """draft_params: a draft model's weights (--draft-model), counted with the model's."""
        # a quantized tied model's token table is one array in two fields: counted once (Params.nbytes)
        leaves = jax.tree.leaves((params, draft_params))
        self.weights = sum(leaf.nbytes for leaf in {id(leaf): leaf for leaf in leaves}.values())
        self.baseline: int | None = None
        self.resident_at_start = 0
        program_memory.watch()  # before the daemon compiles anything ahead

    def parts(self, cache: int, pool: int, batch_kv: int) -> MemoryParts:
        h = heap()
        free = free_resident(h)
        return MemoryParts(weights=self.weights, cache=cache, pool=pool, batch_kv=batch_kv,
                           programs=program_memory.held().bytes,
                           heap_free=free if free is not None else (h.free if h else 0))

    def start(self, cache: int = 0, pool: int = 0, batch_kv: int = 0) -> None:
        self.resident_at_start = resident_bytes()
        self.baseline = self.resident_at_start - self.parts(cache, pool, batch_kv).total()

    def figures(self, cache: int, pool: int, batch_kv: int, arena_span: int = 0,
                programs_after_ready: int = 0) -> dict[str, int]:
        """The gauges: each part, the program count (and `programs_after_ready`, the warm-up's count of
        programs made since), malloc's bytes in use (less the KV arena's span, `arena_span`: reserved,
        backed only where written, and counted by batch_kv where it is), the resident set and what no
        part explains (0 before `start`)."""
        parts, h, resident = self.parts(cache, pool, batch_kv), heap(), resident_bytes()
        out = {f"{k}_bytes": v for k, v in dataclasses.asdict(parts).items()
               if k not in ("cache", "pool", "batch_kv")}  # exported under their own names already
        out["programs"] = program_memory.held().count
        out["programs_after_ready"] = programs_after_ready
        out["heap_in_use_bytes"] = max(0, h.in_use - arena_span) if h else 0
        out["resident_bytes"] = resident
        out["resident_at_start_bytes"] = self.resident_at_start
        out["unaccounted_bytes"] = 0 if self.baseline is None else resident - self.baseline - parts.total()
        return out
