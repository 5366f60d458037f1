"""What the scheduler (cache/scheduler.py) holds per request: a prompt being prefilled, a decode
row per choice, and its counters."""

from __future__ import annotations

import dataclasses

from cache.records import Lookup
from cache.requests import Request
from jaxsmol.kv import KVCache
from jaxsmol.stream import TokenStream
from jaxsmol.structured import Constraint


@dataclasses.dataclass(eq=False)  # compared by identity (in self.prefills)
class Prefill:
    """An admitted request whose prompt is being prefilled into `kv`, a chunk per step."""
    request: Request
    lookup: Lookup
    kv: KVCache
    constraints: list  # per choice: its structured-output Constraint, or None


@dataclasses.dataclass
class Row:
    """A decode row: one choice of a request."""
    request: Request
    lookup: Lookup
    index: int
    stream: TokenStream
    ttft_s: float
    constraint: Constraint | None = None


@dataclasses.dataclass
class SchedulerStats:
    steps: int = 0  # decode steps
    decoded_tokens: int = 0  # tokens sampled by decode steps (first tokens excluded)
    prefilled_tokens: int = 0  # prompt positions computed (padding excluded)
    prefill_calls: int = 0  # forwards that ran prompt chunks (several prompts side by side count once)
    admitted: int = 0
    relayouts: int = 0
