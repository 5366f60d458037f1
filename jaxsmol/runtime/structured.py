"""Structured output: a spec (JSON object, JSON schema, regex, grammar, choice) enforced token by token.

A spec has the shape of OpenAI's `response_format`, plus extensions for what the library also offers:

    {"type": "text"}                                       free text (canonical_spec gives None)
    {"type": "json_object"}                                any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
    {"type": "regex", "regex": "[0-9]{3}-[0-9]{4}"}        extension (vLLM's guided_regex)
    {"type": "grammar", "grammar": "start: ..."}           extension: Lark or GBNF (vLLM's guided_grammar)
    {"type": "choice", "choice": ["yes", "no"]}            extension (vLLM's guided_choice)

`canonical_spec` checks a spec and returns its canonical JSON, the hashable `SamplingParams.structured`.
`constraint_for` turns that into a per-request `Constraint`: before each sampled token `bitmask()` gives
the allowed ids (packed, what `sampling.sample_rows` takes as `allowed`), after it `advance(token)`. When the
output is complete only the end-of-sequence ids are allowed, so generation ends with `stop`.

The library is llguidance (guidance-ai, MIT; the engine behind structured output in vLLM, SGLang and
llama.cpp's `--grammar` backend option). Chosen because: it has no Python dependencies at all (xgrammar
requires torch, transformers and triton at install; outlines-core is torch-free too but compiles a
regex to a DFA over the whole vocabulary up front, slow for large schemas and without recursion);
it builds its token trie straight from a `tokenizers` tokenizer.json; it fills a packed int32 bitmask
per step into a NumPy buffer (an Earley parser computed lazily, tens to hundreds of microseconds a
token, no per-schema precompilation), and it compiles JSON schema, regex and Lark/GBNF grammars.

JSON is generated compact with a space after `:` and `,` (`{"a": 1, "b": [2, 3]}`), the way these
models write it; free whitespace would let a small model loop on newlines. A schema's `x-guidance`
object may override that (llguidance's JSON options). Numbers and strings a schema leaves open get
default bounds, so that the output ends (schema_bounds.py).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np

from jaxsmol.errors import JaxsmolError
from jaxsmol.runtime.schema_bounds import bounded

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SPEC_TYPES = ("text", "json_object", "json_schema", "regex", "grammar", "choice")
MAX_CACHED_SPECS = 128


def _library():
    try:
        import llguidance
    except ImportError:  # a dependency in pyproject.toml; an old environment may lack it
        raise JaxsmolError("structured output needs the llguidance package (pip install llguidance)") from None
    return llguidance


# ---- specs --------------------------------------------------------------------------------------
def _spec_body(spec: dict) -> tuple[str, object]:
    """(llguidance grammar format, its text) for a spec dict; JaxsmolError naming what is wrong."""
    kind = spec.get("type")
    if kind == "json_object":
        return "json_schema", {"type": "object"}
    if kind == "json_schema":
        inner = spec.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema", {}), (dict, bool)):
            raise JaxsmolError("response_format json_schema must be an object with a 'schema' object")
        return "json_schema", inner.get("schema", {})
    if kind in ("regex", "grammar"):
        if not isinstance(spec.get(kind), str) or not spec[kind]:
            raise JaxsmolError(f"response_format {kind} needs a non-empty string field '{kind}'")
        return kind, spec[kind]
    if kind == "choice":
        choice = spec.get("choice")
        if not isinstance(choice, list) or not choice or not all(isinstance(c, str) for c in choice):
            raise JaxsmolError("response_format choice needs 'choice': a non-empty list of strings")
        return "choice", choice
    raise JaxsmolError(f"response_format type must be one of {', '.join(SPEC_TYPES)}; got {kind!r}")


def _grammar(spec_json: str) -> str:
    """The llguidance grammar of a canonical spec, checked (no tokenizer needed)."""
    llg = _library()
    fmt, body = _spec_body(json.loads(spec_json))
    if fmt == "json_schema":
        if isinstance(body, bool):  # JSON Schema allows true / false as a whole schema
            body = {} if body else {"not": {}}
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(bounded(body), defaults=JSON_OPTIONS)
        except ValueError as e:  # e.g. an integer over 64 bits: "Value is not JSON serializable"
            raise JaxsmolError(f"invalid schema: {e}") from None
    elif fmt == "choice":
        grammar = llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in body))
    else:
        try:
            grammar = llg.grammar_from(fmt, body)
        except ValueError as e:
            raise JaxsmolError(f"invalid {fmt}: {e}") from None
    error = llg.LLMatcher.validate_grammar(grammar)
    if error:
        raise JaxsmolError(f"invalid {'schema' if fmt == 'json_schema' else fmt}: {_one_line(error)}")
    return grammar


def _one_line(message: str) -> str:
    """llguidance's multi-line parse errors (with a caret picture) -> its first line plus the cause lines."""
    lines = [line.strip() for line in message.strip().splitlines()]
    causes = [line.removeprefix("error:").strip() for line in lines[1:] if line.startswith("error:")]
    return " ".join([lines[0].rstrip(":") + (":" if causes else "")] + causes) if lines else message


def canonical_spec(spec) -> str | None:
    """A spec (dict, or its JSON text) -> canonical JSON text, or None for free text.

    Checks the spec and compiles its grammar once, so a bad schema fails here with a JaxsmolError
    (before any model work), not in the middle of a generation."""
    if spec is None:
        return None
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise JaxsmolError(f"response_format is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise JaxsmolError(f"response_format must be an object, got {type(spec).__name__}")
    if spec.get("type") == "text":
        return None
    _spec_body(spec)
    # keys keep their order: a schema's property order is the order the model writes them in
    canonical = json.dumps(spec, separators=(",", ":"), ensure_ascii=False)
    _cached(_GRAMMARS, canonical, lambda: _grammar(canonical))
    return canonical


# ---- compiled once: the library's tokenizer per tokenizer, a start-state matcher per spec ---------
_LOCK = threading.Lock()
_TOKENIZERS: OrderedDict = OrderedDict()  # (tokenizer fingerprint, eos ids) -> llguidance.LLTokenizer
_GRAMMARS: OrderedDict = OrderedDict()  # canonical spec -> grammar text
_MATCHERS: OrderedDict = OrderedDict()  # (fingerprint, eos ids, canonical spec) -> start-state LLMatcher


def _cached(table: OrderedDict, key, build, limit: int = MAX_CACHED_SPECS):
    with _LOCK:
        if key in table:
            table.move_to_end(key)
            return table[key]
    value = build()  # outside the lock: building a tokenizer takes ~0.3 s
    with _LOCK:
        table[key] = value
        while len(table) > limit:
            table.popitem(last=False)
    return value


def _ll_tokenizer(tokenizer, eos_ids: tuple[int, ...]):
    llg = _library()
    return _cached(_TOKENIZERS, (tokenizer.fingerprint, eos_ids),
                   lambda: llg.LLTokenizer(tokenizer.to_json(), eos_token=list(eos_ids)), limit=4)


def _start_matcher(tokenizer, eos_ids: tuple[int, ...], spec_json: str):
    llg = _library()
    grammar = _cached(_GRAMMARS, spec_json, lambda: _grammar(spec_json))

    def build():
        matcher = llg.LLMatcher(_ll_tokenizer(tokenizer, eos_ids), grammar, log_level=0)
        if matcher.is_error():
            raise JaxsmolError(f"invalid response_format: {matcher.get_error()}")
        return matcher
    return _cached(_MATCHERS, (tokenizer.fingerprint, eos_ids, spec_json), build)


class Constraint:
    """One request's position in its spec's grammar.

    Before each sampled token: `bitmask()` -> [ceil(vocab_size / 32)] int32, the allowed ids packed
    (bit j of word w allows id 32*w + j; ids the tokenizer lacks are never allowed). After it:
    `advance(token)`. `done` is True once the output is complete and only end-of-sequence ids remain.
    """

    def __init__(self, matcher, vocab_size: int, tokenizer_vocab: int, eos_ids: tuple[int, ...] = ()):
        self._matcher = matcher
        self.vocab_size, self.eos_ids = vocab_size, frozenset(eos_ids)
        self._ll_words = np.zeros(((tokenizer_vocab + 31) // 32,), np.int32)  # llguidance writes here
        self._words = np.zeros(((vocab_size + 31) // 32,), np.int32)

    def bitmask(self) -> np.ndarray:
        """[ceil(vocab_size / 32)] int32: the ids allowed next."""
        self._ll_words[:] = 0  # (a matcher in its error state writes nothing: never the last mask)
        self._matcher.unsafe_compute_mask_ptr(self._ll_words.ctypes.data, self._ll_words.nbytes)
        n = min(len(self._words), len(self._ll_words))
        self._words[:] = 0
        self._words[:n] = self._ll_words[:n]
        if self._matcher.is_error():  # end-of-sequence only, whose `advance` then fails this row alone
            for i in self.eos_ids:
                self._words[i // 32] |= np.int32(np.uint32(1 << (i % 32)).view(np.int32))
        if self.vocab_size % 32:  # ids past the model's vocabulary (a smaller model head)
            self._words[-1] &= np.int32((1 << (self.vocab_size % 32)) - 1)
        return self._words.copy()

    def allowed(self) -> np.ndarray:
        """[vocab_size] bool: the ids allowed next (bitmask() unpacked; for tests and inspection)."""
        return unpack_bits(self.bitmask()[None], self.vocab_size)[0]

    def advance(self, token: int) -> None:
        """Consume the sampled token; a token the mask did not allow is a bug, not a user error, and a
        matcher that gave up (its resource limits) fails the request."""
        if self._matcher.is_error():
            raise RuntimeError(f"structured output: the grammar matcher stopped: {self._matcher.get_error()}")
        if not self._matcher.consume_token(int(token)):
            raise RuntimeError(f"structured output: token {token} rejected: {self._matcher.get_error()}")

    def forced(self) -> list[int]:
        """The tokens the grammar forces next, whatever the model says (a JSON key, a brace): llguidance's
        fast-forward tokens, the drafts of jump-forward decoding."""
        return list(self._matcher.compute_ff_tokens())

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar allows from here."""
        return self._matcher.validate_tokens(list(tokens))

    def masks_along(self, tokens: list[int]) -> np.ndarray:
        """[len(tokens) + 1, words] int32: the bitmask now, and after each of `tokens` (which the grammar
        must allow: see valid_prefix); the constraint is left where it was. An end-of-sequence id is not
        consumed (the matcher keeps no history of it, so a rollback counting it went one token too far):
        the masks after it are the one before, never sampled from (the row ends there)."""
        masks, consumed, ended = [self.bitmask()], 0, False
        for token in tokens:
            ended = ended or token in self.eos_ids
            if not ended:
                self.advance(token)
                consumed += 1
            masks.append(self.bitmask() if not ended else masks[-1])
        self._matcher.rollback(consumed)
        return np.stack(masks)

    @property
    def done(self) -> bool:
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """True when the output so far is complete (an end-of-sequence id is allowed)."""
        return self._matcher.is_accepting()


def constraint_for(tokenizer, eos_ids, vocab_size: int, spec_json: str | None) -> Constraint | None:
    """A fresh Constraint for one request (None for free text). `eos_ids` end the output once it is
    complete; `vocab_size` is the model's (the width of its logits)."""
    if spec_json is None:
        return None
    if tokenizer is None:
        raise JaxsmolError("structured output needs the model's tokenizer (this engine has none)")
    eos_ids = tuple(int(i) for i in eos_ids)
    matcher = _start_matcher(tokenizer, eos_ids, spec_json).deep_copy()
    return Constraint(matcher, vocab_size, _ll_tokenizer(tokenizer, eos_ids).vocab_size, eos_ids)


# ---- bit packing (NumPy; the jitted sampler unpacks with sampling.unpack_bitmask) ---------------
def pack_bits(allowed: np.ndarray) -> np.ndarray:
    """allowed [B, V] bool -> [B, ceil(V / 32)] int32 bitmask, the layout `sample_rows` takes."""
    allowed = np.asarray(allowed, bool)
    B, V = allowed.shape
    padded = np.zeros((B, -(-V // 32) * 32), bool)
    padded[:, :V] = allowed
    return np.packbits(padded, axis=-1, bitorder="little").view(np.int32).reshape(B, -1)


def unpack_bits(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """[B, W] int32 bitmask -> [B, vocab_size] bool (ids past 32 * W are not allowed)."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask, np.int32).view(np.uint8), axis=-1, bitorder="little")
    out = np.zeros((bits.shape[0], vocab_size), bool)
    n = min(vocab_size, bits.shape[1])
    out[:, :n] = bits[:, :n]
    return out


def all_allowed(batch: int, vocab_size: int) -> np.ndarray:
    """[batch, ceil(vocab_size / 32)] int32 with every id allowed: the row of an unconstrained request
    in a batch whose other rows are constrained (one masked program for the whole batch)."""
    return pack_bits(np.ones((batch, vocab_size), bool))
