"""Text <-> token ids for a Hugging Face model directory (`tokenizer.json` + `tokenizer_config.json`).

Encoding is done by the `tokenizers` library; chat prompts are rendered from the model's own Jinja
chat template the way `transformers` does it; `IncrementalDecoder` turns streamed ids into text.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path

from jaxsmol.errors import JaxsmolError

_REPLACEMENT = "\ufffd"  # what a decode of an incomplete UTF-8 sequence ends with
_SURROGATE = re.compile("[\ud800-\udfff]")  # never valid alone in text (JSON "\\ud800" can make one)


def _token_content(tok) -> str | None:
    """tokenizer_config.json names a token either as a string or as an AddedToken dict."""
    return tok.get("content") if isinstance(tok, dict) else tok


class Tokenizer:
    """A loaded tokenizer; build it with `Tokenizer.load(model_dir)`."""

    def __init__(self, tok, config: dict, source_digest: bytes | None = None):
        self._tok = tok
        self.config = config
        self._source_digest = source_digest  # blake2b of the tokenizer.json bytes (set by `load`)
        self._fingerprint: str | None = None
        self.chat_template: str | None = config.get("chat_template")
        if isinstance(self.chat_template, list):  # newer HF format: a list of named templates
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default")
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self._compiled = None  # (template source, compiled template): compiled once, not per request

    @classmethod
    def load(cls, model_dir: str | Path) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        path, cfg_path = model_dir / "tokenizer.json", model_dir / "tokenizer_config.json"
        for p in (path, cfg_path):
            if not p.is_file():
                raise JaxsmolError(f"model directory {model_dir} has no {p.name}")
        try:
            tok = HFTokenizer.from_file(str(path))
            digest = hashlib.blake2b(path.read_bytes(), digest_size=16).digest()
        except Exception as e:  # tokenizers raises a bare Exception for malformed JSON
            raise JaxsmolError(f"cannot read {path}: {e}") from None
        try:
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise JaxsmolError(f"cannot read {cfg_path}: {e}") from None
        return cls(tok, config, source_digest=digest)

    @property
    def fingerprint(self) -> str:
        """A hash of the tokenizer.json bytes and the chat template: the same ids and prompts mean
        the same thing under two tokenizers with one fingerprint (saved prompt caches key on it)."""
        if self._fingerprint is None:
            digest = self._source_digest or hashlib.blake2b(self._tok.to_str().encode(), digest_size=16).digest()
            h = hashlib.blake2b(digest, digest_size=16)
            h.update(b"\0chat_template\0" + (self.chat_template or "").encode())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what structured-output libraries build their vocabulary from)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return None if self.bos_token is None else self.token_to_id(self.bos_token)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Ids that end generation: the configured eos token and ChatML's <|im_end|> (end of a turn)."""
        ids = [self.token_to_id(t) for t in (self.eos_token, "<|im_end|>") if t is not None]
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no BOS is added (SmolLM2 adds none). Special tokens in the text map to their ids."""
        if not isinstance(text, str):
            raise JaxsmolError(f"cannot tokenize a {type(text).__name__}: expected a string")
        bad = _SURROGATE.search(text)
        if bad:
            raise JaxsmolError(f"the text holds a lone surrogate (U+{ord(bad.group()):04X} at character "
                               f"{bad.start()}), which is not valid Unicode")
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise JaxsmolError(f"token id {bad[0]} is out of range (vocab size {self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the model's chat template."""
        if not self.chat_template:
            raise JaxsmolError("this model has no chat template (tokenizer_config.json lacks chat_template)")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise JaxsmolError("messages must be a list of {'role': str, 'content': str} dicts")
        template = self._template()
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except Exception as e:  # raise_exception(), a sandbox refusal, or any error of the template's own code
            raise JaxsmolError(f"chat template error: {e}") from None

    def _template(self):
        """The compiled chat template, compiled on first use (and again only if chat_template changes)."""
        import jinja2

        if self._compiled is None or self._compiled[0] != self.chat_template:
            try:
                self._compiled = (self.chat_template, _jinja_env().from_string(self.chat_template))
            except jinja2.TemplateError as e:
                raise JaxsmolError(f"chat template error: {e}") from None
        return self._compiled[1]


@functools.lru_cache(maxsize=1)
def _jinja_env():
    """A sandboxed Jinja environment configured as in transformers' chat-template rendering (one for all)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


class IncrementalDecoder:
    """Streams text for ids fed one at a time; `"".join(feed(i) for i in ids) + flush() == decode(ids)`.

    Text whose decode ends in U+FFFD (an incomplete UTF-8 sequence, e.g. half an emoji) is held back
    until the next token completes the character. Only a short window of recent ids is re-decoded:
    decoding from `prefix` (a point where earlier text was complete) and diffing keeps tokenizers that
    strip a leading space at the start of a decode (SentencePiece) correct too.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tok, self._skip = tokenizer, skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: text before it has been emitted
        self._read = 0  # ids[prefix:read] decode to text already emitted

    def _window(self, end: int) -> str:
        return self._tok.decode(self._ids[self._prefix:end], skip_special_tokens=self._skip)

    def feed(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        done, text = self._window(self._read), self._window(len(self._ids))
        if len(text) <= len(done) or text.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done):]

    def flush(self) -> str:
        """Whatever is held back (an incomplete character decodes as U+FFFD, as decode() would)."""
        done, text = self._window(self._read), self._window(len(self._ids))
        self._prefix = self._read = len(self._ids)
        return text[len(done):]
