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
    # structured output: the canonical JSON of a spec (jaxsmol.runtime.structured.canonical_spec), None = free text
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
             "structured must be None or a canonical spec string (jaxsmol.runtime.structured.canonical_spec)"),
        ]
        for ok, message in checks:
            if not ok:
                raise JaxsmolError(message)


# What a disallowed id's logit becomes: large but finite, so a row with nothing allowed still yields an
# id (not NaN); after any temperature it stays far below every allowed logit.
MASKED_LOGIT = -1e30


def unpack_bitmask(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """Packed bitmask [B, W] int32 -> allowed [B, vocab_size] bool: bit j of word w allows id 32*w + j.

    Ids past 32*W are not allowed (W may be shorter than the model's vocabulary)."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    allowed = bits.reshape(bitmask.shape[0], -1).astype(bool)[:, :vocab_size]
    return jnp.pad(allowed, ((0, 0), (0, vocab_size - allowed.shape[1])))


DRAW_BLOCK = 256  # ids per block of _draw's two-level CDF


def _draw(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, uniform: jax.Array) -> jax.Array:
    """Inverse-CDF sampling: scaled logits [B, V], top_k [B] int32, top_p [B], uniform [B] in [0, 1) -> ids [B].

    One uniform per row, where Gumbel-max (`jax.random.categorical`) draws V: threefry over 8 x 49,152
    logits took 12 ms a step, this ~0.5 ms. Every float op is elementwise, a max, or `lax.cumsum` (an
    associative scan of elementwise adds off TPU), so a row's draw does not depend on the other rows.
    """
    weights = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))  # [B, V], the largest is 1
    filtered = lax.cond(jnp.any((top_k > 0) | (top_p < 1)), _top_k_top_p, lambda a: a[0],
                        (weights, scaled, top_k, top_p))
    return _first_reaching(filtered, 1 - uniform)


def _first_reaching(weights: jax.Array, share: jax.Array) -> jax.Array:
    """weights [B, V] >= 0, share [B] in (0, 1] -> the first id [B] whose running weight reaches share x
    the row's total: always one of positive weight. The running weight in two levels: each DRAW_BLOCK
    ids' sum (a fixed tree of pairwise adds), the blocks' running sum, then the running sum inside the
    one block the point falls in (a running sum over the whole vocabulary took 1.3 ms for 8 rows)."""
    B, V = weights.shape
    NB = -(-V // DRAW_BLOCK)
    blocks = jnp.pad(weights, ((0, 0), (0, NB * DRAW_BLOCK - V))).reshape(B, NB, DRAW_BLOCK)
    sums = blocks
    while sums.shape[-1] > 1:  # pairwise, in a fixed order
        sums = sums[..., 0::2] + sums[..., 1::2]
    block_cdf = lax.cumsum(sums[..., 0], axis=1)  # [B, NB]
    point = share * block_cdf[:, -1]  # in (0, total]
    j = jnp.minimum(jnp.sum(block_cdf < point[:, None], axis=-1), NB - 1)  # the first block reaching it
    base = jnp.where(j > 0, jnp.take_along_axis(block_cdf, jnp.maximum(j - 1, 0)[:, None], axis=1)[:, 0], 0)
    inner = jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0]  # [B, DRAW_BLOCK], a positive sum
    cdf = base[:, None] + lax.cumsum(inner, axis=1)
    ids = lax.broadcasted_iota(jnp.int32, inner.shape, 1)
    last = jnp.max(jnp.where(inner > 0, ids, 0), axis=-1)  # where rounding leaves the point past the block
    return (j * DRAW_BLOCK + jnp.minimum(jnp.sum(cdf < point[:, None], axis=-1), last)).astype(jnp.int32)


def _order_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 whose unsigned order is the floats' order (so bisection can work on integers)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


CANDIDATES = 128  # the largest logits a row's top-k / top-p look at before searching the whole vocabulary


def _top_k_top_p(args) -> jax.Array:
    """Zero the weights [B, V] outside the top-k and outside the top-p nucleus.

    The nucleus keeps id j when the mass of ids with larger logits is below top_p: the smallest set of
    largest logits whose mass reaches top_p, ties at its edge included. Both use the full
    distribution's mass, so top-k and top-p combine as an intersection.

    Both thresholds come from a row's CANDIDATES largest logits (`lax.top_k`, ~1 ms for 8 x 49,152)
    where they lie among them: top_k <= CANDIDATES, or a nucleus that ends inside them (or a top-k
    inside them cuts it first). A row whose threshold lies beyond them is searched over the whole
    vocabulary by bisection over the logits' order keys, 32 fixed steps of a count or a masked sum
    (~7 ms for 8 rows; a sort of 8 x 49,152 logits took 130 ms). Which way a row takes depends on its
    own logits and settings only, so its draw does not depend on its neighbours.
    """
    weights, scaled, top_k, top_p = args
    V = scaled.shape[-1]
    keys = _order_keys(scaled)  # [B, V]
    lo, hi = jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)  # [B]
    # top_p at least float32's smallest normal: a top_p that is positive as a Python float but rounds to 0
    # (5e-324) would keep no id at all, and the draw would fall on id 0 whatever the mask allows
    mass = jnp.maximum(top_p, jnp.finfo(jnp.float32).tiny) * jnp.sum(weights, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)

    C = min(CANDIDATES, V)
    values, ids = lax.top_k(scaled, C)  # [B, C], largest first
    ckeys, cweights = _order_keys(values), jnp.take_along_axis(weights, ids, axis=1)
    above = jnp.sum(jnp.where(ckeys[:, None, :] > ckeys[:, :, None], cweights[:, None, :], 0), axis=-1)  # [B, C]
    inside = above < mass[:, None]  # candidate i is in the nucleus; true for a prefix of the candidates
    k_inside = k <= C
    kth_c = jnp.take_along_axis(ckeys, jnp.clip(k - 1, 0, C - 1)[:, None], axis=1)[:, 0]
    nucleus_c = jnp.min(jnp.where(inside, ckeys, jnp.uint32(0xFFFFFFFF)), axis=-1)
    # the nucleus may go on past the candidates only where every candidate is in it and no top-k cuts it
    nucleus_beyond = (top_p < 1) & inside[:, -1] & ~((top_k > 0) & k_inside) & (C < V)

    def kth_step(_, bounds):  # invariant: at least k keys >= lo
        lo, hi = bounds
        mid = hi - (hi - lo) // 2
        ok = jnp.sum(keys >= mid[:, None], axis=-1) >= k
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    def nucleus_step(_, bounds):  # invariant: the weight above hi is below top_p's mass
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = jnp.sum(jnp.where(keys > mid[:, None], weights, 0), axis=-1) < mass
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    def search(step, wanted):  # only when some row needs it; rows that do not keep lo
        found = lax.cond(jnp.any(wanted), lambda: lax.fori_loop(0, 32, step, (lo, hi))[0], lambda: lo)
        return jnp.where(wanted, found, lo)

    kth = jnp.where(top_k == 0, lo, jnp.where(k_inside, kth_c, search(kth_step, (top_k > 0) & ~k_inside)))
    nucleus = jnp.where(top_p >= 1, lo, jnp.where(nucleus_beyond, search(nucleus_step, nucleus_beyond), nucleus_c))
    keep = (keys >= kth[:, None]) & (keys >= nucleus[:, None])
    return jnp.where(keep, weights, 0)


def _argmax(x: jax.Array) -> jax.Array:
    """[B, V] -> [B] int32, as jnp.argmax (the first largest, a NaN counting as largest) in two plain
    reductions: XLA:CPU's arg-reduction over 8 x 49,152 logits took 1.3 ms, this 0.5 ms."""
    first = jnp.where((x == jnp.max(x, axis=-1, keepdims=True)) | jnp.isnan(x),
                      lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1), x.shape[-1])
    return jnp.min(first, axis=-1)


def top_logprobs(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """logits [B, V] -> (ids [B, k], log-probabilities [B, k]) of the k most likely tokens."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    values, ids = jax.lax.top_k(logp, k)
    return ids, values


def sample_rows(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                seed_lo: jax.Array, seed_hi: jax.Array, step: jax.Array, allowed: jax.Array) -> jax.Array:
    """Each row with its own settings: logits [W, V] -> token ids [W] int32.

    temperature, top_p [W] float32; top_k, step [W] int32; seed_lo, seed_hi [W] uint32 (a 63-bit seed
    split in two); allowed [W, ceil(V / 32)] int32, a packed bitmask (see unpack_bitmask, the layout
    llguidance fills; all ones for a row without structured output): the ids it leaves out get
    MASKED_LOGIT before greedy, temperature, top-k and top-p. Row i draws with
    `fold_in(fold_in(key(lo_i), hi_i), step_i)`: its seed's 63 bits and its step alone, so a seed gives
    the same tokens alone or in a batch (given the same logits).
    The top-k / top-p search runs only when some row asks for it; greedy rows cost an argmax.
    """
    # unpacked even when every bit is set: a lax.cond skipping an all-ones mask made the daemon's 8-client
    # decode ~6% slower (the unpack fuses into its consumers; the cond's branch does not)
    logits = jnp.where(unpack_bitmask(allowed, logits.shape[-1]), logits, MASKED_LOGIT)
    greedy_rows = temperature < MIN_TEMPERATURE
    greedy = _argmax(logits)

    def draw(_):
        scaled = logits / jnp.where(greedy_rows, 1.0, temperature)[:, None]
        keys = jax.vmap(lambda lo, hi, i: jax.random.fold_in(
            jax.random.fold_in(jax.random.key(lo), hi), i))(seed_lo, seed_hi, step)
        uniform = jax.vmap(lambda key: jax.random.uniform(key, (1,))[0])(keys)
        # greedy rows ask for no filter, so the filter runs only when a sampling row needs it
        return _draw(scaled, jnp.where(greedy_rows, 0, top_k), jnp.where(greedy_rows, 1.0, top_p), uniform)

    drawn = lax.cond(jnp.all(greedy_rows), lambda _: greedy, draw, None)
    return jnp.where(greedy_rows, greedy, drawn)


def split_seed(seed: int) -> tuple[int, int]:
    """A 63-bit seed as the (low, high) uint32 halves `sample_rows` takes."""
    return seed & 0xFFFFFFFF, seed >> 32
