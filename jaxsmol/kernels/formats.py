"""Quantized weight formats: GGUF's Q8_0 and Q4_1 blocks, kept in the kernels' 32-column panels.

A matrix w [K, N] (input-major, as the forward reads `x @ w`) is cut along k into blocks of 32, one
block per (32 k's, column), as GGUF cuts each output row; each block keeps its own scale:

    Q8_0  w[k, n] = d * q            q int8 in -127..127, d a float16 value           (~1.1 bytes a weight)
    Q4_1  w[k, n] = d * q + m        q in 0..15, d and m float16 values              (~0.75 bytes a weight)

In memory (`QuantizedMatrix`, a registered pytree), like a packed float weight (cpu_kernels.pack):
    q   [N / 32, K, 32] int8 (Q8_0), or [N / 32, K, 16] uint8 (Q4_1: byte j holds column j in its
        low four bits and column j + 16 in its high four)
    d   [N / 32, K / 32, 32] float32: the block's scale (a float16 value, widened exactly)
    m   [N / 32, K / 32, 32] float32: the block's minimum (Q4_1), else None
With `dot="int8"` (the integer-dot class) q has the same shape and bytes, reordered:
each column's 4 consecutive k's adjacent ([N / 32, K / 4, 32 or 16, 4]), what the integer-dot kernel
(cpu_matmul_int8.cc) multiplies in one lane (`to_dot`).
d * q is exact in float32 (11 significant bits times at most 7), so a weight's value is the same
float32 number wherever it is computed: XLA's path (`dequantize`, inside the jitted forward), the C++
kernels (in registers), or the float32 import of a GGUF file. Q4_1's `d * q + m` rounds once, and an
FMA of it rounds the same way.

`quantize` follows ggml's reference rounding (quantize_row_q8_0_ref, quantize_row_q4_1_ref), so a
float checkpoint quantized here holds what llama-quantize would write for it.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

FORMATS = ("q8_0", "q4_1")
DOTS = ("exact", "int8")  # how the kernels multiply a matrix (Config.matmul): its float32 values, or codes by rounded x
BLOCK = 32  # k's per block (GGUF's QK8_0 and QK4_1)
PANEL = 32  # columns per panel (cpu_kernels.PANEL)
BYTES_PER_WEIGHT = {"q8_0": 1 + 4 / BLOCK, "q4_1": 0.5 + 8 / BLOCK}  # in memory here (scales as float32)


@flax.struct.dataclass
class QuantizedMatrix:
    """A matrix [K, N] in one of FORMATS, in 32-column panels (see the module docstring)."""
    q: jax.Array  # [N / 32, K, 32] int8, or [N / 32, K, 16] uint8
    d: jax.Array  # [N / 32, K / 32, 32] float32
    m: jax.Array | None = None  # [N / 32, K / 32, 32] float32 (Q4_1)
    fmt: str = flax.struct.field(pytree_node=False, default="q8_0")
    dot: str = flax.struct.field(pytree_node=False, default="exact")  # one of DOTS; "int8": q in k-quads

    @property
    def shape(self) -> tuple[int, ...]:
        """The packed float weight's shape it stands for: [N / 32, K, 32] ([L, N / 32, K, 32] stacked)."""
        return (*self.q.shape[:-1], PANEL)

    @property
    def ndim(self) -> int:
        return self.q.ndim

    @property
    def dtype(self):
        """The values' dtype (what the matmul computes in)."""
        return jnp.dtype(jnp.float32)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.q, self.d, self.m) if a is not None)

    def panels(self, start: int, stop: int) -> QuantizedMatrix:
        """Panels start..stop-1: the columns 32 start .. 32 stop - 1."""
        return self.replace(q=self.q[start:stop], d=self.d[start:stop],
                            m=None if self.m is None else self.m[start:stop])


def concat_panels(parts) -> QuantizedMatrix:
    """Matrices of one format with the same K, side by side: their panels in order."""
    first = parts[0]
    cat = lambda name: jnp.concatenate([getattr(p, name) for p in parts])  # noqa: E731
    return first.replace(q=cat("q"), d=cat("d"), m=None if first.m is None else cat("m"))


def _f16(a: np.ndarray) -> np.ndarray:
    """float32 -> the nearest float16 value, as float32 (GGUF stores the scales in float16)."""
    return a.astype(np.float16).astype(np.float32)


def _blocks(w: np.ndarray, fmt: str) -> np.ndarray:
    """w [K, N] float32 -> [N / 32, K / 32, 32 (k), 32 (column)]: each (panel, k block)'s weights."""
    K, N = w.shape
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; one of {', '.join(FORMATS)}")
    if K % BLOCK or N % PANEL:
        raise ValueError(f"a {fmt} matrix needs K % {BLOCK} == 0 and N % {PANEL} == 0, got [{K}, {N}]")
    return np.asarray(w, np.float32).reshape(K // BLOCK, BLOCK, N // PANEL, PANEL).transpose(2, 0, 1, 3)


def quantize(w, fmt: str) -> QuantizedMatrix:
    """w [K, N] float (numpy) -> a QuantizedMatrix in fmt, rounded as ggml's reference quantizers round."""
    b = _blocks(np.asarray(w, np.float32), fmt)  # [P, KB, 32, 32]
    P, KB = b.shape[:2]
    if fmt == "q8_0":
        amax = np.abs(b).max(axis=2)  # [P, KB, 32]
        d = amax / 127.0
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
        q = np.floor(np.abs(b) * inv[:, :, None] + 0.5) * np.sign(b)  # roundf: half away from zero
        q = q.astype(np.int8).reshape(P, KB * BLOCK, PANEL)
        return QuantizedMatrix(q=jnp.asarray(q), d=jnp.asarray(_f16(d)), fmt=fmt)
    lo, hi = b.min(axis=2), b.max(axis=2)  # [P, KB, 32]
    d = (hi - lo) / 15.0
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.minimum(15, ((b - lo[:, :, None]) * inv[:, :, None] + 0.5).astype(np.int8)).astype(np.uint8)
    q = q.reshape(P, KB * BLOCK, PANEL)
    packed = q[:, :, :16] | (q[:, :, 16:] << 4)
    return QuantizedMatrix(q=jnp.asarray(packed), d=jnp.asarray(_f16(d)), m=jnp.asarray(_f16(lo)), fmt=fmt)


def from_rows(fmt: str, values: np.ndarray, d: np.ndarray, m: np.ndarray | None = None) -> QuantizedMatrix:
    """GGUF's row-major blocks -> a QuantizedMatrix: values [N, K] (int8 codes, or Q4_1's 0..15),
    d and m [N, K / 32] (one scale and minimum per block of a row) for w [K, N] = (rows, transposed)."""
    N, K = values.shape
    P = N // PANEL
    panels = np.ascontiguousarray(values.reshape(P, PANEL, K).transpose(0, 2, 1))  # [P, K, 32]
    if fmt == "q4_1":
        panels = (panels[:, :, :16] | (panels[:, :, 16:] << 4)).astype(np.uint8)
    scale = lambda a: jnp.asarray(_f16(a).reshape(P, PANEL, K // BLOCK).transpose(0, 2, 1))  # noqa: E731
    return QuantizedMatrix(q=jnp.asarray(panels), d=scale(d), m=None if m is None else scale(m), fmt=fmt)


def to_dot(w: QuantizedMatrix, dot: str) -> QuantizedMatrix:
    """w for the kernels of `dot` (DOTS): its codes in k order ("exact") or in k-quads ("int8"), the
    same values (numpy, at load)."""
    if dot not in DOTS:
        raise ValueError(f"unknown dot {dot!r}; one of {', '.join(DOTS)}")
    if w.dot == dot:
        return w
    q = np.asarray(w.q)
    *lead, K, C = q.shape
    moved = (q.reshape(*lead, K // 4, 4, C) if dot == "int8" else q.reshape(*lead, K // 4, C, 4)).swapaxes(-1, -2)
    return w.replace(q=jnp.asarray(np.ascontiguousarray(moved).reshape(q.shape)), dot=dot)


def _k_major(w: QuantizedMatrix) -> jax.Array:
    """w.q as [..., K, C] in k order (to_dot's quads undone: traceable)."""
    if w.dot == "exact":
        return w.q
    *lead, K, C = w.q.shape
    return w.q.reshape(*lead, K // 4, C, 4).swapaxes(-1, -2).reshape(w.q.shape)


def codes(w: QuantizedMatrix) -> jax.Array:
    """The integer codes as float32, [N / 32, K, 32] (Q4_1's nibbles unpacked)."""
    q = _k_major(w)
    if w.fmt == "q8_0":
        return q.astype(jnp.float32)
    low, high = q & 0xF, q >> 4
    return jnp.concatenate([low, high], axis=-1).astype(jnp.float32)


def dequantize(w: QuantizedMatrix) -> jax.Array:
    """The float32 weights, packed [N / 32, K, 32] (jnp, traceable: XLA's path runs it in the forward)."""
    P, K, _ = w.shape
    scale = lambda a: jnp.repeat(a, BLOCK, axis=1)  # noqa: E731  [P, K / 32, 32] -> [P, K, 32]
    out = codes(w) * scale(w.d)
    return out if w.m is None else out + scale(w.m)


def columns(w: QuantizedMatrix, ids: jax.Array) -> jax.Array:
    """Columns `ids` (any shape) of w as float32 rows, [*ids.shape, K]: the embedding lookup of a
    tied model, whose table is the unembedding's (each row the same values dequantize gives)."""
    p, c = ids // PANEL, ids % PANEL
    if w.fmt == "q8_0":
        q = _column(w, p, c).astype(jnp.float32)  # [..., K]
    else:
        q = ((_column(w, p, c % (PANEL // 2)) >> (4 * (c // (PANEL // 2)))[..., None]) & 0xF).astype(jnp.float32)
    out = q * jnp.repeat(w.d[p, :, c], BLOCK, axis=-1)
    return out if w.m is None else out + jnp.repeat(w.m[p, :, c], BLOCK, axis=-1)


def _column(w: QuantizedMatrix, p: jax.Array, c: jax.Array) -> jax.Array:
    """The bytes of column c of panels p, [..., K] in k order."""
    if w.dot == "exact":
        return w.q[p, :, c]
    P, K, C = w.q.shape
    return w.q.reshape(P, K // 4, C, 4)[p, :, c, :].reshape(*p.shape, K)


def params_for_dot(tree, dot: str):
    """Every QuantizedMatrix in a pytree (Params) in `dot`'s layout (to_dot); other leaves as they are."""
    is_matrix = lambda a: isinstance(a, QuantizedMatrix)  # noqa: E731
    return jax.tree.map(lambda a: to_dot(a, dot) if is_matrix(a) else a, tree, is_leaf=is_matrix)


UNEMBED_FORMAT = "q8_0"  # the unembedding under every format (see params.py)


def abstract(K: int, N: int, fmt: str, dot: str = "exact") -> QuantizedMatrix:
    """ShapeDtypeStructs of a [K, N] matrix in fmt (compiling programs before the weights load)."""
    sds = jax.ShapeDtypeStruct
    q = sds((N // PANEL, K, PANEL), jnp.int8) if fmt == "q8_0" else sds((N // PANEL, K, PANEL // 2), jnp.uint8)
    scales = sds((N // PANEL, K // BLOCK, PANEL), jnp.float32)
    return QuantizedMatrix(q=q, d=scales, m=scales if fmt == "q4_1" else None, fmt=fmt, dot=dot)
