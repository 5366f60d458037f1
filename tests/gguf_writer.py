"""A tiny synthetic Llama GGUF, written the way llama.cpp's converter would, for exact import round
trips (tests/test_gguf_import.py, tests/test_default_model.py; the `tiny_gguf` fixture in conftest)."""

from __future__ import annotations

import numpy as np

from jaxsmol.checkpoint import gguf_import
from jaxsmol.checkpoint.gguf_import import permute_qk

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MODEL_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "generation_config.json"}
TINY = dict(V=300, D=64, F=96, L=2, N=4, K=2, H=16)


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _tiny_hf_weights(tied: bool, seed: int = 0, vocab: int | None = None) -> dict[str, np.ndarray]:
    V, D, F, L, N, K, H = (TINY[k] for k in "VDFLNKH")
    V = vocab or V
    rng = np.random.default_rng(seed)
    w = {"model.embed_tokens.weight": rng.normal(size=(V, D)), "model.norm.weight": rng.normal(size=D)}
    if not tied:
        w["lm_head.weight"] = rng.normal(size=(V, D))
    for i in range(L):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (N * H, D), "self_attn.k_proj": (K * H, D), "self_attn.v_proj": (K * H, D),
                  "self_attn.o_proj": (D, N * H), "mlp.gate_proj": (F, D), "mlp.up_proj": (F, D),
                  "mlp.down_proj": (D, F), "input_layernorm": (D,), "post_attention_layernorm": (D,)}
        w.update({f"{p}{k}.weight": rng.normal(size=s) for k, s in shapes.items()})
    return {k: v.astype(np.float32) for k, v in w.items()}


def write_tiny_gguf(path, *, tied=True, arch="llama", quantize_embed=False, sizes=None, matrix_type=None,
                    vocab=None) -> dict[str, np.ndarray]:
    """Write a tiny Llama GGUF the way llama.cpp's converter would (Q/K permuted); return the HF weights.
    `sizes` overrides size fields of the metadata (not the tensors), as a crafted file would;
    `matrix_type` (e.g. "Q4_0") stores the layers' matrices in that type, as llama-quantize would;
    `vocab` another vocabulary size (a multiple of 32 for quantized runs)."""
    import gguf

    V, D, F, L, N, K, H = (TINY[k] for k in "VDFLNKH")
    V = vocab or V
    m = {**dict(block_count=L, context_length=256, embedding_length=D, feed_forward_length=F, head_count=N,
                head_count_kv=K, vocab_size=V), **(sizes or {})}
    hf = _tiny_hf_weights(tied, vocab=V)
    tokens = SPECIALS + _byte_chars()
    merges = ["Ġ t", "h e", "Ġt he", "Ġ a"]
    tokens += ["Ġt", "he", "Ġthe", "Ġa"]
    tokens += [f"<extra_{i}>" for i in range(V - len(tokens))]
    types = [3] * len(SPECIALS) + [1] * (V - len(SPECIALS))
    w = gguf.GGUFWriter(str(path), arch)
    for field, value in m.items():
        getattr(w, f"add_{field}")(value)
    w.add_rope_dimension_count(H)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    rev = {v: k for k, v in gguf_import.LAYER_NAMES.items()}
    for name, t in hf.items():
        if name.startswith("model.layers."):
            _, _, i, *mid, _ = name.split(".")
            gname = f"blk.{i}.{rev['.'.join(mid)]}.weight"
        else:
            gname = names[name]
        if name.endswith("q_proj.weight"):
            t = permute_qk(t, N)
        elif name.endswith("k_proj.weight"):
            t = permute_qk(t, K)
        kind = None
        if quantize_embed and gname == "token_embd.weight":
            kind = gguf.GGMLQuantizationType.Q8_0
        elif matrix_type and gname.startswith("blk.") and t.ndim == 2:
            kind = gguf.GGMLQuantizationType[matrix_type]
        if kind is not None:
            q = gguf.quants.quantize(t, kind)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=kind)
        else:
            w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def leftovers(parent):
    """Names of the import's temporaries (*.tmp) left in `parent`."""
    return [p.name for p in parent.iterdir() if p.name.endswith(".tmp")]
