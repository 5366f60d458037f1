"""Tokenizer of the default SmolLM2-135M-Instruct model (built from the bundled GGUF)."""

from __future__ import annotations

import json

import pytest

from jaxsmol.checkpoint.default_model import default_model_dir
from jaxsmol.errors import JaxsmolError
from jaxsmol.checkpoint.tokenizer import IncrementalDecoder, Tokenizer

pytestmark = pytest.mark.real

CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>",
                  "<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>",
                  "<jupyter_start>", "<jupyter_text>", "<jupyter_code>", "<jupyter_output>", "<jupyter_script>",
                  "<empty_output>"]

TRICKY = [
    "", " ", "Hello, world!", "  leading and trailing  ", "multiple   internal    spaces\t\ttabs",
    "line1\nline2\r\nline3\n\n\n", "naïve café résumé Ærøskøbing", "Привет, мир! Γειά σου κόσμε",
    "日本語のテキスト、中文，한국어", "emoji 😀👍🏽👨‍👩‍👧‍👦 🇫🇷 flags", "math: ∑_{i=1}^{n} x² ≤ ∞ ≠ π",
    "def f(x):\n    return x ** 2  # square\n", "if (a && b) { printf(\"%d\\n\", 42); }",
    "numbers 3.14159 1,000,000 2024-01-31 0x1F", "<|im_start|>user\nhi<|im_end|>\n", "I'm sure they'll say it's fine",
    "\u200b zero width \u00a0nbsp \ufeff", "tab\tend\t", "<not_special> <|fake|>", "a" * 300,
]


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    try:
        return Tokenizer.load(default_model_dir(progress=False))
    except JaxsmolError as e:
        pytest.fail(f"the default model is needed for this test: {e}", pytrace=False)


def test_basic_properties(tok):
    assert tok.vocab_size == 49152
    assert tok.bos_id == 1 and tok.eos_ids == (2,)
    assert tok.token_to_id("<|im_end|>") == 2 and tok.token_to_id("no such token") is None


def test_control_tokens_are_single_ids(tok):
    for i, t in enumerate(CONTROL_TOKENS):
        assert tok.encode(t) == [i], t
        assert tok.decode([i]) == t
    ids = tok.encode("<|im_start|>user\nHi there<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1]
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHi there"


def test_no_bos_added(tok):
    assert tok.encode("Hello")[0] != tok.bos_id
    assert len(tok.encode("Hello")) == 1


def test_digits_split_one_by_one(tok):
    ids = tok.encode("12345")
    assert [tok.decode([i]) for i in ids] == list("12345")
    ids = tok.encode("in 2024, 100 people")
    pieces = [tok.decode([i]) for i in ids]
    assert "2" in pieces and "0" in pieces and not any(len(p.strip()) > 1 and p.strip().isdigit() for p in pieces)


def test_common_words_are_single_tokens(tok):
    assert len(tok.encode("Hello world")) == 2
    assert tok.encode(" the") == [tok.token_to_id("Ġthe")]


@pytest.mark.parametrize("s", TRICKY)
def test_round_trip(tok, s):
    assert tok.decode(tok.encode(s)) == s


def test_chat_template_two_messages(tok):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]
    assert tok.apply_chat_template(msgs) == ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                                            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("What is 2+2?<|im_end|>\n")


def test_chat_template_default_system_prompt(tok):
    out = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert out == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                   "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(out)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2


@pytest.mark.parametrize("bad", [None, "hi", [{"role": "user"}], [{"role": "user", "content": 3}], ["x"]])
def test_chat_template_bad_messages(tok, bad):
    with pytest.raises(JaxsmolError, match="messages"):
        tok.apply_chat_template(bad)


def test_chat_template_raise_exception_and_no_template(tok):
    strict = Tokenizer(tok._tok, {"chat_template": "{{ raise_exception('only user turns') }}"})
    with pytest.raises(JaxsmolError, match="only user turns"):
        strict.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(JaxsmolError, match="no chat template"):
        Tokenizer(tok._tok, {}).apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_errors_of_its_own_code(tok):
    for source in ("{{ 1 + 'a' }}", "{{ messages[5].content }}", "{% if %}", "{{ messages | no_such_filter }}"):
        with pytest.raises(JaxsmolError, match="chat template error"):
            Tokenizer(tok._tok, {"chat_template": source}).apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_is_compiled_once(tok, monkeypatch):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    compiles = []
    compile_ = ImmutableSandboxedEnvironment.from_string

    def counting(self, source, *a, **kw):
        compiles.append(source)
        return compile_(self, source, *a, **kw)

    monkeypatch.setattr(ImmutableSandboxedEnvironment, "from_string", counting)
    t = Tokenizer(tok._tok, {"chat_template": tok.chat_template})
    texts = {t.apply_chat_template([{"role": "user", "content": f"question {i}"}]) for i in range(5)}
    assert len(texts) == 5 and len(compiles) == 1
    t.chat_template = "{{ messages[0].content }}"  # a changed template is compiled again
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "x" and len(compiles) == 2


@pytest.mark.parametrize("text, at, code", [("\ud800", 0, "D800"), ("ok \udfff", 3, "DFFF"),
                                            ("pair as two code points: \ud83d\ude00", 25, "D83D")])
def test_lone_surrogate_is_named(tok, text, at, code):
    with pytest.raises(JaxsmolError, match=f"lone surrogate \\(U\\+{code} at character {at}\\)"):
        tok.encode(text)
    chat = tok.apply_chat_template([{"role": "user", "content": text}])  # rendering keeps it; encoding refuses
    with pytest.raises(JaxsmolError, match="lone surrogate"):
        tok.encode(chat)
    assert tok.encode("\U0001F600") == tok.encode("😀")  # a real astral character is fine


def test_template_variables_and_sandbox(tok):
    t = Tokenizer(tok._tok, {"chat_template": "{{ bos_token }}|{{ eos_token }}|{{ messages|length }}",
                             "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}})
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>|<|im_end|>|1"
    evil = Tokenizer(tok._tok, {"chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"})
    with pytest.raises(JaxsmolError):
        evil.apply_chat_template([{"role": "user", "content": "x"}])


def _stream(tok, ids, **kw):
    d = IncrementalDecoder(tok, **kw)
    return [d.feed(i) for i in ids] + [d.flush()]


@pytest.mark.parametrize("s", ["a 😀👍🏽 b", "👨‍👩‍👧‍👦 family 🇫🇷 你好 ∑", "plain ascii text, 123"] + TRICKY)
def test_incremental_decoder_matches_decode(tok, s):
    ids = tok.encode(s)
    chunks = _stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids) == s
    assert not any("\ufffd" in c for c in chunks)


def test_incremental_decoder_holds_back_split_emoji(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1 and "\ufffd" in tok.decode(ids[:1])  # the emoji really is split across tokens
    chunks = _stream(tok, ids)
    assert chunks[:-2] == [""] * (len(ids) - 1) and chunks[-2] == "😀" and chunks[-1] == ""


def test_incremental_decoder_flush_and_specials(tok):
    half = tok.encode("😀")[:1]
    assert _stream(tok, half) == ["", tok.decode(half)]  # flush releases the incomplete tail as decode() does
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert "".join(_stream(tok, ids, skip_special_tokens=True)) == "hi"


def test_errors(tok, tmp_path):
    with pytest.raises(JaxsmolError, match="tokenizer.json"):
        Tokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({}))
    with pytest.raises(JaxsmolError, match="cannot read"):
        Tokenizer.load(tmp_path)
    with pytest.raises(JaxsmolError, match="out of range"):
        tok.decode([49152])
    with pytest.raises(JaxsmolError, match="string"):
        tok.encode(None)
