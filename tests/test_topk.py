"""The indexer's ascending top-k (pallas_kernels/topk): the jnp reference and the GPU kernel
(interpret mode on CPU; compiled when a GPU is present) against a numpy oracle that ranks by
(score descending in IEEE total order, column ascending) itself; the CUDA lowering (checked here
without a GPU); the fallbacks and argument errors; `select_topk`'s mask and offset on both paths.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41_jax.attention import select_topk
from pallas_kernels.topk import api, kernel_gpu

HAS_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")


def total_order_key(s: np.ndarray) -> np.ndarray:
    """bf16 values -> int64 keys in IEEE total order (-0 below +0), from the bits (numpy only)."""
    bits = np.asarray(s, ml_dtypes.bfloat16).view(np.uint16).astype(np.int64)
    return np.where(bits & 0x8000, -(bits & 0x7FFF) - 1, bits)


def oracle(s: np.ndarray, k: int) -> np.ndarray:
    keys = total_order_key(s).reshape(-1, s.shape[-1])
    rows = [np.sort(np.lexsort((np.arange(len(r)), -r))[:k]) for r in keys]
    return np.asarray(rows, np.int32).reshape(*s.shape[:-1], k)


def tied_scores(rng, shape, signed_zeros: bool) -> np.ndarray:
    """bf16 scores with many ties (halves in [-2, 2]), -inf columns, and +-0 when asked."""
    s = rng.integers(-4, 5, size=shape).astype(np.float32) * 0.5
    s[..., ::7] = -np.inf
    if signed_zeros:
        s[..., 3::11] = -0.0
    else:
        s[s == 0] = 0.0  # +0 only: lax.top_k on CPU need not order -0 below +0
    return s.astype(ml_dtypes.bfloat16)


# name -> (shape, k): widths below, at and above powers of 2; k = W; one row; the released
# decode widths (2048 and 4096 compressed positions, index_topk 512)
CASES = {
    "small": ((3, 100), 7),
    "k_is_width": ((5, 37), 37),
    "one_column": ((2, 1), 1),
    "pow2": ((4, 1024), 100),
    "ratio2_4k": ((2, 1, 2048), 512),
    "ratio1_4k": ((1, 1, 4096), 512),
}


class Base:
    implementation, interpret, signed_zeros = "reference", False, False

    @pytest.mark.parametrize("case", list(CASES))
    def test_matches_oracle(self, case):
        shape, k = CASES[case]
        s = tied_scores(np.random.default_rng(len(case)), shape, self.signed_zeros)
        got = api.topk_positions(jnp.asarray(s), k, implementation=self.implementation, interpret=self.interpret)
        assert got.dtype == jnp.int32 and got.shape == (*shape[:-1], k)
        np.testing.assert_array_equal(np.asarray(got), oracle(s, k))

    def test_distinct_scores(self):
        s = np.random.default_rng(3).standard_normal((6, 3000)).astype(ml_dtypes.bfloat16)
        got = api.topk_positions(jnp.asarray(s), 512, implementation=self.implementation, interpret=self.interpret)
        np.testing.assert_array_equal(np.asarray(got), oracle(s, 512))


class TestReference(Base):
    pass


class TestKernelInterpret(Base):
    implementation, interpret = "pallas", True


class TestKernelInterpretSignedZeros(Base):
    implementation, interpret, signed_zeros = "pallas", True, True


@pytest.mark.gpu
@needs_gpu
class TestKernelGPU(Base):
    implementation, signed_zeros = "pallas", True


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("width", [2048, 4096, 16384])
def test_kernel_equals_xla_top_k_on_gpu(width):
    """Compiled, on the model's score distribution (bf16 sums with ties and -inf columns): the
    kernel's rows are XLA:GPU's own top_k + sort, bit for bit."""
    s = jnp.asarray(tied_scores(np.random.default_rng(width), (8, width), True))
    want = jax.jit(lambda s: api.topk_positions(s, 512, implementation="reference"))(s)
    got = jax.jit(lambda s: api.topk_positions(s, 512, implementation="pallas"))(s)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_score_keys_order_every_bf16_like_total_order():
    codes = np.arange(1 << 16, dtype=np.uint16)
    vals = codes.view(ml_dtypes.bfloat16)
    keys = np.asarray(kernel_gpu.score_keys(jnp.asarray(vals)))
    want = total_order_key(vals)
    assert keys.min() == -32768 and keys.max() == 32767
    np.testing.assert_array_equal(keys, want)


def test_kernel_lowers_to_triton_for_cuda():
    s = jnp.zeros((4, 4096), jnp.bfloat16)
    f = lambda s: kernel_gpu.topk_positions(s, 512, num_warps=None, interpret=False)
    assert "topk_positions" in jax.jit(f).trace(s).lower(lowering_platforms=("cuda",)).as_text()


def test_rows_wider_than_a_program_fall_back_with_a_warning(caplog):
    s = tied_scores(np.random.default_rng(5), (1, kernel_gpu.MAX_WIDTH + 1), False)
    with caplog.at_level(logging.WARNING, logger="pallas_kernels.topk.api"):
        got = api.topk_positions(jnp.asarray(s), 64, implementation="pallas", interpret=True)
    assert "does not handle scores (1, 16385)" in caplog.text
    np.testing.assert_array_equal(np.asarray(got), oracle(s, 64))


def test_f32_scores_fall_back_to_the_reference(caplog):
    s = np.random.default_rng(6).standard_normal((2, 50)).astype(np.float32)
    with caplog.at_level(logging.WARNING, logger="pallas_kernels.topk.api"):
        got = api.topk_positions(jnp.asarray(s), 5, implementation="pallas", interpret=True)
    assert "bf16 scores only" in caplog.text
    np.testing.assert_array_equal(np.asarray(got), np.sort(np.argsort(-s, axis=-1, kind="stable")[:, :5], axis=-1))


@pytest.mark.parametrize("k", [0, 11, 2.0])
def test_bad_k_is_rejected(k):
    with pytest.raises(ValueError, match="k must be an int in"):
        api.topk_positions(jnp.zeros((2, 10), jnp.bfloat16), k)


@pytest.mark.parametrize("implementation, interpret", [("reference", False), ("pallas", True)])
def test_select_topk_masks_hidden_positions_and_adds_the_offset(implementation, interpret):
    s = tied_scores(np.random.default_rng(7), (2, 1, 300), False)
    lens = jnp.asarray([[[40]], [[300]]], jnp.int32)
    got = np.asarray(select_topk(jnp.asarray(s), lens, 64, 128, implementation, interpret))
    idx = oracle(s, 64)
    want = np.where(idx < np.asarray(lens), idx + 128, -1)
    np.testing.assert_array_equal(got, want)
    assert (got[0] == -1).sum() == 64 - np.sum(idx[0] < 40)
