"""Write a random-weight checkpoint at a real SmolLM2 size (no hub here), to load, generate and bench.

    PYTHONPATH=$PWD python tools/make_checkpoint.py 360M /tmp/smollm2-360m
    PYTHONPATH=$PWD python tools/make_checkpoint.py 1.7B /tmp/smollm2-1.7b --dtype bfloat16
    jaxsmol bench --model /tmp/smollm2-360m --quick --only prefill decode

The directory gets config.json (the real config of that size), model.safetensors (random weights,
written one tensor at a time, so memory stays at one tensor) and the tokenizer files of the bundled
SmolLM2-135M-Instruct (the SmolLM2 sizes share one tokenizer). Random weights give meaningless text
but the real cost: every matmul, the cache and the memory are those of the real model.
Never commit the output.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
from pathlib import Path

import numpy as np

# Hugging Face config.json fields of the real SmolLM2 checkpoints that differ between sizes.
SIZES = {
    "135M": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, rope_theta=100000.0),
    "360M": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                 num_key_value_heads=5, rope_theta=100000.0),
    "1.7B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                 num_key_value_heads=32, rope_theta=130000.0),
}
# A two-layer size with the real vocabulary: what the tests run the CLI, the daemon and the benchmark on
# when their subject is not the real weights (its programs compile in a fraction of a second).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=10000.0)
COMMON = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, rms_norm_eps=1e-5,
              max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
              pad_token_id=2, hidden_act="silu", attention_bias=False, mlp_bias=False)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


def hf_config(size: str | dict) -> dict:
    """config.json for a named size, or for explicit fields (e.g. a tiny test config)."""
    fields = SIZES[size] if isinstance(size, str) else size
    cfg = dict(COMMON, **fields)
    cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg["torch_dtype"] = "float32"
    return cfg


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], dtype: str, seed: int) -> int:
    """Random tensors (norms near 1, matrices ~ N(0, 1/fan_in)) streamed into one safetensors file."""
    import ml_dtypes

    np_dtype, tag = (np.float32, "F32") if dtype == "float32" else (ml_dtypes.bfloat16, "BF16")
    itemsize = np.dtype(np_dtype).itemsize
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * itemsize
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):
                t = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
            else:
                t = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[-1]))
            f.write(np.ascontiguousarray(t.astype(np_dtype)).tobytes())
    return offset


def make_checkpoint(size: str | dict, out: str | Path, dtype: str = "bfloat16", seed: int = 0,
                    tokenizer_dir: str | Path | None = None) -> Path:
    """Write config.json, model.safetensors and the tokenizer files into `out`; returns it."""
    from jaxsmol.model.config import Config
    from jaxsmol.model.params import expected_shapes

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg_json = hf_config(size)
    (out / "config.json").write_text(json.dumps(cfg_json, indent=2))
    write_safetensors(out / "model.safetensors", expected_shapes(Config.load(out)), dtype, seed)
    if tokenizer_dir is None:
        from jaxsmol.checkpoint.default_model import default_model_dir
        tokenizer_dir = default_model_dir(progress=False)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, out / name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("size", choices=sorted(SIZES))
    ap.add_argument("out")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                    help="the stored dtype (the hub's SmolLM2 files are bfloat16); jaxsmol converts on load")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path = make_checkpoint(args.size, args.out, args.dtype, args.seed)
    print(f"wrote {path} ({(path / 'model.safetensors').stat().st_size / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
