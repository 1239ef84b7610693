"""The one-launch window-KV row (pallas_kernels/window_kv): interpret mode against the jnp
reference on CPU, the compiled kernel on a GPU (`gpu` marker), the model's decode step with it."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.window_kv import api, kernel_gpu
from pallas_kernels.window_kv import reference as ref

HAS_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")


def _inputs(rng, window: int, hd: int, rd: int, exact_scale: int | None = None):
    """ring, kv, norm weight, cos, sin. With exact_scale: kv of one binade (+-n 2^(e-4), 32 <= n
    < 64), so the norm's sum of squares is exact in any order."""
    ring = jnp.asarray(rng.standard_normal((1, window, hd)), jnp.bfloat16)
    if exact_scale is None:
        kv = rng.standard_normal((1, hd)) * 3
    else:
        kv = (rng.integers(32, 64, (1, hd)) * rng.choice([-1, 1], (1, hd)) * 2.0 ** (exact_scale - 4))
    nw = jnp.asarray(1 + 0.1 * rng.standard_normal(hd), jnp.bfloat16)
    ang = rng.uniform(-40, 40, (1, rd // 2)).astype(np.float32)
    return ring, jnp.asarray(kv, jnp.bfloat16), nw, jnp.cos(ang), jnp.sin(ang)


def _bits(a):
    return np.asarray(a).view(np.uint16)


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=[pytest.mark.gpu, needs_gpu])])
@pytest.mark.parametrize(("window", "hd", "rd"), [(128, 512, 64), (8, 64, 16), (12, 128, 32)])
def test_kernel_writes_the_reference_row_into_its_slot(window, hd, rd, interpret):
    """The released shape (tile 64, all of it RoPE) and smaller ones (a tile with identity columns
    before the RoPE pairs): where the norm's sum of squares is exact in any order (rows of one
    binade over 40 binades of scale) the ring equals the reference's bit for bit at every slot
    form (first, last, negative, out of range: dropped); on normal rows too (measured: every
    bit equal on these rows), and only the slot's row changes."""
    rng = np.random.default_rng(41)
    for scale in (-20, 0, 20, None, None):
        ring, kv, nw, cos, sin = _inputs(rng, window, hd, rd, scale)
        for slot in (0, window - 1, 5, -1, window, -window - 1):
            got = api.write_window_row(ring, jnp.asarray([slot]), kv, nw, 1e-6, cos, sin, rd, implementation="pallas",
                                       interpret=interpret)
            want = ref.write_window_row(ring, jnp.asarray([slot]), kv, nw, 1e-6, cos, sin, rd)
            np.testing.assert_array_equal(_bits(got), _bits(want))
            changed = np.flatnonzero(np.any(_bits(got) != _bits(ring), axis=-1)[0])
            in_range = -window <= slot < window
            assert list(changed) == ([slot % window] if in_range else [])


def test_rotation_matrix_rotates_the_pairs_of_the_tail():
    """`rotation` is the identity before the RoPE tail and, on it, `layers.apply_rope`'s
    rotation of interleaved pairs, bit for bit (each output one product or the sum of two)."""
    from dsv41_jax.layers import apply_rope

    rng = np.random.default_rng(42)
    ang = rng.uniform(-40, 40, 16).astype(np.float32)
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x = jnp.asarray(rng.standard_normal((1, 64)), jnp.bfloat16)
    r = kernel_gpu.rotation(cos, sin, 64, 32)
    got = (np.asarray(x, np.float32).T * np.asarray(r)).sum(axis=0).astype(ml_dtypes.bfloat16)
    want = apply_rope(x[None], cos[None, None], sin[None, None], 32)[0, 0]
    np.testing.assert_array_equal(got.view(np.uint16), _bits(want))


def test_other_batches_and_shapes_take_the_reference(caplog):
    """Two rows, or a head dim that no power-of-2 tile covering the RoPE tail divides (a
    warning), run the reference; bad arguments are rejected."""
    rng = np.random.default_rng(43)
    ring, kv, nw, cos, sin = _inputs(rng, 8, 64, 16)
    ring2, kv2 = jnp.concatenate([ring, ring]), jnp.concatenate([kv, kv * 2])
    cos2, sin2 = jnp.concatenate([cos, cos]), jnp.concatenate([sin, sin])
    got = api.write_window_row(ring2, jnp.asarray([1, 2]), kv2, nw, 1e-6, cos2, sin2, 16, implementation="pallas",
                               interpret=True)
    np.testing.assert_array_equal(_bits(got), _bits(ref.write_window_row(ring2, jnp.asarray([1, 2]), kv2, nw, 1e-6,
                                                                         cos2, sin2, 16)))
    # hd 96 with a 64-wide RoPE tail: no power-of-2 tile >= 64 divides 96
    odd_ring, odd_kv, odd_nw, ocos, osin = _inputs(rng, 8, 96, 64)
    with caplog.at_level(logging.WARNING, logger="pallas_kernels.window_kv.api"):
        got = api.write_window_row(odd_ring, jnp.asarray([3]), odd_kv, odd_nw, 1e-6, ocos, osin, 64,
                                   implementation="pallas", interpret=True)
    assert "window_kv_row: kernel does not handle" in caplog.text
    np.testing.assert_array_equal(_bits(got), _bits(ref.write_window_row(odd_ring, jnp.asarray([3]), odd_kv, odd_nw,
                                                                         1e-6, ocos, osin, 64)))
    with pytest.raises(ValueError, match=r"ring \[b, W, hd\] and kv \[b, hd\]"):
        api.write_window_row(ring, jnp.asarray([0]), kv[:, :32], nw, 1e-6, cos, sin, 16)


def test_kernel_lowers_to_triton_for_cuda():
    ring, kv = jnp.zeros((1, 128, 512), jnp.bfloat16), jnp.zeros((1, 512), jnp.bfloat16)
    cs = jnp.zeros((1, 32), jnp.float32)
    f = lambda ring, kv: kernel_gpu.write_window_row(ring, jnp.asarray([3]), kv, kv[0], 1e-20, cs, cs, 64,
                                                     interpret=False)
    text = jax.jit(f).trace(ring, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert "window_kv_row" in text


def test_model_decode_step_with_the_window_row_in_one_launch(monkeypatch):
    """The one-row golden decode step with `Attention.kv_row_kernel` on every layer (kernels
    "pallas", interpret): every layer writes its window row with the kernel and the step's
    logits and new caches equal the reference path's (measured: bit-identical on the first
    golden set's first step on CPU)."""
    from conftest import GOLDEN_DIRS
    from flax import nnx

    from dsv41_jax import parity
    from dsv41_jax.attention import Attention
    from dsv41_jax.parity import GoldenSet

    gs = GoldenSet(GOLDEN_DIRS[0])
    model = parity.load_model(gs, kernels="pallas", kernels_interpret=True)
    layers = [m for _, m in nnx.iter_modules(model) if isinstance(m, Attention)]
    for m in layers:
        m.kv_row_kernel = True
    calls = []
    original = kernel_gpu.write_window_row
    monkeypatch.setattr(kernel_gpu, "write_window_row",
                        lambda ring, *a, **kw: calls.append(ring.shape) or original(ring, *a, **kw))
    jax.clear_caches()
    cache = jax.tree.map(lambda a: a[:1], parity.teacher_forced_cache(parity.load_model(gs), gs))

    def first_step(m):
        ids = jnp.asarray(gs["decode.input"][0], jnp.int32)[:1]
        return m.decode_step(ids, jnp.full(ids.shape, int(gs["decode.start_pos"][0]), jnp.int32), cache)

    logits, new_cache = first_step(model)
    a = gs.args
    assert calls and set(calls) == {(1, a.window_size, a.head_dim)}
    want_logits, want_cache = first_step(parity.load_model(gs))
    np.testing.assert_array_equal(np.asarray(logits, np.float32), np.asarray(want_logits, np.float32))
    for got, want in zip(jax.tree.leaves(new_cache), jax.tree.leaves(want_cache), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
