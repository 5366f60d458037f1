"""Prompt scoring: the log-probability the model gives each token of a sequence, given those before it.

This is what evaluation harnesses need (the log-likelihood of a continuation) and what `echo` with
`logprobs` and `prompt_logprobs` return on the daemon. It is exact by construction: a cold prefill of
the whole sequence in exact chunks of SCORE_ROWS rows in a row of the KV arena (every row has the bits
one forward over the whole would give it; one program, whatever the length), never a state restored
from the prefix cache, so a score is the same whether or not the prompt (or a prefix of it) was
cached. Each chunk's logits are normalised and dropped before the next: a long prompt's [T, V] is
never held.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxsmol.errors import JaxsmolError

MAX_TOP_K = 20  # as SamplingParams.logprobs
_ROWS = 32  # positions normalised at once: bounds the float64 scratch to _ROWS x V (6 MB a temporary)


@dataclasses.dataclass(frozen=True)
class TokenScore:
    """One position: its token, log P(token | tokens before it) (None for the first token, which has
    no context), its rank there (1 = most likely), and the `top_k` most likely tokens there as
    (id, logprob), best first (None at the first position)."""
    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] | None
    rank: int | None = None

    def as_dict(self) -> dict | None:
        """{"token", "logprob", "top": [(id, logprob)], "rank"}, the shape of ChoiceResult.logprobs
        entries (plus the rank); None for the first position."""
        if self.logprob is None:
            return None
        return {"token": self.token, "logprob": self.logprob, "top": list(self.top), "rank": self.rank}


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[N, V] float32 logits -> [N, V] log-probabilities (computed in float64, returned as float64)."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def top_k_rows(logp: np.ndarray, k: int) -> list[tuple[tuple[int, float], ...]]:
    """[N, V] -> for each row its k largest entries as ((id, value), ...), best first (ties: lower id)."""
    if k == 0:
        return [()] * len(logp)
    part = np.argpartition(-logp, k - 1, axis=-1)[:, :k]
    out = []
    for row, ids in zip(logp, part):
        order = sorted(ids.tolist(), key=lambda i: (-row[i], i))
        out.append(tuple((int(i), float(row[i])) for i in order))
    return out


def score(engine, ids, top_k: int = 0) -> list[TokenScore]:
    """Score `ids` (a list of token ids, at least one) with one cold forward.

    Returns len(ids) TokenScores: position 0 has logprob None and top None; position p > 0 has
    log P(ids[p] | ids[:p]) and the top_k most likely tokens at p (an empty tuple for top_k 0).
    """
    steps = score_steps(engine, ids, top_k)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def score_steps(engine, ids, top_k: int = 0):
    """`score` a chunk at a time: a generator that yields after each chunk of SCORE_ROWS positions and
    returns the scores (a daemon runs its other requests' steps between the chunks of a long prompt's
    scoring). Its arena row is held until it returns or is closed."""
    from jaxsmol.runtime.engine import SCORE_ROWS

    if not isinstance(top_k, int) or not 0 <= top_k <= MAX_TOP_K:
        raise JaxsmolError(f"top_k must be an integer in [0, {MAX_TOP_K}], got {top_k!r}")
    ids = engine.check_prompt(ids)
    out = [TokenScore(ids[0], None, None)]
    arena = engine.arena()
    with arena.borrowed(len(ids)) as row:
        for begin, logits in arena.logits_chunks(row, ids, SCORE_ROWS):  # row p predicts ids[p + 1]
            first = len(out) - 1  # a chunk moved back at the arena's end repeats positions already scored
            for start in range(first - begin, min(len(logits), len(ids) - 1 - begin), _ROWS):
                rows = log_softmax(logits[start:min(start + _ROWS, len(ids) - 1 - begin)])
                tops = top_k_rows(rows, top_k)
                for r, (row_, top) in enumerate(zip(rows, tops)):
                    token = ids[begin + start + r + 1]
                    out.append(TokenScore(token, float(row_[token]), top, rank=int((row_ > row_[token]).sum()) + 1))
            if len(out) < len(ids):
                yield
    return out
