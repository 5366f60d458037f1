"""Model parameters as a registered pytree, loaded from Hugging Face safetensors.

The layers' weights are stacked: `Params.layers` is one `LayerParams` whose every array has a leading
[L] axis, so that the forward runs one compiled layer in a loop over the layer index (see
`model.forward`); the C++ kernels read layer i of a stacked matrix in place. Matrices are stored
input-major ([in, out]) so that the forward reads `x @ W`; HF stores `nn.Linear` weights as
[out, in], so the loader transposes.
"""

from __future__ import annotations

import json
from pathlib import Path

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxsmol.kernels import cpu_kernels, formats
from jaxsmol.kernels.stacking import stack_layers
from jaxsmol.model.config import Config
from jaxsmol.errors import JaxsmolError


@flax.struct.dataclass
class LayerParams:
    """One decoder layer, or all of them stacked ([L, ...] before each shape below: Params.layers).
    Matrices are [in, out], or packed [out / 32, in, 32] when the config runs the CPU kernels
    (cpu_kernels.pack)."""
    attn_norm: jax.Array  # [D]
    wq: jax.Array | None  # [D, N*H]
    wk: jax.Array | None  # [D, K*H]
    wv: jax.Array | None  # [D, K*H]
    wo: jax.Array  # [N*H, D]
    mlp_norm: jax.Array  # [D]
    w_gate: jax.Array | None  # [D, F]
    w_up: jax.Array | None  # [D, F]
    w_down: jax.Array  # [F, D]
    # Under the CPU kernels (cpu_kernels.pack_layer) q, k and v are one packed product and gate and
    # up another, and the fields they replace are None: fewer, longer weight streams (the layers'
    # matmuls at one row: 0.97x the time), and each output column keeps its own sum, so no bit changes.
    wqkv: jax.Array | None = None  # packed [(N*H + 2 K*H) / 32, D, 32]
    w_gate_up: jax.Array | None = None  # packed [2F / 32, D, 32]


@flax.struct.dataclass
class Params:
    embed: jax.Array  # [V, D], rows gathered by token id; a quantized tied model: unembed itself (read by column)
    layers: LayerParams  # every layer's, stacked: each array [L, ...]
    final_norm: jax.Array  # [D]
    unembed: jax.Array  # [D, V]: lm_head.weight transposed (embed transposed when tied)
    # Why a transposed copy even when tied: XLA:CPU computes x @ [D, V] 2.5x faster than
    # x . [V, D] for one decode row (4.4 vs 11 ms for SmolLM2's 49152 x 576), a quarter of a step.

    @property
    def compute_dtype(self):
        """The activations' and the cache's dtype: float32 under the CPU kernels (packed matrices, which
        they widen as they load), else the weights' own (XLA's ops compute in it)."""
        return jnp.dtype(jnp.float32) if self.unembed.ndim == 3 else self.embed.dtype

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in {id(x): x for x in jax.tree.leaves(self)}.values())  # a shared table once


# HF name suffix under `model.layers.{i}.` -> (our field, its HF shape for cfg). The loader transposes
# the 2-D ones (HF's [out, in] -> our [in, out]) and keeps the 1-D norms as they are.
def layer_specs(cfg: Config):
    D, F, NH, KH = cfg.dim, cfg.ffn_dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return {
        "input_layernorm.weight": ("attn_norm", (D,)),
        "self_attn.q_proj.weight": ("wq", (NH, D)),
        "self_attn.k_proj.weight": ("wk", (KH, D)),
        "self_attn.v_proj.weight": ("wv", (KH, D)),
        "self_attn.o_proj.weight": ("wo", (D, NH)),
        "post_attention_layernorm.weight": ("mlp_norm", (D,)),
        "mlp.gate_proj.weight": ("w_gate", (F, D)),
        "mlp.up_proj.weight": ("w_up", (F, D)),
        "mlp.down_proj.weight": ("w_down", (D, F)),
    }


def expected_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name this config needs, with its HF shape."""
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.dim), "model.norm.weight": (cfg.dim,)}
    for i in range(cfg.n_layers):
        for suffix, (_, shape) in layer_specs(cfg).items():
            shapes[f"model.layers.{i}.{suffix}"] = shape
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.dim)
    return shapes


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise JaxsmolError(f"model directory {model_dir} has no model.safetensors")
    return [single]


class Checkpoint:
    """The tensors of a checkpoint directory, read one at a time (as `dtype`, float32 by default) when
    asked for.

    A mapping by HF name, like the dict `read_hf_tensors` returns, plus `shape(name)` from the file
    header: loading a 1.7B model then holds one layer field in host memory, not the whole file. Each
    read opens its shard anew: safetensors maps the file, and every page read stays in this process's
    resident memory until the file is closed (the whole 3.4 GB of a 1.7B checkpoint by the end of
    the load, on top of the weights, when one handle stayed open)."""

    def __init__(self, model_dir: str | Path, dtype=np.float32):
        from safetensors import safe_open

        self._where, self._shapes, self._dtype = {}, {}, np.dtype(dtype)
        for path in _safetensors_files(Path(model_dir)):
            if not path.is_file():
                raise JaxsmolError(f"missing checkpoint shard {path}")
            try:
                # the numpy framework reads f32/f16, and bf16 through ml_dtypes, which jax ships
                with safe_open(str(path), framework="np") as f:
                    for name in f.keys():
                        self._where[name] = path
                        self._shapes[name] = tuple(f.get_slice(name).get_shape())
            except Exception as e:  # safetensors raises several error types for a corrupt file
                raise JaxsmolError(f"cannot read {path}: {e}") from None

    def keys(self):
        return self._where.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def __getitem__(self, name: str) -> np.ndarray:
        from safetensors import safe_open

        path = self._where[name]
        try:
            with safe_open(str(path), framework="np") as f:
                return np.asarray(f.get_tensor(name), dtype=self._dtype)
        except Exception as e:
            raise JaxsmolError(f"cannot read {name} from {path}: {e}") from None


def read_hf_tensors(model_dir: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint directory as float32 NumPy arrays, by HF name."""
    ckpt = Checkpoint(model_dir)
    return {name: ckpt[name] for name in ckpt.keys()}


def params_from_hf(cfg: Config, tensors, dtype=jnp.float32) -> Params:
    """Map HF tensors (a dict of arrays, or a `Checkpoint`) to `Params`, asserting every shape;
    a missing or unexpected tensor is an error. Tensors are read one at a time. With
    cfg.cpu_kernels the matrices come packed for the kernel (cpu_kernels.pack_params)."""
    # a Checkpoint (or a GGUF's tensors) tells shapes from its header, without reading a tensor
    shape_of = tensors.shape if callable(getattr(tensors, "shape", None)) else (lambda name: tuple(tensors[name].shape))
    names = {k for k in tensors.keys() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_embeddings:
        names.discard("lm_head.weight")  # some tied checkpoints still store a copy
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - names)
    unexpected = sorted(names - set(expected))
    if missing:
        raise JaxsmolError(f"checkpoint is missing tensor {missing[0]}"
                           + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if unexpected:
        raise JaxsmolError(f"checkpoint has unexpected tensor {unexpected[0]}"
                           + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    for name, shape in expected.items():
        if shape_of(name) != shape:
            raise JaxsmolError(f"tensor {name} has shape {shape_of(name)}, expected {shape} from config.json")

    def for_dot(w):  # the layout of cfg's matmul class, one matrix at a time
        return formats.to_dot(w, cfg.matmul)

    def matrix(a, fmt=cfg.quant):  # HF's [out, in] -> [in, out], packed one at a time (peak: one extra)
        if isinstance(a, formats.QuantizedMatrix):  # a GGUF's own blocks (checkpoint/gguf_weights.py)
            if a.fmt == fmt:
                return for_dot(a)
            a = np.asarray(cpu_kernels.unpack(formats.dequantize(a))).T  # e.g. a Q4_0 token table: to Q8_0
        if fmt:  # quantized from its float32 values, in panels on both paths
            return for_dot(formats.quantize(np.asarray(a, np.float32).T, fmt))
        return jnp.asarray(cpu_kernels.pack(a.T) if cfg.cpu_kernels else np.ascontiguousarray(a.T), dtype)

    def weight(i, suffix, shape):  # a matrix, or a norm's [D]
        a = tensors[f"model.layers.{i}.{suffix}"]
        return matrix(a) if len(shape) == 2 else jnp.asarray(a, dtype)

    def layer(i):  # fused as it is read (packed under the kernels), not all layers at the end
        fields = LayerParams(**{field: weight(i, suffix, shape) for suffix, (field, shape) in layer_specs(cfg).items()})
        return cpu_kernels.pack_layer(fields) if cfg.cpu_kernels or cfg.quant else fields

    layers = stack_layers(layer, cfg.n_layers)
    embed = tensors["model.embed_tokens.weight"]
    head = embed if cfg.tie_embeddings else tensors["lm_head.weight"]
    unembed = matrix(head, cfg.quant and formats.UNEMBED_FORMAT)
    if cfg.quant and cfg.tie_embeddings:
        embed = unembed  # one table: rows gathered from its columns (formats.columns)
    else:
        embed = jnp.asarray(embed, dtype)
    return Params(embed=embed, layers=layers, final_norm=jnp.asarray(tensors["model.norm.weight"], dtype),
                  unembed=unembed)


def load_params(model_dir: str | Path, cfg: Config, dtype=jnp.float32) -> Params:
    # read in the target dtype: a bfloat16 load then never stages a tensor in float32
    return params_from_hf(cfg, Checkpoint(model_dir, jnp.dtype(dtype)), dtype)


def abstract_params(cfg: Config, dtype=jnp.float32) -> Params:
    """ShapeDtypeStructs in the layout params_from_hf builds: enough to compile programs before
    (or while) the weights load."""
    sds = lambda shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731

    def spec(shape):  # a norm's [D], or a matrix [in, out]
        if len(shape) == 2 and cfg.quant:
            return formats.abstract(*shape, cfg.quant, cfg.matmul)
        return sds(shape)

    layer = LayerParams(**{field: spec(tuple(reversed(shape))) for field, shape in layer_specs(cfg).values()})
    if cfg.cpu_kernels or cfg.quant:
        layer = jax.eval_shape(cpu_kernels.pack_layer, layer)
    layers = jax.tree.map(lambda a: jax.ShapeDtypeStruct((cfg.n_layers, *a.shape), a.dtype), layer)
    unembed = (formats.abstract(cfg.dim, cfg.vocab_size, formats.UNEMBED_FORMAT, cfg.matmul) if cfg.quant
               else sds((cfg.dim, cfg.vocab_size)))
    embed = unembed if cfg.quant and cfg.tie_embeddings else sds((cfg.vocab_size, cfg.dim))
    params = Params(embed=embed, layers=layers, final_norm=sds((cfg.dim,)), unembed=unembed)
    return jax.eval_shape(cpu_kernels.pack_params, params) if cfg.cpu_kernels or cfg.quant else params


def init_random(cfg: Config, seed: int = 0, dtype=jnp.float32) -> Params:
    """Random parameters with the real layout (for tests on tiny configs and shape checks)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight") or "layernorm" in name:
            tensors[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            tensors[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    return params_from_hf(cfg, tensors, dtype)
