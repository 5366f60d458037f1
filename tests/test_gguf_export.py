"""`jaxsmol quantize DIR OUT.gguf` (checkpoint/gguf_export.py): the file runs in jaxsmol as the weights of
`--quantize TYPE` (the same params and logits bit for bit), carries the metadata llama.cpp needs, and
the command's refusals are one line each. The round trips run on a tiny checkpoint with a 320-token
vocabulary (tests/gguf_writer.py's model, imported): reading a GGUF's 49,152 real tokens takes seconds;
the metadata test runs on tiny_model_dir, which has the real tokenizer."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsmol import Engine, JaxsmolError
from jaxsmol.checkpoint.gguf_export import export_gguf
from jaxsmol.checkpoint.gguf_import import permute_qk
from jaxsmol.model.forward import forward
from jaxsmol.model.kv import KVCache
from jaxsmol.model.params import Checkpoint

IDS = [1, 17, 42, 99, 3, 250, 7, 64, 128, 5, 33]


@pytest.fixture(autouse=True)
def models_dir(tmp_path, monkeypatch):
    """Engine.load(OUT.gguf) imports its config and tokenizer here (the compiled kernels stay where they are)."""
    from jaxsmol.checkpoint import gguf_weights

    monkeypatch.setattr(gguf_weights, "models_dir", lambda: tmp_path / "models")


@pytest.fixture(scope="module")
def small_dirs(tmp_path_factory):
    """{"tied": DIR, "untied": DIR}: tiny float32 checkpoints (vocab 320, sizes multiples of 32)."""
    from gguf_writer import write_tiny_gguf
    from jaxsmol.checkpoint.gguf_import import import_gguf

    root, dirs = tmp_path_factory.mktemp("small"), {}
    for name, tied in (("tied", True), ("untied", False)):
        write_tiny_gguf(root / f"{name}.gguf", tied=tied, vocab=320)
        dirs[name] = import_gguf(root / f"{name}.gguf", root / name, progress=False)
    return dirs


def logits(engine: Engine) -> np.ndarray:
    kv = KVCache.zeros(engine.cfg, 256, dtype=jnp.float32)
    fn = jax.jit(forward, static_argnames=("cfg", "all_logits"))
    out, _ = fn(engine.params, jnp.asarray([IDS]), jnp.int32(len(IDS)), kv, cfg=engine.cfg, all_logits=True)
    return np.asarray(out)


def same_params(a: Engine, b: Engine) -> bool:
    la, lb = jax.tree.leaves(a.params), jax.tree.leaves(b.params)
    return (jax.tree.structure(a.params) == jax.tree.structure(b.params)
            and all(x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)))


def check_round_trip(model_dir, out, qtype):
    export_gguf(model_dir, out, qtype, progress=False)
    quantize = None if qtype == "f32" else qtype
    native = Engine.load(out, progress=False)
    direct = Engine.load(model_dir, quantize=quantize, progress=False)
    assert native.cfg.quant == direct.cfg.quant == quantize
    assert same_params(native, direct)  # the same values in the same format
    assert np.array_equal(logits(native), logits(direct))


@pytest.mark.parametrize("qtype", ["q8_0", "q4_1", "f32"])
def test_the_file_runs_as_the_quantized_checkpoint_bit_for_bit(small_dirs, tmp_path, qtype):
    check_round_trip(small_dirs["tied"], tmp_path / f"tiny-{qtype}.gguf", qtype)


def test_an_untied_checkpoint(small_dirs, tmp_path):
    """lm_head becomes output (Q8_0), token_embd stays F32 (jaxsmol gathers float32 rows of it)."""
    out = tmp_path / "untied.gguf"
    check_round_trip(small_dirs["untied"], out, "q4_1")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types["output.weight"] == "Q8_0" and types["token_embd.weight"] == "F32"


def test_the_metadata_and_layout_llama_cpp_reads(tiny_model_dir, small_dirs, tmp_path):
    out = export_gguf(tiny_model_dir, tmp_path / "tiny.gguf", "q8_0", progress=False)
    r = gguf.GGUFReader(out)
    f = {k: v.contents() for k, v in r.fields.items()}
    assert f["general.architecture"] == "llama" and f["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    want = {"block_count": 2, "context_length": 8192, "embedding_length": 64, "feed_forward_length": 128,
            "attention.head_count": 4, "attention.head_count_kv": 2, "rope.dimension_count": 16,
            "attention.key_length": 16, "vocab_size": 49152}
    assert {k: f[f"llama.{k}"] for k in want} == want
    assert f["llama.rope.freq_base"] == 10000.0 and f["llama.attention.layer_norm_rms_epsilon"] == np.float32(1e-5)
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "smollm"
    tokens, types = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 49152 and tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert types[:3] == [3, 3, 3] and types[100] == 1 and f["tokenizer.ggml.merges"][0] == "Ġ t"
    assert (f["tokenizer.ggml.bos_token_id"], f["tokenizer.ggml.eos_token_id"], f["tokenizer.ggml.unknown_token_id"],
            f["tokenizer.ggml.padding_token_id"]) == (1, 2, 0, 2)
    assert f["tokenizer.ggml.add_bos_token"] is False and "<|im_start|>" in f["tokenizer.chat_template"]
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == 2 + 9 * 2 and "output.weight" not in tensors  # tied: llama.cpp reuses token_embd
    matrices = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    assert {n: t.tensor_type.name for n, t in tensors.items() if not n.startswith("blk.1.")} == {
        "token_embd.weight": "Q8_0", "output_norm.weight": "F32", "blk.0.attn_norm.weight": "F32",
        "blk.0.ffn_norm.weight": "F32", **{f"blk.0.{m}.weight": "Q8_0" for m in matrices}}
    assert [int(d) for d in tensors["blk.0.ffn_down.weight"].shape] == [128, 64]  # GGUF: fastest dim first
    # q and k rows permuted as the converter permutes them (compared in the f32 file, exactly)
    f32 = {t.name: t for t in gguf.GGUFReader(export_gguf(small_dirs["tied"], tmp_path / "f32.gguf", "f32",
                                                          progress=False)).tensors}
    ckpt = Checkpoint(small_dirs["tied"])
    for name, hf, heads in (("attn_q", "q_proj", 4), ("attn_k", "k_proj", 2)):
        got = np.asarray(f32[f"blk.1.{name}.weight"].data)
        assert np.array_equal(got, permute_qk(ckpt[f"model.layers.1.self_attn.{hf}.weight"], heads))


def quantize_cli(*args, capsys):
    from jaxsmol.cli.main import main

    rc = main(["quantize", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_command_and_its_refusals(small_dirs, tmp_path, capsys):
    src = small_dirs["tied"]
    out = tmp_path / "m.gguf"
    rc, stdout, _ = quantize_cli(src, out, "--type", "q4_1", capsys=capsys)
    assert rc == 0 and stdout.startswith(f"wrote {out} (q4_1, ")
    rc, _, err = quantize_cli(src, out, capsys=capsys)
    assert rc == 2 and err == f"error: {out} already exists (pass --force to replace it)\n"
    rc, _, _ = quantize_cli(src, out, "--force", "--type", "f32", capsys=capsys)
    assert rc == 0 and gguf.GGUFReader(out).fields["general.file_type"].contents() == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # no temporary left
    rc, _, err = quantize_cli(src, tmp_path / "x.gguf", "--type", "q5_k", capsys=capsys)
    assert rc == 2 and err == "error: unknown --type 'q5_k': one of q8_0, q4_1, f32\n"
    rc, _, err = quantize_cli(tmp_path / "nope", tmp_path / "x.gguf", capsys=capsys)
    assert rc == 2 and err == f"error: model directory {tmp_path / 'nope'} does not exist\n"
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    rc, _, err = quantize_cli(other, tmp_path / "x.gguf", capsys=capsys)
    assert rc == 2 and err.startswith("error: unsupported architecture: model_type='gpt2'") and err.count("\n") == 1
    assert not (tmp_path / "x.gguf").exists()


def test_a_gguf_source_is_requantized_from_its_float_values(small_dirs, tmp_path):
    """`jaxsmol quantize FILE.gguf`: what Engine.load(FILE, quantize=TYPE) runs."""
    f32 = export_gguf(small_dirs["tied"], tmp_path / "f32.gguf", "f32", progress=False)
    out = export_gguf(f32, tmp_path / "q8.gguf", "q8_0", progress=False)
    assert same_params(Engine.load(out, progress=False), Engine.load(f32, quantize="q8_0", progress=False))
    with pytest.raises(JaxsmolError, match="is a file, not a model directory or a .gguf file"):
        export_gguf(small_dirs["tied"] / "config.json", tmp_path / "x.gguf", progress=False)
