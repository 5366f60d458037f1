"""Answers waiting to be stored for the next turn, a chunk at a time (cache/answers.py), for the
scheduler (cache/scheduler/scheduler.py).

Storing an answer is speculative work (the next turn may never come), so it yields to requests:
the scheduler runs a chunk only in a step where no prompt is being prefilled and no row decodes,
unless a waiting prompt continues that answer (`wanted_by` moves it to the front and marks it
wanted; `may_run`). Under steady load answers are then not stored ahead; a next turn prefills its answer
itself, which costs it no more than the save would have.
"""

from __future__ import annotations

import collections

from jaxsmol.cache.answers import AnswerPrefill
from jaxsmol.cache.prefix_cache import PrefixCache
from jaxsmol.cache.records import AnswerSave
from jaxsmol.cache.store.values import common_prefix_len

MAX_PENDING = 64  # answers waiting; beyond them the oldest is dropped (its next turn runs colder)


class AnswerQueue:
    def __init__(self, cache: PrefixCache, arena, lease):
        """arena: where the answers' chunks run; lease: the scheduler's holder of its rows."""
        self.cache, self.arena, self.lease = cache, arena, lease
        self._queue: collections.deque[AnswerPrefill] = collections.deque()

    def __bool__(self) -> bool:
        return bool(self._queue)

    def add(self, save: AnswerSave) -> None:
        self._queue.append(AnswerPrefill(save))
        while len(self._queue) > MAX_PENDING:
            self._queue.popleft().drop(self.cache, self.lease)

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
        if self._queue[0].step(self.cache, self.arena, self.lease, max_rows):
            self._queue.popleft()

    def close(self) -> None:
        """Give every waiting answer up (their rows back)."""
        while self._queue:
            self._queue.popleft().drop(self.cache, self.lease)
