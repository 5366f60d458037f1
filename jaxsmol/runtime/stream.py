"""One choice's sampled tokens -> its text, its log-probabilities and the reason it ends.

The host side of generation, one `TokenStream` per decode row of the scheduler: incremental
detokenizing, stop ids (EOS included), stop strings, max_tokens. Stop strings are searched
incrementally: each token scans only the new text plus the longest stop string's length of what
came before, so a long answer costs O(new text) a token.
"""

from __future__ import annotations

import dataclasses

from jaxsmol.runtime.sampling import SamplingParams


@dataclasses.dataclass
class Step:
    """One generated token."""
    token: int
    text: str  # the new text it completes (may be "" while a UTF-8 character is incomplete)
    top_logprobs: list[tuple[int, float]] | None = None
    logprob: float | None = None


class TokenStream:
    """Feed it sampled tokens with `push`; read output_ids, text, logprobs and finish_reason."""

    def __init__(self, tokenizer, sp: SamplingParams, eos_ids=()):
        from jaxsmol.checkpoint.tokenizer import IncrementalDecoder

        self.sp = sp
        self.stop_ids = set(sp.stop_ids) | (set() if sp.ignore_eos else set(eos_ids))
        self._decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self._longest_stop = max((len(s) for s in sp.stop_strings), default=0)
        self._all_text = ""  # every decoded character; `text` is the part released (streamed)
        self._searched = 0  # stop strings cannot start before this index of _all_text
        self.output_ids: list[int] = []
        self.logprobs: list[dict] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_string: str | None = None  # the stop string that ended the text, if one did

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def push(self, token: int, logprob: float | None = None,
             top: list[tuple[int, float]] | None = None) -> Step:
        """Record one sampled token; returns the Step with the text it releases."""
        sp = self.sp
        self.output_ids.append(token)
        step = Step(token=token, text="", top_logprobs=top, logprob=logprob)
        if top is not None:
            self.logprobs.append({"token": token, "logprob": logprob, "top": top})
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.output_ids) >= sp.max_tokens:
            self.finish_reason = "length"
        if self._decoder is not None:
            step.text = self._release(token)
        return step

    def _release(self, token: int) -> str:
        # An EOS ends the text and is not part of it; the decoder's held-back bytes are released on
        # the last step so that the streamed text equals `text`.
        new = self._decoder.feed(token) if token not in self.stop_ids else ""
        if self.finish_reason:
            new += self._decoder.flush()
        self._all_text += new
        hit = self._find_stop()
        if hit is not None:
            self._all_text, self.finish_reason = self._all_text[:hit[0]], "stop"
            self.stop_string = hit[1]
        # hold back a tail that may still grow into a stop string
        safe = len(self._all_text) if self.finish_reason else len(self._all_text) - self._stop_prefix_len()
        released = self._all_text[len(self.text):safe]
        self.text = self._all_text[:safe]
        return released

    def _find_stop(self) -> tuple[int, str] | None:
        """(the earliest index where a stop string occurs, that string: the first listed of those
        starting there), searching only text not searched before."""
        stops = [s for s in self.sp.stop_strings if s]
        start = self._searched
        self._searched = max(0, len(self._all_text) - self._longest_stop + 1)
        hits = [(i, order, s) for order, s in enumerate(stops) if (i := self._all_text.find(s, start)) >= 0]
        if not hits:
            return None
        i, _, s = min(hits)
        return i, s

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        text, best = self._all_text, 0
        for s in self.sp.stop_strings:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
