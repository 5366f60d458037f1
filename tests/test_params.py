"""Loading HF tensors into Params (jaxsmol/model/params.py): shapes, names, tying, safetensors files."""

from __future__ import annotations

import dataclasses
import json

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxsmol.kernels.stacking import unstack_layers
from jaxsmol.model.config import Config
from jaxsmol.errors import JaxsmolError
from jaxsmol.model.params import expected_shapes, load_params, params_from_hf, read_hf_tensors


def _tensors(cfg: Config, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in expected_shapes(cfg).items()}


def _hf_config(cfg: Config) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.ffn_dim,
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "max_position_embeddings": cfg.max_position, "tie_word_embeddings": cfg.tie_embeddings,
            "bos_token_id": cfg.bos_id, "eos_token_id": list(cfg.eos_ids)}


def _assert_params_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_expected_shapes(tiny_cfg):
    shapes = expected_shapes(tiny_cfg)
    assert len(shapes) == 2 + 9 * tiny_cfg.n_layers  # tied: no lm_head
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (2 * 16, 64)  # [K*H, D]
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 128)  # [D, F]
    assert expected_shapes(dataclasses.replace(tiny_cfg, tie_embeddings=False))["lm_head.weight"] == (256, 64)


def test_params_layout_and_values(tiny_cfg):
    t = _tensors(tiny_cfg)
    p = params_from_hf(tiny_cfg, t)
    L = tiny_cfg.n_layers
    assert p.layers.wq.shape == (L, 64, 64)  # one LayerParams, every layer's stacked
    for i, layer in enumerate(unstack_layers(p.layers)):  # matrices transposed to [in, out]
        assert layer.wq.shape == (64, 64) and layer.wk.shape == (64, 32) and layer.wo.shape == (64, 64)
        assert layer.w_down.shape == (128, 64) and layer.attn_norm.shape == (64,)
        np.testing.assert_array_equal(np.asarray(layer.wq), t[f"model.layers.{i}.self_attn.q_proj.weight"].T)
        np.testing.assert_array_equal(np.asarray(layer.w_up), t[f"model.layers.{i}.mlp.up_proj.weight"].T)
        np.testing.assert_array_equal(np.asarray(layer.mlp_norm),
                                      t[f"model.layers.{i}.post_attention_layernorm.weight"])
    np.testing.assert_array_equal(np.asarray(p.embed), t["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(p.final_norm), t["model.norm.weight"])


@pytest.mark.parametrize("name", ["model.embed_tokens.weight", "model.layers.1.self_attn.k_proj.weight",
                                  "model.layers.0.input_layernorm.weight", "model.norm.weight"])
def test_wrong_shape_names_tensor_and_both_shapes(tiny_cfg, name):
    t = _tensors(tiny_cfg)
    want = t[name].shape
    bad = want[:-1] + (want[-1] + 1,)
    t[name] = np.zeros(bad, np.float32)
    with pytest.raises(JaxsmolError) as e:
        params_from_hf(tiny_cfg, t)
    msg = str(e.value)
    assert name in msg and str(bad) in msg and str(want) in msg


def test_transposed_weight_is_a_shape_error(tiny_cfg):
    t = _tensors(tiny_cfg)
    name = "model.layers.0.mlp.gate_proj.weight"
    t[name] = t[name].T.copy()
    with pytest.raises(JaxsmolError, match=name.replace(".", r"\.")):
        params_from_hf(tiny_cfg, t)


def test_missing_tensor_is_named(tiny_cfg):
    t = _tensors(tiny_cfg)
    del t["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(JaxsmolError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        params_from_hf(tiny_cfg, t)


def test_unexpected_tensor_is_named(tiny_cfg):
    t = _tensors(tiny_cfg)
    t["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
    with pytest.raises(JaxsmolError, match=r"unexpected tensor model\.layers\.0\.self_attn\.q_proj\.bias"):
        params_from_hf(tiny_cfg, t)
    # a checkpoint with more layers than the config says is refused too
    t = _tensors(tiny_cfg)
    t["model.layers.2.input_layernorm.weight"] = np.ones(64, np.float32)
    with pytest.raises(JaxsmolError, match=r"model\.layers\.2\.input_layernorm\.weight"):
        params_from_hf(tiny_cfg, t)


def test_rotary_inv_freq_buffers_are_ignored(tiny_cfg):
    t = _tensors(tiny_cfg)
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    params_from_hf(tiny_cfg, t)


def test_tied_embeddings(tiny_cfg):
    """Tied: the head is the embedding, stored transposed ([D, V], for a faster x @ W)."""
    t = _tensors(tiny_cfg)
    p = params_from_hf(tiny_cfg, t)
    assert p.unembed.shape == (64, 256)
    np.testing.assert_array_equal(np.asarray(p.unembed), t["model.embed_tokens.weight"].T)
    np.testing.assert_array_equal(np.asarray(p.embed), t["model.embed_tokens.weight"])
    # some tied checkpoints still store a copy of the head: accepted and not used
    p2 = params_from_hf(tiny_cfg, {**t, "lm_head.weight": np.zeros((256, 64), np.float32)})
    np.testing.assert_array_equal(np.asarray(p2.unembed), t["model.embed_tokens.weight"].T)
    _assert_params_equal(p, p2)


def test_untied_config_needs_lm_head(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg, tie_embeddings=False)
    t = _tensors(cfg)
    p = params_from_hf(cfg, t)
    np.testing.assert_array_equal(np.asarray(p.unembed), t["lm_head.weight"].T)
    np.testing.assert_array_equal(np.asarray(p.embed), t["model.embed_tokens.weight"])
    del t["lm_head.weight"]
    with pytest.raises(JaxsmolError, match=r"missing tensor lm_head\.weight"):
        params_from_hf(cfg, t)
    t["lm_head.weight"] = np.zeros((255, 64), np.float32)
    with pytest.raises(JaxsmolError, match=r"lm_head\.weight has shape \(255, 64\), expected \(256, 64\)"):
        params_from_hf(cfg, t)


def _write_model(path, cfg, tensors):
    path.mkdir(exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(_hf_config(cfg)))


def test_safetensors_round_trip(tmp_path, tiny_cfg):
    t = _tensors(tiny_cfg, seed=3)
    _write_model(tmp_path, tiny_cfg, t)
    cfg = Config.load(tmp_path)
    assert cfg == tiny_cfg
    _assert_params_equal(load_params(tmp_path, cfg), params_from_hf(tiny_cfg, t))


def test_safetensors_sharded_round_trip(tmp_path, tiny_cfg):
    t = _tensors(tiny_cfg, seed=4)
    names = sorted(t)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in shards.items():
        save_file({k: t[k] for k in keys}, str(tmp_path / fname))
    weight_map = {k: fname for fname, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _assert_params_equal(load_params(tmp_path, tiny_cfg), params_from_hf(tiny_cfg, t))
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(JaxsmolError, match="model-00002-of-00002"):
        load_params(tmp_path, tiny_cfg)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_half_precision_checkpoint_reads_as_float32(tmp_path, tiny_cfg, dtype):
    t = {k: v.astype(dtype) for k, v in _tensors(tiny_cfg, seed=5).items()}
    _write_model(tmp_path, tiny_cfg, t)
    got = read_hf_tensors(tmp_path)
    assert set(got) == set(t)
    for k, v in t.items():
        assert got[k].dtype == np.float32
        np.testing.assert_array_equal(got[k], v.astype(np.float32))


def test_corrupt_safetensors_is_a_jaxsmol_error(tmp_path, tiny_cfg):
    _write_model(tmp_path, tiny_cfg, _tensors(tiny_cfg))
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(JaxsmolError, match="cannot read"):
        load_params(tmp_path, tiny_cfg)
    f.write_bytes(b"\x00this is not a safetensors file" * 10)  # garbage
    with pytest.raises(JaxsmolError, match="cannot read"):
        load_params(tmp_path, tiny_cfg)
    f.unlink()
    with pytest.raises(JaxsmolError, match="model.safetensors"):
        load_params(tmp_path, tiny_cfg)
