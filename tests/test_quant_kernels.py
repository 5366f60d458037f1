"""The quantized matmul kernels (jaxsmol/kernels/cpu_matmul_quant.cc): Q8_0 and Q4_1 weights.

Each weight is dequantized to one float32 value (formats.dequantize's), and each output element is
one FMA chain over k in order, so the product has the bits of the float32 kernel on the dequantized
panels, on every path (one row, 2-16 rows, many rows) and whatever the row count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsmol.kernels import cpu_kernels, formats


@pytest.fixture(autouse=True)
def kernels_built():
    """The kernels are what these tests test: without a C++ compiler that is a failed install step."""
    if not cpu_kernels.available():
        pytest.fail("the CPU kernels did not build: install a C++ compiler (Debian: apt-get install g++), "
                    "see the stderr line above", pytrace=False)


ROWS = (1, 2, 3, 7, 15, 16, 17, 31, 64, 200)  # one row, the few-row passes (<= 16), the tiled path
_matmul = jax.jit(cpu_kernels.matmul)


def _weights(fmt: str, K: int, N: int, seed: int) -> formats.QuantizedMatrix:
    """A random [K, N] matrix in fmt; its first 32 k's of the first panel zero (a block whose scale is 0)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((K, N), np.float32) * np.exp(rng.standard_normal(N, np.float32))  # scales vary by column
    w[:32, :32] = 0
    return formats.quantize(w, fmt)


# K: one block; below, at, and not a multiple of the tiled path's 192-row k blocks; the model's.
# N: one panel, an odd count of panels (one-row streams leave a remainder), the model's widths.
@pytest.mark.parametrize("fmt", formats.FORMATS)
@pytest.mark.parametrize("K,N", [(32, 32), (64, 96), (224, 160), (576, 576), (1536, 96), (576, 800)])
def test_quantized_matmul_has_the_float32_kernels_bits_on_the_dequantized_weights(fmt, K, N):
    qm = _weights(fmt, K, N, seed=K + N)
    wide = formats.dequantize(qm)  # packed float32 [N / 32, K, 32]
    unpacked = np.asarray(cpu_kernels.unpack(wide), np.float64)
    rng = np.random.default_rng(K * N)
    for M in ROWS:
        x = rng.standard_normal((M, K), np.float32)
        got = np.asarray(_matmul(jnp.asarray(x), qm))
        np.testing.assert_array_equal(got, np.asarray(_matmul(jnp.asarray(x), wide)), err_msg=f"{M} rows")
        want = x.astype(np.float64) @ unpacked
        bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(unpacked)) + 1e-30
        assert np.all(np.abs(got - want) <= bound), f"{M} rows: off the float64 product by more than 1e-5 of |x| @ |w|"


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_a_rows_bits_do_not_depend_on_the_other_rows(fmt):
    """A row alone (the one-row path) gets the bits it gets among 5 (few rows) or 40 (tiled), and a
    matrix's first panels alone give the same bits as the whole."""
    qm = _weights(fmt, 576, 576, seed=1)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((40, 576), np.float32))
    many, few = np.asarray(_matmul(x, qm)), np.asarray(_matmul(x[:5], qm))
    np.testing.assert_array_equal(few, many[:5])
    for r in (0, 4):
        np.testing.assert_array_equal(np.asarray(_matmul(x[r:r + 1], qm))[0], many[r])
        np.testing.assert_array_equal(np.asarray(_matmul(x[r:r + 1], qm.panels(0, 5)))[0], many[r, :160])


def test_q4_1_reads_both_nibbles_and_the_minimum():
    """Codes 0..15 in both halves of a panel, with negative minimums: the values formats.dequantize gives."""
    K, N = 64, 64
    rng = np.random.default_rng(5)
    q = rng.integers(0, 16, (N // 32, K, 32)).astype(np.uint8)
    d = formats._f16(rng.uniform(0.01, 1, (N // 32, K // 32, 32)).astype(np.float32))
    m = formats._f16(rng.uniform(-8, 1, (N // 32, K // 32, 32)).astype(np.float32))
    qm = formats.QuantizedMatrix(q=jnp.asarray(q[:, :, :16] | (q[:, :, 16:] << 4)), d=jnp.asarray(d),
                                 m=jnp.asarray(m), fmt="q4_1")
    want = np.repeat(d, 32, axis=1) * q + np.repeat(m, 32, axis=1)  # float32, one rounding (d q is exact)
    np.testing.assert_array_equal(np.asarray(formats.dequantize(qm)), want)
    eye = jnp.eye(K, dtype=jnp.float32)  # rows of the identity pick out the weights' rows
    for M in (1, 8, K):
        np.testing.assert_array_equal(np.asarray(_matmul(eye[:M], qm)), np.asarray(cpu_kernels.unpack(want))[:M])
