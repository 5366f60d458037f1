"""Quantized weights (kernels/formats.py): ggml's rounding, the float32 values they stand for on both
paths (C++ kernels and XLA's), the prefix cache's exactness, the refusals, and on the real model the
bundled Q4_1 file's own weights."""

from __future__ import annotations

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import quants

from jaxsmol import Engine, JaxsmolError, SamplingParams, score
from jaxsmol.kernels import cpu_kernels, formats
from jaxsmol.model.config import Config
from jaxsmol.model.forward import forward
from jaxsmol.model.kv import KVCache
from jaxsmol.model.params import abstract_params, expected_shapes, params_from_hf
from jaxsmol.cache.scheduler.many import generate

GGML = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_1": gguf.GGMLQuantizationType.Q4_1}
FORMATS = formats.FORMATS


def dequantized(w_hf: np.ndarray, fmt: str) -> np.ndarray:
    """An HF matrix [out, in] -> the float32 values fmt keeps of it, [out, in]."""
    return np.asarray(cpu_kernels.unpack(formats.dequantize(formats.quantize(w_hf.T, fmt)))).T


def random_tensors(cfg: Config, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {name: ((1 + 0.1 * rng.standard_normal(shape)) if len(shape) == 1 else
                   rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
            for name, shape in expected_shapes(cfg).items()}


def as_stored(tensors: dict, fmt: str) -> dict:
    """The float32 checkpoint holding exactly the values a `fmt` engine runs: every matrix through
    fmt, the (tied) embedding through the unembedding's format."""
    out = {}
    for name, a in tensors.items():
        if a.ndim == 1:
            out[name] = a
        elif name == "model.embed_tokens.weight":
            out[name] = dequantized(a, formats.UNEMBED_FORMAT)
        else:
            out[name] = dequantized(a, fmt)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_rounds_as_ggml_does(fmt):
    w = np.random.default_rng(1).standard_normal((96, 128)).astype(np.float32)  # [out, in]
    w[3, :32] = 0.0  # an all-zero block: scale 0
    ref = quants.dequantize(quants.quantize(w, GGML[fmt]), GGML[fmt])
    assert np.array_equal(dequantized(w, fmt), ref)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_bytes_a_weight_takes(fmt):
    qm = formats.quantize(np.ones((576, 1536), np.float32), fmt)
    assert qm.nbytes == 576 * 1536 * formats.BYTES_PER_WEIGHT[fmt]


def _logits(cfg: Config, tensors: dict, tokens: np.ndarray) -> np.ndarray:
    params = params_from_hf(cfg, tensors)
    kv = KVCache.zeros(cfg, 256, dtype=jnp.float32)  # a whole attention block
    fn = jax.jit(forward, static_argnames=("cfg", "all_logits"))
    logits, _ = fn(params, jnp.asarray(tokens), jnp.int32(tokens.shape[1]), kv, cfg=cfg, all_logits=True)
    return np.asarray(logits)


@pytest.mark.parametrize("kernels", [False, True], ids=["xla", "kernels"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_quantized_model_computes_what_its_float32_values_compute_bit_for_bit(fmt, kernels):
    """On either path a quantized matrix is dequantized to the very float32 values a float checkpoint
    of them holds, and summed in the same order: the logits are the same bits."""
    cfg = Config.tiny()
    if kernels:
        if not cpu_kernels.available():  # a missing compiler is a failed install step, not a skip
            pytest.fail("the CPU kernels did not build: install a C++ compiler (Debian: apt-get install g++): "
                        f"{cpu_kernels.state().reason}", pytrace=False)
        cfg = cpu_kernels.configure(cfg, jnp.float32)
        assert cfg.cpu_kernels
    tensors = random_tensors(cfg)
    tokens = np.array([[1, 17, 42, 99, 3, 250, 7, 64, 128, 5, 33]], np.int32)
    got = _logits(dataclasses.replace(cfg, quant=fmt), tensors, tokens)
    want = _logits(cfg, as_stored(tensors, fmt), tokens)
    assert np.array_equal(got, want)
    assert np.abs(got - _logits(cfg, tensors, tokens)).max() > 0  # and they are not the unquantized ones


@pytest.mark.parametrize("fmt", FORMATS)
def test_programs_compiled_ahead_see_the_loaded_layout(fmt):
    cfg = dataclasses.replace(cpu_kernels.configure(Config.tiny(), jnp.float32), quant=fmt)
    real = params_from_hf(cfg, random_tensors(cfg))
    shapes = lambda p: jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), p)  # noqa: E731
    assert jax.tree.structure(abstract_params(cfg)) == jax.tree.structure(real)
    assert shapes(abstract_params(cfg)) == shapes(real)


@pytest.mark.parametrize("fmt", FORMATS)
def test_warm_runs_equal_cold_runs_on_quantized_weights(tiny_model_dir, fmt):
    from jaxsmol.cache import PrefixCache

    engine = Engine.load(tiny_model_dir, quantize=fmt, progress=False)
    assert engine.cfg.quant == fmt
    sp = SamplingParams(max_tokens=6)
    prompt = list(range(100, 180))
    cold = generate(engine, prompt, sp)
    cache = PrefixCache(engine, mode="radix")
    generate(cache, prompt[:50] + [9, 9, 9], sp)  # stores the shared 50-token prefix
    warm = generate(cache, prompt, sp)
    report = warm.report
    assert warm.output_ids == cold.output_ids and report.reused >= 50
    assert np.array_equal(warm.prompt_logits, cold.prompt_logits)


def test_refusals_name_the_problem(tiny_model_dir):
    with pytest.raises(JaxsmolError, match="quantize must be one of q8_0, q4_1, got 'q5_k'"):
        Engine.load(tiny_model_dir, quantize="q5_k", progress=False)
    with pytest.raises(JaxsmolError, match="takes --dtype float32"):
        Engine.load(tiny_model_dir, quantize="q8_0", dtype="bfloat16", progress=False)
    odd = Config.tiny(ffn_dim=80)
    from jaxsmol.runtime.engine import with_quantization

    with pytest.raises(JaxsmolError, match="multiple of 32: intermediate_size=80"):
        with_quantization(odd, "q4_1", "float32", None)


PARITY_PROMPTS = ["The capital of France is Paris. The capital of Germany is Berlin.",
                  "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)",
                  "Once upon a time, in a small village by the sea, there lived an old fisherman."]


def _logprobs(engine) -> np.ndarray:
    return np.concatenate([[s.logprob for s in score(engine, engine.tokenizer.encode(p))[1:]]
                           for p in PARITY_PROMPTS])


@pytest.mark.real
def test_the_bundled_q4_1_file_runs_as_it_is(real_engine, model_dir):
    """The bundled GGUF is Q4_1 (its token table Q8_0): quantizing its float32 import gives back the
    file's own blocks, so --quantize q4_1 runs the file's weights, with the float32 import's logits."""
    q4 = Engine.load(model_dir, quantize="q4_1", matmul="exact", progress=False)
    assert np.array_equal(_logprobs(q4), _logprobs(real_engine))
    assert q4.params.nbytes < real_engine.params.nbytes / 5  # 112 MB against 651
    from jaxsmol.cli.info import weight_bytes  # what `jaxsmol info` prints, from the config alone

    assert weight_bytes(model_dir)["q4_1"] == q4.params.nbytes
    assert weight_bytes(model_dir)["float32"] == real_engine.params.nbytes


@pytest.mark.real
def test_the_default_model_is_its_q4_1_file_where_the_kernels_run(real_engine, model_dir):
    """Engine.load() with no model runs the bundled file's Q4_1 matrices as they are where the CPU
    kernels run (1/6 of the memory; with --matmul exact the same logits as the float32 values, by
    default the int8 class's), float32 elsewhere (XLA dequantizes at every step there); quantize="none"
    asks for the float32 values, of the default model or of any GGUF file."""
    from jaxsmol.checkpoint.default_model import bundled_gguf_path
    from jaxsmol.kernels import cpu_kernels

    default = Engine.load(progress=False)
    assert default.cfg.quant == ("q4_1" if cpu_kernels.available() else None)
    assert default.cfg.matmul == ("int8" if cpu_kernels.available() else "exact")
    exact = Engine.load(matmul="exact", progress=False)
    assert np.array_equal(_logprobs(exact), _logprobs(real_engine))
    for source in (None, bundled_gguf_path()):
        plain = Engine.load(source, quantize="none", progress=False)
        assert plain.cfg.quant is None and plain.params.nbytes == real_engine.params.nbytes
    assert Engine.load(dtype="bfloat16", progress=False).cfg.quant is None  # quantized weights compute in float32


@pytest.mark.real
def test_q8_0_stays_close_to_the_float32_weights(real_engine, model_dir):
    q8 = Engine.load(model_dir, quantize="q8_0", matmul="exact", progress=False)
    diff = np.abs(_logprobs(q8) - _logprobs(real_engine))
    print(f"q8_0 vs float32: max |logprob diff| {diff.max():.4f}, mean {diff.mean():.4f} over {diff.size}")
    assert diff.max() < 0.3 and diff.mean() < 0.05  # measured: 0.156 and 0.029
    ids = real_engine.tokenizer.encode(PARITY_PROMPTS[0][:40])
    sp = SamplingParams(max_tokens=16)
    assert generate(q8, ids, sp).text == generate(real_engine, ids, sp).text


@pytest.mark.real
@pytest.mark.parametrize("fmt,bounds", [("q4_1", (0.35, 0.07)), ("q8_0", (0.5, 0.1))])
def test_the_int8_class_states_its_error_against_the_float32_weights(real_engine, model_dir, fmt, bounds):
    """--matmul int8 (the default under the kernels) rounds each matmul's input to 8 bits per 32 values:
    its logprobs on the parity prompts against the float32 weights' (docs/performance.md states them).
    Measured (2026-12-05): Q4_1 max 0.219, mean 0.042; Q8_0 max 0.370, mean 0.059 (exact Q8_0: 0.156,
    0.029; exact Q4_1: 0, its values are the file's)."""
    int8 = Engine.load(model_dir, quantize=fmt, matmul="int8", progress=False)
    diff = np.abs(_logprobs(int8) - _logprobs(real_engine))
    print(f"{fmt} int8 vs float32: max |logprob diff| {diff.max():.4f}, mean {diff.mean():.4f} over {diff.size}")
    assert 0 < diff.max() < bounds[0] and diff.mean() < bounds[1]


@pytest.mark.parametrize("kind,fmt", [("Q8_0", "q8_0"), ("Q4_1", "q4_1"), ("Q4_0", "q4_1"), ("F16", None)])
def test_a_gguf_file_runs_as_it_is(tmp_path, monkeypatch, kind, fmt):
    """--model FILE.gguf: its quantized matrices read block by block (Q4_0 as Q4_1 with m = -8 d),
    the same values as its float32 import, so (with --matmul exact) the same logits bit for bit."""
    from gguf_writer import write_tiny_gguf

    monkeypatch.setenv("JAXSMOL_HOME", str(tmp_path / "home"))
    path = tmp_path / f"tiny-{kind}.gguf"
    write_tiny_gguf(path, matrix_type=kind, quantize_embed=True, vocab=320)
    native = Engine.load(path, matmul="exact", progress=False)
    assert native.cfg.quant == fmt
    assert Engine.load(path, progress=False).cfg.matmul == ("int8" if fmt else "exact")  # the default
    imported = Engine.load(path, quantize="none", progress=False)  # its float32 import
    ids = [1, 40, 41, 42, 100, 7, 300]
    assert [s.logprob for s in score(native, ids)] == [s.logprob for s in score(imported, ids)]


def test_a_gguf_of_another_type_is_refused_with_what_to_do(tmp_path, monkeypatch):
    from gguf_writer import write_tiny_gguf

    monkeypatch.setenv("JAXSMOL_HOME", str(tmp_path / "home"))
    path = tmp_path / "tiny-q5.gguf"
    write_tiny_gguf(path, matrix_type="Q5_0", vocab=320)
    with pytest.raises(JaxsmolError, match=r"tiny-q5.gguf holds matrices of type Q5_0: .* llama-quantize"):
        Engine.load(path, progress=False)
    assert Engine.load(path, quantize="q8_0", progress=False).cfg.quant == "q8_0"  # requantized when asked


def test_a_shared_token_table_is_counted_once(tiny_model_dir):
    """A quantized tied model's token table is one array in two fields of the params: the weights
    gauge counts it once, as Params.nbytes and `jaxsmol info` do (it was counted twice: 53 MB too
    many on a 360M at Q8_0). Here, not in test_memory_account.py: it needs no glibc."""
    from jaxsmol.cli.server.memory import MemoryAccount

    engine = Engine.load(tiny_model_dir, quantize="q8_0", progress=False)
    leaves = jax.tree.leaves(engine.params)
    assert len({id(x) for x in leaves}) < len(leaves)
    assert MemoryAccount(engine.params).weights == engine.params.nbytes
