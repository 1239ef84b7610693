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

from dsv41_jax import quant
from dsv41_jax.attention import select_topk
from pallas_kernels.topk import api, kernel_gpu
from pallas_kernels.topk import reference as ref

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
@pytest.mark.parametrize("width", [2048, 4096, 16384, 32768, 65536, 600000])
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


LOWEST = np.array([0xFFFF], np.uint16).view(ml_dtypes.bfloat16)[0]  # key -32768, the chunk padding's value


# rows wider than one program: a padded last chunk (16385 = 2 x 8193 - 1, 40000 = 3 x 13334 - 2)
# and the 64k context's widths (32768 and 65536 compressed positions: 2 and 4 chunks, no padding)
@pytest.mark.parametrize("shape", [(2, 16385), (1, 40000), (2, 1, 32768), (1, 65536)])
def test_rows_wider_than_a_program_run_in_chunks(shape, caplog):
    s = tied_scores(np.random.default_rng(shape[-1]), shape, True)
    s.reshape(-1)[5::97] = LOWEST
    with caplog.at_level(logging.WARNING, logger="pallas_kernels.topk.api"):
        got = api.topk_positions(jnp.asarray(s), 512, implementation="pallas", interpret=True)
    assert "does not handle" not in caplog.text
    np.testing.assert_array_equal(np.asarray(got), oracle(s, 512))


def test_chunk_padding_never_takes_a_real_lowest_score_s_place():
    """Most of the row holds the lowest key itself (as the padding does): the k picks are the few
    larger scores, then the lowest columns among the ties, never a padding column."""
    width = kernel_gpu.MAX_WIDTH + 3  # two chunks of 8194 columns, one of padding
    s = np.full((2, width), LOWEST)
    s[:, [7, 8200, width - 1]] = np.array([1.0, -2.0, 3.0], ml_dtypes.bfloat16)
    got = np.asarray(api.topk_positions(jnp.asarray(s), 300, implementation="pallas", interpret=True))
    np.testing.assert_array_equal(got, oracle(s, 300))
    assert np.all(got.max(axis=1) == width - 1) and np.all(np.count_nonzero(got > 8193, axis=1) == 2)


def test_candidates_wider_than_a_program_go_through_the_chunks_again(monkeypatch, caplog):
    """Programs of 1024 columns and k = 64: 40000 columns -> 40 chunks -> 2560 candidates -> 3
    chunks -> 192 -> one program: the oracle's picks (the same rounds hold rows above 524288
    columns at the real width, k = 512)."""
    monkeypatch.setattr(kernel_gpu, "MAX_WIDTH", 1024)
    s = tied_scores(np.random.default_rng(8), (2, 40000), True)
    s.reshape(-1)[3::89] = LOWEST
    calls = []
    row_kernel = kernel_gpu.topk_positions
    monkeypatch.setattr(kernel_gpu, "topk_positions", lambda x, k, **kw: calls.append(x.shape) or row_kernel(x, k, **kw))
    with caplog.at_level(logging.WARNING, logger="pallas_kernels.topk.api"):
        got = api.topk_positions(jnp.asarray(s), 64, implementation="pallas", interpret=True)
    assert "does not handle" not in caplog.text
    np.testing.assert_array_equal(np.asarray(got), oracle(s, 64))
    assert calls == [(2, 40000), (80, 1000), (2, 2560), (6, 854), (2, 192)]


def test_rows_whose_chunks_cannot_hold_k_fall_back_with_a_warning(caplog):
    s = tied_scores(np.random.default_rng(5), (1, kernel_gpu.MAX_WIDTH + 1), False)
    with caplog.at_level(logging.WARNING, logger="pallas_kernels.topk.api"):
        got = api.topk_positions(jnp.asarray(s), 9000, implementation="pallas", interpret=True)
    assert "does not handle scores (1, 16385)" in caplog.text and "need k < 8193" in caplog.text
    np.testing.assert_array_equal(np.asarray(got), oracle(s, 9000))


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


# ---------------------------------------------------------------- the MoE gate's ranked top-k


def total_order_key32(x: np.ndarray) -> np.ndarray:
    """f32 values -> int64 keys in IEEE total order, from the bits (numpy only)."""
    bits = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
    return np.where(bits < 0, -(bits & 0x7FFFFFFF) - 1, bits)


def router_oracle(scores: np.ndarray, biased: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank by (biased descending in total order, column ascending); weights = scores there."""
    keys = total_order_key32(biased)
    idx = np.stack([np.lexsort((np.arange(len(r)), -r))[:k] for r in keys]).astype(np.int32)
    return np.take_along_axis(scores, idx, axis=-1), idx


def router_inputs(rng, n: int, e: int, special: bool) -> tuple[np.ndarray, np.ndarray]:
    """sqrt-softplus-like scores and biased scores with ties (every other row on a 1/4 grid);
    `special` adds +-inf, a NaN of each sign and -0 next to +0 (IEEE total order ranks them)."""
    scores = np.sqrt(np.log1p(np.exp(rng.standard_normal((n, e))))).astype(np.float32)
    biased = scores + (rng.integers(-2, 3, e) * 0.25).astype(np.float32)
    biased[::2] = np.round(biased[::2] * 4) / 4
    if special and e >= 8:
        biased[:, 1], biased[:, 2] = np.inf, -np.inf
        biased[0, 3], biased[0, 4] = -0.0, 0.0
        biased[-1, 5] = np.float32(np.nan)
        biased[-1, 6] = -np.float32(np.nan)
        biased[0, 7:] = 0.0  # a row of +0 ties after its -0
    return scores, biased


# name -> (rows, experts, k): the released gate (384 experts, top-6), the tiny sets' 8 experts,
# a width that is no power of 2, k = E
ROUTER_CASES = {"released": (3, 384, 6), "one_token": (1, 384, 6), "tiny": (4, 8, 3), "odd_width": (5, 100, 8),
                "k_is_width": (2, 7, 7)}


class RouterBase:
    implementation, interpret, special = "reference", False, False

    @pytest.mark.parametrize("case", list(ROUTER_CASES))
    def test_router_matches_oracle(self, case):
        n, e, k = ROUTER_CASES[case]
        scores, biased = router_inputs(np.random.default_rng(n * e), n, e, self.special)
        w, idx = api.router_topk(jnp.asarray(scores), jnp.asarray(biased), k, implementation=self.implementation,
                                 interpret=self.interpret)
        assert w.dtype == jnp.float32 and idx.dtype == jnp.int32 and idx.shape == w.shape == (n, k)
        want_w, want_idx = router_oracle(scores, biased, k)
        np.testing.assert_array_equal(np.asarray(idx), want_idx)
        np.testing.assert_array_equal(np.asarray(w).view(np.uint32), want_w.view(np.uint32))


class TestRouterReference(RouterBase):  # lax.top_k on CPU need not rank -0 / NaN in total order
    pass


class TestRouterKernelInterpret(RouterBase):
    implementation, interpret, special = "pallas", True, True


@pytest.mark.gpu
@needs_gpu
class TestRouterKernelGPU(RouterBase):
    implementation, special = "pallas", True


@pytest.mark.gpu
@needs_gpu
def test_router_kernel_equals_xla_top_k_on_gpu():
    scores, biased = (jnp.asarray(a) for a in router_inputs(np.random.default_rng(8), 64, 384, False))
    want = jax.jit(lambda s, b: api.router_topk(s, b, 6, implementation="reference"))(scores, biased)
    got = jax.jit(lambda s, b: api.router_topk(s, b, 6, implementation="pallas"))(scores, biased)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_score_keys32_order_like_total_order():
    rng = np.random.default_rng(9)
    bits = np.concatenate([rng.integers(-(1 << 31), 1 << 31, 4096), [0, -(1 << 31), 0x7F800000, -8388608, 0x7FC00000,
                                                                     -1, 0x7FFFFFFF, 1]]).astype(np.int32)
    vals = bits.view(np.float32)
    keys = np.asarray(kernel_gpu.score_keys32(jnp.asarray(vals)))
    np.testing.assert_array_equal(keys.astype(np.int64), total_order_key32(vals))


def test_router_kernel_lowers_to_triton_for_cuda():
    s = jnp.zeros((4, 384), jnp.float32)
    f = lambda s: kernel_gpu.router_topk(s, s, 6, num_warps=None, interpret=False)
    assert "router_topk" in jax.jit(f).trace(s).lower(lowering_platforms=("cuda",)).as_text()


def _gate_logits(rng, n: int, e: int) -> np.ndarray:
    """[n, e] f32 logits: normal ones, some large of both signs (softplus saturating to x and to
    exp(x)), tiny ones, exact zeros, and ties (repeated values)."""
    x = (rng.standard_normal((n, e)) * 3).astype(np.float32)
    x[:, :8] = [40.0, -40.0, 1e-30, -1e-30, 0.0, -0.0, 88.5, -103.0]
    x[:, 8:12] = x[:, 12:16]
    return x


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=[pytest.mark.gpu, needs_gpu])])
@pytest.mark.parametrize("per_row_bias", [False, True])
def test_router_scored_in_the_kernel_equals_scores_then_selection(interpret, per_row_bias):
    """`router_topk_scored` with sqrt(softplus) formed in the kernel (interpret, or compiled on a
    GPU) gives XLA's scores followed by the selection bit for bit (weights and ranks; bias [E]
    or per row), for the released width and an odd one; the scores are numpy's float64
    sqrt(softplus) rounded as torch rounds it."""
    rng = np.random.default_rng(12)
    for n, e, k in ((1, 384, 6), (3, 384, 6), (5, 100, 8)):
        logits = _gate_logits(rng, n, e)
        bias = (rng.integers(-4, 5, (n, e) if per_row_bias else e) * 0.125).astype(np.float32)
        got = api.router_topk_scored(jnp.asarray(logits), jnp.asarray(bias), k, "sqrtsoftplus",
                                     implementation="pallas", interpret=interpret)
        want = jax.jit(ref.router_topk_scored, static_argnums=(2, 3))(jnp.asarray(logits), jnp.asarray(bias), k,
                                                                      "sqrtsoftplus")
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint32), np.asarray(want[0]).view(np.uint32))
        sp = np.logaddexp(logits.astype(np.float64), 0.0).astype(np.float32)
        scores = np.sqrt(sp.astype(np.float64)).astype(np.float32)
        want_w, want_idx = router_oracle(scores, scores + bias, k)
        np.testing.assert_array_equal(np.asarray(got[1]), want_idx)
        np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint32), want_w.view(np.uint32))


def test_router_scored_takes_other_score_functions_through_xla(monkeypatch):
    """Softmax and sigmoid scores are formed by XLA and then selected (the kernel gets scores);
    a bad score function or bias shape is an error naming it."""
    rng = np.random.default_rng(13)
    logits, bias = jnp.asarray(_gate_logits(rng, 2, 64)), jnp.asarray(rng.standard_normal(64), jnp.float32)
    seen = []
    original = kernel_gpu.router_topk
    monkeypatch.setattr(kernel_gpu, "router_topk", lambda s, b, k, **kw: seen.append(kw.get("score_func"))
                        or original(s, b, k, **kw))
    for func in ("softmax", "sigmoid", "sqrtsoftplus"):
        got = api.router_topk_scored(logits, bias, 4, func, implementation="pallas", interpret=True)
        want = ref.router_topk_scored(logits, bias, 4, func)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert seen == [None, None, "sqrtsoftplus"]
    with pytest.raises(ValueError, match="score_func must be one of"):
        api.router_topk_scored(logits, bias, 4, "relu")
    with pytest.raises(ValueError, match="bias"):
        api.router_topk_scored(logits, bias[:8], 4, "sqrtsoftplus")


def test_router_scored_kernel_lowers_to_triton_for_cuda():
    s = jnp.zeros((4, 384), jnp.float32)
    f = lambda s: kernel_gpu.router_topk(s, s[:1], 6, num_warps=None, interpret=False, score_func="sqrtsoftplus")
    assert "router_topk" in jax.jit(f).trace(s).lower(lowering_platforms=("cuda",)).as_text()


def test_router_bf16_scores_fall_back_and_bad_arguments_are_rejected(caplog):
    scores, biased = router_inputs(np.random.default_rng(10), 2, 16, False)
    s16, b16 = jnp.asarray(scores, jnp.bfloat16), jnp.asarray(biased, jnp.bfloat16)
    with caplog.at_level(logging.WARNING, logger="pallas_kernels.topk.api"):
        w, idx = api.router_topk(s16, b16, 4, implementation="pallas", interpret=True)
    assert "f32 scores only" in caplog.text
    want_w, want_idx = router_oracle(np.asarray(s16, np.float32), np.asarray(b16, np.float32), 4)
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_array_equal(np.asarray(w, np.float32), want_w)
    with pytest.raises(ValueError, match="k must be an int in"):
        api.router_topk(jnp.asarray(scores), jnp.asarray(biased), 17)
    with pytest.raises(ValueError, match="the same"):
        api.router_topk(jnp.asarray(scores), jnp.asarray(biased[:, :8]), 2)


def test_gate_on_the_kernel_path_routes_as_the_reference_path():
    """moe.Gate with kernels="pallas" (interpret) gives the reference path's weights and indices
    bit for bit (the released router's 384 experts, top-6, normalised, x1.5)."""
    from dsv41_jax.config import ModelArgs
    from dsv41_jax.moe import Gate

    args = ModelArgs(dim=64, n_routed_experts=384, n_activated_experts=6, score_func="sqrtsoftplus", route_scale=1.5)
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.bfloat16)
    weight = jnp.asarray(rng.standard_normal((384, 64)) * 0.1, jnp.bfloat16)
    bias = jnp.asarray(rng.integers(-2, 3, 384) * 0.05, jnp.float32)
    out = {}
    for kernels, interp in (("reference", False), ("pallas", True)):
        gate = Gate(0, args.replace(kernels=kernels, kernels_interpret=interp))
        gate.weight[...], gate.bias[...] = weight, bias
        out[kernels] = [np.asarray(a) for a in gate(x)]
    assert out["reference"][1].shape == (5, 6)
    for got, want in zip(out["pallas"], out["reference"], strict=True):
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def _norm_row(rng, k: int, scale_exp: int) -> np.ndarray:
    """[1, k] bf16 values +-n * 2^(scale_exp - 4), 32 <= n <= 63 (one binade): every square and
    partial sum of squares (k <= 2048) is exact in fp32, so the norm's mean is the same in any
    order."""
    n = rng.integers(32, 64, k) * rng.choice([-1, 1], k)
    return (n * 2.0 ** (scale_exp - 4)).astype(ml_dtypes.bfloat16)[None]


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=[pytest.mark.gpu, needs_gpu])])
def test_router_logits_with_the_norm_in_the_kernel(interpret):
    """`router_logits` of one row with its RMSNorm in the kernel (interpret, or compiled on a GPU):
    where the norm's sum of squares and the logits' sums are exact in any order (rows of one
    binade at scales over 40 binades, weights in {-1, 0, 1} / 8) the normalised row and the logits equal the
    reference's bit for bit; on normal rows the normalised row is nearly always identical and
    every logit is within the f32 summation bound of the float64 sum of its own exact products;
    the quantised row is always `act_quant_bf16` of the normalised one; a NaN in the row makes
    every output NaN (the norm's mean is NaN)."""
    rng = np.random.default_rng(31)
    e, k = 64, 1024
    nw = jnp.asarray(1 + rng.integers(-8, 9, k) / 64, jnp.bfloat16)
    bs = api.BlockSizes(norm_logits=True)

    def both(x, w):
        got = api.router_logits(x, w, norm_weight=nw, norm_eps=1e-6, quantise=True, implementation="pallas",
                                interpret=interpret, block_sizes=bs)
        want = ref.router_logits(x, w, nw, 1e-6, quantise=True)
        return [np.asarray(a) for a in got], [np.asarray(a) for a in want]

    w_exact = jnp.asarray(rng.integers(-1, 2, (e, k)) / 8, jnp.bfloat16)
    for scale_exp in (-20, -3, 0, 5, 20):
        x = jnp.asarray(_norm_row(rng, k, scale_exp))
        (lg, xn, xq), (want_lg, want_xn, want_xq) = both(x, w_exact)
        assert xn.dtype == want_xn.dtype == xq.dtype == jnp.bfloat16 and lg.shape == (1, e)
        np.testing.assert_array_equal(xn.view(np.uint16), want_xn.view(np.uint16))
        np.testing.assert_array_equal(xq.view(np.uint16), want_xq.view(np.uint16))
        assert not np.array_equal(xq.view(np.uint16), xn.view(np.uint16))  # the quantiser moved values
        # the normalised row: 8 significant bits over at most 3 binades (the row's one, the norm
        # weight's 1 +- 1/8); the weights one bit: every partial sum of the 1024 products is a
        # multiple of the smallest product's last bit below 2^21 of them, exact in fp32
        np.testing.assert_array_equal(lg.view(np.uint32), want_lg.view(np.uint32))
    same = []
    w = jnp.asarray(rng.standard_normal((e, k)) * 0.05, jnp.bfloat16)
    for _ in range(6):
        x = jnp.asarray(rng.standard_normal((1, k)) * 3, jnp.bfloat16)
        (lg, xn, xq), (_, want_xn, _) = both(x, w)
        same.append(np.mean(xn.view(np.uint16) == want_xn.view(np.uint16)))
        np.testing.assert_array_equal(xq.view(np.uint16), np.asarray(quant.act_quant_bf16(xn)).view(np.uint16))
        p = xn.astype(np.float64) * np.asarray(w, np.float64)  # [e, k] exact products
        exact = p.sum(axis=1)
        bound = k * 2.0**-24 * np.abs(p).sum(axis=1)
        assert np.all(np.abs(lg[0].astype(np.float64) - exact) <= bound)
    assert np.mean(same) >= 0.95
    x = jnp.asarray(_norm_row(rng, k, 0)).at[0, 7].set(np.nan)
    (lg, xn, xq), _ = both(x, w)
    assert np.all(np.isnan(lg)) and np.all(np.isnan(xn.astype(np.float32)))
    assert np.all(np.isnan(xq.astype(np.float32)))


def test_router_logits_takes_the_reference_unless_one_row_with_a_norm_and_the_switch(caplog):
    """Without a norm, with two rows, with `norm_logits` off or with a shape the kernel refuses
    (a warning) `router_logits` is the reference's; bad arguments are rejected."""
    rng = np.random.default_rng(32)
    e, k = 16, 256
    w = jnp.asarray(rng.standard_normal((e, k)), jnp.bfloat16)
    nw = jnp.asarray(1 + 0.1 * rng.standard_normal(k), jnp.bfloat16)
    x2 = jnp.asarray(rng.standard_normal((2, k)), jnp.bfloat16)
    on = api.BlockSizes(norm_logits=True)

    def same(got, want):
        for a, b in zip(got, want, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    kw = {"implementation": "pallas", "interpret": True}
    same(api.router_logits(x2[:1], w, block_sizes=on, **kw), ref.router_logits(x2[:1], w))
    same(api.router_logits(x2, w, norm_weight=nw, norm_eps=1e-6, block_sizes=on, **kw),
         ref.router_logits(x2, w, nw, 1e-6))
    calls = []
    original = kernel_gpu.router_logits
    try:
        kernel_gpu.router_logits = lambda *a, **kw_: calls.append(1) or original(*a, **kw_)
        api.router_logits(x2[:1], w, norm_weight=nw, norm_eps=1e-6, **kw)  # the switch is off by default
        assert not calls
        api.router_logits(x2[:1], w, norm_weight=nw, norm_eps=1e-6, block_sizes=on, **kw)
        assert calls == [1]
    finally:
        kernel_gpu.router_logits = original
    odd = jnp.asarray(rng.standard_normal((1, 40)), jnp.bfloat16)
    with caplog.at_level(logging.WARNING, logger="pallas_kernels.topk.api"):
        got = api.router_logits(odd, w[:, :40], norm_weight=nw[:40], norm_eps=1e-6, block_sizes=on, **kw)
    assert "router_logits: kernel does not handle" in caplog.text
    same(got, ref.router_logits(odd, w[:, :40], nw[:40], 1e-6))
    with pytest.raises(ValueError, match="go together"):
        api.router_logits(x2, w, norm_weight=nw)
    with pytest.raises(ValueError, match=r"x \[N, K\] and weight \[E, K\]"):
        api.router_logits(x2, w[:, :8])


def test_router_logits_kernel_lowers_to_triton_for_cuda():
    x, nw = jnp.zeros((1, 5120), jnp.bfloat16), jnp.ones((5120,), jnp.bfloat16)
    w = jnp.zeros((384, 5120), jnp.bfloat16)
    f = lambda x, w, nw: kernel_gpu.router_logits(x, w, nw, 1e-20, interpret=False)
    assert "router_logits" in jax.jit(f).trace(x, w, nw).lower(lowering_platforms=("cuda",)).as_text()


def test_model_decode_step_with_the_ffn_norm_in_the_gate_launch(monkeypatch):
    """The one-row golden decode step with `Gate.norm_logits` on every layer (kernels "pallas",
    interpret): each MoE's gate runs `router_logits` with the FFN norm (one launch a layer) and
    the step's logits equal the reference path's (measured: bit-identical on the first golden
    set's first step on CPU)."""
    from conftest import GOLDEN_DIRS
    from flax import nnx

    from dsv41_jax import parity
    from dsv41_jax.moe import Gate
    from dsv41_jax.parity import GoldenSet

    gs = GoldenSet(GOLDEN_DIRS[0])
    model = parity.load_model(gs, kernels="pallas", kernels_interpret=True)
    gates = [m for _, m in nnx.iter_modules(model) if isinstance(m, Gate)]
    assert len(gates) == gs.args.n_layers
    for g in gates:
        g.norm_logits = True
    calls = []
    original = kernel_gpu.router_logits
    monkeypatch.setattr(kernel_gpu, "router_logits",
                        lambda x, w, *a, **kw: calls.append((x.shape, w.shape)) or original(x, w, *a, **kw))
    jax.clear_caches()
    cache = jax.tree.map(lambda a: a[:1], parity.teacher_forced_cache(parity.load_model(gs), gs))

    def first_step(m):
        ids = jnp.asarray(gs["decode.input"][0], jnp.int32)[:1]
        logits, _ = m.decode_step(ids, jnp.full(ids.shape, int(gs["decode.start_pos"][0]), jnp.int32), cache)
        return np.asarray(logits, np.float32)

    got = first_step(model)
    a = gs.args
    assert calls and set(calls) == {((1, a.dim), (a.n_routed_experts, a.dim))}
    np.testing.assert_array_equal(got, first_step(parity.load_model(gs)))
