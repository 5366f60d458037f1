"""The pure forward pass: (params, tokens, length, kv) -> (logits, kv).

Shape legend: B batch, T tokens in this call (a padded bucket), S cache slots, L layers, D model
dim, N query heads, K kv heads, G = N // K query heads per kv head, H head dim, F MLP dim, V vocab,
C keys per attention block.

Attention reads the cache in blocks of C slots and stops after the last block that holds a position
in use (a `fori_loop` with a traced trip count), so a decode step costs O(pos), not O(S).
Block boundaries are absolute slot indices, so a row's attention is computed the same way whatever
chunk it arrives in: extra, fully masked blocks leave the running softmax bit-for-bit unchanged
(the max is unchanged, exp(0) = 1, and the masked probabilities are exactly 0).

Dtypes: the matrix products run in the weights' dtype (float32 or bfloat16) and the cache holds that
dtype too, while the residual stream, RoPE, the softmax and the logits are float32 whatever the weights
(so the residual stream keeps one dtype, and bfloat16 loses precision only where it saves memory).
With float32 weights every cast is a no-op.

With `cfg.cpu_kernels` (one CPU device; the Engine sets it), attention and every matmul run C++
kernels instead (cpu_kernels.py), and the RMS norm sums in a fixed order; the functions below are then
the reference they are tested against, and what device meshes run. The kernels compute in float32
(activations and cache) whatever the matrices' dtype: bfloat16 matrices are widened as they load.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxsmol.model.config import Config
from jaxsmol.model.kv import KVCache
from jaxsmol.model.params import LayerParams, Params
from jaxsmol.model.rope import apply_rope, rope_tables
from jaxsmol.kernels import cpu_copies, cpu_kernels
from jaxsmol.kernels.formats import QuantizedMatrix, columns, dequantize

ATTN_BLOCK = 256  # C; every cache capacity is a multiple of it
LAYER_UNROLL = 1  # layers per loop iteration in the compiled forward (see `forward`)
NEG_INF = -1e30  # a large finite negative: masked scores give exp(.) == 0 and never NaN


def rms_norm(x: jax.Array, w: jax.Array, eps: float, in_order: bool = False) -> jax.Array:
    """x [..., D] normalized by its root mean square, times w [D]. in_order (with the CPU kernels):
    the sum of squares in a fixed order, so a row's bits do not depend on how many rows there are."""
    x32 = x.astype(jnp.float32)
    mean_square = _mean_square_in_order(x32) if in_order else jnp.mean(x32 * x32, axis=-1, keepdims=True)
    return (x32 * lax.rsqrt(mean_square + eps)).astype(x.dtype) * w


def _mean_square_in_order(x: jax.Array) -> jax.Array:
    """mean(x * x) over the last axis [..., D] -> [..., 1], summed in a fixed tree: D as [D / 16, 16]
    lanes, the first axis folded in half until one row is left, then the lanes the same way. XLA:CPU
    tiles a reduction differently for different row counts (measured: D = 64, rows of a 32-row chunk
    differ from the same rows in a 64-row one); elementwise adds it does not reorder. A tree, not a
    running sum over the D / 16 steps: ~15 traced ops a norm instead of ~80, which halved the time
    to trace and lower the real model's forward (61 norms)."""
    *lead, D = x.shape
    lanes = 16 if D % 16 == 0 else 1
    sq = (x * x).reshape(*lead, D // lanes, lanes)
    return _fold(_fold(sq, x.ndim - 1), x.ndim).reshape(*lead, 1) / D


def _fold(a: jax.Array, axis: int) -> jax.Array:
    """Sums `axis` to length 1 by halves: a[:h] + a[h:2h], an odd length's last element added to the first."""
    while (n := a.shape[axis]) > 1:
        half = n // 2
        folded = lax.slice_in_dim(a, 0, half, axis=axis) + lax.slice_in_dim(a, half, 2 * half, axis=axis)
        if n % 2:
            first = lax.slice_in_dim(folded, 0, 1, axis=axis) + lax.slice_in_dim(a, n - 1, n, axis=axis)
            folded = lax.concatenate([first, lax.slice_in_dim(folded, 1, half, axis=axis)], axis)
        a = folded
    return a


def linear(x: jax.Array, w: jax.Array, cfg: Config, out_dtype=None, layer: jax.Array | None = None) -> jax.Array:
    """x [..., Din] @ w [Din, Dout] -> [..., Dout]: through the C++ matmul when cfg.cpu_kernels (its
    rows' bits do not depend on the row count: see cpu_kernels.py; w then comes packed,
    [Dout / 32, Din, 32]), XLA's dot otherwise. w may be a QuantizedMatrix (cfg.quant) on either path.
    With `layer`, w is stacked over the layers ([L, ...]) and layer `layer` is the one multiplied: the
    kernels read it in place, XLA's path slices it out."""
    quantized = isinstance(w, QuantizedMatrix)
    if cfg.cpu_kernels:
        if not (quantized or w.ndim == 3 + (layer is not None)):
            raise ValueError("cfg.cpu_kernels needs its params packed: cpu_kernels.pack_params(params)")
        return cpu_kernels.matmul(x, w, layer=layer)  # a quantized matrix: dequantized in registers, same bits
    if layer is not None:
        w = _layer_of(w, layer)
    if quantized:  # XLA's path (no kernels, GPU, TPU): the same float32 values, made inside the program
        w = cpu_kernels.unpack(dequantize(w))
    return jnp.einsum("...d,dn->...n", x, w, preferred_element_type=out_dtype)


def _layer_of(stacked, layer: jax.Array):
    """Layer `layer` of a stacked array (or QuantizedMatrix) [L, ...] -> [...]."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, layer, keepdims=False), stacked)


def attend(q: jax.Array, k_all: jax.Array, v_all: jax.Array, layer: jax.Array, pos: jax.Array,
           cfg: Config, as_steps: bool = False, rows: jax.Array | None = None) -> jax.Array:
    """Causal attention of q [B, T, K, G, H] over layer `layer` of the cache (query row b over cache
    row rows[b]; None: row b): the C++ kernel when cfg.cpu_kernels (as_steps: each row with a decode
    step's bits), `attention` (XLA) otherwise."""
    if cfg.cpu_kernels and cpu_kernels.attention_applies(q, k_all):
        return cpu_kernels.attention(q, k_all, v_all, layer, pos, as_steps=as_steps, rows=rows)
    return attention(q, k_all, v_all, layer, pos, rows)


ATTN_TILE = 64  # queries are processed in tiles of this many rows (see `attention`)


def attention(q: jax.Array, k_all: jax.Array, v_all: jax.Array, layer: jax.Array, pos: jax.Array,
              rows: jax.Array | None = None) -> jax.Array:
    """Causal attention of the chunk's queries over the cache of one layer, in 64-row query tiles.

    q [B, T, K, G, H] (already scaled, RoPE applied), at positions pos..pos+T-1;
    k_all, v_all [L, R, K, S, H], the chunk's own keys already written; query row b reads cache row
    rows[b] (None: row b, R == B). Returns [B, T, K, G, H].

    Why tiles: XLA:CPU fuses the running-softmax update differently for different T (measured:
    exp(m - max(m, s)) over [1, 9, 1, T] differs in the last bit between T=64 and T=512), so a row's
    result would depend on the chunk it arrived in. Every tile runs the same compiled program, so a
    row gets the same bits whatever chunk length and offset carried it.
    """
    B, T, K, G, H = q.shape
    if T <= ATTN_TILE or T % ATTN_TILE:  # decode steps, and odd lengths outside the engine's buckets
        return _attention_tile(q, k_all, v_all, layer, pos, rows)
    n = T // ATTN_TILE
    tiles = q.reshape(B, n, ATTN_TILE, K, G, H).transpose(1, 0, 2, 3, 4, 5)  # [n, B, tile, K, G, H]
    out = lax.map(lambda a: _attention_tile(a[0], k_all, v_all, layer, pos + a[1] * ATTN_TILE, rows),
                  (tiles, jnp.arange(n)))
    return out.transpose(1, 0, 2, 3, 4, 5).reshape(B, T, K, G, H)


def _key_block(cache: jax.Array, layer: jax.Array, i: jax.Array, B: int, rows: jax.Array | None) -> jax.Array:
    """Slots [i C, (i + 1) C) of layer `layer` of cache [L, R, K, S, H] for each query row: [B, K, C, H]
    (rows None: cache rows 0..B-1, batch-major for the matmuls, no copy; else cache row rows[b])."""
    _, _, K, _, H = cache.shape
    if rows is None:
        return lax.dynamic_slice(cache, (layer, 0, 0, i * ATTN_BLOCK, 0), (1, B, K, ATTN_BLOCK, H))[0]
    return jax.vmap(lambda r: lax.dynamic_slice(cache, (layer, r, 0, i * ATTN_BLOCK, 0),
                                                (1, 1, K, ATTN_BLOCK, H))[0, 0])(rows)


def _attention_tile(q: jax.Array, k_all: jax.Array, v_all: jax.Array, layer: jax.Array, pos: jax.Array,
                    rows: jax.Array | None = None) -> jax.Array:
    """Attention for q [B, T, K, G, H] at positions pos..pos+T-1 over key blocks 0..last in use."""
    B, T, K, G, H = q.shape
    q_pos = pos[..., None] + jnp.arange(T)  # [T], or [B, T] when each row has its own position
    n_blocks = (jnp.max(pos) + T + ATTN_BLOCK - 1) // ATTN_BLOCK  # blocks holding positions <= the last query

    def block(i, carry):
        m, denom, acc = carry  # [B, K, G, T], [B, K, G, T], [B, K, G, T, H]
        kb = _key_block(k_all, layer, i, B, rows)  # [B, K, C, H]
        vb = _key_block(v_all, layer, i, B, rows)
        s = jnp.einsum("btkgh,bkch->bkgtc", q, kb)  # [B, K, G, T, C]
        k_pos = i * ATTN_BLOCK + jnp.arange(ATTN_BLOCK)  # [C]
        visible = k_pos <= q_pos[..., None]  # [T, C] or [B, T, C]
        s = jnp.where(visible if visible.ndim == 2 else visible[:, None, None], s, NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=-1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        denom = denom * correction + p.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("bkgtc,bkch->bkgth", p, vb)
        return m_new, denom, acc

    init = (jnp.full((B, K, G, T), NEG_INF, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32),
            jnp.zeros((B, K, G, T, H), jnp.float32))
    _, denom, acc = lax.fori_loop(0, n_blocks, block, init)
    out = acc / denom[..., None]  # [B, K, G, T, H]
    return out.transpose(0, 3, 1, 2, 4).astype(q.dtype)  # [B, T, K, G, H]


def _write(cache: jax.Array, new: jax.Array, layer: jax.Array, pos: jax.Array,
           rows: jax.Array | None = None, kernels: bool = False) -> jax.Array:
    """cache [L, R, K, S, H] with new [B, T, K, H] written at layer `layer`, slots pos.. (per row if pos
    is [B]), row b of new into cache row rows[b] (None: row b). A bfloat16 cache with the kernels: by
    cpu_copies.write_rows (XLA:CPU widens a bfloat16 update-slice, the whole cache, at every layer)."""
    if kernels and cache.dtype == jnp.bfloat16:
        at = jnp.arange(new.shape[0], dtype=jnp.int32) if rows is None else rows
        return cpu_copies.write_rows(cache, new, layer, jnp.broadcast_to(pos, (new.shape[0],)), at)
    new = new.transpose(0, 2, 1, 3)  # [B, K, T, H]
    if pos.ndim == 0 and rows is None:
        return lax.dynamic_update_slice(cache, new[None], (layer, 0, 0, pos, 0))
    pos = jnp.broadcast_to(pos, (new.shape[0],))
    at = jnp.arange(new.shape[0], dtype=jnp.int32) if rows is None else rows

    def row(b, c):  # one in-place slice per row: a scatter would copy the whole cache on XLA:CPU
        return lax.dynamic_update_slice(c, lax.dynamic_index_in_dim(new, b)[None], (layer, at[b], 0, pos[b], 0))
    return lax.fori_loop(0, new.shape[0], row, cache)


def decoder_layer(w: LayerParams, x: jax.Array, k_all: jax.Array, v_all: jax.Array, layer: jax.Array, pos: jax.Array,
                  sin: jax.Array, cos: jax.Array, cfg: Config, dt, as_steps: bool = False,
                  rows: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Decoder layer `layer` (an int32 scalar, traced: one compiled body serves every layer): x [B, T, D]
    float32 (the residual stream) with its keys/values written into k_all, v_all [L, B, K, S, H] at
    slots pos.. -> (x, k_all, v_all); w: every layer's weights, stacked; dt: the matrix products' inputs;
    as_steps: attention computes each row as a decode step would (see `forward`); rows: see `forward`."""
    B, T, _ = x.shape
    K, G, H = cfg.n_kv_heads, cfg.q_per_kv, cfg.head_dim
    mm = lambda a, m, out_dtype=None: linear(a, m, cfg, out_dtype, layer)  # noqa: E731
    h = rms_norm(x, _layer_of(w.attn_norm, layer), cfg.rms_norm_eps, cfg.cpu_kernels).astype(dt)
    # q's and k's heads rotated together, in one tensor that attention and the cache write both read:
    # XLA:CPU then computes the rotation once, as its own loop, whatever the batch. (k's rotation
    # alone was fused into a lone chunk's cache write and compiled otherwise than a batch's: a
    # prompt prefilled beside others got keys differing from its lone chunk's in the last bits.)
    if w.wqkv is not None:  # the kernels' layout: one product (see LayerParams)
        qkv = mm(h, w.wqkv).reshape(B, T, K * G + 2 * K, H)
        qk, v = qkv[:, :, :K * G + K], qkv[:, :, K * G + K:]
    else:
        qk = jnp.concatenate([mm(h, w.wq).reshape(B, T, K * G, H), mm(h, w.wk).reshape(B, T, K, H)], axis=2)
        v = mm(h, w.wv).reshape(B, T, K, H)
    qk = apply_rope(qk, sin, cos)  # [B, T, K * G + K, H]
    q, k = qk[:, :, :K * G] * (H ** -0.5), qk[:, :, K * G:]
    k_all = _write(k_all, k.astype(k_all.dtype), layer, pos, rows, cfg.cpu_kernels)
    v_all = _write(v_all, v.astype(v_all.dtype), layer, pos, rows, cfg.cpu_kernels)
    a = attend(q.reshape(B, T, K, G, H), k_all, v_all, layer, pos, cfg, as_steps, rows).reshape(B, T, K * G * H)
    x = x + mm(a.astype(dt), w.wo, jnp.float32)
    h = rms_norm(x, _layer_of(w.mlp_norm, layer), cfg.rms_norm_eps, cfg.cpu_kernels).astype(dt)
    if w.w_gate_up is not None:
        gate, up = jnp.split(mm(h, w.w_gate_up), 2, axis=-1)  # [B, T, F] each
    else:
        gate, up = mm(h, w.w_gate), mm(h, w.w_up)  # [B, T, F] each
    x = x + mm(jax.nn.silu(gate) * up, w.w_down, jnp.float32)
    return x, k_all, v_all


def embed(table, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] -> their rows of the embedding table, float32 [B, T, D]: a float table [V, D], or
    a quantized tied model's unembedding, read by column."""
    if isinstance(table, QuantizedMatrix):
        return columns(table, tokens)
    return table[tokens].astype(jnp.float32)


def _last_real(x: jax.Array, length: jax.Array) -> jax.Array:
    """x [B, T, D] -> [B, D]: row length - 1 of every sequence (length a scalar, or [B])."""
    if length.ndim == 0:
        return lax.dynamic_index_in_dim(x, length - 1, axis=1, keepdims=False)
    return jnp.take_along_axis(x, (length - 1)[:, None, None], axis=1)[:, 0]


def forward(params: Params, tokens: jax.Array, length: jax.Array, kv: KVCache, cfg: Config,
            all_logits: bool = False, as_steps: bool = False,
            rows: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """Run `tokens` [B, T] (the first `length` are real, the rest padding) at positions kv.pos...

    kv.pos is a scalar (every row at the same position: one sequence, or a prompt's forks) or a
    vector [B] (each row its own sequence at its own position: batched decoding and prompts
    prefilled side by side, see batch.py); so is `length` (a vector: each row's own real tokens).
    Writes their keys/values into the cache with `dynamic_update_slice` and returns
    (logits, new kv with pos + length). Logits are [B, V] for the last real token, or
    [B, T, V] for every row when `all_logits`. Requires kv.pos + T <= S (the caller sizes S).
    as_steps (the CPU kernels): every row gets the bits a one-token decode step at its position would
    (a speculative step's drafted rows; a prompt chunk's rows are otherwise the chunk's).
    rows [B] int32: the cache's rows the token rows go to (kv.k [L, R, K, S, H], kv.pos [B] the
    positions of those rows: the KV arena, jaxsmol/runtime/kv_arena.py); None: row b is cache row b.
    """
    B, T = tokens.shape
    pos = kv.pos
    dt = params.compute_dtype  # the matrix products' inputs (see the module docstring)
    sin, cos = rope_tables(pos[..., None] + jnp.arange(T), cfg.head_dim, cfg.rope_theta)  # [T, H] or [B, T, H]
    x = embed(params.embed, tokens)  # [B, T, D], the residual stream
    # One compiled layer in a loop over the layer index, not L unrolled copies: a program is then
    # ~1/L the size and compile time (docs/design.md, "One layer, looped"). The kernels read layer i
    # of the stacked weights and cache in place, so the loop copies no weight.
    def layer(i, carry):
        return decoder_layer(params.layers, *carry, i, pos, sin, cos, cfg, dt, as_steps, rows)

    x, k_all, v_all = lax.fori_loop(0, cfg.n_layers, layer, (x, kv.k, kv.v), unroll=LAYER_UNROLL)
    if not all_logits:  # only the last real row is needed: skip the V x D product for the others
        x = _last_real(x, length)  # [B, D]
    x = rms_norm(x, params.final_norm, cfg.rms_norm_eps, cfg.cpu_kernels).astype(dt)
    logits = linear(x, params.unembed, cfg, jnp.float32)  # [B, V] or [B, T, V]
    return logits, KVCache(k=k_all, v=v_all, pos=pos + length.astype(jnp.int32))
