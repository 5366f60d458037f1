"""Token sampling: greedy, temperature, top-k and top-p, all traced so one compile serves every setting.

A request's randomness is `fold_in(key(seed), step)`: the same seed gives the same tokens, and a
token does not depend on how many other requests ran before it.

A temperature below MIN_TEMPERATURE is greedy (as in vLLM): logits / 2e-38 overflow float32 to inf,
and sampling from infinities is garbage; at 1e-5 the scaled logits stay far inside float32's range
(|logits| < 1e4 gives < 1e9), and a distribution that sharp is the argmax anyway.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxsmol.errors import JaxsmolError

MIN_TEMPERATURE = 1e-5  # below it, sampling is greedy (see the module docstring)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 (or anything below MIN_TEMPERATURE) means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0  # 1 means off
    seed: int = 0
    stop_ids: tuple[int, ...] = ()  # generation ends after emitting one of these (EOS is added by the engine)
    stop_strings: tuple[str, ...] = ()
    logprobs: int = 0  # top-K log-probabilities to report per generated position
    ignore_eos: bool = False  # keep going past end-of-sequence tokens (benchmarks; as vLLM's ignore_eos)
    # structured output: the canonical JSON of a spec (jaxsmol.structured.canonical_spec), None = free text
    structured: str | None = None

    def __post_init__(self):
        checks = [
            (self.max_tokens >= 0, f"max_tokens must be >= 0, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 <= self.top_k < 2**31, f"top_k must be in [0, 2^31), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (0 <= self.seed < 2**63, f"seed must be a non-negative integer, got {self.seed}"),
            (self.structured is None or isinstance(self.structured, str),
             "structured must be None or a canonical spec string (jaxsmol.structured.canonical_spec)"),
        ]
        for ok, message in checks:
            if not ok:
                raise JaxsmolError(message)


def seed_key(seed: int) -> jax.Array:
    """A PRNG key using all 63 bits of `seed` (jax.random.key alone keeps only 32 without x64)."""
    return jax.random.fold_in(jax.random.key(seed & 0xFFFFFFFF), seed >> 32)


# What a disallowed id's logit becomes: large but finite, so a row with nothing allowed still yields an
# id (not NaN); after any temperature it stays far below every allowed logit.
MASKED_LOGIT = -1e30


def unpack_bitmask(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """Packed bitmask [B, W] int32 -> allowed [B, vocab_size] bool: bit j of word w allows id 32*w + j.

    Ids past 32*W are not allowed (W may be shorter than the model's vocabulary)."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    allowed = bits.reshape(bitmask.shape[0], -1).astype(bool)[:, :vocab_size]
    return jnp.pad(allowed, ((0, 0), (0, vocab_size - allowed.shape[1])))


def sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array, allowed: jax.Array | None = None) -> jax.Array:
    """logits [B, V] float32 -> token ids [B] int32. Scalars are traced (no recompiles per setting).

    `allowed` (structured output): None, or a packed bitmask [B, W] int32 (see unpack_bitmask, the
    layout llguidance fills); ids it leaves out get MASKED_LOGIT before greedy, temperature, top-k and
    top-p, so every decoding mode respects it. None vs an array is the argument's pytree structure, so
    jit keeps the unconstrained program unchanged and compiles one more for masked sampling.

    `lax.cond` runs only the branch taken, so greedy decoding costs an argmax, and plain
    temperature sampling skips the sort that top-k / top-p need (a full sort of 49,152 logits
    takes ~12 ms on these cores, a third of a decode step).
    """
    if allowed is not None:  # static: pytree structure, not a traced value
        logits = jnp.where(unpack_bitmask(allowed, logits.shape[-1]), logits, MASKED_LOGIT)

    def greedy(_):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        scaled = logits / temperature
        filtered = lax.cond((top_k > 0) | (top_p < 1), _top_k_top_p, lambda a: a[0], (scaled, top_k, top_p))
        return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)

    return lax.cond(temperature >= MIN_TEMPERATURE, draw, greedy, None)


def _top_k_top_p(args) -> jax.Array:
    """Mask to -inf the logits [B, V] outside the top-k and outside the top-p nucleus."""
    scaled, top_k, top_p = args
    V = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # [B, V]
    # top-k: keep logits >= the k-th largest (k = V when off)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(sorted_desc, jnp.full(scaled.shape[:-1] + (1,), k - 1), axis=-1)
    # top-p: keep the smallest prefix of the sorted distribution whose mass reaches top_p
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.maximum(jnp.sum(mass_before < top_p, axis=-1, keepdims=True), 1)
    pth = jnp.take_along_axis(sorted_desc, n_keep - 1, axis=-1)
    return jnp.where((scaled >= kth) & (scaled >= pth), scaled, -jnp.inf)


def top_logprobs(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """logits [B, V] -> (ids [B, k], log-probabilities [B, k]) of the k most likely tokens."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    values, ids = jax.lax.top_k(logp, k)
    return ids, values


GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (logits / 1e-38 would overflow)


def sample_rows(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                seed_lo: jax.Array, seed_hi: jax.Array, step: jax.Array, allowed: jax.Array) -> jax.Array:
    """Each row with its own settings: logits [W, V] -> token ids [W] int32.

    temperature, top_p [W] float32; top_k, step [W] int32; seed_lo, seed_hi [W] uint32 (a 63-bit seed
    split in two); allowed [W, ceil(V / 32)] int32, a packed bitmask as `sample` takes (all ones for a
    row without structured output). Row i draws with `fold_in(seed_key(seed_i), step_i)`, the key
    `Generation` uses, so a seed gives the same tokens alone or in a batch (given the same logits).
    The sort that top-k / top-p need runs only when some row asks for it; greedy rows cost an argmax.
    """
    logits = jnp.where(unpack_bitmask(allowed, logits.shape[-1]), logits, MASKED_LOGIT)
    greedy_rows = temperature < GREEDY_BELOW
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        scaled = logits / jnp.where(greedy_rows, 1.0, temperature)[:, None]
        needs_sort = jnp.any(~greedy_rows & ((top_k > 0) | (top_p < 1)))
        filtered = lax.cond(needs_sort, _top_k_top_p, lambda a: a[0], (scaled, top_k[:, None], top_p[:, None]))
        keys = jax.vmap(lambda lo, hi, i: jax.random.fold_in(
            jax.random.fold_in(jax.random.key(lo), hi), i))(seed_lo, seed_hi, step)
        return jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)

    drawn = lax.cond(jnp.all(greedy_rows), lambda _: greedy, draw, None)
    return jnp.where(greedy_rows, greedy, drawn)


def split_seed(seed: int) -> tuple[int, int]:
    """A 63-bit seed as the (low, high) uint32 halves `sample_rows` takes."""
    return seed & 0xFFFFFFFF, seed >> 32
