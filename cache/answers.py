"""Storing an answer for the next turn, one chunk at a time: prompt + answer re-prefilled from the stored
prompt, so that the next turn restores the bits a cold prefill of it computes (cache/prefix_cache.py's
docstring says why an answer's decode-step state is not stored as it is).

The scheduler queues it and runs a chunk in a step with room (cache/scheduler/answers.py).
"""

from __future__ import annotations

import dataclasses

from jaxsmol.cache.records import AnswerSave
from jaxsmol.model.kv import KVCache
from jaxsmol.runtime.chunks import capacity_for


@dataclasses.dataclass
class AnswerPrefill:
    """An answer being stored: its save (the stored prompt held) and the cache its chunks fill."""
    save: AnswerSave
    kv: KVCache | None = None
    wanted: bool = False  # a waiting prompt continues this answer (the scheduler's queue)

    def step(self, cache, max_rows: int) -> bool:
        """One prefill chunk of at most max_rows rows; True once the answer is stored or given up
        (a failed save costs the next turn its reuse, nothing else)."""
        engine, tokens = cache.engine, self.save.tokens
        try:
            if self.kv is None:
                self.kv = engine.restore(self.save.prefix, capacity_for(len(tokens)), len(self.save.lookup.prompt),
                                         cache.exact_state(tokens))
            logits, self.kv = engine.prefill_chunk(tokens, self.kv, max_rows)
            if int(self.kv.pos) < len(tokens):
                return False
            cache.finish_answer(self.save, self.kv, logits)
            engine.recycle(self.kv)
            self.kv = None
        except Exception:
            self.drop(cache)
        return True

    def drop(self, cache) -> None:
        """Give up: unhold the stored prompt, hand the cache back."""
        cache.finish_answer(self.save, None, None)
        cache.engine.recycle(self.kv)
        self.kv = None
