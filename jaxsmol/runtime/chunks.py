"""Prompt chunks and cache capacities: the few shapes every forward program is compiled for.

Prompts are prefilled in chunks whose padded lengths come from a short list of buckets (the KV arena's
programs, one per bucket, serve every prompt length), and the pure API's one-sequence caches are
allocated with capacities from a doubling ladder. Exactness decides the buckets: on XLA:CPU the rows of `x @ W` are
bit-identical for any row count >= 64 (not for 1..56), so an exact prefill chunk has at least 64
rows; with the CPU kernels every row of a chunk of >= 2 rows gets the same bits whatever its size,
so 8-, 16- and 32-row chunks are exact too (jaxsmol/runtime/engine.py says why that makes the cache exact).
"""

from __future__ import annotations

from jaxsmol.model.forward import ATTN_BLOCK

PREFILL_BUCKETS = (64, 128, 256, 512)  # chunk lengths T; >= 64 rows keeps XLA's prefill bit-exact (see above)
ROW_EXACT_BUCKETS = (8, 16, 32) + PREFILL_BUCKETS  # exact with the CPU kernels (see above)
# The non-bitwise fast path (exact=False) may also prefill a short suffix in 1, 8, 16 or 32 rows: less
# padding, but those rows differ from a cold prefill's in the last bits.
FAST_BUCKETS = (1, 8, 16, 32) + PREFILL_BUCKETS
# What one more chunk costs, in rows: a chunk streams every weight once whatever its rows. Measured
# (the real model, 2 cores, one prompt): 8 / 16 / 32 / 64 rows 25.7 / 36.1 / 53.8 / 96.4 ms, ~1.3 ms
# a row plus ~15 ms a chunk; 8 is the smallest that keeps every split below ahead of one chunk there.
CHUNK_COST_ROWS = 8
MIN_CAPACITY = 2 * ATTN_BLOCK
# The least prompt rows a scheduler's step runs when no row decodes, and the longest chunk it then runs
# (cache/scheduler/settings.py step_rows): a newcomer arriving meanwhile waits for that step.
IDLE_STEP_ROWS = 128


def prefill_buckets(exact: bool = True, cpu_kernels: bool = False) -> tuple[int, ...]:
    """The chunk lengths a prefill may use: bit-exact ones (which depend on the matmul), or the fast path's."""
    return (ROW_EXACT_BUCKETS if cpu_kernels else PREFILL_BUCKETS) if exact else FAST_BUCKETS


def chunk_length(n_left: int, max_rows: int = PREFILL_BUCKETS[-1], buckets: tuple = PREFILL_BUCKETS) -> int:
    """The padded length T of the next chunk of n_left tokens still to prefill, at most max_rows real
    ones: the smallest of `buckets` that holds them (the largest when none does)."""
    return next((b for b in buckets if b >= min(n_left, max_rows)), buckets[-1])


def chunk_plan(n: int, buckets: tuple = PREFILL_BUCKETS) -> list[int]:
    """Chunk lengths (padded) to prefill n tokens: 512s, then the smallest bucket that holds the rest."""
    plan = []
    while n > 0:
        T = chunk_length(n, buckets=buckets)
        plan.append(T)
        n -= min(T, n)
    return plan


def tight_plan(n: int, buckets: tuple = PREFILL_BUCKETS) -> list[int]:
    """Chunk lengths (padded) covering n > 0 tokens: the smallest bucket that holds them, or the
    largest that they fill plus one for the rest where that saves more than CHUNK_COST_ROWS rows.
    45 tokens: 32 + 16 rows, which took 209-211 ms on the AVX2 CPU where one 64-row chunk took
    243-249 ms; 40 tokens: 32 + 8 (79.5 ms against 96.4); 20 tokens: one 32-row chunk (16 + 8: 61.8
    ms against 53.8)."""
    whole = chunk_length(n, n, buckets)
    if whole < n:  # longer than the largest bucket
        return [whole] + tight_plan(n - whole, buckets)
    fill = max((b for b in buckets if b <= n), default=whole)
    split = [fill, chunk_length(n - fill, n, buckets)] if fill < n else [whole]
    return split if sum(split) + CHUNK_COST_ROWS < whole else [whole]


def capacity_for(slots: int) -> int:
    """The smallest capacity on the doubling ladder MIN_CAPACITY * 2^i that holds `slots`."""
    cap = MIN_CAPACITY
    while cap < slots:
        cap *= 2
    return cap
