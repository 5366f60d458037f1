"""Config.from_hf (jaxsmol/model/config.py) on the real SmolLM configurations: the forward's shapes for each
(jax.eval_shape, nothing computed), and the refusals that name the field; the forward itself is in
tests/test_model.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from jaxsmol.model.config import Config
from jaxsmol.errors import JaxsmolError
from jaxsmol.model.kv import KVCache
from jaxsmol.model.forward import forward
from jaxsmol.model.params import abstract_params

# ---- real configurations: shapes only ------------------------------------------------------------

def _hf(hidden, layers, heads, kv_heads, inter, theta, max_pos, theta_in_rope_parameters=False):
    d = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
         "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
         "intermediate_size": inter, "vocab_size": 49152, "max_position_embeddings": max_pos,
         "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": True, "attention_bias": False,
         "mlp_bias": False, "rope_scaling": None, "bos_token_id": 1, "eos_token_id": 2,
         "torch_dtype": "bfloat16"}
    if theta_in_rope_parameters:  # transformers >= 5 layout
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    else:
        d["rope_theta"] = theta
    return d


REAL_CONFIGS = {
    "SmolLM-135M": (_hf(576, 30, 9, 3, 1536, 10000.0, 2048), 64),
    "SmolLM-360M": (_hf(960, 32, 15, 5, 2560, 10000.0, 2048), 64),
    "SmolLM-1.7B": (_hf(2048, 24, 32, 32, 8192, 10000.0, 2048), 64),
    "SmolLM2-135M": (_hf(576, 30, 9, 3, 1536, 100000.0, 8192, theta_in_rope_parameters=True), 64),
    "SmolLM2-360M": (_hf(960, 32, 15, 5, 2560, 100000.0, 8192), 64),
    "SmolLM2-1.7B": (_hf(2048, 24, 32, 32, 8192, 130000.0, 8192, theta_in_rope_parameters=True), 64),
}


def test_abstract_params_match_the_loader_layout(params, tiny_cfg):
    """params.abstract_params (used below, and by the precompile) has the structure and shapes
    params_from_hf builds."""
    real, abstract = jax.tree.structure(params), jax.tree.structure(abstract_params(tiny_cfg))
    assert real == abstract
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(abstract_params(tiny_cfg))):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)


@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_real_configs_eval_shape(name):
    hf, head_dim = REAL_CONFIGS[name]
    cfg = Config.from_hf(hf)
    theta = hf.get("rope_theta") or hf["rope_parameters"]["rope_theta"]
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size) == (
        hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"], hf["num_key_value_heads"],
        head_dim, hf["intermediate_size"], 49152)
    assert cfg.rope_theta == theta and cfg.max_position == hf["max_position_embeddings"]
    assert cfg.tie_embeddings and cfg.eos_ids == (2,)
    params = abstract_params(cfg)
    for T, cap, all_logits in [(64, 512, False), (1, 2048, False), (128, 512, True)]:
        kv = jax.eval_shape(lambda: KVCache.zeros(cfg, cap))  # noqa: B023
        tokens = jax.ShapeDtypeStruct((1, T), jnp.int32)
        length = jax.ShapeDtypeStruct((), jnp.int32)
        logits, new_kv = jax.eval_shape(functools.partial(forward, cfg=cfg, all_logits=all_logits),
                                        params, tokens, length, kv)
        assert logits.shape == ((1, T, cfg.vocab_size) if all_logits else (1, cfg.vocab_size))
        assert logits.dtype == jnp.float32
        assert new_kv.k.shape == new_kv.v.shape == (cfg.n_layers, 1, cfg.n_kv_heads, cap, head_dim)
        assert new_kv.pos.shape == () and new_kv.pos.dtype == jnp.int32


# ---- Config refusals -----------------------------------------------------------------------------

def _base_hf():
    return dict(REAL_CONFIGS["SmolLM2-360M"][0])


@pytest.mark.parametrize("change, words", [
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, ["rope_scaling", "yarn"]),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ["rope_scaling", "llama3"]),
    ({"attention_bias": True}, ["attention_bias"]),
    ({"mlp_bias": True}, ["mlp_bias"]),
    ({"hidden_act": "gelu"}, ["hidden_act", "gelu"]),
    ({"model_type": "mistral"}, ["model_type", "mistral"]),
    ({"architectures": ["MistralForCausalLM"]}, ["MistralForCausalLM"]),
    ({"num_key_value_heads": 4}, ["num_attention_heads=15", "num_key_value_heads=4"]),
])
def test_config_refusals_name_the_field(change, words):
    hf = {**_base_hf(), **change}
    with pytest.raises(JaxsmolError) as e:
        Config.from_hf(hf)
    for w in words:
        assert w in str(e.value)


def test_config_missing_field_is_named():
    hf = _base_hf()
    del hf["hidden_size"]
    with pytest.raises(JaxsmolError, match="hidden_size"):
        Config.from_hf(hf)


def test_config_defaults_and_loading(tmp_path):
    hf = _base_hf()
    for k in ("num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "eos_token_id"):
        del hf[k]
    cfg = Config.from_hf(hf)
    assert cfg.n_kv_heads == cfg.n_heads == 15  # HF LlamaConfig defaults
    assert cfg.rms_norm_eps == 1e-6 and cfg.tie_embeddings is False and cfg.eos_ids == ()
    assert Config.from_hf({**hf, "eos_token_id": [2, 7]}).eos_ids == (2, 7)
    hash(cfg)  # a static jit argument
    with pytest.raises(JaxsmolError, match="config.json"):
        Config.load(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(JaxsmolError, match="cannot read"):
        Config.load(tmp_path)
