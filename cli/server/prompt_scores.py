"""A job's prompt log-probabilities (`echo` with `logprobs`, `prompt_logprobs`), a chunk at a time.

Scoring is a cold forward of the whole prompt (jaxsmol/runtime/scoring.py); a 1500-token prompt takes
seconds, and run at once it held every stream decoding beside it for as long. The worker advances one
job's scoring a chunk per round instead, between the scheduler's steps, and submits the job once its
scores are in.
"""

from __future__ import annotations

from jaxsmol.cli.api.events import ChoiceSpec
from jaxsmol.runtime.scoring import score_steps


class PromptScores:
    """The scores one job's choices ask for: one scoring per distinct (prompt, top k). `advance` runs
    the next chunk; once `done`, `result` maps each asking choice's index to its prompt's scores (the
    TokenScore dicts). `close` gives back the arena row of a scoring cut short."""

    def __init__(self, engine, choices: list[ChoiceSpec]):
        self.engine = engine
        self.wanted: dict[tuple, list[int]] = {}  # (prompt ids, top k) -> indices of the choices asking
        for spec in choices:
            if spec.prompt_logprobs is not None:
                self.wanted.setdefault((tuple(spec.prompt_ids), spec.prompt_logprobs), []).append(spec.index)
        self.todo = list(self.wanted)
        self.result: dict[int, list] = {}
        self._steps = None

    @property
    def done(self) -> bool:
        return not self.todo

    def advance(self) -> None:
        """One chunk of the current scoring (JaxsmolError: a prompt or top k it refuses)."""
        key = self.todo[0]
        if self._steps is None:
            self._steps = score_steps(self.engine, list(key[0]), key[1])
        try:
            next(self._steps)
        except StopIteration as finished:
            scores = [s.as_dict() for s in finished.value]
            for index in self.wanted[key]:
                self.result[index] = scores
            self.todo.pop(0)
            self._steps = None

    def close(self) -> None:
        if self._steps is not None:
            self._steps.close()
            self._steps = None
