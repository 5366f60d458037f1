"""CPU kernels written in C++ and called from jitted programs through JAX's foreign function interface
(`jax.ffi`): two computing the forward in float32, and a copy.

- `matmul` (cpu_matmul.cc), for every matmul of the model, its weights stored float32 or bfloat16 (widened
  exactly as they load; activations, sums and the cache stay float32). Each output element is one fused
  multiply-add chain over k in order, whatever the row count, so a row's bits do not depend on the other rows:
  decode rows are batch-invariant, and a prompt row gets the same bits in a 16-row chunk as in a 512-row one
  (XLA:CPU's GEMM sums differently below 64 rows, which is why exact prefill without the kernels needs >=
  64-row chunks). Its weights are packed once, at load, in 32-column panels (`pack`, `pack_params`; q, k, v as
  one product and gate, up as another: `pack_layer`), so every call streams them sequentially. Few rows
  (decode steps) stream each weight row once; XLA:CPU's dot packs a weight panel before every product, which
  at 2-16 rows costs more than the arithmetic. Many rows (prefill chunks) run a cache-blocked GEMM over the
  panels, as fast as XLA's.
- `matmul` on quantized weights (formats.py): cpu_matmul_quant.cc dequantizes them in registers (the float32
  kernel's bits on their values; `--matmul exact`), cpu_matmul_int8.cc rounds x to 8 bits per 32 k's and sums
  integer dot products (`--matmul int8`, llama.cpp's arithmetic; a row's bits still depend on the row alone).
- `attention` (cpu_attention.cc), causal, for prefill chunks and decode steps alike. XLA's blocked attention
  copies every 256-slot block of the cache before its matmuls (a batch's or several heads' block is not
  contiguous) and runs every row to the chunk's or batch's last position; the kernel reads each (row, kv
  head)'s keys and values in place, up to that query's own position. Each query row is computed on its own in
  position order, so its bits do not depend on the chunk or batch carrying it (a decode step's single row
  takes a different, split path: T == 1 differs from T >= 2).
- the KV caches' copies (cpu_prefix.cc), called through cpu_copies.py.

A wheel holds the library prebuilt for a few instruction sets (variants.py; `prebuilt/`, built by setup.py
with libstdc++ linked in, so it needs only glibc): the best one this CPU runs is loaded, no compiler needed.
Elsewhere (an editable install, a source build, a CPU no variant fits) the library is compiled on first use
with the system's C++ compiler (`$CXX`, else `c++`) for this CPU (`-march=native`, build.py) and kept in the
kernels directory (system/data_dirs.kernels_dir), keyed by sources, flags, compiler, jax version and CPU.
Either gives the same bits. Its vectors and register tiles follow the CPU: 16 floats with AVX-512, else 8
(`vector_lanes`).
`JAXSMOL_KERNELS` (`kernel_switch`) switches them: `auto` (the default) uses them where they build, `on` makes
that a requirement (a JaxsmolError where they cannot), `off` runs XLA's ops only (the path every GPU and TPU
takes). In `auto`, where they cannot be built (no compiler, a CPU other than x86-64 with AVX2 and FMA: skipped
before compiling), the forward uses XLA's dot and attention, with one line on stderr saying why. `state()`
records what happened (`jaxsmol info` prints it).
"""

from __future__ import annotations

import ctypes
import dataclasses
import platform
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxsmol.errors import JaxsmolError
from jaxsmol.kernels.build import FLAGS, HEADERS, SOURCES, UNITS, compile_library  # noqa: F401 (the API's)
from jaxsmol.kernels import choice
from jaxsmol.kernels.choice import (ENV, ISAS, MODES, OLD_ENV, KernelState, compiled_library,  # noqa: F401
                                    compiler, kernel_switch, prebuilt_variant)
from jaxsmol.kernels.cpu_identity import _cpu_flags, cpu_signature, unsupported_cpu  # noqa: F401 (the API's)
from jaxsmol.kernels.formats import QuantizedMatrix, concat_panels
from jaxsmol.kernels.stacking import stack_layers, unstack_layers
from jaxsmol.system.progress import Wait

TARGETS = {"jaxsmol_matmul": "JaxsmolMatmul", "jaxsmol_matmul_bf16": "JaxsmolMatmulBf16",
           "jaxsmol_matmul_q8_0": "JaxsmolMatmulQ8_0", "jaxsmol_matmul_q4_1": "JaxsmolMatmulQ4_1",
           "jaxsmol_matmul_q8_0_int8": "JaxsmolMatmulQ8_0Int8", "jaxsmol_matmul_q4_1_int8": "JaxsmolMatmulQ4_1Int8",
           "jaxsmol_attention": "JaxsmolAttention", "jaxsmol_attention_bf16": "JaxsmolAttentionBf16",
           "jaxsmol_load_prefix": "JaxsmolLoadPrefix", "jaxsmol_write_slots": "JaxsmolWriteSlots",
           "jaxsmol_copy_row": "JaxsmolCopyRow", "jaxsmol_read_slots": "JaxsmolReadSlots",
           "jaxsmol_write_rows": "JaxsmolWriteRows", "jaxsmol_reserve": "JaxsmolReserve"}
PANEL = 32  # columns per panel of a packed weight: a matmul's N must be a multiple
HEAD_DIMS = (16, 32, 64, 128)  # the head sizes the attention kernel handles
WEIGHT_DTYPES = (jnp.float32, jnp.bfloat16)  # the matrices' dtypes the matmul kernel reads
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # LayerParams' matmul weights
FUSED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}  # packed: one product each

_lock = threading.Lock()
_state: KernelState | None = None  # None until the first call of state()


def _build() -> tuple[Path, bool]:
    """Compile the kernel sources for this CPU into one shared library in the kernels directory (once
    per key: choice.compiled_library) -> (its path, whether this call compiled it)."""
    out, cxx = compiled_library(), compiler()
    if out.is_file():
        return out, False
    with Wait(f"compiling the CPU kernels for this CPU ({len(UNITS)} units with {cxx}; once: kept in {out.parent})"):
        compile_library(cxx, FLAGS, jax.ffi.include_dir(), out)
    return out, True


def state() -> KernelState:
    """The kernels' state, loading them on the first call (once per process; see _load)."""
    global _state
    with _lock:
        if _state is None:
            _state = _load(*kernel_switch())
        return _state


def available() -> bool:
    """Whether the kernels are built and registered (loading them on the first call); in mode `on`
    a JaxsmolError where they are not."""
    s = state()
    if s.mode == "on" and not s.in_use:
        raise JaxsmolError(f"{s.switch}=on, but the CPU kernels are not available: {s.reason}")
    return s.in_use


def vector_lanes() -> int:
    """The kernels' vector width in floats, 0 where they are off. A decode step's attention sums q.k
    in lanes, so builds of different widths differ in its last bits (part of Engine.fingerprint)."""
    return state().lanes if available() else 0


def _load(mode: str, switch: str | None) -> KernelState:
    """Find (a wheel's prebuilt variant, else a library built before) or build the library and register its
    targets with JAX, unless switched off or the CPU cannot run it (checked before compiling). In mode
    auto a failure is one line on stderr."""
    if mode == "off":
        return KernelState(mode, switch, False, reason=f"switched off ({switch}=off): XLA's ops only")
    flags = _cpu_flags()
    why = unsupported_cpu(platform.machine(), flags)
    if why is None:
        try:
            path, source, isa, lanes = _open(flags)
        except (RuntimeError, OSError, AttributeError) as e:
            why = str(e)
        else:
            return KernelState(mode, switch, True, source, isa or ISAS.get(lanes, f"{lanes} lanes"), lanes, str(path))
    if mode == "auto":  # in mode on, available() raises with the reason instead
        print(f"jaxsmol: the CPU kernels are not available ({why}); the forward uses XLA's dot and attention",
              file=sys.stderr)
    return KernelState(mode, switch, False, reason=why)


def _open(flags: set[str] | None) -> tuple[Path, str, str | None, int]:
    """The library registered -> (its path, its source, its variant's name or None, its vector width):
    the best prebuilt variant this CPU runs, else one compiled for this CPU (now or before)."""
    variant, refused = prebuilt_variant(flags), ""
    if variant is not None:
        path = choice.PREBUILT / variant.library
        try:
            return path, "prebuilt", variant.name, _register(path)
        except OSError as e:  # a library this system's loader refuses: compiled for this CPU instead
            refused = f"the prebuilt {variant.library} does not load ({e}); "
    try:
        path, compiled = _build()
    except RuntimeError as e:
        raise RuntimeError(refused + str(e)) from None
    return path, "compiled" if compiled else "cache", None, _register(path)


def _register(path: Path) -> int:
    """Load the library and register its FFI targets for the CPU -> its vector width in floats."""
    lib = ctypes.cdll.LoadLibrary(str(path))
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return int(lib.JaxsmolVectorLanes())


def fits(cfg) -> bool:
    """Whether every matmul and attention of cfg's model fits the kernels: each matmul's output width
    a whole number of weight panels, and a head size the attention kernel handles. (All or nothing:
    one op left to XLA would make a prompt row's bits depend on its chunk again.)"""
    widths = (cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim, cfg.vocab_size)
    return all(n % PANEL == 0 for n in widths) and cfg.head_dim in HEAD_DIMS


def configure(cfg, dtype, mesh=None):
    """cfg with `cpu_kernels` set: on for float32 or bfloat16 weights on one CPU device where the
    kernels load and the model's shapes fit them. (A mesh partitions the forward with GSPMD, which
    cannot split a custom call.) Params for a cfg with the kernels on are packed (pack_params)."""
    use = (jnp.dtype(dtype) in WEIGHT_DTYPES and mesh is None and jax.default_backend() == "cpu" and fits(cfg)
           and available())
    return cfg if cfg.cpu_kernels == use else dataclasses.replace(cfg, cpu_kernels=use)


def pack(w):
    """A weight [K, N] (numpy or jax) -> the kernel's layout [N / 32, K, 32]: each 32-column panel
    contiguous over k, so a matmul streams it sequentially (see cpu_matmul.cc)."""
    if isinstance(w, QuantizedMatrix):  # quantized matrices are kept in panels always
        return w
    K, N = w.shape
    if N % PANEL:
        raise ValueError(f"a packed weight needs N % {PANEL} == 0, got [{K}, {N}]")
    panels = w.reshape(K, N // PANEL, PANEL).transpose(1, 0, 2)
    return np.ascontiguousarray(panels) if isinstance(w, np.ndarray) else panels


def unpack(panels):
    """pack's inverse: [N / 32, K, 32] -> [K, N]."""
    P, K, _ = panels.shape
    return panels.transpose(1, 0, 2).reshape(K, P * PANEL)


def is_packed(w) -> bool:
    return w.ndim == 3 and not isinstance(w, QuantizedMatrix)


def pack_params(params, packed: bool = True):
    """params with every matmul weight packed (the layers' matrices, see pack_layer, and the
    unembedding; not the embedding table, whose rows are gathered), or with packed=False every one
    unpacked: the layout a cfg with the kernels on, or off, needs. Weights already in it are kept.
    params.layers is stacked ([L, ...] leaves); a change of layout goes a layer at a time."""
    unembed = params.unembed
    if not isinstance(unembed, QuantizedMatrix) and is_packed(unembed) != packed:
        unembed = (pack if packed else unpack)(unembed)
    layers = params.layers
    if not (_quantized(layers) or (layers.wqkv is not None) == packed):
        per_layer = unstack_layers(layers)
        layers = stack_layers(lambda i: pack_layer(per_layer[i], packed), len(per_layer))
    return params.replace(layers=layers, unembed=unembed)


def pack_layer(layer, packed: bool = True):
    """A LayerParams in the kernels' layout: every matrix packed, and q, k, v (and gate, up) as one
    product each, their panels side by side (FUSED); packed=False: back to separate [in, out] matrices.
    One call streams the three weights where three calls each had their own start-up and stream."""
    if _quantized(layer):  # panels, fused, on both paths (XLA's dequantizes them in the forward)
        return layer if layer.wqkv is not None else layer.replace(
            **{name: concat_panels([getattr(layer, f) for f in parts]) for name, parts in FUSED.items()},
            **{f: None for parts in FUSED.values() for f in parts})
    if not packed:
        if layer.wqkv is not None:  # the fused panels split by width (wo's input is q's, w_down's up's)
            q, f = layer.wo.shape[1] // PANEL, layer.w_down.shape[1] // PANEL
            kv = (layer.wqkv.shape[0] - q) // 2
            layer = layer.replace(wq=layer.wqkv[:q], wk=layer.wqkv[q:q + kv], wv=layer.wqkv[q + kv:], wqkv=None,
                                  w_gate=layer.w_gate_up[:f], w_up=layer.w_gate_up[f:], w_gate_up=None)
        return layer.replace(**{f: unpack(getattr(layer, f)) for f in MATRICES if is_packed(getattr(layer, f))})
    if layer.wqkv is not None:
        return layer
    panels = {f: getattr(layer, f) if is_packed(getattr(layer, f)) else pack(getattr(layer, f)) for f in MATRICES}
    fused = {name: jnp.concatenate([panels[f] for f in parts]) for name, parts in FUSED.items()}
    return layer.replace(wo=panels["wo"], w_down=panels["w_down"], **fused,
                         **{f: None for parts in FUSED.values() for f in parts})


def _quantized(layer) -> bool:
    return isinstance(layer.wo, QuantizedMatrix)


def matmul(x: jax.Array, panels, target: str | None = None, layer: jax.Array | None = None) -> jax.Array:
    """x [..., K] float32 @ w -> [..., N] float32 through the kernel, w given packed as [N / 32, K, 32]
    in float32 or bfloat16 (available() must be True), or stacked over the layers as [L, N / 32, K, 32]
    with `layer` (an int32 scalar, traced or not) naming the one to read in place. `target`: another
    build's registered name (tools/kernel_revision.py); by default the project's own for the weight's
    dtype. A QuantizedMatrix (formats.py) goes to its format's kernel: the same bits as the float32
    kernel on its dequantized values."""
    if layer is None:  # one matrix: a stack of one
        panels, layer = jax.tree.map(lambda a: a[None], panels), 0
    layer = jnp.asarray(layer, jnp.int32)
    if isinstance(panels, QuantizedMatrix):
        return _matmul_quantized(x, panels, layer)
    if target is None:
        target = "jaxsmol_matmul_bf16" if panels.dtype == jnp.bfloat16 else "jaxsmol_matmul"
    _, P, K, _ = panels.shape
    lead, N = x.shape[:-1], P * PANEL
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.size // K, N), jnp.float32))
    return call(x.reshape(-1, K), panels, layer).reshape(*lead, N)


def _matmul_quantized(x: jax.Array, w: QuantizedMatrix, layer: jax.Array) -> jax.Array:
    P, K = w.q.shape[-3:-1]
    lead, N = x.shape[:-1], P * PANEL
    suffix = "" if w.dot == "exact" else "_" + w.dot
    call = jax.ffi.ffi_call(f"jaxsmol_matmul_{w.fmt}{suffix}", jax.ShapeDtypeStruct((x.size // K, N), jnp.float32))
    scales = (w.d,) if w.m is None else (w.d, w.m)
    return call(x.reshape(-1, K), w.q, *scales, layer).reshape(*lead, N)


def attention_applies(q: jax.Array, k_all: jax.Array) -> bool:
    """Whether attention of q [B, T, K, G, H] over k_all goes to the kernel: q float32, the cache
    float32 or bfloat16, H in 16..128."""
    return q.dtype == jnp.float32 and attention_kernel_for(k_all.dtype, q.shape[-1])


def attention_kernel_for(cache_dtype, head_dim: int) -> bool:
    """Whether a cache of this dtype and head size is read by the kernel (in place, any capacity),
    not by XLA's attention (whole 256-slot blocks): float32, or bfloat16 (widened exactly as it loads)."""
    return cache_dtype in (jnp.float32, jnp.bfloat16) and head_dim in HEAD_DIMS


def attention(q: jax.Array, k_all: jax.Array, v_all: jax.Array, layer, pos: jax.Array,
              target: str | None = None, as_steps: bool = False, rows: jax.Array | None = None) -> jax.Array:
    """Causal attention of q [B, T, K, G, H] (scaled, RoPE applied) at positions pos.. (a scalar or
    [B]) over cache layer `layer` (an int32 scalar, traced or not) of k_all, v_all [L, R, K, S, H] (the
    chunk's keys already written), query row b reading cache row rows[b] (None: row b, R == B)
    -> [B, T, K, G, H]. Each query row is computed on its own, so its bits do not depend on the chunk.
    as_steps: every row (b, t) with the bits of a decode step at position pos[b] + t (a one-row chunk's
    numerics, which differ from a longer chunk's in the last bits): a speculative step's drafted rows.
    A bfloat16 cache is read in place and widened exactly: the bits of a float32 cache of its values.
    `target`: another build's registered name (tools/kernel_revision.py); by default the project's own
    for the cache's dtype."""
    if target is None:
        target = "jaxsmol_attention_bf16" if k_all.dtype == jnp.bfloat16 else "jaxsmol_attention"
    pos = jnp.broadcast_to(pos.astype(jnp.int32), (q.shape[0],))
    rows = jnp.arange(q.shape[0], dtype=jnp.int32) if rows is None else rows.astype(jnp.int32)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q, k_all, v_all, pos, rows, jnp.asarray(layer, jnp.int32), as_steps=np.int32(as_steps))
