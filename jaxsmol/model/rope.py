"""Rotary position embedding, in the Hugging Face Llama layout (rotate the two halves of a head)."""

import jax
import jax.numpy as jnp


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """positions [T] (or [B, T]) int32 -> (sin, cos), each [T, H] (or [B, T, H]) float32."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))  # [H/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., T, H/2]
    # The barrier keeps the tables computed once: without it XLA:CPU fuses sin and cos into each of
    # the 2 L uses of the tables (q and k of every layer), and recomputed them there: 2.7% of a
    # 512-row chunk's time went to sincosf (perf), which took 1.04-1.08x the time of this.
    sin, cos = jax.lax.optimization_barrier((jnp.sin(angles), jnp.cos(angles)))
    return jnp.concatenate([sin, sin], axis=-1), jnp.concatenate([cos, cos], axis=-1)  # [..., T, H]


def apply_rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """x [B, T, heads, H]; sin, cos [T, H], or [B, T, H] (a position per row)."""
    if sin.ndim == 2:
        sin, cos = sin[None], cos[None]
    sin, cos = sin.astype(x.dtype), cos.astype(x.dtype)  # as HF does: bfloat16 q, k stay bfloat16
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
