"""Time the matmul kernel alone on the model's shapes: the 7 matmuls of each of 30 layers (SmolLM2-135M,
weights packed, each its own buffer so they come from memory), at several row counts.

    PYTHONPATH=$PWD python tools/time_matmuls.py [--rows 1 8 16 32] [--runs 15]

Prints, per row count, the median time of the whole set, the weight bytes streamed per second and the
arithmetic rate. Compare builds by running it in alternating processes (the machine's memory speed
moves between runs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxsmol import cpu_kernels

D, F, KV, LAYERS = 576, 1536, 192, 30
SHAPES = [(D, D), (D, KV), (D, KV), (D, D), (D, F), (D, F), (F, D)]  # q, k, v, o, gate, up, down


@jax.jit
def layers(weights, x):
    """x [M, D] through every layer's matmuls, each feeding the next as the model's data flow does."""
    for wq, wk, wv, wo, wg, wu, wd in weights:
        q, k, v = (cpu_kernels.matmul(x, w) for w in (wq, wk, wv))
        o = cpu_kernels.matmul(q + jnp.tile(k + v, 3), wo)
        h = cpu_kernels.matmul(o, wg) * cpu_kernels.matmul(o, wu)
        x = cpu_kernels.matmul(h, wd) * 0.01
    return x


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32, 64])
    p.add_argument("--runs", type=int, default=15)
    args = p.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("the CPU kernels are not available")
    rng = np.random.default_rng(0)
    weights = [[cpu_kernels.pack(jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 0.02)) for s in SHAPES]
               for _ in range(LAYERS)]
    nbytes = sum(k * n for k, n in SHAPES) * LAYERS * 4
    for M in args.rows:
        x = jnp.asarray(rng.standard_normal((M, D), dtype=np.float32))
        layers(weights, x).block_until_ready()
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            layers(weights, x).block_until_ready()
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        print(f"{M:4d} rows  {1e3 * t:7.2f} ms  {nbytes / t / 1e9:5.1f} GB/s of weights  "
              f"{2 * M * nbytes / 4 / t / 1e9:6.1f} GFLOP/s", flush=True)


if __name__ == "__main__":
    main()
