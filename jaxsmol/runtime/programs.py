"""Every compiled program, in one place: `jax.jit` is applied here and only here.

Single sequence (engine.py): `forward` (chunked prefill and decode), `sample` and `step_key`,
`top_logprobs`, `load_prefix`. Batched decoding (batch.py, used by the scheduler): `decode_step`, `sample_first`,
`insert_row`, `relayout`, `prefill_rows`.

A cache argument is donated where the caller hands over a buffer that nothing else holds (a fresh
cache, a recycled one, or one restored from a host snapshot), so XLA updates it in place. Host
snapshots held by the prefix store are NumPy arrays, never device buffers, so a donation can never
touch a stored prefix.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable

import jax

from jaxsmol.runtime import batch, sampling
from jaxsmol.model import forward as model, kv

forward = jax.jit(model.forward, static_argnames=("cfg", "all_logits"), donate_argnames=("kv",))
sample = jax.jit(sampling.sample)
step_key = jax.jit(jax.random.fold_in)  # a request's key for step i: 0.63 ms a token run op by op
load_prefix = jax.jit(kv.load_prefix, static_argnames=("kernel",), donate_argnames=("kv",))
top_logprobs = jax.jit(sampling.top_logprobs, static_argnames=("k",))

decode_step = jax.jit(batch.decode_step, static_argnames=("cfg", "logprobs"), donate_argnames=("kv",))
sample_first = jax.jit(batch.sample_and_score, static_argnames=("logprobs",))
insert_row = jax.jit(batch.insert_row, donate_argnames=("batch",))
relayout = jax.jit(batch.relayout, static_argnames=("width", "capacity"))
prefill_rows = jax.jit(batch.prefill_rows, static_argnames=("cfg", "window"), donate_argnames=("rows",))

ALL = {"forward": forward, "sample": sample, "step_key": step_key, "load_prefix": load_prefix, "top_logprobs": top_logprobs,
       "decode_step": decode_step, "sample_first": sample_first, "insert_row": insert_row,
       "relayout": relayout, "prefill_rows": prefill_rows}


def compile_all(lowerings: Iterable[Callable[[], jax.stages.Lowered]], stop: threading.Event | None = None) -> int:
    """Compile programs ahead, each lowered by one zero-argument callable (`lambda: forward.lower(...)`),
    one after another: XLA's compiler runs threads of its own, and two compiles at once were slower
    under the command line's single malloc arena (system/host_memory.py: 35.6 s against 30.6 s for the
    daemon's 49 batched programs). `stop` (an Event) is checked before each. Returns how many."""
    n = 0
    for lower in lowerings:
        if stop is not None and stop.is_set():
            break
        lower().compile()
        n += 1
    return n


def compiled_count(name: str = "forward") -> int:
    """How many programs the jitted function `name` has compiled in this process so far."""
    return ALL[name]._cache_size()
