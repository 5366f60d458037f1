"""Time the matmul kernel alone on the model's shapes, at several row counts.

The 7 matmuls of each of 30 layers (SmolLM2-135M, weights packed, each its own buffer so they come
from memory).

    PYTHONPATH=$PWD python tools/time_matmuls.py [--rows 1 8 16 32] [--runs 15] [--against REV]
                                                 [--dtype bfloat16] [--per-shape] [--format q8_0]
                                                 [--dot int8]

Prints, per row count, the median time of the whole set, the weight bytes streamed per second and the
arithmetic rate. `--against REV` also builds git revision REV's cpu_matmul.cc (its symbols renamed)
and alternates the two kernels call by call in this one process, printing the time ratio and whether
their outputs are bitwise equal: the machine's memory speed moves between runs, so only figures
taken side by side compare two builds.

`--format q8_0|q4_1` times the quantized kernel against the float32 kernel, alternating in one
process, on the same matrices: random ones quantized, the float32 kernel given their dequantized
values (so the two outputs must be bitwise equal). The stack then ends with the unembedding
[576, 49152], as the model's step does: of every row up to 16 (a batched decode step), of the last
row beyond (a prompt chunk). Printed: each kernel's time and weight bytes per second, and the ratio
quantized / float32. With `--against REV` too, the quantized kernel alternates instead with REV's
cpu_matmul_quant.cc (with `--dot int8`: its cpu_matmul_int8.cc) on the same quantized matrices (the
outputs again bitwise equal). `--dot int8`
puts the integer-dot kernel (cpu_matmul_int8.cc, `--matmul int8`) in the quantized kernel's place, its
codes in k-quads (its outputs differ: x is rounded to 8 bits).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxsmol.kernels import cpu_kernels, formats

import kernel_revision  # tools/, beside this file

D, F, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152
SHAPES = [(D, D), (D, KV), (D, KV), (D, D), (D, F), (D, F), (F, D)]  # q, k, v, o, gate, up, down


def unit(y):
    """Each row scaled to mean square 1, as the model's norms keep it: 30 products in a row otherwise
    reach subnormal floats, which the arithmetic runs at another speed."""
    return y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-30)


def stack(matmul, pick=None):
    """The timed program for one kernel: x [M, D] through every layer's matmuls, each feeding the
    next as the model's data flow does. pick: which of call_args' weights it takes (--format), its
    last matrix then the unembedding."""
    @jax.jit
    def layers(weights, x):
        if pick is not None:
            weights, unembed = weights[pick][:-1], weights[pick][-1]
        for wq, wk, wv, wo, wg, wu, wd in weights:
            q, k, v = (matmul(x, w) for w in (wq, wk, wv))
            o = matmul(q + jnp.tile(k + v, 3), wo)
            h = matmul(o, wg) * matmul(o, wu)
            x = unit(matmul(h, wd))
        if pick is None:
            return x
        logits = matmul(x if x.shape[0] <= 16 else x[-1:], unembed)
        return jnp.concatenate([x.ravel(), logits.ravel()])
    return layers


PRODUCTS = {"qkv": (D, D + 2 * KV), "o": (D, D), "gate_up": (D, 2 * F), "down": (F, D)}  # the model's products


def one_shape(matmul, K, N, pick=None):
    """The timed program for --per-shape: x [M, K] through 30 weights of one fused shape (K, N), each
    product's output folded back into x so that the calls depend on each other."""
    @jax.jit
    def layers(weights, x):
        for w in (weights if pick is None else weights[pick]):
            y = matmul(x, w)
            x = x + 0.001 * (y[:, :K] if N >= K else jnp.tile(y, (1, K // N + 1))[:, :K])
        return x
    return layers


def quantized(shape, fmt, rng):
    """(a random matrix of this shape in fmt, the float32 kernel's packed panels of its values)."""
    qm = formats.quantize(rng.standard_normal(shape, dtype=np.float32) * 0.02, fmt)
    return qm, jax.block_until_ready(formats.dequantize(qm))


def per_shape(args, rng, dtype, target) -> None:
    """--per-shape: each of the model's four fused products alone (30 layers of it)."""
    rev = args.against or ("float32" if args.format else None)  # what "now" is timed against
    for name, (K, N) in PRODUCTS.items():
        if args.format:  # (quantized, float32) per layer, the programs alternated
            pairs = [quantized((K, N), args.format, rng) for _ in range(LAYERS)]
            weights = tuple(list(w) for w in zip(*pairs))
            programs = {"now": one_shape(cpu_kernels.matmul, K, N, 0),
                        "float32": one_shape(cpu_kernels.matmul, K, N, 1)}
        else:
            weights = [cpu_kernels.pack(jnp.asarray(rng.standard_normal((K, N), dtype=np.float32) * 0.02, dtype))
                       for _ in range(LAYERS)]
            programs = {"now": one_shape(cpu_kernels.matmul, K, N)}
        if target:
            programs[args.against] = one_shape(functools.partial(cpu_kernels.matmul, target=target), K, N)
        for M in args.rows:
            x = jnp.asarray(rng.standard_normal((M, K), dtype=np.float32))
            t, versus = kernel_revision.side_by_side(programs, (weights, x), args.runs, rev)
            print(f"{name:8s} {M:4d} rows  {1e3 * t:7.2f} ms  {2 * M * K * N * LAYERS / t / 1e9:6.1f} GFLOP/s" + versus,
                  flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32, 64])
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--against", metavar="REV", help="alternate with git revision REV's kernel in this process")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the weights' dtype")
    p.add_argument("--per-shape", action="store_true", help="each fused product (q/k/v, o, gate/up, down) alone")
    p.add_argument("--format", choices=formats.FORMATS, help="time this quantized format against float32")
    p.add_argument("--dot", choices=formats.DOTS, default="exact",
                   help="with --format: int8 times the integer-dot kernel in the quantized kernel's place "
                        "(its outputs differ from float32's: x is rounded)")
    args = p.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("the CPU kernels are not available")
    if args.format and (args.dtype != "float32" or (args.against and args.per_shape)):
        raise SystemExit("--format: no --dtype, and no --per-shape with --against")
    rng = np.random.default_rng(0)
    dtype = jnp.dtype(args.dtype)
    target = None
    if args.format and args.against:
        symbol = {"q8_0": "JaxsmolMatmulQ8_0", "q4_1": "JaxsmolMatmulQ4_1"}[args.format]
        source, suffix = ("cpu_matmul_int8.cc", "Int8") if args.dot == "int8" else ("cpu_matmul_quant.cc", "")
        target = kernel_revision.register(args.against, source, symbol + suffix)
    elif args.against:
        handler = "JaxsmolMatmulBf16" if dtype == jnp.bfloat16 else "JaxsmolMatmul"
        target = kernel_revision.register(args.against, "cpu_matmul.cc", handler)
    if args.per_shape:
        return per_shape(args, rng, dtype, target)
    if args.format:
        return against_float32(args, rng, target)
    weights = [[cpu_kernels.pack(jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 0.02, dtype)) for s in SHAPES]
               for _ in range(LAYERS)]
    nbytes = sum(k * n for k, n in SHAPES) * LAYERS * dtype.itemsize
    programs = {"now": stack(cpu_kernels.matmul)}
    if target:
        programs[args.against] = stack(functools.partial(cpu_kernels.matmul, target=target))
    for M in args.rows:
        x = jnp.asarray(rng.standard_normal((M, D), dtype=np.float32))
        t, versus = kernel_revision.side_by_side(programs, (weights, x), args.runs, args.against)
        line = (f"{M:4d} rows  {1e3 * t:7.2f} ms  {nbytes / t / 1e9:5.1f} GB/s of weights  "
                f"{2 * M * nbytes / dtype.itemsize / t / 1e9:6.1f} GFLOP/s" + versus)
        print(line, flush=True)


def quantized_matmul(target):
    """cpu_kernels.matmul on a QuantizedMatrix, through another build's registered target."""
    def matmul(x, w):
        w = jax.tree.map(lambda a: a[None], w)  # a stack of one layer, read at layer 0 (the kernels' operand)
        P, K = w.q.shape[-3:-1]
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.size // K, P * formats.PANEL), jnp.float32))
        scales = (w.d,) if w.m is None else (w.d, w.m)
        return call(x.reshape(-1, K), w.q, *scales, jnp.int32(0)).reshape(*x.shape[:-1], -1)
    return matmul


def against_float32(args, rng, target=None) -> None:
    """--format: the quantized stack (with the unembedding) against float32 on the same values, the
    two alternating call by call (each first half the time). Printed per row count: the medians and
    their ratio, and the ratio of the fastest calls (steadier where other work shares the machine).
    target (--against REV): REV's quantized kernel in float32's place, on the quantized matrices."""
    layers = [[quantized(s, args.format, rng) for s in SHAPES] for _ in range(LAYERS)]
    unembed = quantized((D, VOCAB), args.format, rng)
    # quantized, float32
    weights = tuple([*([pair[i] for pair in layer] for layer in layers), unembed[i]] for i in (0, 1))
    count = sum(k * n for k, n in SHAPES) * LAYERS + D * VOCAB  # weights in the stack, unembedding included
    qbytes = sum(a.nbytes for a in jax.tree.leaves(weights[0]))
    programs = (stack(cpu_kernels.matmul, 0), stack(cpu_kernels.matmul, 1))
    other = "float32"
    if target:
        programs, other = (programs[0], stack(quantized_matmul(target), 0)), args.against
    if args.dot == "int8":  # the integer-dot class on the same codes (its outputs differ: x is rounded)
        weights = ([*([formats.to_dot(w, "int8") for w in layer] for layer in weights[0][:-1]),
                    formats.to_dot(weights[0][-1], "int8")], weights[1])
    print(f"{args.format}: {qbytes / 1e6:.0f} MB of weights ({qbytes / count:.3f} bytes a weight), "
          f"float32 {4 * count / 1e6:.0f} MB", flush=True)
    for M in args.rows:
        x = jnp.asarray(rng.standard_normal((M, D), dtype=np.float32))
        same = np.array_equal(*(np.asarray(f(weights, x)) for f in programs))
        times = ([], [])
        for run in range(args.runs):
            for i in ((0, 1) if run % 2 else (1, 0)):
                t0 = time.perf_counter()
                jax.block_until_ready(programs[i](weights, x))
                times[i].append(time.perf_counter() - t0)
        (tq, tf), (bq, bf) = (statistics.median(t) for t in times), (min(t) for t in times)
        print(f"{M:4d} rows  {args.format} {1e3 * tq:7.2f} ms  {qbytes / tq / 1e9:5.1f} GB/s of weights  "
              f"{other} {1e3 * tf:7.2f} ms  {args.format}/{other} {tq / tf:.3f} (fastest calls {bq / bf:.3f}), "
              f"bitwise {'equal' if same else 'DIFFERENT'}", flush=True)


if __name__ == "__main__":
    main()
