"""Answers waiting to be stored for the next turn, re-prefilled a chunk at a time (cache/scheduler/scheduler.py).

A finished choice's prompt + answer is stored in the prefix cache by re-prefilling the answer in
prefill chunks (the engine's exact buckets) from the stored prompt (so the next turn gets the bits a
cold prefill computes).
Storing an answer is speculative work (the next turn may never come), so it yields to requests:
the scheduler runs a chunk only in a step where no prompt is being prefilled and no row decodes,
unless a waiting prompt continues that answer (`wanted_by` moves it to the front and marks it
wanted; `may_run`). Under steady load answers are then not stored ahead; a next turn prefills its answer
itself, which costs it no more than the save would have.
"""

from __future__ import annotations

import collections
import dataclasses

from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.store.values import common_prefix_len
from jaxsmol.cache.records import AnswerSave
from jaxsmol.runtime.chunks import capacity_for
from jaxsmol.model.kv import KVCache

MAX_PENDING = 64  # answers waiting; beyond them the oldest is dropped (its next turn runs colder)


@dataclasses.dataclass
class _Saving:
    save: AnswerSave
    kv: KVCache | None = None
    wanted: bool = False  # a waiting prompt continues this answer


class AnswerQueue:
    def __init__(self, cache: PrefixCache):
        self.cache, self.engine = cache, cache.engine
        self._queue: collections.deque[_Saving] = collections.deque()

    def __bool__(self) -> bool:
        return bool(self._queue)

    def add(self, save: AnswerSave) -> None:
        self._queue.append(_Saving(save))
        while len(self._queue) > MAX_PENDING:
            self._drop(self._queue.popleft())

    def may_run(self, rows_decoding: bool) -> bool:
        """Should a chunk run this step? When no row decodes, or when a waiting prompt continues the
        first answer (see the module docstring)."""
        return bool(self._queue) and (not rows_decoding or self._queue[0].wanted)

    def wanted_by(self, prompt_ids, namespace) -> bool:
        """Does this prompt continue an answer still waiting? Then that answer moves to the front."""
        for i, s in enumerate(self._queue):
            if s.save.lookup.ns == namespace and \
                    common_prefix_len(prompt_ids, s.save.tokens) > len(s.save.lookup.prompt):
                del self._queue[i]
                s.wanted = True
                self._queue.appendleft(s)
                return True
        return False

    def step(self, max_rows: int) -> None:
        """One prefill chunk (at most max_rows rows) of the first waiting answer; stores it when done."""
        s = self._queue[0]
        tokens, start = s.save.tokens, len(s.save.lookup.prompt)
        try:
            if s.kv is None:
                s.kv = self.engine.restore(s.save.prefix, capacity_for(len(tokens)), start,
                                           self.cache.exact_state(tokens))
            logits, s.kv = self.engine.prefill_chunk(tokens, s.kv, max_rows)
            if int(s.kv.pos) < len(tokens):
                return
            self._queue.popleft()
            self.cache.finish_answer(s.save, s.kv, logits)
            self.engine.recycle(s.kv, self.cache.exact_state(tokens) or ())  # prompt + answer, prefilled exactly
        except Exception:  # a failed save costs the next turn its reuse, nothing else
            self._drop(self._queue.popleft())

    def _drop(self, s: _Saving) -> None:
        self.cache.finish_answer(s.save, None, None)
        self.engine.recycle(s.kv)
