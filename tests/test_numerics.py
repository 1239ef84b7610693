"""Division and square-root rounding points (dsv41_jax/numerics.py) on whatever backend runs them.

On CPU XLA divides exactly anyway; on a GPU, XLA's own f32 division is `div.full.f32` (not
correctly rounded) and these tests are the ones that show it: before `exact_div` divided in
float64, the fp4 tie below came out one e2m1 step too high on an H200 and the golden prefill
parity failed from the first compressed layer on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.numerics import exact_div, reciprocal_sqrt
from dsv41_jax.quant import fp4_quant_dequant_e4m3


def _random_f32(rng, n):
    """Finite f32 values over many binades (mantissas uniform), both signs."""
    m = rng.uniform(1.0, 2.0, n).astype(np.float32)
    e = rng.integers(-40, 40, n)
    return (np.ldexp(m, e) * rng.choice([-1, 1], n)).astype(np.float32)


def test_exact_div_is_the_ieee_quotient_on_random_pairs_and_ties():
    rng = np.random.default_rng(0)
    a, b = _random_f32(rng, 200_000), _random_f32(rng, 200_000)
    # quotients that are exact e2m1 / e4m3 ties and exact small ratios, where a rounding
    # division lands one ulp off and the next rounding step goes the other way
    a[:4] = [1.171875, 6.375, 1.25 * 0.875, 7.0]
    b[:4] = [0.9375, 6.0, 0.875, 3.0]
    got = np.asarray(jax.jit(exact_div)(jnp.asarray(a), jnp.asarray(b)))
    want = a / b  # numpy: IEEE f32 division, correctly rounded
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
    assert got[0] == np.float32(1.25) and got[1] == np.float32(1.0625)


def test_exact_div_broadcasts_a_row_divisor_without_a_reciprocal_multiply():
    rng = np.random.default_rng(1)
    a = _random_f32(rng, 64 * 256).reshape(64, 256)
    b = _random_f32(rng, 64).reshape(64, 1)
    got = np.asarray(jax.jit(exact_div)(jnp.asarray(a), jnp.asarray(b)))
    np.testing.assert_array_equal(got.view(np.int32), (a / b).view(np.int32))


def test_reciprocal_sqrt_is_one_over_the_ieee_square_root():
    rng = np.random.default_rng(2)
    x = np.abs(_random_f32(rng, 200_000))
    got = np.asarray(jax.jit(reciprocal_sqrt)(jnp.asarray(x)))
    want = np.float32(1.0) / np.sqrt(x)
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))


def test_fp4_e4m3_qdq_rounds_an_exact_tie_after_the_division_to_the_even_code():
    # amax 5.625: s = e4m3(5.625 / 6) = 0.9375 exactly; 1.171875 / s = 1.25, the tie between
    # the e2m1 codes 1.0 (even) and 1.5 -> 1.0 * s; 2.34375 / s = 2.5, tie of 2 (even) and 3
    x = np.zeros(16, np.float32)
    x[:3] = [1.171875, 5.625, -2.34375]
    got = np.asarray(jax.jit(fp4_quant_dequant_e4m3)(jnp.asarray(x, jnp.bfloat16)).astype(jnp.float32))
    np.testing.assert_array_equal(got[:3], [0.9375, 5.625, -1.875])
    assert not got[3:].any()
