"""GGUF -> Hugging Face import: a tiny synthetic GGUF for exact round trips (tests/gguf_writer.py), and the
real bundled model. Where the default model lives and its one-time import: tests/test_default_model.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from gguf_writer import MODEL_FILES, SPECIALS, TINY, leftovers, write_tiny_gguf
from jaxsmol.checkpoint import default_model, gguf_import
from jaxsmol.model.config import Config
from jaxsmol.errors import JaxsmolError
from jaxsmol.checkpoint.gguf_import import import_gguf, permute_qk, unpermute_qk
from jaxsmol.checkpoint.tokenizer import Tokenizer


# --- Q/K permutation ---------------------------------------------------------------------------------

def test_permute_hand_cases():
    # One head of dim 4: HF rotates (0,2),(1,3) as halves; llama.cpp wants pairs adjacent.
    assert permute_qk(np.arange(4)[:, None], 1).ravel().tolist() == [0, 2, 1, 3]
    assert permute_qk(np.arange(12)[:, None], 2).ravel().tolist() == [0, 3, 1, 4, 2, 5, 6, 9, 7, 10, 8, 11]
    assert unpermute_qk(np.array([[0], [3], [1], [4], [2], [5]]), 1).ravel().tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("n_head,rows", [(9, 576), (3, 192), (1, 8), (4, 64)])
def test_unpermute_inverts_permute(n_head, rows):
    w = np.random.default_rng(0).normal(size=(rows, 5)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, n_head), n_head), w)
    np.testing.assert_array_equal(permute_qk(unpermute_qk(w, n_head), n_head), w)
    assert not np.array_equal(permute_qk(w, n_head), w) or rows // n_head == 2


# --- tiny synthetic GGUF -----------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [True, False])
def test_tiny_round_trip(tmp_path, tied):
    src = tmp_path / "tiny.gguf"
    hf = write_tiny_gguf(src, tied=tied)
    out = import_gguf(src, tmp_path / "model", progress=False)
    assert {p.name for p in out.iterdir()} == MODEL_FILES
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(hf)
    for name, want in hf.items():
        assert got[name].dtype == np.float32 and got[name].shape == want.shape, name
        np.testing.assert_array_equal(got[name], want, err_msg=name)  # F32: exact, Q/K unpermuted
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is tied
    c = Config.from_hf(cfg)
    assert (c.vocab_size, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim) == \
        tuple(TINY[k] for k in "VDLNKHF")
    assert (c.rms_norm_eps, c.rope_theta, c.max_position, c.bos_id, c.eos_ids) == (1e-5, 1e5, 256, 1, (2,))
    tok = Tokenizer.load(out)
    ids = tok.encode("<|im_start|>the the")
    assert ids == [1, tok.token_to_id("t"), tok.token_to_id("he"), tok.token_to_id("Ġthe")]
    assert tok.decode(ids) == "<|im_start|>the the"
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2,
                                                                         "pad_token_id": 2}


def test_quantized_tensor_is_dequantized(tmp_path):
    src = tmp_path / "q.gguf"
    hf = write_tiny_gguf(src, quantize_embed=True)
    out = import_gguf(src, tmp_path / "model", progress=False)
    emb = load_file(str(out / "model.safetensors"))["model.embed_tokens.weight"]
    want = hf["model.embed_tokens.weight"]
    assert emb.shape == want.shape and emb.dtype == np.float32
    assert np.abs(emb - want).max() < 0.02 * np.abs(want).max()  # Q8_0 error, not garbage
    assert not np.array_equal(emb, want)


def test_missing_file(tmp_path):
    with pytest.raises(JaxsmolError, match="not found"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all" * 10, b"GGUF\x03\x00\x00\x00garbage"])
def test_not_a_gguf(tmp_path, content):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    with pytest.raises(JaxsmolError, match="cannot read GGUF"):
        import_gguf(bad, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_directory_is_not_a_gguf(tmp_path):
    with pytest.raises(JaxsmolError, match="not a regular file"):
        import_gguf(tmp_path, tmp_path / "out", progress=False)


def test_non_llama_architecture(tmp_path):
    src = tmp_path / "q.gguf"
    write_tiny_gguf(src, arch="qwen2")
    with pytest.raises(JaxsmolError, match="architecture 'qwen2'"):
        import_gguf(src, tmp_path / "out", progress=False)


def test_existing_output_dir_is_refused(tiny_gguf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(JaxsmolError, match="already exists"):
        import_gguf(tiny_gguf[0], out, progress=False)
    assert (out / "keep.txt").read_text() == "mine"



@pytest.mark.parametrize("exc", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_failure_mid_import_leaves_nothing(tiny_gguf, tmp_path, monkeypatch, exc):
    calls = []
    real = gguf_import.dequantize

    def flaky(t, cfg):
        calls.append(t.name)
        if len(calls) == 5:
            raise exc
        return real(t, cfg)

    monkeypatch.setattr(gguf_import, "dequantize", flaky)
    parent = tmp_path / "models"
    with pytest.raises(type(exc)):
        import_gguf(tiny_gguf[0], parent / "m", progress=False)
    assert len(calls) == 5
    assert not (parent / "m").exists()
    assert leftovers(parent) == []


def test_bad_tensor_shape_is_refused(tiny_gguf, tmp_path, monkeypatch):
    real = gguf_import.dequantize
    monkeypatch.setattr(gguf_import, "dequantize", lambda t, cfg: real(t, cfg)[:-1])
    with pytest.raises(JaxsmolError, match="has shape"):
        import_gguf(tiny_gguf[0], tmp_path / "m", progress=False)
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("sizes, words", [
    (dict(block_count=2**32 - 1), "block_count 4294967295"), (dict(block_count=3), "block_count 3"),
    (dict(context_length=2**32 - 1), "context_length"), (dict(vocab_size=2**32 - 1), "has shape"),
    (dict(embedding_length=2**31), "partial RoPE"), (dict(feed_forward_length=10**9), "has shape"),
    (dict(head_count=0), "invalid sizes"), (dict(head_count_kv=3), "invalid sizes")])
def test_crafted_sizes_are_refused_before_allocating(tmp_path, sizes, words):
    """Metadata sizes that the file's tensors do not back: refused from the headers, nothing sized from them
    (block_count 2^32 - 1 used to build 9 x 2^32 expected tensor names and exhaust memory)."""
    import tracemalloc

    path = tmp_path / "crafted.gguf"
    write_tiny_gguf(path, sizes=sizes)
    tracemalloc.start()
    try:
        with pytest.raises(JaxsmolError, match=words):
            import_gguf(path, tmp_path / "m", progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, peak  # the tiny file's own size, not the declared model's
    assert not (tmp_path / "m").exists() and leftovers(tmp_path) == []


_KILLED_IMPORT = """
import sys, time
from jaxsmol.checkpoint import gguf_import
real = gguf_import.dequantize
def stuck(t, cfg):
    print("writing", flush=True)
    time.sleep(600)
gguf_import.dequantize = stuck
gguf_import.import_gguf(sys.argv[1], sys.argv[2], progress=False)
"""


def test_a_killed_import_leaves_no_temporary_after_the_next(tiny_gguf, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    parent = tmp_path / "models"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_IMPORT, str(tiny_gguf[0]), str(parent / "m")],
                            stdout=subprocess.PIPE, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        assert proc.stdout.readline() == b"writing\n"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    killed = leftovers(parent)
    assert len(killed) == 1 and killed[0].startswith(f".m.{proc.pid}.")  # what a kill leaves
    old = parent / ".m.abcdefgh.tmp"  # an older jaxsmol's temporary (no pid): removed once over an hour old
    old.mkdir()
    os.utime(old, (time.time() - 7200,) * 2)
    fresh = parent / ".m.ijklmnop.tmp"  # ... and kept while recent (an import may be running)
    fresh.mkdir()
    running = parent / f".m.{os.getpid()}.qrstuvwx.tmp"  # a live process's import is left alone
    running.mkdir()
    other = parent / ".m.1.1.abcdefgh.tmp"  # model "m.1"'s temporary is no business of "m"'s import
    other.mkdir()
    assert import_gguf(tiny_gguf[0], parent / "m", progress=False) == parent / "m"
    assert sorted(leftovers(parent)) == sorted([fresh.name, running.name, other.name])
    assert {p.name for p in (parent / "m").iterdir()} == MODEL_FILES


def test_files_are_fsynced_before_the_rename(tiny_gguf, tmp_path, monkeypatch):
    import os

    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(a, b):
        events.append(("rename", str(a)))
        return real_rename(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    out = import_gguf(tiny_gguf[0], tmp_path / "m", progress=False)
    at = events.index(next(e for e in events if e[0] == "rename"))
    tmp = events[at][1]
    synced = {path for kind, path in events[:at] if kind == "fsync"}
    assert {f"{tmp}/{name}" for name in MODEL_FILES} | {tmp} <= synced
    assert ("fsync", str(out.parent)) in events[at:]  # and the rename itself


# --- the real bundled SmolLM2-135M-Instruct GGUF ------------------------------------------------------

@pytest.fixture(scope="session")
def real_import(tmp_path_factory):
    try:
        src = default_model.bundled_gguf_path()
    except JaxsmolError as e:
        pytest.fail(f"the default model is needed for this test: {e}", pytrace=False)
    return import_gguf(src, tmp_path_factory.mktemp("jaxsmol_home") / "SmolLM2", progress=False)


@pytest.mark.real
def test_real_import_files_and_config(real_import):
    assert {p.name for p in real_import.iterdir()} == MODEL_FILES
    cfg = json.loads((real_import / "config.json").read_text())
    expected = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
                "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
                "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
                "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "hidden_act": "silu",
                "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32"}
    assert cfg == expected
    tc = json.loads((real_import / "tokenizer_config.json").read_text())
    assert (tc["bos_token"], tc["eos_token"], tc["pad_token"], tc["unk_token"], tc["add_bos_token"]) == \
        ("<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>", False)
    assert tc["chat_template"].startswith("{% for message in messages %}")


@pytest.mark.real
def test_real_import_tensors(real_import):
    with safe_open(str(real_import / "model.safetensors"), "numpy") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        emb = f.get_tensor("model.embed_tokens.weight")
        norm = f.get_tensor("model.norm.weight")
        q0 = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert len(shapes) == 2 + 30 * 9 and "lm_head.weight" not in shapes
    assert shapes["model.embed_tokens.weight"] == (49152, 576) and shapes["model.norm.weight"] == (576,)
    for i in (0, 29):
        p = f"model.layers.{i}."
        assert shapes[p + "self_attn.q_proj.weight"] == (576, 576)
        assert shapes[p + "self_attn.k_proj.weight"] == shapes[p + "self_attn.v_proj.weight"] == (192, 576)
        assert shapes[p + "self_attn.o_proj.weight"] == (576, 576)
        assert shapes[p + "mlp.gate_proj.weight"] == shapes[p + "mlp.up_proj.weight"] == (1536, 576)
        assert shapes[p + "mlp.down_proj.weight"] == (576, 1536)
        assert shapes[p + "input_layernorm.weight"] == shapes[p + "post_attention_layernorm.weight"] == (576,)
    for w in (emb, norm, q0):
        assert w.dtype == np.float32 and np.isfinite(w).all() and w.std() > 0
    assert 0.01 < np.abs(emb).mean() < 1.0  # dequantized scale is sane, not raw block bytes


@pytest.mark.real
def test_real_tokenizer_builds(real_import):
    tok = Tokenizer.load(real_import)
    assert tok.vocab_size == 49152
    assert [tok.token_to_id(t) for t in SPECIALS] == [0, 1, 2]
    data = json.loads((real_import / "tokenizer.json").read_text(encoding="utf-8"))
    assert data["pre_tokenizer"] == {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    assert data["decoder"]["type"] == "ByteLevel" and data["normalizer"] is None
    assert len(data["model"]["merges"]) == 48900
    assert [(a["id"], a["content"], a["special"]) for a in data["added_tokens"]][:3] == \
        [(0, "<|endoftext|>", True), (1, "<|im_start|>", True), (2, "<|im_end|>", True)]
    assert len(data["added_tokens"]) == 17


def test_unknown_pre_tokenizer_is_refused():
    with pytest.raises(JaxsmolError, match="pre-tokenizer 'mystery'"):
        gguf_import.pre_tokenizer("mystery")
