"""jaxsmol's core idea in one file: a pure forward over an immutable KV pytree, a dict of stored
prefixes, restore, continue, and the same bits as a run from zero.

    python examples/prefix_cache.py        # the bundled SmolLM2-135M-Instruct, on the CPU

Three frames, as in gpt-fast's generate.py: `generate` (look up, restore, prefill, decode), `prefill`
(a prompt in chunks) and the model, `programs.forward(params, tokens, length, kv, cfg) -> (logits,
kv)`: kv is a pytree of k, v [L, 1, K, S, H] and a position scalar `pos`; the forward writes the
chunk's keys and values at pos with `dynamic_update_slice` and returns a new pytree at pos + length.
The prefix cache is `stored`: prompt prefix (token ids) -> a host copy of the pytree after prefilling
the first len(prompt) - 1 tokens. The last prompt token is always computed: its logits give the
first generated token. The forward donates its cache (XLA updates it in place), so a snapshot is
copied to the host and a restore copies it back. The library's PrefixCache is this idea with a
radix tree, budgets and eviction (cache/prefix_cache.py).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxsmol import Engine, KVCache
from jaxsmol.runtime import programs
from jaxsmol.runtime.chunks import chunk_plan

engine = Engine.load(progress=False)
params, cfg, tokenizer = engine.params, engine.cfg, engine.tokenizer
EXACT = engine.buckets(exact=True)  # chunk lengths in which a row keeps the bits of any other chunking
CAPACITY = 1024  # cache slots: prompt and answer must fit

stored: dict[tuple[int, ...], KVCache] = {}  # prompt prefix -> its KV pytree, on the host


def prefill(ids: list[int], kv: KVCache) -> tuple[jax.Array, KVCache]:
    """ids through the model from kv.pos, in exact chunks (padded; `length` says how many are real)."""
    logits, start = None, 0
    for T in chunk_plan(len(ids), EXACT):
        chunk = ids[start:start + T]
        tokens = np.zeros((1, T), np.int32)
        tokens[0, :len(chunk)] = chunk
        logits, kv = programs.forward(params, jnp.asarray(tokens), jnp.int32(len(chunk)), kv, cfg)
        start += len(chunk)
    return logits, kv


def generate(ids: list[int], max_tokens: int, use_cache: bool = True) -> tuple[list[int], np.ndarray, int]:
    """Greedy tokens of a prompt, the first token's logits, and how many prompt tokens were reused."""
    hits = [p for p in stored if use_cache and len(p) < len(ids) and tuple(ids[:len(p)]) == p]
    prefix = max(hits, key=len, default=())
    if prefix:  # warm: restore the snapshot (a device copy: the forward donates it)
        kv = jax.tree.map(jnp.array, stored[prefix])
    else:  # cold: an empty cache at position 0
        kv = KVCache.zeros(cfg, CAPACITY, dtype=engine.cache_dtype)
    if len(ids) - 1 > len(prefix):  # prefill up to the last prompt token, then keep a snapshot
        _, kv = prefill(ids[len(prefix):-1], kv)
        if use_cache:
            stored[tuple(ids[:-1])] = jax.device_get(kv)
    logits, kv = prefill(ids[-1:], kv)  # the last prompt token: its logits give the first token
    first = np.asarray(logits[0])
    out = []
    for _ in range(max_tokens):
        out.append(int(jnp.argmax(logits[0])))
        logits, kv = programs.forward(params, jnp.asarray([[out[-1]]], jnp.int32), jnp.int32(1), kv, cfg)
    return out, first, len(prefix)


def main() -> None:
    capitals = [("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"), ("Egypt", "Cairo")]
    shots = "".join(f"Q: What is the capital of {c}?\nA: {city}.\n" for c, city in capitals)
    questions = ["Q: What is the capital of France?\nA:", "Q: What is the capital of Germany?\nA:"]
    prompts = [tokenizer.encode(shots + q) for q in questions]
    n_shots = len(tokenizer.encode(shots))
    for timed in (False, True):  # the first round compiles each chunk shape; the second is timed
        stored.clear()
        for ids in prompts:
            t0 = time.perf_counter()
            cold, cold_logits, _ = generate(ids, 8, use_cache=False)
            t1 = time.perf_counter()
            generate(ids[:n_shots + 1], 0)  # store the shared few-shot prefix
            t2 = time.perf_counter()
            warm, warm_logits, reused = generate(ids, 8)
            t3 = time.perf_counter()
            if timed:
                print(f"{len(ids)} prompt tokens, {reused} restored: cold {1e3 * (t1 - t0):.0f} ms, "
                      f"warm {1e3 * (t3 - t2):.0f} ms; identical tokens: {cold == warm}, "
                      f"identical logits: {np.array_equal(cold_logits, warm_logits)}; {tokenizer.decode(warm)!r}")


if __name__ == "__main__":
    main()
