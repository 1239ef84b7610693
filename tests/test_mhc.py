"""Hyper-connections: Sinkhorn split order and epsilons, hc_pre / hc_post contraction direction,
hc_post_pre's collapse."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.mhc import hc_post, hc_post_pre, hc_pre, identity_pre_mix
from pallas_kernels.sinkhorn.reference import hc_split_sinkhorn

HC, ITERS, EPS = 4, 20, 1e-6


def _sinkhorn_f64(m, scale, base, column_first=True):
    """float64 transcription of SPEC §4.3; column_first=False is the wrong (row-first) order."""
    sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    pre = sig(m[..., :HC] * scale[0] + base[:HC]) + EPS
    post = 2 * sig(m[..., HC:2 * HC] * scale[1] + base[HC:2 * HC])
    c = (m[..., 2 * HC:] * scale[2] + base[2 * HC:]).reshape(*m.shape[:-1], HC, HC)
    c = np.exp(c - c.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + EPS
    if column_first:
        c = c / (c.sum(-2, keepdims=True) + EPS)
        for _ in range(ITERS - 1):
            c = c / (c.sum(-1, keepdims=True) + EPS)
            c = c / (c.sum(-2, keepdims=True) + EPS)
    else:
        for _ in range(ITERS):
            c = c / (c.sum(-2, keepdims=True) + EPS)
            c = c / (c.sum(-1, keepdims=True) + EPS)
    return pre, post, c


def _random_mixes(n=64, seed=0):
    rng = np.random.default_rng(seed)
    m = rng.normal(0, 2, (n, (2 + HC) * HC)).astype(np.float32)
    scale = np.array([0.6, 0.5, 0.8], np.float32)
    base = rng.normal(0, 1, (2 + HC) * HC).astype(np.float32)
    base[2 * HC:] += 1.5 * np.eye(HC, dtype=np.float32).ravel()
    return m, scale, base


def test_sinkhorn_matches_float64_spec_order():
    m, scale, base = _random_mixes()
    pre, post, comb = hc_split_sinkhorn(jnp.asarray(m), jnp.asarray(scale), jnp.asarray(base), hc=HC, iters=ITERS, eps=EPS)
    rp, rq, rc = _sinkhorn_f64(m.astype(np.float64), scale.astype(np.float64), base.astype(np.float64))
    np.testing.assert_allclose(np.asarray(pre), rp, rtol=2e-6)
    np.testing.assert_allclose(np.asarray(post), rq, rtol=2e-6)
    np.testing.assert_allclose(np.asarray(comb), rc, rtol=1e-5, atol=1e-7)
    # the last pass normalises columns: column sums are 1 up to eps, rows are only close
    np.testing.assert_allclose(np.asarray(comb).sum(-2), 1.0, atol=1e-5)


def test_sinkhorn_row_first_order_is_distinguishable():
    """Negative twin: the row-first order gives a different comb than the spec's column-first."""
    m, scale, base = _random_mixes(seed=1)
    _, _, comb = hc_split_sinkhorn(jnp.asarray(m), jnp.asarray(scale), jnp.asarray(base), hc=HC, iters=ITERS, eps=EPS)
    _, _, wrong = _sinkhorn_f64(m.astype(np.float64), scale.astype(np.float64), base.astype(np.float64), column_first=False)
    assert np.abs(np.asarray(comb) - wrong).max() > 1e-4


def test_sinkhorn_pre_includes_eps_and_post_is_twice_sigmoid():
    m = np.zeros((1, 24), np.float32)
    base = np.zeros(24, np.float32)
    pre, post, comb = hc_split_sinkhorn(jnp.asarray(m), jnp.ones(3), jnp.asarray(base), hc=HC, iters=ITERS, eps=EPS)
    np.testing.assert_array_equal(np.asarray(pre), np.float32(0.5) + np.float32(EPS))
    np.testing.assert_array_equal(np.asarray(post), 1.0)
    np.testing.assert_allclose(np.asarray(comb), 0.25, rtol=1e-5)


def test_hc_post_contracts_over_the_first_comb_index():
    rng = np.random.default_rng(3)
    f = rng.normal(size=(1, 2, 8)).astype(np.float32)
    res = rng.normal(size=(1, 2, HC, 8)).astype(np.float32)
    post = rng.uniform(size=(1, 2, HC)).astype(np.float32)
    comb = rng.uniform(size=(1, 2, HC, HC)).astype(np.float32)
    out = np.asarray(hc_post(jnp.asarray(f), jnp.asarray(res), jnp.asarray(post), jnp.asarray(comb)))
    want = post[..., None] * f[..., None, :] + np.einsum("bsij,bsid->bsjd", comb, res)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    wrong = post[..., None] * f[..., None, :] + np.einsum("bsij,bsjd->bsid", comb, res)
    assert np.abs(out - wrong).max() > 1e-2  # negative twin: the transposed contraction differs


def test_hc_pre_sums_in_f32_then_rounds_once_to_bf16():
    x = jnp.asarray(np.full((1, 1, HC, 4), 1.0 + 2.0**-8, np.float32), jnp.bfloat16)  # 1 + half-ulp -> 1
    x = x.at[..., 0, :].set(jnp.bfloat16(1.0 + 2.0**-7))
    mix = jnp.asarray([[[0.5, 0.5, 0.0, 0.0]]], jnp.float32)
    y = hc_pre(x, mix)
    assert y.dtype == jnp.bfloat16
    # 0.5 * (1 + 2^-7) + 0.5 * 1 = 1 + 2^-8: a tie in bf16 that rounds to even (1.0)
    np.testing.assert_array_equal(np.asarray(y, np.float32), 1.0)
    np.testing.assert_array_equal(np.asarray(identity_pre_mix(1, 2, HC))[..., 0], 1.0)


@pytest.mark.parametrize("shape", [(1, 1, 5120), (2, 3, 64), (64, 1, 64)])
def test_hc_post_pre_is_hc_post_then_hc_pre_bit_for_bit(shape):
    """hc_post_pre gives what hc_post then hc_pre of its result give in one program, bit for bit,
    compiled: the collapse formed from f and the residual again (up to RECOMPUTE_ROWS rows) or
    from the new stream (above)."""
    b, s, d = shape
    rng = np.random.default_rng(5)
    f = jnp.asarray(rng.normal(size=(b, s, d)) * 3, jnp.bfloat16)
    res = jnp.asarray(rng.normal(size=(b, s, HC, d)) * 3, jnp.bfloat16)
    post = jnp.asarray(rng.uniform(0, 2, size=(b, s, HC)), jnp.float32)
    comb = jnp.asarray(rng.uniform(size=(b, s, HC, HC)), jnp.float32)
    pre = jnp.asarray(rng.uniform(size=(b, s, HC)), jnp.float32)

    def two_calls(f, res, post, comb, pre):
        x = hc_post(f, res, post, comb)
        return x, hc_pre(x, pre)

    x, c = jax.jit(hc_post_pre)(f, res, post, comb, pre)
    x_want, c_want = jax.jit(two_calls)(f, res, post, comb, pre)
    assert x.dtype == c.dtype == jnp.bfloat16 and c.shape == (b, s, d)
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(x_want, np.float32), "new stream")
    np.testing.assert_array_equal(np.asarray(c, np.float32), np.asarray(c_want, np.float32), "collapse")
    # the collapse reads the new stream's copies: another pre gives another result
    c_other = jax.jit(hc_pre)(x_want, pre[..., ::-1])
    assert np.abs(np.asarray(c, np.float32) - np.asarray(c_other, np.float32)).max() > 0


def test_site_projection_dots_float64_operands():
    """The projection's dot takes float64 operands: XLA:GPU compiles a dot of f32 operands asked
    for a float64 result to a GEMM that sums in f32 (benchmarks/README.md, forty-third session),
    which no CPU run can show, so the program's form is pinned here."""
    from pallas_kernels.sinkhorn.api import project_rounded_once

    u, fn = jnp.zeros((1, 2, 256), jnp.float32), jnp.zeros((24, 256), jnp.float32)
    dots = [e for e in jax.make_jaxpr(project_rounded_once)(u, fn).jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 1 and [v.aval.dtype for v in dots[0].invars] == [jnp.float64, jnp.float64]


@pytest.mark.parametrize("shape", [(2, 5, 20480), (1, 1, 20480), (1, 3, 256)])
def test_site_projection_sums_in_float64_and_rounds_once(shape):
    """`project_rounded_once`: bit-identical to the dot of float64 copies rounded to f32 (on a GPU
    too, where a dot of the f32 operands asked for a float64 result sums in f32), and within one
    f32 ulp of numpy's float64 sums (another order)."""
    from pallas_kernels.sinkhorn.api import project_rounded_once

    key = jax.random.key(7)
    u = jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
    fn = jax.random.normal(jax.random.fold_in(key, 1), (24, shape[-1]), jnp.float32) * 0.01
    got = np.asarray(jax.jit(project_rounded_once)(u, fn))

    def float64_copies(u, fn):
        with jax.enable_x64(True):
            return jnp.einsum("bsk,mk->bsm", u.astype(jnp.float64), fn.astype(jnp.float64),
                              precision=jax.lax.Precision.HIGHEST).astype(jnp.float32)

    assert got.dtype == np.float32 and got.shape == (*shape[:2], 24)
    np.testing.assert_array_equal(got, np.asarray(jax.jit(float64_copies)(u, fn)))
    want = np.einsum("bsk,mk->bsm", np.asarray(u, np.float64), np.asarray(fn, np.float64))
    assert np.all(np.abs(got - want) <= np.spacing(np.abs(want).astype(np.float32)))
    # an f32 sum of the same products misses the float64 rounding somewhere
    f32 = np.asarray(jax.jit(lambda u, f: jnp.einsum("bsk,mk->bsm", u, f, precision="highest"))(u, fn))
    assert shape[-1] < 20480 or np.any(f32 != got)
