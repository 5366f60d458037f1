"""How large a KV arena is (runtime/kv_arena.py): its shape for a context and a number of rows, and the
rows an engine's arena gets (at least DEFAULT_ROWS, at most what the memory it lives in can span)."""

from __future__ import annotations

import numpy as np

from jaxsmol.model.forward import ATTN_BLOCK
from jaxsmol.system import host_memory

# The rows an engine's arena has by default: a scheduler of 16 decode rows (the daemon's default
# --max-batch), 8 prompts being prefilled, 2 spare (cache/scheduler/scheduler.py arena_rows). One size
# for the library's calls and the daemon's, so that they run (and store) the same programs.
DEFAULT_ROWS = 26
# The share of the machine's memory (RAM and swap; a device's, elsewhere) one of k, v may span: an
# allocation larger than the machine is refused by the OS however little of it is ever written.
SPAN_SHARE = 0.8


def arena_shape(cfg, ctx: int, rows: int) -> tuple[int, ...]:
    """k's and v's shape for `rows` rows (plus the pad row) of a `ctx` context: [L, rows + 1, K, S, H]."""
    return cfg.n_layers, rows + 1, cfg.n_kv_heads, -(-ctx // ATTN_BLOCK) * ATTN_BLOCK, cfg.head_dim


def rows_that_fit(cfg, ctx: int, dtype, device=None) -> int:
    """The most rows an arena of this context may have (SPAN_SHARE of the memory it lives in)."""
    _, _, K, S, H = arena_shape(cfg, ctx, 1)
    row = cfg.n_layers * K * S * H * np.dtype(dtype).itemsize
    stats = device.memory_stats() if device is not None and device.platform != "cpu" else None
    total = (stats or {}).get("bytes_limit") or host_memory.total_bytes()
    return max(1, int(SPAN_SHARE * total) // row - 1) if total else DEFAULT_ROWS


def rows_for(cfg, ctx: int, dtype, asked: int, device=None) -> int:
    """The rows an engine's arena gets when `asked` for so many: at least DEFAULT_ROWS, at most what
    fits (rows_that_fit)."""
    return min(max(asked, DEFAULT_ROWS), rows_that_fit(cfg, ctx, dtype, device))
