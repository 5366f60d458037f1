"""A GGUF file run as it is (checkpoint/gguf_weights.py) imports only what it does not read from itself:
config, tokenizer and its float tensors (the norms), in NAME-KEY.lean under the data directory; the
full float32 import (NAME-KEY) is made only for what needs every float value (--quantize none, a
float file). Tiny files with a 320-token vocabulary (tests/gguf_writer.py)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsmol import Engine
from jaxsmol.model.forward import forward
from jaxsmol.model.kv import KVCache
from jaxsmol.checkpoint.gguf_weights import GGUFFile, GGUFTensors
from jaxsmol.model.params import Checkpoint, params_from_hf

IDS = [1, 40, 41, 42, 100, 7, 300, 17, 250]


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSMOL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def logits(engine: Engine) -> np.ndarray:
    kv = KVCache.zeros(engine.cfg, 64, dtype=jnp.float32)
    fn = jax.jit(forward, static_argnames=("cfg", "all_logits"))
    out, _ = fn(engine.params, jnp.asarray([IDS]), jnp.int32(len(IDS)), kv, cfg=engine.cfg, all_logits=True)
    return np.asarray(out)


def imports(home) -> list[str]:
    return sorted(p.name for p in (home / "models").iterdir())


@pytest.mark.parametrize("kind,fmt,tied", [("Q8_0", "q8_0", True), ("Q4_1", "q4_1", True), ("Q4_0", "q4_1", True),
                                           ("Q8_0", "q8_0", False)])
def test_a_native_file_imports_only_its_floats_with_the_same_logits(tmp_path, home, kind, fmt, tied):
    """The lean import holds the norms (and an untied model's F32 head), no float32 copy of a quantized
    matrix; with --matmul exact the logits are those of the full float32 import bit for bit."""
    from gguf_writer import write_tiny_gguf

    path = tmp_path / f"tiny-{kind}.gguf"
    hf = write_tiny_gguf(path, matrix_type=kind, quantize_embed=True, tied=tied, vocab=320)
    native = Engine.load(path, matmul="exact", progress=False)
    assert native.cfg.quant == fmt and native.model_dir.name.endswith(".lean")
    lean = Checkpoint(native.model_dir)
    floats = {n for n in hf if n.endswith("norm.weight") or "layernorm" in n or n == "lm_head.weight"}
    assert set(lean.keys()) == floats  # the token table (Q8_0) and the matrices are read from the file
    size = (native.model_dir / "model.safetensors").stat().st_size
    assert size < 4 * sum(hf[n].size for n in floats) + 4096
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (native.model_dir / f).is_file()
    assert imports(home) == [native.model_dir.name]  # no full import was written

    full = Engine.load(path, quantize="none", progress=False)  # a lean import is never taken for the full one
    assert full.cfg.quant is None and full.model_dir.name == native.model_dir.name.removesuffix(".lean")
    assert set(Checkpoint(full.model_dir).keys()) == set(hf)
    if tied:
        assert np.array_equal(logits(native), logits(full))
    else:  # its F32 head runs at Q8_0 (formats.UNEMBED_FORMAT); its Q8_0 token table as the full import's values
        assert np.array_equal(np.asarray(native.params.embed), np.asarray(full.params.embed))
    # the params the full import's floats give (what a native run read before lean imports) bit for bit
    gguf = GGUFFile(path, progress=False)
    cfg_hf = json.loads((full.model_dir / "config.json").read_text())
    before = params_from_hf(native.cfg, GGUFTensors(gguf.reader, full.model_dir, cfg_hf, tied))
    assert all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(native.params), jax.tree.leaves(before)))
    assert gguf.model_dir == native.model_dir  # each kind reused
    assert imports(home) == sorted([native.model_dir.name, full.model_dir.name])


def test_a_float_file_gets_the_full_import(tmp_path, home):
    from gguf_writer import write_tiny_gguf

    path = tmp_path / "tiny-f16.gguf"
    hf = write_tiny_gguf(path, matrix_type="F16", vocab=320)
    engine = Engine.load(path, progress=False)
    assert engine.cfg.quant is None and not engine.model_dir.name.endswith(".lean")
    assert set(Checkpoint(engine.model_dir).keys()) == set(hf)
    assert imports(home) == [engine.model_dir.name]


def test_an_import_made_before_lean_ones_is_the_full_import_still(tmp_path, home):
    """Full imports keep their old name (NAME-KEY): one already on disk is what --quantize none
    reuses; a run of the file as it is leaves it alone and imports its lean one beside it."""
    from gguf_writer import write_tiny_gguf
    from jaxsmol.checkpoint.gguf_weights import imported_dir

    path = tmp_path / "tiny-q8.gguf"
    write_tiny_gguf(path, matrix_type="Q8_0", quantize_embed=True, vocab=320)
    old = imported_dir(path, progress=False)  # what every earlier version wrote, for any file
    mtime = (old / "model.safetensors").stat().st_mtime_ns
    native = Engine.load(path, progress=False)
    assert native.model_dir == old.with_name(old.name + ".lean")
    assert Engine.load(path, quantize="none", progress=False).model_dir == old
    assert (old / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rewritten
