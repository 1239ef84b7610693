"""Kernel suites: one base class per kernel over a table of shapes, one subclass per implementation.

The float64 oracles here are independent numpy re-statements of SPEC §4.3 and §5.10; every
implementation (the jnp reference, the GPU and TPU kernels in interpret mode on CPU, the compiled
GPU kernel when a GPU is present) is held to the same tolerance, derived from the dtype and the
length of the reduction. The compiled-GPU classes are marked `gpu` and skip without a GPU.
"""

from __future__ import annotations

import functools
import logging
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.sinkhorn import api as sinkhorn_api
from pallas_kernels.sparse_attention import api as attn_api

EPS32 = float(np.finfo(np.float32).eps)
HAS_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")


def pytest_generate_tests(metafunc):
    """Each class names the rows of the shape table it runs (interpret-mode TPU runs are slow)."""
    for name, table in (("sinkhorn_case", SINKHORN_CASES), ("attn_case", ATTN_CASES)):
        if name in metafunc.fixturenames:
            rows = getattr(metafunc.cls, name.upper() + "S", None) or list(table)
            metafunc.parametrize(name, rows)


# ================================================================================ Sinkhorn split

# name -> (leading shape, hc, iters, spread of the mixes)
SINKHORN_CASES = {
    "one_token": ((1,), 4, 20, 1.0),
    "odd_tokens": ((7,), 4, 20, 1.0),
    "batch_and_seq": ((2, 5), 4, 20, 1.0),
    "more_than_one_block": ((261,), 4, 20, 1.0),
    "wide_mixes": ((64,), 4, 20, 3.0),
    "hc2_three_iters": ((3,), 2, 3, 1.0),
    "single_iteration": ((4,), 4, 1, 1.0),
}
HC_EPS = 1e-6


def sinkhorn_f64(m, scale, base, hc, iters, eps):
    """SPEC §4.3 in float64."""
    m, scale, base = (np.asarray(a, np.float64) for a in (m, scale, base))
    pre = 1 / (1 + np.exp(-(m[..., :hc] * scale[0] + base[:hc]))) + eps
    post = 2 / (1 + np.exp(-(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])))
    c = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).reshape(*m.shape[:-1], hc, hc)
    c = np.exp(c - c.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + eps
    c = c / (c.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdims=True) + eps)
        c = c / (c.sum(-2, keepdims=True) + eps)
    return pre, post, c


def sinkhorn_rtol(iters):
    """Relative tolerance: each of the ~2 * iters + 4 dependent normalisation steps (a 4-term sum
    and a division, both f32) may add a few ulps; the f32 logits (m * s + b) add input rounding."""
    return 4 * (2 * iters + 4) * EPS32


def sinkhorn_inputs(case, seed=0):
    lead, hc, iters, spread = SINKHORN_CASES[case]
    rng = np.random.default_rng(seed)
    n_mix = (2 + hc) * hc
    m = (rng.normal(size=(*lead, n_mix)) * spread).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, size=3).astype(np.float32)
    base = rng.normal(size=n_mix).astype(np.float32)
    return m, scale, base, hc, iters


class SinkhornBase:
    implementation = "reference"
    target = None
    interpret = False
    extras = True  # the site and gradient tests (slow in interpret mode: one interpret class runs them)
    block_sizes = None

    def split(self, m, scale, base, hc, iters):
        return sinkhorn_api.hc_split_sinkhorn(jnp.asarray(m), jnp.asarray(scale), jnp.asarray(base), hc=hc,
                                              iters=iters, eps=HC_EPS, implementation=self.implementation,
                                              target=self.target, interpret=self.interpret,
                                              block_sizes=self.block_sizes)

    def test_split_matches_float64_oracle_within_iteration_tolerance(self, sinkhorn_case, caplog):
        m, scale, base, hc, iters = sinkhorn_inputs(sinkhorn_case)
        with caplog.at_level(logging.WARNING):
            got = self.split(m, scale, base, hc, iters)
        assert "using the reference" not in caplog.text  # a kernel class must not test the fallback
        want = sinkhorn_f64(m, scale, base, hc, iters, HC_EPS)
        for g, w, name in zip(got, want, ("pre", "post", "comb")):
            assert g.dtype == jnp.float32 and g.shape == w.shape, name
            np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=sinkhorn_rtol(iters), atol=0, err_msg=name)

    def test_site_at_released_sizes_matches_mhc_hc_mixes(self):
        if not self.extras:
            pytest.skip("run by another class of the same kernel")
        # hc 4, dim 5120: the RMS runs over the flattened 20480-long stream, 24 mixes
        from dsv41_jax.mhc import hc_mixes as mhc_hc_mixes
        rng = np.random.default_rng(3)
        x = jnp.asarray(rng.normal(size=(1, 3, 4, 5120)), jnp.bfloat16)
        fn = jnp.asarray(rng.normal(size=(24, 4 * 5120)) * 0.02, jnp.float32)
        scale = jnp.asarray([0.9, 1.1, 1.7], jnp.float32)
        base = jnp.asarray(rng.normal(size=24), jnp.float32)
        kw = {"norm_eps": 1e-6, "iters": 20, "hc_eps": HC_EPS}
        want = mhc_hc_mixes(x, fn, scale, base, **kw, implementation="reference")  # the model's jnp path
        got = sinkhorn_api.hc_mixes(x, fn, scale, base, **kw, implementation=self.implementation,
                                    target=self.target, interpret=self.interpret)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2 * sinkhorn_rtol(20), atol=0)

    def test_gradient_is_the_reference_gradient(self):
        if self.implementation == "reference" or not self.extras:
            pytest.skip("the kernels' custom VJP is under test, once per kernel")
        m, scale, base, hc, iters = sinkhorn_inputs("hc2_three_iters")

        def loss(fn):
            def f(m, s, b):
                pre, post, comb = fn(m, s, b)
                return jnp.sum(pre * 1.5) + jnp.sum(post) + jnp.sum(comb * jnp.arange(hc * hc).reshape(hc, hc))
            return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(jnp.asarray(m), jnp.asarray(scale), jnp.asarray(base))

        got = loss(lambda m, s, b: self.split(m, s, b, hc, iters))
        want = loss(lambda m, s, b: sinkhorn_api.hc_split_sinkhorn(m, s, b, hc=hc, iters=iters, eps=HC_EPS,
                                                                   implementation="reference"))
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


class TestSinkhornReference(SinkhornBase):
    implementation = "reference"
    SINKHORN_CASES = ("one_token", "batch_and_seq", "wide_mixes", "hc2_three_iters")


class TestSinkhornGpuInterpret(SinkhornBase):
    implementation, target, interpret = "pallas", "gpu", True
    SINKHORN_CASES = ("odd_tokens", "more_than_one_block", "hc2_three_iters")


class TestSinkhornGpuTokenLayoutInterpret(SinkhornBase):
    implementation, target, interpret = "pallas", "gpu", True
    block_sizes = sinkhorn_api.BlockSizes(lanes=False)
    SINKHORN_CASES = ("odd_tokens", "hc2_three_iters")
    extras = False


@pytest.mark.parametrize("lanes", [False, True])
def test_sinkhorn_kernel_lowers_to_triton_for_cuda(lanes):
    """The Pallas -> Triton lowering of both layouts runs without a GPU (cross-platform lowering)."""
    from pallas_kernels.sinkhorn import kernel_gpu

    m, scale, base, hc, iters = (v if isinstance(v, int) else jnp.asarray(v) for v in sinkhorn_inputs("odd_tokens"))
    f = lambda m, s, b, r: kernel_gpu.hc_split_sinkhorn(m, s, b, r, hc=hc, iters=iters, eps=HC_EPS, block_tokens=8,
                                                         num_warps=4, division="rcp_fma", interpret=False, lanes=lanes)
    rms = jnp.ones(m.shape[0], jnp.float32)
    assert "hc_split_sinkhorn" in jax.jit(f).trace(m, scale, base, rms).lower(lowering_platforms=("cuda",)).as_text()


def test_sinkhorn_lanes_need_a_power_of_two_hc():
    from pallas_kernels.sinkhorn import kernel_gpu

    m = jnp.zeros((2, 15), jnp.float32)  # hc 3
    with pytest.raises(NotImplementedError, match="power of 2"):
        kernel_gpu.hc_split_sinkhorn(m, jnp.ones(3), jnp.zeros(15), None, hc=3, iters=2, eps=HC_EPS, block_tokens=8,
                                     num_warps=4, division="rcp_fma", interpret=True, lanes=True)


class TestSinkhornTpuInterpret(SinkhornBase):
    implementation, target, interpret = "pallas", "tpu", True
    SINKHORN_CASES = ("odd_tokens", "single_iteration")
    extras = False


@pytest.mark.gpu
@needs_gpu
class TestSinkhornGpu(SinkhornBase):
    implementation, target = "pallas", "gpu"


@pytest.mark.gpu
@needs_gpu
class TestSinkhornGpuRcpFma(SinkhornBase):
    implementation, target = "pallas", "gpu"
    block_sizes = sinkhorn_api.BlockSizes(division="rcp_fma")
    extras = False


# ============================================================================ sparse attention


def _window(rng, n_filled, width):
    """A sliding window of `width` slots holding the last n_filled positions (the rest -1)."""
    w = np.full(width, -1, np.int64)
    w[:n_filled] = np.arange(n_filled)
    return w


def _topk(rng, lo, hi, n_valid, width):
    t = np.full(width, -1, np.int64)
    t[:n_valid] = rng.choice(np.arange(lo, hi), size=n_valid, replace=False)
    return t


def _idx_window_not_full(rng):  # decode: 10 of a 32-slot window filled, 16 top-k slots of which 5 valid
    return np.stack([np.concatenate([_window(rng, 10, 32), _topk(rng, 10, 40, 5, 16)]) for _ in range(2)])[:, None]


def _idx_fewer_valid_than_topk(rng):  # full window, 7 valid of 64 top-k slots
    rows = [np.concatenate([60 + np.arange(32), _topk(rng, 0, 60, 7, 64)]) for _ in range(3)]
    return np.stack(rows)[None]


def _idx_all_minus_one(rng):
    idx = rng.integers(0, 20, size=(2, 2, 24))
    idx[1, 0] = -1
    idx[0, 1] = -1
    return idx


def _idx_random(b, m, n, k, p_skip, rng):
    idx = rng.integers(0, n, size=(b, m, k))  # repeats allowed: a repeated slot counts each time
    idx[rng.random(size=idx.shape) < p_skip] = -1
    return idx


def _idx_released_decode(rng):  # 128 window + 512 top-k; batch 1's window holds 40 positions only
    rows = []
    for filled in (128, 40):
        win = np.full(128, -1)
        win[:filled] = 700 - filled + np.arange(filled)
        rows.append(np.concatenate([win, _topk(rng, 0, 700 - 128, 512, 512)]))
    return np.stack(rows)[:, None]


def _idx_released_prefill(rng):  # causal window of 128 over the first queries, few top-k picks yet
    rows = []
    for i in range(3):
        win = np.full(128, -1)
        win[:i + 1] = np.arange(i + 1)
        rows.append(np.concatenate([win, _topk(rng, 100, 300, 2 * i, 512)]))
    return np.stack(rows)[None]


# name -> (b, m, h, d, n, idx maker, spread of q and kv, sinks)
ATTN_CASES = {
    "window_not_full": (2, 1, 16, 64, 48, _idx_window_not_full, 1.0, None),
    "fewer_valid_than_topk": (1, 3, 16, 64, 96, _idx_fewer_valid_than_topk, 1.0, None),
    "rows_all_minus_one": (2, 2, 16, 64, 20, _idx_all_minus_one, 1.0, None),
    "odd_tokens_and_heads": (1, 5, 6, 32, 37, lambda rng: _idx_random(1, 5, 37, 19, 0.2, rng), 1.0, None),
    "batch_with_repeats": (3, 2, 16, 64, 50, lambda rng: _idx_random(3, 2, 50, 70, 0.3, rng), 1.0, None),
    "released_decode": (2, 1, 64, 512, 700, _idx_released_decode, 1.0, None),
    "released_prefill_rows": (1, 3, 64, 512, 300, _idx_released_prefill, 1.0, None),
    "huge_logits_and_sinks": (1, 2, 16, 32, 4, lambda rng: _idx_random(1, 2, 4, 8, 0.2, rng), 30.0, 300.0),
}


def _bf16(rng, shape, spread):
    return jnp.asarray((rng.normal(size=shape) * spread).astype(ml_dtypes.bfloat16))


def attn_inputs(case, seed=0):
    b, m, h, d, n, make_idx, spread, sink_mag = ATTN_CASES[case]
    rng = np.random.default_rng(seed)
    q, kv = _bf16(rng, (b, m, h, d), spread), _bf16(rng, (b, n, d), spread)
    if sink_mag is None:
        sink = rng.uniform(-1, 3, size=h)
    else:
        sink = np.where(np.arange(h) % 2 == 0, sink_mag, -sink_mag)
    idx = jnp.asarray(make_idx(rng).astype(np.int32))
    assert idx.shape[:2] == (b, m)
    return q, kv, jnp.asarray(sink, jnp.float32), idx, d ** -0.5


def attn_f64(q, kv, sink, idx, scale):
    """SPEC §5.10 in float64 (vectorised; invalid slots are masked)."""
    q, kv, sink, idx = (np.asarray(a, np.float64) for a in (q, kv, sink, idx))
    valid = idx >= 0
    g = np.take_along_axis(kv[:, None], np.where(valid, idx, 0).astype(np.int64)[..., None], axis=2)  # [b,m,k,d]
    logits = np.einsum("bmhd,bmkd->bmhk", q, g) * scale
    logits = np.where(valid[:, :, None], logits, -np.inf)
    top = np.maximum(logits.max(-1), sink)
    e = np.exp(logits - top[..., None])
    out = np.einsum("bmhk,bmkd->bmhd", e, g) / (e.sum(-1) + np.exp(sink - top))[..., None]
    return np.where(valid.any(-1)[:, :, None, None], out, 0.0)


def bf16_ulp(x):
    """Spacing of bf16 at |x| (8 significant bits)."""
    x = np.maximum(np.abs(x), np.finfo(np.float32).tiny)
    return 2.0 ** (np.floor(np.log2(x)) - 7)


class AttnBase:
    implementation = "reference"
    target = None
    interpret = False
    block_sizes = None
    accumulate = "f64"
    exact_probs = True  # False: p rounded to bf16 once before p.V
    extras = True  # the gradient test (slow in interpret mode: once per kernel)

    def attend(self, q, kv, sink, idx, scale):
        return attn_api.sparse_attn(q, kv, sink, idx, scale, implementation=self.implementation,
                                    accumulate=self.accumulate, target=self.target, interpret=self.interpret,
                                    block_sizes=self.block_sizes)

    def tolerance(self, want, kv, k):
        """One bf16 ulp of the result (the single final rounding may land on either neighbour of
        an f32-accurate value) plus f32 accumulation slack over the d + k long reductions, scaled
        by the largest value averaged; with p rounded to bf16, 2^-8 of that largest value."""
        d = kv.shape[-1]
        vmax = float(np.max(np.abs(np.asarray(kv, np.float64))))
        slack = (d + k) * EPS32 * vmax if self.exact_probs else 2.0 ** -8 * vmax
        return bf16_ulp(want) + slack

    def test_matches_float64_oracle(self, attn_case, caplog):
        q, kv, sink, idx, scale = attn_inputs(attn_case)
        with caplog.at_level(logging.WARNING):
            got = self.attend(q, kv, sink, idx, scale)
        assert "using the reference" not in caplog.text  # a kernel class must not test the fallback
        assert got.dtype == jnp.bfloat16 and got.shape == q.shape
        got = np.asarray(got, np.float64)
        want = attn_f64(q, kv, sink, idx, scale)
        assert np.all(np.isfinite(got))
        err = np.abs(got - want)
        tol = self.tolerance(want, kv, idx.shape[-1])
        assert np.all(err <= tol), f"max excess {np.max(err - tol)} at {np.unravel_index(np.argmax(err - tol), err.shape)}"
        empty = ~np.asarray(idx >= 0).any(-1)
        assert np.all(got[empty] == 0.0)  # a row with nothing to attend to is exactly zero

    def test_gradient_matches_reference_f32(self):
        if self.implementation == "reference" or not self.extras:
            pytest.skip("the kernels' custom VJP is under test, once per kernel")
        q, kv, sink, idx, scale = attn_inputs("batch_with_repeats")
        w = jnp.asarray(np.random.default_rng(5).normal(size=q.shape), jnp.float32)

        def grads(fn):
            loss = lambda a, b, c: jnp.sum(fn(a, b, c).astype(jnp.float32) * w)
            return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, sink)

        got = grads(lambda a, b, c: self.attend(a, b, c, idx, scale))
        want = grads(lambda a, b, c: attn_api.sparse_attn(a, b, c, idx, scale, implementation="reference",
                                                          accumulate="f32"))
        for g, r in zip(got, want):
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=2e-2, atol=2e-2)


class TestAttnReference(AttnBase):
    implementation = "reference"


class TestAttnReferenceF32(AttnBase):
    implementation, accumulate = "reference", "f32"
    ATTN_CASES = ("fewer_valid_than_topk", "batch_with_repeats", "released_decode", "huge_logits_and_sinks")


# the kernels are f32 (accumulate="f64" on the kernel path is the reference: tested below)
class TestAttnGpuInterpret(AttnBase):
    implementation, target, interpret, accumulate = "pallas", "gpu", True, "f32"


class TestAttnGpuInterpretSplitsAndColumnBlocks(AttnBase):
    implementation, target, interpret, accumulate = "pallas", "gpu", True, "f32"
    block_sizes = attn_api.BlockSizes(block_k=16, block_d=16, num_splits=3)
    ATTN_CASES = ("window_not_full", "rows_all_minus_one", "huge_logits_and_sinks")
    extras = False


class TestAttnGpuInterpretHeadBlocks(AttnBase):
    # 64 heads in 4 programs of 16 (6 heads: padded to one block of 16), 64-slot steps, index splits
    implementation, target, interpret, accumulate = "pallas", "gpu", True, "f32"
    block_sizes = attn_api.BlockSizes(block_h=16, block_k=64, num_splits=2)
    ATTN_CASES = ("released_decode", "odd_tokens_and_heads")
    extras = False


class TestAttnGpuInterpretBf16Probs(AttnBase):
    implementation, target, interpret, accumulate = "pallas", "gpu", True, "f32"
    block_sizes = attn_api.BlockSizes(split_probs=False)
    exact_probs = False
    ATTN_CASES = ("batch_with_repeats",)
    extras = False


class TestAttnTpuInterpret(AttnBase):
    implementation, target, interpret, accumulate = "pallas", "tpu", True, "f32"
    block_sizes = attn_api.BlockSizes(block_k=16)
    ATTN_CASES = ("window_not_full", "rows_all_minus_one", "odd_tokens_and_heads")
    extras = False


class F64KernelBase(AttnBase):
    """The GPU kernel's float64 program (`BlockSizes.f64_kernel`): within the oracle's bound and
    bit for bit the float64 reference's outputs (both round an f64 result, which differ by f64
    operation order alone, ~1e-16 relative)."""
    implementation, target, accumulate = "pallas", "gpu", "f64"
    block_sizes = attn_api.BlockSizes(f64_kernel=True)

    def test_bits_equal_the_float64_reference(self, attn_case, caplog):
        q, kv, sink, idx, scale = attn_inputs(attn_case, seed=1)
        with caplog.at_level(logging.INFO):
            got = self.attend(q, kv, sink, idx, scale)
        assert "using the reference" not in caplog.text
        want = attn_api.sparse_attn(q, kv, sink, idx, scale, implementation="reference")
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


class TestAttnGpuInterpretF64(F64KernelBase):
    interpret = True
    extras = False


class TestAttnGpuInterpretF64SplitsAndColumnBlocks(F64KernelBase):
    interpret = True
    block_sizes = attn_api.BlockSizes(f64_kernel=True, block_k=16, block_d=16, num_splits=3)
    ATTN_CASES = ("window_not_full", "rows_all_minus_one", "huge_logits_and_sinks", "batch_with_repeats")
    extras = False


def test_f64_kernel_tiles_and_its_tpu_request():
    """The float64 program's default tiles (16 heads, all columns, 8 warps, 32-slot steps; index
    splits filling the SMs at decode); on a TPU target the request stays the logged reference."""
    bs = attn_api.BlockSizes(f64_kernel=True).resolved("gpu", 1, 512, 640, 64, f64=True)
    assert (bs.block_h, bs.block_d, bs.block_k, bs.num_warps, bs.num_splits) == (16, 512, 32, 8, 20)
    bs = attn_api.BlockSizes(f64_kernel=True).resolved("gpu", 64, 512, 640, 64, f64=True)
    assert (bs.block_k, bs.num_splits) == (32, 1)
    q, kv, sink, idx, scale = attn_inputs("window_not_full")
    got = attn_api.sparse_attn(q, kv, sink, idx, scale, implementation="pallas", target="tpu", interpret=True,
                               block_sizes=attn_api.BlockSizes(f64_kernel=True))
    want = attn_api.sparse_attn(q, kv, sink, idx, scale, implementation="reference")
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("splits", [1, 4])
def test_f64_kernel_lowers_to_triton_for_cuda(splits):
    """The float64 program lowers for CUDA without a GPU (64-bit types on inside the call only)."""
    from pallas_kernels.sparse_attention import kernel_gpu

    q, kv, sink, idx, scale = attn_inputs("released_decode")
    f = functools.partial(kernel_gpu.sparse_attn, scale=scale, block_k=16, block_d=512, block_h=16,
                          num_splits=splits, num_warps=8, num_stages=2, split_probs=True, interpret=False, f64=True)
    text = jax.jit(f).trace(q, kv, sink, idx).lower(lowering_platforms=("cuda",)).as_text()
    assert "sparse_attn_f64" in text
    assert not jax.config.jax_enable_x64


@pytest.mark.gpu
@needs_gpu
class TestAttnGpuF64(F64KernelBase):
    extras = False


@pytest.mark.gpu
@needs_gpu
class TestAttnGpuF64Splits(F64KernelBase):
    block_sizes = attn_api.BlockSizes(f64_kernel=True, num_splits=4, block_k=32)
    extras = False


@pytest.mark.gpu
@needs_gpu
class TestAttnGpu(AttnBase):
    implementation, target, accumulate = "pallas", "gpu", "f32"


@pytest.mark.gpu
@needs_gpu
class TestAttnGpuSplits(AttnBase):
    implementation, target, accumulate = "pallas", "gpu", "f32"
    block_sizes = attn_api.BlockSizes(num_splits=4, block_d=128, block_k=32)
    extras = False


@pytest.mark.gpu
@needs_gpu
class TestAttnGpuHeadBlocks(AttnBase):
    implementation, target, accumulate = "pallas", "gpu", "f32"
    block_sizes = attn_api.BlockSizes(block_h=32, block_d=256, num_splits=2, num_warps=8)
    extras = False


@pytest.mark.gpu
@needs_gpu
class TestAttnGpuBf16Probs(AttnBase):
    implementation, target, accumulate = "pallas", "gpu", "f32"
    block_sizes = attn_api.BlockSizes(split_probs=False)
    exact_probs = False
    extras = False


@pytest.mark.parametrize("accumulate", ["f64", "f32"])
def test_reference_in_query_chunks_equals_one_pass_bit_for_bit(accumulate):
    """`reference.sparse_attn` with a gather budget below one pass runs the queries in sequential
    chunks (here 7 queries in chunks of 3, 3 and 1 padded to 3) and gives the one-pass outputs bit
    for bit, rows without a valid index included; the lowered chunked program holds no tensor of
    the accumulation dtype above the budget, where the one-pass program holds the whole gather."""
    from pallas_kernels.sparse_attention import reference as ref
    rng = np.random.default_rng(3)
    b, m, h, d, n, k = 2, 7, 16, 64, 40, 24
    q, kv = _bf16(rng, (b, m, h, d), 1.0), _bf16(rng, (b, n, d), 1.0)
    idx = _idx_random(b, m, n, k, 0.3, rng)
    idx[1, 4] = -1
    idx = jnp.asarray(idx.astype(np.int32))
    sink = jnp.asarray(rng.uniform(-1, 3, size=h), jnp.float32)
    item = 8 if accumulate == "f64" else 4
    budget = 3 * b * k * d * item  # three queries' gathered rows
    one = ref.sparse_attn(q, kv, sink, idx, d ** -0.5, accumulate=accumulate)
    chunked = ref.sparse_attn(q, kv, sink, idx, d ** -0.5, accumulate=accumulate, max_gather_bytes=budget)
    assert chunked.shape == (b, m, h, d) and chunked.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(chunked, np.float32), np.asarray(one, np.float32))
    assert not np.any(np.asarray(one[1, 4], np.float32))  # no valid index: zeros

    def largest(max_gather_bytes):
        with jax.enable_x64(True):
            text = jax.jit(ref.sparse_attn, static_argnames=("scale", "accumulate", "max_gather_bytes")).lower(
                q, kv, sink, idx, scale=d ** -0.5, accumulate=accumulate,
                max_gather_bytes=max_gather_bytes).as_text()
        dims = [np.prod([int(v) for v in t.split("x")]) for t in re.findall(rf"tensor<([0-9x]+)x{accumulate}>", text)]
        return max(dims) * item

    assert largest(budget) <= budget
    assert largest(ref.GATHER_BYTES) == b * m * k * d * item


# ==================================================================== dispatch and validation


def test_auto_on_cpu_is_the_reference_bit_for_bit():
    if jax.default_backend() != "cpu":
        pytest.skip("CPU dispatch")
    q, kv, sink, idx, scale = attn_inputs("batch_with_repeats")
    from pallas_kernels.sparse_attention.reference import sparse_attn as ref
    np.testing.assert_array_equal(np.asarray(attn_api.sparse_attn(q, kv, sink, idx, scale), np.float32),
                                  np.asarray(ref(q, kv, sink, idx, scale), np.float32))


def test_pallas_on_cpu_without_interpret_is_refused():
    if jax.default_backend() != "cpu":
        pytest.skip("CPU dispatch")
    q, kv, sink, idx, scale = attn_inputs("window_not_full")
    with pytest.raises(ValueError, match="interpret"):
        attn_api.sparse_attn(q, kv, sink, idx, scale, implementation="pallas")


def test_target_platform_makes_the_platform_choices_for_another_platform():
    """Tracing for a GPU on this host (deviceless compilation, `benchmarks.launch_count`): the
    kernels are picked as on a GPU, the float64 evaluations stay, and the default returns after."""
    from dsv41_jax.attention import resolve_attn_accumulate
    from pallas_kernels._dispatch import platform, resolve, target_platform

    if jax.default_backend() != "cpu":
        pytest.skip("CPU dispatch")
    assert platform() == "cpu" and resolve("auto", None, False) == (False, "gpu")
    with target_platform("gpu"):
        assert platform() == "gpu" and resolve("auto", None, False) == (True, "gpu")
        assert resolve("pallas", None, False) == (True, "gpu")  # no interpret needed: not run here
        with target_platform("tpu"):
            assert resolve("auto", None, False) == (True, "tpu")
            assert resolve_attn_accumulate("auto") == "f32"
        assert resolve_attn_accumulate("auto") == "f64"
    assert platform() == "cpu" and resolve("auto", None, False) == (False, "gpu")
    with pytest.raises(ValueError, match="target_platform must be one of"), target_platform("cuda"):
        pass


@pytest.mark.parametrize("bad, match", [
    ({"kv_shape": (2, 48, 32)}, "kv must be"),
    ({"sink_shape": (15,)}, "attn_sink must be"),
    ({"idx_shape": (2, 2, 8)}, "idx must be"),
    ({"implementation": "xla"}, "implementation must be"),
    ({"target": "cuda"}, "target must be"),
])
def test_attention_entry_point_validates_before_tracing(bad, match):
    q, kv, sink, idx, scale = attn_inputs("window_not_full")
    if "kv_shape" in bad:
        kv = jnp.zeros(bad["kv_shape"], jnp.bfloat16)
    if "sink_shape" in bad:
        sink = jnp.zeros(bad["sink_shape"], jnp.float32)
    if "idx_shape" in bad:
        idx = jnp.zeros(bad["idx_shape"], jnp.int32)
    with pytest.raises(ValueError, match=match):
        attn_api.sparse_attn(q, kv, sink, idx, scale, implementation=bad.get("implementation", "pallas"),
                             target=bad.get("target", "gpu"), interpret=True)


def test_sinkhorn_entry_point_validates_before_tracing():
    m, scale, base, _, _ = sinkhorn_inputs("odd_tokens")
    with pytest.raises(ValueError, match="mixes must be"):
        sinkhorn_api.hc_split_sinkhorn(jnp.asarray(m[:, :20]), scale, base, hc=4, iters=20, eps=HC_EPS)
    with pytest.raises(ValueError, match="base must be"):
        sinkhorn_api.hc_split_sinkhorn(jnp.asarray(m), scale, base[:20], hc=4, iters=20, eps=HC_EPS)
    with pytest.raises(ValueError, match="iters"):
        sinkhorn_api.hc_split_sinkhorn(jnp.asarray(m), scale, base, hc=4, iters=0, eps=HC_EPS)


def test_unsupported_attention_shape_falls_back_loudly_to_the_reference(caplog):
    rng = np.random.default_rng(0)
    q, kv = _bf16(rng, (1, 2, 4, 48), 1.0), _bf16(rng, (1, 9, 48), 1.0)  # head_dim 48: no Triton tile
    sink, idx = jnp.zeros((4,), jnp.float32), jnp.asarray(_idx_random(1, 2, 9, 5, 0.2, rng).astype(np.int32))
    with caplog.at_level(logging.WARNING):
        got = attn_api.sparse_attn(q, kv, sink, idx, 0.1, implementation="pallas", target="gpu", interpret=True,
                                   accumulate="f32")
    assert "head_dim must be a power of 2" in caplog.text and "(1, 2, 4, 48)" in caplog.text
    from pallas_kernels.sparse_attention.reference import sparse_attn as ref
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(ref(q, kv, sink, idx, 0.1, accumulate="f32"), np.float32))


@pytest.mark.parametrize("bs", [sinkhorn_api.BlockSizes(block_tokens=96, lanes=False),
                                sinkhorn_api.BlockSizes(lane_tokens=6)])
def test_unsupported_sinkhorn_tile_falls_back_loudly_to_the_reference(caplog, bs):
    m, scale, base, hc, iters = sinkhorn_inputs("odd_tokens")
    with caplog.at_level(logging.WARNING):
        got = sinkhorn_api.hc_split_sinkhorn(jnp.asarray(m), scale, base, hc=hc, iters=iters, eps=HC_EPS,
                                             implementation="pallas", target="gpu", interpret=True,
                                             block_sizes=bs)
    assert "block_tokens must be a power of 2" in caplog.text and "(7, 24)" in caplog.text
    want = sinkhorn_api.hc_split_sinkhorn(jnp.asarray(m), scale, base, hc=hc, iters=iters, eps=HC_EPS,
                                          implementation="reference")
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_attention_precision_is_validated_before_tracing():
    q, kv, sink, idx, scale = attn_inputs("window_not_full")
    with pytest.raises(ValueError, match="accumulate must be"):
        attn_api.sparse_attn(q, kv, sink, idx, scale, implementation="pallas", target="gpu", interpret=True,
                             accumulate="bf16")


@pytest.mark.parametrize("target", ["gpu", "tpu"])
def test_float64_request_on_the_kernel_path_is_the_logged_float64_reference(target, caplog):
    # the model's call (accumulate="f64"): bit for bit the oracle's rounding, never the f32 kernel
    q, kv, sink, idx, scale = attn_inputs("released_decode")
    with caplog.at_level(logging.WARNING):
        got = attn_api.sparse_attn(q, kv, sink, idx, scale, implementation="pallas", target=target,
                                   interpret=jax.default_backend() == "cpu")
    assert "computes in f32, float64 rounding was asked for" in caplog.text
    want = attn_api.sparse_attn(q, kv, sink, idx, scale, implementation="reference")
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
