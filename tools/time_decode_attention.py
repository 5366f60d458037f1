"""Time the attention kernel alone on decode steps and prompt chunks of a SmolLM2-135M-shaped cache.

Decode steps (one query per row) and prompt chunks, over 30 layers of a SmolLM2-135M-shaped cache
(3 kv heads, 3 query heads each, head dim 64), at several widths and positions.

    PYTHONPATH=$PWD python tools/time_decode_attention.py [--cases 1x2000 8x2000 512@512] [--runs 9] [--against REV]
        [--kv-dtype float32|bfloat16|both]

A case WIDTHxPOSITION is a decode step; ROWS@POSITION a prompt chunk of that many rows (one sequence)
whose first query is at that position. Prints the median time per case and the cache bytes read per
second (decode) or the arithmetic rate of the q.k and P V products (chunks). `--against REV` also builds git
revision REV's cpu_attention.cc beside the current one (tools/kernel_revision.py) and alternates the
two in this process, printing the ratio and whether their outputs are bitwise equal.

`--kv-dtype bfloat16` times the kernel over a bfloat16 cache (`--kv-dtype` of the engine; the
keys and values widened as they load); `both` alternates a float32 and a bfloat16 cache of the same
(bfloat16-rounded) values in this process and prints bfloat16's time as a ratio of float32's, and
whether the outputs are bitwise equal (they must be).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxsmol.kernels import cpu_kernels

import kernel_revision  # tools/, beside this file

LAYERS, K, G, H, BLOCK = 30, 3, 3, 64, 256


def stack(attention):
    """The timed program: every layer's decode attention for q [B, 1, K, G, H] at positions pos [B]."""
    @jax.jit
    def layers(q, k_all, v_all, pos):
        return [attention(q, k_all, v_all, i, pos) for i in range(LAYERS)]
    return layers


def alternate(programs: dict, runs: int) -> dict:
    """{name: (f, args)} -> {name: (median seconds, output)}, run alternately (each first half the time)."""
    outputs = {name: np.asarray(jax.tree.leaves(f(*a))) for name, (f, a) in programs.items()}
    times = {name: [] for name in programs}
    for run in range(runs):
        for name, (f, a) in list(programs.items())[::1 if run % 2 else -1]:
            t0 = time.perf_counter()
            jax.block_until_ready(f(*a))
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(times[name]), outputs[name]) for name in programs}


def timed(programs: dict, call_args: tuple, runs: int, against: str | None, kv_dtype: str) -> tuple[float, str]:
    """(seconds of the program for kv_dtype's cache, a suffix) on q, k_all, v_all (float32), pos: with
    kv_dtype "both", float32's time and bfloat16's ratio to it; else kernel_revision.side_by_side."""
    q, k_all, v_all, pos = call_args
    if kv_dtype == "float32":
        return kernel_revision.side_by_side(programs, call_args, runs, against)
    k16, v16 = k_all.astype(jnp.bfloat16), v_all.astype(jnp.bfloat16)
    if kv_dtype == "bfloat16":
        return kernel_revision.side_by_side(programs, (q, k16, v16, pos), runs, against)
    f = programs["now"]
    got = alternate({"float32": (f, (q, k16.astype(jnp.float32), v16.astype(jnp.float32), pos)),
                     "bfloat16": (f, (q, k16, v16, pos))}, runs)
    (t32, o32), (t16, o16) = got["float32"], got["bfloat16"]
    return t32, (f"  | bfloat16 cache {1e3 * t16:7.2f} ms: bfloat16/float32 {t16 / t32:.3f}, "
                 f"bitwise {'equal' if np.array_equal(o32, o16) else 'DIFFERENT'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=["1x2000", "8x2000", "1x700", "4x700", "1x100"],
                   help="WIDTHxPOSITION: rows decoding at about that position (each its own, up to 50 less); "
                        "ROWS@POSITION: a prompt chunk")
    p.add_argument("--runs", type=int, default=9)
    p.add_argument("--against", metavar="REV", help="alternate with git revision REV's kernel in this process")
    p.add_argument("--kv-dtype", choices=("float32", "bfloat16", "both"), default="float32",
                   help="the cache's dtype; both: a float32 and a bfloat16 cache of the same values, alternately")
    args = p.parse_args()
    if args.against and args.kv_dtype == "both":
        p.error("--against compares builds on one cache dtype: give --kv-dtype float32 or bfloat16")
    if not cpu_kernels.available():
        raise SystemExit("the CPU kernels are not available")
    programs = {"now": stack(cpu_kernels.attention)}
    if args.against:
        symbol = "JaxsmolAttentionBf16" if args.kv_dtype == "bfloat16" else "JaxsmolAttention"  # REV must have it
        target = kernel_revision.register(args.against, "cpu_attention.cc", symbol)
        programs[args.against] = stack(functools.partial(cpu_kernels.attention, target=target))
    rng = np.random.default_rng(0)
    for case in args.cases:
        if "@" in case:
            T, P = map(int, case.split("@"))
            S = -(-(P + T) // BLOCK) * BLOCK
            q = jnp.asarray(rng.standard_normal((1, T, K, G, H), dtype=np.float32) * H ** -0.5)
            k_all, v_all = (jnp.asarray(rng.standard_normal((LAYERS, 1, K, S, H), dtype=np.float32)) for _ in range(2))
            pos = jnp.asarray([P], dtype=jnp.int32)
            t, versus = timed(programs, (q, k_all, v_all, pos), args.runs, args.against, args.kv_dtype)
            # q.k and P V, each row to its own position
            flops = 2 * 2 * LAYERS * K * G * H * sum(P + i + 1 for i in range(T))
            print(f"chunk {T:4d} rows at {P:5d}  {1e3 * t:7.2f} ms  {flops / t / 1e9:5.1f} GFLOP/s" + versus,
                  flush=True)
            continue
        B, P = map(int, case.split("x"))
        S = -(-(P + 1) // BLOCK) * BLOCK
        q = jnp.asarray(rng.standard_normal((B, 1, K, G, H), dtype=np.float32) * H ** -0.5)
        k_all, v_all = (jnp.asarray(rng.standard_normal((LAYERS, B, K, S, H), dtype=np.float32)) for _ in range(2))
        pos = jnp.asarray(np.maximum(P - rng.integers(0, 50, B), 0).astype(np.int32))
        t, versus = timed(programs, (q, k_all, v_all, pos), args.runs, args.against, args.kv_dtype)
        itemsize = 2 if args.kv_dtype == "bfloat16" else 4  # both: t is float32's time
        read = 2 * LAYERS * K * H * itemsize * int(np.sum(np.asarray(pos) + 1))
        line = f"{B:3d} rows at ~{P:5d}  {1e3 * t:7.2f} ms  {read / t / 1e9:5.1f} GB/s of keys and values" + versus
        print(line, flush=True)


if __name__ == "__main__":
    main()
