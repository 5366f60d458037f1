"""One sequence's generation: restore or prefill the prompt, then sample and decode token by token.

`Engine.start` returns a `Generation`; iterating it yields `Step`s (jaxsmol/runtime/stream.py turns tokens
into text and applies the stops). The batched path (cache/scheduler/scheduler.py) shares the same pieces:
`Engine.restore` / `Engine.prefill`, the sampler, `TokenStream` and the structured-output hook.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxsmol.runtime import programs
from jaxsmol.model.config import Config
from jaxsmol.errors import JaxsmolError
from jaxsmol.model.kv import KVCache
from jaxsmol.runtime.sampling import SamplingParams, seed_key
from jaxsmol.runtime.stream import Step, TokenStream
from jaxsmol.runtime.structured import constraint_for



class Model(Protocol):
    """What a generation needs of the engine that starts it (jaxsmol/runtime/engine.py's Engine): named here
    so this module does not import the engine, which imports it (no import circle)."""
    cfg: Config
    tokenizer: object

    def new_cache(self, slots: int) -> KVCache: ...
    def restore(self, snapshot: KVCache, slots: int, length: int | None = None, tokens=None) -> KVCache: ...
    def prefill(self, ids: list[int], kv: KVCache, exact: bool = True) -> tuple[jax.Array, KVCache]: ...
    def decode(self, token: int, kv: KVCache) -> tuple[jax.Array, KVCache]: ...
    def slots_needed(self, start: int, n_prompt: int, max_tokens: int, exact: bool = True) -> int: ...


@dataclasses.dataclass
class Timings:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # positions taken from a prefix snapshot
    prefilled_tokens: int = 0  # positions computed by prefill (real tokens, padding excluded)
    generated_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0  # request start to first token sampled
    decode_s: float = 0.0
    total_s: float = 0.0
    # Set by a caller that loads the model or compiles programs for this request (the CLI): so the
    # prefill/decode figures above are compute, and the start-up cost is reported apart from them.
    load_s: float = 0.0  # reading config, tokenizer and weights
    compile_s: float = 0.0  # compiling (or loading from the compilation cache) the request's programs
    startup_s: float = 0.0  # wall time until both were done (they may overlap: compile_s runs while loading)

    @property
    def prefill_tok_s(self) -> float:
        return self.prefilled_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        # the first token comes from prefill logits; the rest each cost one decode step
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(prefill_tok_s=round(self.prefill_tok_s, 2), decode_tok_s=round(self.decode_tok_s, 2))
        return d



class Generation:
    """An in-flight request: iterate it for `Step`s; afterwards read output_ids, text, finish_reason, timings."""

    def __init__(self, engine: Model, prompt_ids: list[int], sp: SamplingParams, prefix, prefix_len,
                 prefix_logits, on_prefill, exact: bool = True, prefix_exact: bool = False):
        n = len(prompt_ids)
        if prefix is not None and not 0 < prefix_len <= min(n, int(prefix.pos)):
            raise JaxsmolError(f"prefix_len {prefix_len} must be in [1, {min(n, int(prefix.pos))}]")
        if prefix_len == n and prefix_logits is None:
            raise JaxsmolError("reusing the whole prompt needs the logits stored with it")
        self.engine, self.prompt_ids, self.sp = engine, prompt_ids, sp
        self._prefix, self._prefix_len, self._prefix_logits = (prefix, prefix_len if prefix is not None else 0,
                                                               prefix_logits)
        self._restore_tokens = prompt_ids if prefix_exact else None  # (restore takes its first prefix_len)
        self._on_prefill, self._exact = on_prefill, exact
        self.output_ids: list[int] = []
        self.logprobs: list[dict] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.timings = Timings(prompt_tokens=n, reused_tokens=self._prefix_len)
        self.kv: KVCache | None = None  # the cache after the last step (positions 0..pos-1 computed);
        # None after an exact full hit that needed no decode step, or once recycled
        self.pos = 0  # positions computed for this request at the end (prompt + generated - 1)
        self.prompt_logits: np.ndarray | None = None  # [V] logits after the last prompt token
        # structured output (sp.structured): built here so a bad spec fails before any model work
        self.constraint = constraint_for(engine.tokenizer, engine.cfg.eos_ids, engine.cfg.vocab_size, sp.structured)

    def __iter__(self) -> Iterator[Step]:
        eng, sp = self.engine, self.sp
        t0 = time.perf_counter()
        n = len(self.prompt_ids)
        kv, logits, slots = self._prompt_state()
        self.timings.prefilled_tokens = n - self._prefix_len
        self.prompt_logits = np.asarray(logits)[0]  # indexed on the host: a device slice is an op (~130 us)
        self.timings.prefill_s = time.perf_counter() - t0
        if sp.max_tokens == 0:
            if self._on_prefill is not None:
                self._on_prefill(kv, logits)
            self.kv, self.finish_reason, self.pos = kv, "length", n
            self.timings.total_s = self.timings.ttft_s = time.perf_counter() - t0
            return

        stream = TokenStream(eng.tokenizer, sp, eng.cfg.eos_ids)
        key = seed_key(sp.seed)
        t_decode = None
        for i in range(sp.max_tokens):
            if i > 0:
                if kv is None:
                    kv = eng.restore(self._prefix, slots, self._prefix_len, self._restore_tokens)
                logits, kv = eng.decode(self.output_ids[-1], kv)
            # NumPy scalars, not jnp ones: each jnp scalar is a device array made op by op (~50 us)
            token_arr = programs.sample(logits, programs.step_key(key, np.int32(i)), np.float32(sp.temperature),
                                        np.int32(sp.top_k), np.float32(sp.top_p), self._allowed())
            token = int(np.asarray(token_arr)[0])
            if self.constraint is not None:
                self.constraint.advance(token)
            if i == 0:
                self.timings.ttft_s = time.perf_counter() - t0
                t_decode = time.perf_counter()
            step = stream.push(token, *self._logprobs(logits, token))
            self.output_ids, self.logprobs, self.text = stream.output_ids, stream.logprobs, stream.text
            self.finish_reason = stream.finish_reason
            self.timings.generated_tokens = len(self.output_ids)
            try:
                yield step
            finally:  # the prompt's state is stored once its first token is out (not on the time to
                # first token: a radix split or a fresh host copy took 45-70 ms), before decode donates kv
                if i == 0 and self._on_prefill is not None:
                    self._on_prefill(kv, logits)
            if stream.done:
                break
        self.kv = kv
        self.pos = n + len(self.output_ids) - 1
        self.timings.decode_s = time.perf_counter() - t_decode
        self.timings.total_s = time.perf_counter() - t0

    def _prompt_state(self) -> tuple[KVCache | None, jax.Array, int]:
        """(kv, logits [1, V] after the prompt, the cache's slots): the prompt restored and prefilled,
        or, on an exact full hit, the stored logits and no cache yet (restored only if a decode step
        needs it)."""
        eng, n = self.engine, len(self.prompt_ids)
        # only a suffix after a restored prefix takes the fast path: a cold prefill is always exact
        exact = self._exact or self._prefix is None
        slots = eng.slots_needed(self._prefix_len, n, self.sp.max_tokens, exact)
        if self._prefix_len >= n:  # exact full hit: the stored logits stand in for the forward
            return None, jnp.asarray(self._prefix_logits, jnp.float32)[None], slots
        kv = (eng.restore(self._prefix, slots, self._prefix_len, self._restore_tokens) if self._prefix is not None
              else eng.new_cache(slots))
        logits, kv = eng.prefill(self.prompt_ids, kv, exact)
        return kv, logits, slots

    def _logprobs(self, logits: jax.Array, token: int) -> tuple[float | None, list[tuple[int, float]] | None]:
        """The sampled token's log-probability and the top sp.logprobs (id, logprob), or (None, None)."""
        if not self.sp.logprobs:
            return None, None
        ids, values = programs.top_logprobs(logits, self.sp.logprobs)
        logprob = float(jax.nn.log_softmax(logits[0])[token])
        return logprob, [(int(a), float(b)) for a, b in zip(ids[0], values[0])]

    def _allowed(self) -> np.ndarray | None:
        """The structured-output mask for the next token: [1, ceil(V / 32)] int32, or None (free text)."""
        return None if self.constraint is None else self.constraint.bitmask()[None]
