"""The model configuration: a frozen, hashable dataclass built from a Hugging Face `config.json`.

It is passed to the jitted forward as a static argument, so it must be hashable and immutable.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp

from jaxsmol.errors import JaxsmolError


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int
    dim: int  # D, hidden size
    n_layers: int  # L
    n_heads: int  # N, query heads
    n_kv_heads: int  # K, key/value heads (GQA: N % K == 0)
    head_dim: int  # H
    ffn_dim: int  # F
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position: int = 2048
    tie_embeddings: bool = True
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    # An execution choice, not part of the checkpoint: attention and every matmul run the C++
    # kernels of cpu_kernels.py. Set by cpu_kernels.configure (the Engine does); off by default.
    cpu_kernels: bool = False
    # The matrices' format: None (the checkpoint's floats, in the load dtype), or "q8_0" / "q4_1"
    # (jaxsmol/kernels/formats.py: GGUF's blocks, dequantized inside the matmul). Part of every
    # compiled program's shape, and of the engine's fingerprint.
    quant: str | None = None
    # How the kernels multiply quantized matrices (an execution choice, resolved by Engine.load's
    # `matmul`): "exact", the float32 kernel's bits on the dequantized weights, or "int8", the
    # integer-dot class (x rounded to 8 bits per 32 k's, as llama.cpp does: cpu_matmul_int8.cc). Part
    # of every program's shape and of the engine's fingerprint, so one class's snapshots never
    # restore into the other.
    matmul: str = "exact"
    # The KV cache's dtype: None (the matrix products' input dtype: float32 under the kernels, else the
    # weights'), or "bfloat16" / "float32". bfloat16 halves the cache, its snapshots and attention's
    # reads; keys and values are rounded to it as they are written, every sum stays float32.
    kv_dtype: str | None = None

    def cache_dtype(self, compute_dtype):
        """The KV cache's dtype for params computing in compute_dtype."""
        return jnp.dtype(self.kv_dtype) if self.kv_dtype else jnp.dtype(compute_dtype)

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise JaxsmolError(
                f"num_attention_heads={self.n_heads} is not a multiple of num_key_value_heads={self.n_kv_heads}"
            )

    def check_blocks(self, fmt: str, block: int) -> None:
        """A JaxsmolError naming every matrix size that does not split into `fmt`'s blocks of `block`
        (a quantized format: --quantize, jaxsmol quantize)."""
        sizes = {"hidden_size": self.dim, "intermediate_size": self.ffn_dim, "vocab_size": self.vocab_size,
                 "heads x head_dim": self.n_heads * self.head_dim,
                 "kv heads x head_dim": self.n_kv_heads * self.head_dim}
        odd = [f"{k}={v}" for k, v in sizes.items() if v % block]
        if odd:
            raise JaxsmolError(f"{fmt} needs every matrix size to be a multiple of {block}: {', '.join(odd)}")

    @property
    def q_per_kv(self) -> int:  # G, query heads sharing one key/value head
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_hf(cls, hf: dict) -> Config:
        """Build from a parsed HF `config.json` of a `LlamaForCausalLM`; refuse what we do not implement."""
        archs = hf.get("architectures") or ["LlamaForCausalLM"]
        if hf.get("model_type", "llama") != "llama" or archs[0] != "LlamaForCausalLM":
            raise JaxsmolError(
                f"unsupported architecture: model_type={hf.get('model_type')!r}, architectures={archs!r} "
                "(only LlamaForCausalLM is supported)"
            )
        for field in ("attention_bias", "mlp_bias"):
            if hf.get(field):
                raise JaxsmolError(f"unsupported config field {field}={hf[field]!r} (only false is supported)")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise JaxsmolError(f"unsupported config field hidden_act={act!r} (only 'silu' is supported)")
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or None
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type")) or rope.get("rope_type", "default")
        if rope_type not in ("default", None):
            raise JaxsmolError(f"unsupported config field rope_scaling: rope_type={rope_type!r} (only 'default')")
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size") if k not in hf]
        if missing:
            raise JaxsmolError(f"config.json lacks required field(s): {', '.join(missing)}")
        n_heads = int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or hf["hidden_size"] // n_heads)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(hf["vocab_size"]),
            dim=int(hf["hidden_size"]),
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            head_dim=head_dim,
            ffn_dim=int(hf["intermediate_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position=int(hf.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_id=hf.get("bos_token_id"),
            eos_ids=eos_ids,
        )

    @classmethod
    def load(cls, model_dir: str | Path) -> Config:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise JaxsmolError(f"model directory {model_dir} has no config.json")
        try:
            hf = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise JaxsmolError(f"cannot read {path}: {e}") from None
        return cls.from_hf(hf)

    @classmethod
    def tiny(cls, **overrides) -> Config:
        """A tiny random config for fast tests (same structure as SmolLM: GQA, tied embeddings)."""
        base = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                    rms_norm_eps=1e-5, rope_theta=10000.0, max_position=1024, tie_embeddings=True,
                    bos_id=1, eos_ids=(2,))
        base.update(overrides)
        return cls(**base)
