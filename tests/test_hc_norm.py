"""The fused hc_pre + RMSNorm kernel (pallas_kernels/hc_norm) against the model's two jnp steps
(interpret mode on CPU; compiled when a GPU is present), its dispatch, and the model's fused path
(`ModelArgs.kernels_fused`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.hc_norm import api, kernel_gpu
from pallas_kernels.hc_norm import reference as ref

HAS_GPU = jax.default_backend() == "gpu"


def _inputs(rng, t, hc, d):
    x = rng.standard_normal((t, hc, d)) * np.exp(rng.uniform(-4, 4, (t, 1, 1)))
    x[0, :, :7] = 0.0  # a few exact zeros; token 0 keeps a non-zero norm
    pre = rng.uniform(0.0, 1.0, (t, hc))
    w = rng.standard_normal(d)
    return jnp.asarray(x, jnp.bfloat16), jnp.asarray(pre, jnp.float32), jnp.asarray(w, jnp.bfloat16)


def _bf16_ulps(a, b) -> np.ndarray:
    ia = np.asarray(a).view(np.uint16).astype(np.int32)
    ib = np.asarray(b).view(np.uint16).astype(np.int32)
    to_ordered = lambda i: np.where(i & 0x8000, 0x8000 - (i & 0x7FFF), 0x8000 + i)
    return np.abs(to_ordered(ia) - to_ordered(ib))


@pytest.mark.parametrize("t, hc, d, block_d", [(1, 4, 5120, 1024), (3, 4, 5120, 512), (5, 2, 200, 64),
                                               (2, 1, 96, 32), (7, 4, 256, 256)])
def test_kernel_matches_hc_pre_then_rms_norm(t, hc, d, block_d):
    """Same rounding points. The order of the d squares differs, and XLA:CPU contracts hc_pre's
    multiply-adds differently in the two (kernel_gpu._Ops); measured in interpret mode: at most
    2 bf16 ulps (an hc_pre sum that cancels to a neighbouring bf16 value), on at most 0.1% of
    the outputs (1 of 1000 at d = 200; 3 of 15360 at d = 5120), none at the smallest d."""
    x, pre, w = _inputs(np.random.default_rng(t * 100 + d), t, hc, d)
    got = api.hc_pre_norm(x, pre, w, 1e-6, implementation="pallas", interpret=not HAS_GPU,
                          block_sizes=api.BlockSizes(block_d=block_d))
    want = ref.hc_pre_norm(x, pre, w, 1e-6)
    assert got.shape == (t, d) and got.dtype == jnp.bfloat16
    ulps = _bf16_ulps(got, want)
    assert ulps.max() <= 2 and np.mean(ulps > 0) <= 1e-3, (ulps.max(), np.mean(ulps > 0))


def test_leading_dims_and_auto_dispatch():
    rng = np.random.default_rng(1)
    x, pre, w = _inputs(rng, 6, 4, 128)
    x4, pre3 = x.reshape(2, 3, 4, 128), pre.reshape(2, 3, 4)
    got = api.hc_pre_norm(x4, pre3, w, 1e-6, implementation="pallas", interpret=not HAS_GPU)
    assert got.shape == (2, 3, 128)
    np.testing.assert_array_equal(np.asarray(got).reshape(6, 128).view(np.uint16),
                                  np.asarray(api.hc_pre_norm(x, pre, w, 1e-6, implementation="pallas",
                                                             interpret=not HAS_GPU)).view(np.uint16))
    if not HAS_GPU:  # "auto" on CPU is the reference, bit for bit
        np.testing.assert_array_equal(np.asarray(api.hc_pre_norm(x4, pre3, w, 1e-6)).view(np.uint16),
                                      np.asarray(ref.hc_pre_norm(x4, pre3, w, 1e-6)).view(np.uint16))


def test_bad_shapes_name_the_tensor():
    x, pre, w = _inputs(np.random.default_rng(2), 2, 4, 64)
    with pytest.raises(ValueError, match="pre must be"):
        api.hc_pre_norm(x, pre[:, :3], w, 1e-6)
    with pytest.raises(ValueError, match="norm weight must be"):
        api.hc_pre_norm(x, pre, w[:32], 1e-6)


def test_unsupported_dtype_falls_back_to_the_reference(caplog):
    x, pre, w = _inputs(np.random.default_rng(3), 2, 4, 64)
    with caplog.at_level("WARNING"):
        got = api.hc_pre_norm(x.astype(jnp.float32), pre, w, 1e-6, implementation="pallas", interpret=True)
    assert "hc_pre_norm: kernel does not handle" in caplog.text
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref.hc_pre_norm(x.astype(jnp.float32), pre, w, 1e-6)))


def test_kernel_lowers_to_triton_for_cuda():
    x = jax.ShapeDtypeStruct((64, 4, 5120), jnp.bfloat16)
    pre = jax.ShapeDtypeStruct((64, 4), jnp.float32)
    w = jax.ShapeDtypeStruct((5120,), jnp.bfloat16)
    f = lambda x, p, w: kernel_gpu.hc_pre_norm(x, p, w, eps=1e-6, block_d=1024, num_warps=4, interpret=False)
    assert "hc_pre_norm" in jax.jit(f).trace(x, pre, w).lower(lowering_platforms=("cuda",)).as_text()


def test_gradient_comes_from_the_reference():
    x, pre, w = _inputs(np.random.default_rng(4), 2, 4, 64)
    loss = lambda impl: lambda p: jnp.sum(api.hc_pre_norm(x, p, w, 1e-6, implementation=impl,
                                                          interpret=True).astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(jax.grad(loss("pallas"))(pre)),
                               np.asarray(jax.grad(loss("reference"))(pre)), rtol=1e-6)


def test_model_decode_step_with_fused_kernels_tracks_the_unfused_step(monkeypatch):
    """kernels_fused=True routes every sublayer input and the head's through hc_pre_norm, lets
    the fp8 kernel quantise its own rows and the Sinkhorn kernel form its RMS factor; the golden set's first decode step (kernels in
    interpret mode on CPU) then tracks the unfused jnp path's logits."""
    from conftest import GOLDEN_DIRS

    from dsv41_jax import parity
    from dsv41_jax.parity import GoldenSet
    from pallas_kernels.fp8_matmul import kernel_gpu as fp8_kernel
    from pallas_kernels.sinkhorn import kernel_gpu as sinkhorn_kernel

    gs = GoldenSet(GOLDEN_DIRS[0])
    norms, quantised, splits = [], [], []
    original_norm, original_fp8 = kernel_gpu.hc_pre_norm, fp8_kernel.fp8_matmul
    original_split = sinkhorn_kernel.hc_split_sinkhorn
    monkeypatch.setattr(kernel_gpu, "hc_pre_norm", lambda *a, **kw: norms.append(a[0].shape) or original_norm(*a, **kw))
    monkeypatch.setattr(sinkhorn_kernel, "hc_split_sinkhorn",
                        lambda *a, **kw: splits.append(kw.get("rms_from")) or original_split(*a, **kw))
    monkeypatch.setattr(fp8_kernel, "fp8_matmul",
                        lambda *a, **kw: quantised.append(kw.get("quantise", False)) or original_fp8(*a, **kw))
    jax.clear_caches()
    cache = parity.teacher_forced_cache(parity.load_model(gs), gs)
    ids = jnp.asarray(gs["decode.input"][0], jnp.int32)
    pos = jnp.full(ids.shape, int(gs["decode.start_pos"][0]), jnp.int32)

    def step(model):
        return np.asarray(model.decode_step(ids, pos, cache)[0], np.float32)

    got = step(parity.load_model(gs, kernels="pallas", kernels_interpret=True, kernels_fused=True))
    # two sublayers a layer and the head; each site is traced twice (the fallback check, the call)
    assert len(norms) == 2 * (2 * gs.args.n_layers + 1)
    assert quantised and all(quantised)
    assert splits and all(r == (gs.args.hc_mult * gs.args.dim, gs.args.norm_eps) for r in splits)
    norms.clear()
    want = step(parity.load_model(gs))  # the jnp path (kernels "auto" on CPU), unfused
    assert not norms
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())
    assert np.mean(got == want) >= 0.99


def test_sinkhorn_site_forming_its_rms_factor_in_the_kernel_is_bit_identical():
    """kernels_fused's Sinkhorn site: the GPU split kernel forms 1 / sqrt(sum / n + eps) from the
    sums of squares (`_triton.rms_factor`, the IEEE steps of numerics.mean / reciprocal_sqrt)
    instead of taking the factor from XLA; the outputs (and the gradient) are unchanged."""
    from pallas_kernels.sinkhorn import api as sinkhorn_api

    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, 3, 4, 1280)) * 3, jnp.bfloat16)  # n = 5120: not a power of 2
    fn = jnp.asarray(rng.standard_normal((24, 4 * 1280)) * 0.02, jnp.float32)
    scale = jnp.asarray([0.9, 1.1, 1.7], jnp.float32)
    base = jnp.asarray(rng.standard_normal(24), jnp.float32)
    kw = {"norm_eps": 1e-6, "iters": 20, "hc_eps": 1e-6, "implementation": "pallas", "interpret": not HAS_GPU}
    plain = sinkhorn_api.hc_mixes(x, fn, scale, base, **kw)
    fused = sinkhorn_api.hc_mixes(x, fn, scale, base, **kw, fused=True)
    for a, b in zip(plain, fused):
        np.testing.assert_array_equal(np.asarray(a).view(np.int32), np.asarray(b).view(np.int32))
    loss = lambda f: lambda x: jnp.sum(sinkhorn_api.hc_mixes(x.astype(jnp.bfloat16), fn, scale, base, **kw,
                                                             fused=f)[2] * jnp.arange(16.0).reshape(4, 4))
    xf = x.astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(jax.grad(loss(True))(xf)), np.asarray(jax.grad(loss(False))(xf)),
                               rtol=1e-6, atol=1e-12)


def test_rms_factor_is_the_models_rounding():
    from dsv41_jax.numerics import mean, reciprocal_sqrt
    from pallas_kernels._triton import rms_factor

    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((512, 5120)), jnp.float32)
    want = reciprocal_sqrt(mean(jnp.square(x), axis=-1) + jnp.float32(1e-6))
    got = jax.jit(lambda s: rms_factor(s, 5120, 1e-6, True))(jnp.sum(jnp.square(x), axis=-1))
    np.testing.assert_array_equal(np.asarray(got).view(np.int32), np.asarray(want).view(np.int32))
