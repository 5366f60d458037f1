"""Storing an answer for the next turn, one chunk at a time: prompt + answer re-prefilled from the stored
prompt, so that the next turn restores the bits a cold prefill of it computes (cache/prefix_cache.py's
docstring says why an answer's decode-step state is not stored as it is).

The scheduler queues it and runs a chunk in a step with room (cache/scheduler/answers.py); its chunks
run in a row of the KV arena (jaxsmol/runtime/kv_arena.py), taken at its first chunk and given back
once it is stored (holding the exact state of prompt + answer: the next turn may take that row as it is).
"""

from __future__ import annotations

import dataclasses

from jaxsmol.cache.records import AnswerSave


@dataclasses.dataclass
class AnswerPrefill:
    """An answer being stored: its save (the stored prompt held) and the arena row its chunks fill."""
    save: AnswerSave
    row: int | None = None
    wanted: bool = False  # a waiting prompt continues this answer (the scheduler's queue)

    def step(self, cache, arena, lease, max_rows: int) -> bool:
        """One prefill chunk of at most max_rows rows; True once the answer is stored or given up
        (a failed save costs the next turn its reuse, nothing else)."""
        engine, tokens = cache.engine, self.save.tokens
        try:
            if self.row is None:
                if arena.free_rows < 2:
                    return False  # a row left for a scoring: later
                self.row = cache.answer_row(self.save, lease)
                if self.row is None:
                    self.drop(cache, lease)  # its prompt was evicted meanwhile: the next turn runs colder
                    return True
            T = engine.chunk_rows(len(tokens) - arena.pos[self.row], max_rows)
            logits = arena.prefill([(self.row, tokens)], T, exact_rows=T in engine.buckets(True))
            if arena.pos[self.row] < len(tokens):
                return False
            cache.finish_answer(self.save, arena.view(self.row), logits)
            self._give_back(lease)
        except Exception:
            self.drop(cache, lease)
        return True

    def drop(self, cache, lease) -> None:
        """Give up: unhold the stored prompt, hand the row back (to the scheduler's lease)."""
        cache.finish_answer(self.save, None, None)
        self._give_back(lease)

    def _give_back(self, lease) -> None:
        if self.row is not None:
            lease.give(self.row)
            self.row = None
