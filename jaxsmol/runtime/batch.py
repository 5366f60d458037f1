"""The programs over rows of the KV arena (runtime/kv_arena.py): the single-sequence forward, run on the
rows a call names.

The arena is a `KVCache` whose k, v are [L, R, K, S, H]: R rows of S = the context's slots each, one
sequence a row. Every function here takes it (donated by the caller, updated in place) with `rows` [B]
(the arena rows this call's token rows go to) and `kv.pos` [B] (their positions), and is the one pure
forward (model.forward with `rows`), so nothing about the model is written twice:

- `prefill_rows`: a chunk of P prompts side by side (P = 1: one prompt), each into its own row;
- `decode_step`: one token of W rows, sampled in the same program;
- `verify_step`: a row's last token and its drafted tokens, each computed and sampled as a decode step
  would (speculation);
- `greedy_drafts`: a draft model's next k greedy tokens for one row;
- `sample_first`: a prompt's first token for each of its choices;
- `write_slots`, `copy_row`, `read_slots`: a staged block of a host snapshot into a row (a restore),
  a row's slots into another (a prompt's forks), a block of a row out (a snapshot saved).

Request fields are data, never shapes: each row's sampling settings, its structured-output mask and
whether it wants log-probabilities are arrays, so one program of a shape serves every request.
Log-probabilities (the chosen token's and the top TOP_LOGPROBS) are computed in a branch taken when
any row asks for them, and are zeros otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsmol.kernels import cpu_copies
from jaxsmol.model.config import Config
from jaxsmol.model.forward import ATTN_BLOCK, forward
from jaxsmol.model.kv import KVCache
from jaxsmol.model.params import Params
from jaxsmol.runtime.sampling import SamplingParams, sample_rows, split_seed, top_logprobs
from jaxsmol.runtime.structured import all_allowed

TOP_LOGPROBS = 20  # the most top log-probabilities a row may ask for (OpenAI's limit)
BLOCK = ATTN_BLOCK  # slots a restore writes or a save reads per call (the arena's S is a multiple)


def prefill_rows(params: Params, tokens: jax.Array, lengths: jax.Array, kv: KVCache, rows: jax.Array,
                 cfg: Config, all_logits: bool = False) -> tuple[jax.Array, KVCache]:
    """One prefill chunk of P prompts: tokens [P, T] (row i's first lengths[i] real) written into arena
    rows `rows` [P] at positions kv.pos [P]. Returns (logits [P, V] after each row's last real token, or
    [P, T, V] for every row with `all_logits`; kv with pos + lengths). A prompt's rows get the bits of
    its own [1, T] chunk where a row's bits do not depend on the rows beside it (the C++ kernels; XLA's
    GEMM with >= 64-row chunks): one pass over the weights serves P prompts (a burst of short prompts)."""
    return forward(params, tokens, lengths, kv, cfg, all_logits=all_logits, rows=rows)


def decode_step(params: Params, tokens: jax.Array, kv: KVCache, rows: jax.Array, sampling: dict,
                cfg: Config) -> tuple[dict, KVCache]:
    """One decode step of W rows: tokens [W] at positions kv.pos [W] of arena rows `rows` [W], sampled in
    the same program (one host round trip per step). sampling: per-row arrays (`row_settings`).
    Returns (sample_and_score's output, kv with pos + 1)."""
    logits, kv = forward(params, tokens[:, None], jnp.ones_like(kv.pos), kv, cfg, rows=rows)
    return sample_and_score(logits, sampling), kv


def verify_step(params: Params, tokens: jax.Array, lengths: jax.Array, kv: KVCache, rows: jax.Array,
                sampling: dict, cfg: Config) -> tuple[dict, KVCache]:
    """One speculative step of W rows: row w's last sampled token and its lengths[w] - 1 drafted tokens,
    tokens [W, T] (the rest padding), each position computed as a decode step would compute it
    (forward's as_steps: the CPU kernels) and sampled as that step would sample it (its own step
    number), so what is accepted is exactly what plain decoding would have produced.

    sampling: per-row arrays as `decode_step` takes them, with step [W] the row's first position's and
    "allowed" [W, T, words] per position. Row w accepts its drafts while each equals the token sampled
    before it; its pos advances by 1 + accepted (the KV written past it is overwritten later, never
    read). Returns ({"tokens" [W, T] sampled, "count" [W] how many of them are the row's new tokens,
    "logprob" [W, T], "top_ids"/"top_logprobs" [W, T, 20]}, kv)."""
    W, T = tokens.shape
    pos = kv.pos
    logits, kv = forward(params, tokens, lengths, kv, cfg, all_logits=True, as_steps=True, rows=rows)  # [W, T, V]
    # Sampled position by position, each a decode step's [W, V] computation: XLA:CPU's reductions over
    # V (log_softmax's sum) give other bits for another row count ([W T, V] against [W, V]).
    def position(t):
        at_t = {**sampling, "step": sampling["step"] + t, "allowed": sampling["allowed"][:, t]}
        return sample_and_score(logits[:, t], at_t)

    out = jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1), lax.map(position, jnp.arange(T, dtype=jnp.int32)))
    drafted = jnp.arange(1, T) < lengths[:, None]  # [W, T - 1]: position t + 1 holds a draft
    matches = (out["tokens"][:, :-1] == tokens[:, 1:]) & drafted
    out["count"] = 1 + jnp.sum(jnp.cumprod(matches, axis=1), axis=1).astype(jnp.int32)
    return out, kv.replace(pos=pos + out["count"])


def greedy_drafts(params: Params, tokens: jax.Array, length: jax.Array, kv: KVCache, rows: jax.Array, cfg: Config,
                  k: int) -> tuple[jax.Array, KVCache]:
    """A draft model's k proposed tokens for one row: tokens [1, P] (the sequence's tokens not yet in its
    row, the first `length` real) fed at kv.pos [1], then k - 1 greedy decode steps, each feeding the
    token before it. Returns (drafts [k] int32, kv with pos + length + k - 1: the drafts but the last are
    in it; the caller moves the row's position back to what the target accepted, and later steps
    overwrite the rest)."""
    logits, kv = forward(params, tokens, length[None], kv, cfg, rows=rows)

    def step(carry, _):
        token, kv = carry
        logits, kv = forward(params, token[None, None], jnp.ones((1,), jnp.int32), kv, cfg, rows=rows)
        token = jnp.argmax(logits[0]).astype(jnp.int32)
        return (token, kv), token

    first = jnp.argmax(logits[0]).astype(jnp.int32)
    (_, kv), rest = lax.scan(step, (first, kv), None, length=k - 1)
    return jnp.concatenate([first[None], rest]), kv


def sample_and_score(logits: jax.Array, sampling: dict) -> dict:
    """logits [W, V] -> {"tokens" [W], "logprob" [W], "top_ids" [W, 20], "top_logprobs" [W, 20]}: the
    log-probabilities computed when any row's sampling["logprobs"] is set, zeros otherwise."""
    settings = {k: v for k, v in sampling.items() if k != "logprobs"}
    tokens = sample_rows(logits, **settings)
    W = logits.shape[0]

    def scored(_):
        logp = jax.nn.log_softmax(logits, axis=-1)
        ids, top = top_logprobs(logits, TOP_LOGPROBS)
        return jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0], ids, top

    def unscored(_):
        return (jnp.zeros((W,), jnp.float32), jnp.zeros((W, TOP_LOGPROBS), jnp.int32),
                jnp.zeros((W, TOP_LOGPROBS), jnp.float32))

    logprob, ids, top = lax.cond(jnp.any(sampling["logprobs"]), scored, unscored, None)
    return {"tokens": tokens, "logprob": logprob, "top_ids": ids, "top_logprobs": top}


def sample_first(logits: jax.Array, sampling: dict) -> dict:
    """A prompt's first token for each of its N choices: logits [1, V] after the prompt, sampling
    per-row arrays of N rows (padding rows greedy). Returns sample_and_score's output for the N rows."""
    N = sampling["temperature"].shape[0]
    return sample_and_score(jnp.broadcast_to(logits, (N, logits.shape[-1])), sampling)


def write_slots(k: jax.Array, v: jax.Array, kb: jax.Array, vb: jax.Array, row: jax.Array, start: jax.Array,
                n: jax.Array, kernel: bool = False) -> tuple[jax.Array, jax.Array]:
    """The arena's k, v with the first n slots of a block kb, vb [L, 1, K, P, H] written into row `row`
    from slot `start` (kernel: by the CPU kernel, on both threads, the n slots alone; else XLA's
    dynamic-update-slice, the whole block: its padding is zeros)."""
    def write(cache, block):
        block = block.astype(cache.dtype)
        if kernel:
            return cpu_copies.write_slots(cache, block, row, start, n)
        return lax.dynamic_update_slice(cache, block, (0, row, 0, start, 0))

    return write(k, kb), write(v, vb)


def copy_row(k: jax.Array, v: jax.Array, source: jax.Array, dest: jax.Array, n: jax.Array,
             kernel: bool = False) -> tuple[jax.Array, jax.Array]:
    """The arena's k, v with the first n slots of row `source` copied into row `dest` (a prompt's forks);
    slots past n untouched (kernel: by the CPU kernel; else XLA's, BLOCK slots at a time)."""
    def copy(cache):
        if kernel:
            return cpu_copies.copy_row(cache, source, dest, n)
        L, _, K, _, H = cache.shape

        def block(i, c):
            part = lax.dynamic_slice(c, (0, source, 0, i * BLOCK, 0), (L, 1, K, BLOCK, H))
            return lax.dynamic_update_slice(c, part, (0, dest, 0, i * BLOCK, 0))
        return lax.fori_loop(0, (n + BLOCK - 1) // BLOCK, block, cache)

    return copy(k), copy(v)


def read_slots(k: jax.Array, v: jax.Array, row: jax.Array, start: jax.Array, n: jax.Array,
               kernel: bool = False) -> tuple[jax.Array, jax.Array]:
    """Slots start..start + BLOCK - 1 of arena row `row`: (k, v) [L, 1, K, BLOCK, H], of which the first n
    are wanted (kernel: the CPU kernel reads those alone, zeros past them; else XLA's dynamic slice)."""
    L, _, K, _, H = k.shape
    if kernel:
        return tuple(cpu_copies.read_slots(a, row, start, n, BLOCK) for a in (k, v))
    return tuple(lax.dynamic_slice(a, (0, row, 0, start, 0), (L, 1, K, BLOCK, H)) for a in (k, v))


def reserve(shape: tuple[int, ...], dtype, kernel: bool = False) -> jax.Array:
    """Zeros of `shape` for the arena: with the CPU kernel, not touched (memory only where written)."""
    return cpu_copies.reserve(shape, dtype) if kernel else jnp.zeros(shape, dtype)


@functools.cache
def free_mask(vocab_size: int, width: int) -> jax.Array:
    """The all-allowed token mask [width, ceil(V / 32)] of rows that sample freely, kept on the device."""
    return jnp.asarray(all_allowed(width, vocab_size))


def row_settings(samplings: list[SamplingParams], steps: list[int], constraints: list,
                 free_mask: np.ndarray) -> dict:
    """The per-row arrays `sample_and_score` takes, for rows with these settings at these steps.

    constraints: per row a structured-output Constraint or None; free_mask [W, ceil(V / 32)] is the
    all-allowed mask used when no row is constrained (the common case: no mask built per step)."""
    seeds = [split_seed(sp.seed) for sp in samplings]
    allowed = free_mask
    if any(c is not None for c in constraints):
        free = np.asarray(free_mask)[0]  # a row that allows every id (on the host: no program sliced it)
        allowed = np.stack([free if c is None else c.bitmask() for c in constraints])
    return {"temperature": np.array([sp.temperature for sp in samplings], np.float32),
            "top_k": np.array([sp.top_k for sp in samplings], np.int32),
            "top_p": np.array([sp.top_p for sp in samplings], np.float32),
            "seed_lo": np.array([lo for lo, _ in seeds], np.uint32),
            "seed_hi": np.array([hi for _, hi in seeds], np.uint32),
            "step": np.array(steps, np.int32), "allowed": allowed,
            "logprobs": np.array([sp.logprobs > 0 for sp in samplings], bool)}
