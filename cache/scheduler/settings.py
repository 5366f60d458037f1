"""How a Scheduler batches: its settings (the daemon's --max-batch, --kv-cache-bytes, --batch-invariant,
--prefill-chunk, --admission, --admission-bound, --speculate, --speculate-tokens), the ladder of batch widths, and
the prompt rows a step may run."""

from __future__ import annotations

import dataclasses

from jaxsmol.cache.scheduler.speculation_modes import SPECULATE_MODES, VERIFY_ROWS
from jaxsmol.runtime.chunks import IDLE_STEP_ROWS, PREFILL_BUCKETS  # noqa: F401 (IDLE_STEP_ROWS: the settings')
from jaxsmol.errors import JaxsmolError


# Prompts a scheduler prefills at once (side by side where their chunks have one length), each in its
# own row of the KV arena.
PREFILLS_AT_ONCE = 8
# Arena rows admission leaves free: an answer being stored, a scoring (the worker's prompt logprobs).
SPARE_ROWS = 2
MIN_DECODING_CHUNK = 32  # the shortest cap on a prompt's chunk while rows decode (see chunk_cap)
# The step budgets a user may pick (--prefill-chunk). 32 and 48 run as exact 32 / 32 + 16 row chunks
# with the CPU kernels; without them a chunk is padded to 64 rows, so they act as 64. The default 48:
# on the AVX2 CPU a step beside 8 decoding rows then waits ~210 ms for its prompt rows, not ~240-250
# (jaxsmol bench --only serve --clients 8, 48 / 64 alternating: ITL p99 298 / 287 ms against 457 / 382
# while 1000-token prompts arrive, the rest alike).
CHUNK_ROWS_CHOICES = (32, 48) + PREFILL_BUCKETS
# The order waiting requests are admitted in: "lpm" the longest prefix stored in the prefix cache first
# (SGLang's longest-prefix-match), a request overtaken `admission_bound` times next; "fifo" by arrival.
ADMISSION_ORDERS = ("lpm", "fifo")


def widths_for(max_batch: int) -> tuple[int, ...]:
    """The batch widths used: powers of two below max_batch, and max_batch."""
    widths, w = [], 1
    while w < max_batch:
        widths.append(w)
        w *= 2
    return tuple(widths) + (max_batch,)


@dataclasses.dataclass(frozen=True)
class BatchSettings:
    max_batch: int = 16  # decode rows
    kv_bytes: int = 160 << 20  # the KV the requests in flight may be granted (scheduler.py: memory)
    batch_invariant: bool = False  # decode always at max_batch rows (see cache/scheduler/scheduler.py)
    chunk_rows: int = 48  # prefill rows per step while others decode (a long prompt: 32 of them)
    admission: str = "lpm"  # one of ADMISSION_ORDERS
    admission_bound: int = 8  # lpm: later requests that may be admitted before a waiting one
    speculate: str = "auto"  # one of SPECULATE_MODES (cache/scheduler/speculation.py)
    speculate_tokens: int = 7  # the most drafted tokens a row verifies in one step

    def __post_init__(self):
        if self.max_batch < 1:
            raise JaxsmolError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.admission not in ADMISSION_ORDERS:
            raise JaxsmolError(f"admission must be one of {', '.join(ADMISSION_ORDERS)}, got {self.admission!r}")
        if self.admission_bound < 0:
            raise JaxsmolError(f"admission_bound must be >= 0, got {self.admission_bound}")
        if self.speculate not in SPECULATE_MODES:
            raise JaxsmolError(f"speculate must be one of {', '.join(SPECULATE_MODES)}, got {self.speculate!r}")
        if not 1 <= self.speculate_tokens <= VERIFY_ROWS[-1] - 1:
            raise JaxsmolError(f"speculate_tokens must be in [1, {VERIFY_ROWS[-1] - 1}], got {self.speculate_tokens}")
        if self.chunk_rows not in CHUNK_ROWS_CHOICES:
            raise JaxsmolError(f"chunk_rows must be one of {CHUNK_ROWS_CHOICES}, got {self.chunk_rows}")

    @property
    def widths(self) -> tuple[int, ...]:
        return (self.max_batch,) if self.batch_invariant else widths_for(self.max_batch)

    def width_for(self, rows: int) -> int:
        """The narrowest width on the ladder that holds `rows` (the widest if none does)."""
        return next((w for w in self.widths if w >= rows), self.widths[-1])

    def step_rows(self, decoding: bool) -> int:
        """Prompt rows a step may run: chunk_rows while rows decode (their next token waits for
        them); when none do, at least IDLE_STEP_ROWS. Not a whole 512-row chunk: a newcomer arriving
        meanwhile waits for the step (~2.2 s for 512 rows on the AVX2 CPU, ~0.5 s for 128), and a
        prompt alone loses little to the shorter chunks (1024 tokens: 4.4 s in 512s, 4.5 s in 128s)."""
        return self.chunk_rows if decoding else max(self.chunk_rows, IDLE_STEP_ROWS)

    def chunks(self, plan: list[int], budget: int, decoding: bool) -> list[int]:
        """The chunks (their most rows) a prompt runs in this step, given its least padded plan and the
        step's rows left: the whole plan if that fits (the prompt finishes), else one of at most
        `chunk_cap` rows."""
        return plan if sum(plan) <= budget else [min(budget, self.chunk_cap(decoding))]

    def longest_chunk(self, buckets: tuple[int, ...]) -> int:
        """The longest chunk (of `buckets`) a prompt may run in one step, decoding or not."""
        most = max(self.step_rows(True), self.step_rows(False))
        return next((b for b in buckets if b >= most), buckets[-1])

    def chunk_cap(self, decoding: bool) -> int:
        """The longest chunk of one prompt in a step: half the step's rows while rows decode, so that
        a long prompt advances in short chunks while a burst of short prompts still joins two per step.
        chunk_rows 48 or 64 gives 32-row chunks: exact with the CPU kernels (without them the engine
        pads a chunk to 64 rows anyway), and a step that waits ~half as long on a CPU slow at arithmetic."""
        return max(MIN_DECODING_CHUNK, self.chunk_rows // 2) if decoding else self.step_rows(False)


def arena_rows(max_batch: int) -> int:
    """The arena rows a scheduler of `max_batch` decode rows asks for: those, a row for each prompt being
    prefilled whose choices take no decode row, and SPARE_ROWS (the engine's arena has at least
    arena_size.DEFAULT_ROWS, as many as fit the machine)."""
    return max_batch + PREFILLS_AT_ONCE + SPARE_ROWS
