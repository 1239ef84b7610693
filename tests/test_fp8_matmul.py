"""The dense fp8 matmul (pallas_kernels/fp8_matmul): the jnp reference and the GPU kernel
(interpret mode on CPU; compiled when a GPU is present) over edge shapes, held to a float64 numpy
oracle that decodes the e4m3 bytes itself and to each other; the e4m3 bit decode over all 256
codes; the CUDA lowering of both decodes (checked here without a GPU); the `linear()` dispatch
and the model's fp8 Linear through `kernels`.

Tolerance: every product is exact, so an implementation differs from the exact sum only by its
fp32 summation (<= K * eps32 * sum|products|) and the final bf16 rounding (half a bf16 ulp).
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import quant
from dsv41_jax.layers import Linear
from dsv41_jax.numerics import rms_norm
from pallas_kernels._triton import act_quant_row
from pallas_kernels.fp8_matmul import api, kernel_gpu
from pallas_kernels.fp8_matmul import reference as ref

EPS32 = float(np.finfo(np.float32).eps)
HAS_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")


def np_dense(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """e4m3 [N, K], e8m0 bytes [ceil(N/32), ceil(K/32)] -> float64 [N, K] (ml_dtypes decodes)."""
    n, k = w.shape
    sc = np.ldexp(1.0, np.asarray(s).view(np.uint8).astype(np.int64) - 127)
    full = np.repeat(np.repeat(sc, 32, axis=0)[:n], 32, axis=1)[:, :k]
    return np.asarray(w).astype(np.float64) * full


def make(rng, m: int, n: int, k: int):
    """Every finite e4m3 code (NaN codes replaced), scale bytes 112..135, act-quantised bf16 rows."""
    b = rng.integers(0, 256, (n, k), dtype=np.uint8)
    b = np.where((b & 0x7F) == 0x7F, b ^ 0x40, b).astype(np.uint8)
    w = b.view(ml_dtypes.float8_e4m3fn)
    s = rng.integers(112, 136, (-(-n // 32), -(-k // 32)), dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)
    x = quant.act_quant_bf16(jnp.asarray(rng.standard_normal((m, k)) * 3, jnp.float32))
    return x, jnp.asarray(w), jnp.asarray(s), w, s


def check_oracle(out, x, dense):
    xf = np.asarray(x, np.float64)
    exact = xf @ dense.T
    mag = np.abs(xf) @ np.abs(dense).T
    bound = xf.shape[1] * EPS32 * mag + 2.0**-8 * np.abs(exact) + 1e-30
    got = np.asarray(out, np.float64)
    assert np.all(np.isfinite(got))
    assert np.all(np.abs(got - exact) <= bound), float(np.max(np.abs(got - exact) / bound))


def ulps(a, b) -> np.ndarray:
    def ordered(v):
        i = np.asarray(v).view(np.uint16).astype(np.int32)
        return np.where(i & 0x8000, -(i & 0x7FFF), i)
    return np.abs(ordered(a) - ordered(b))


# name -> (M, N, K, BlockSizes overrides)
CASES = {
    "one_row": (1, 128, 256, {}),
    "one_row_tensor_cores": (1, 128, 256, {"one_row": False}),
    "one_row_k_split": (1, 64, 512, {"k_splits": 2}),
    "one_row_scaled_per_element": (1, 128, 256, {"one_row_group_sums": False}),
    "one_row_group_sums_k_split": (1, 64, 512, {"k_splits": 2, "block_k": 128}),
    "odd_rows_k_split": (5, 64, 512, {"k_splits": 2}),
    "rows_across_m_blocks": (37, 96, 256, {"block_m": 16, "block_n": 32}),
    "released_wq_a_one_row": (1, 1280, 5120, {}),
    "many_rows_short_k": (130, 64, 128, {"block_k": 64}),
    "rows_across_m_blocks_swap_ab": (37, 96, 256, {"block_m": 16, "block_n": 32, "swap_ab": True}),
    "sixty_four_rows_swap_ab_k_split": (64, 128, 512, {"swap_ab": True, "k_splits": 2}),
    "one_row_ignores_swap_ab": (1, 128, 256, {"swap_ab": True}),
}


class Base:
    implementation = "reference"
    interpret = False
    decode = "native"

    @pytest.mark.parametrize("case", list(CASES))
    def test_matches_float64_oracle_and_reference(self, case):
        m, n, k, over = CASES[case]
        x, w, s, w_np, s_np = make(np.random.default_rng(m * 31 + n), m, n, k)
        bs = api.BlockSizes(decode=self.decode, **over)
        out = api.fp8_matmul(x, w, s, implementation=self.implementation, interpret=self.interpret, block_sizes=bs)
        assert out.shape == (m, n) and out.dtype == jnp.bfloat16
        check_oracle(out, x, np_dense(w_np, s_np))
        base = ref.fp8_matmul(x, w, s)
        # exact products in both: only the fp32 summation order differs (K splits, tile order),
        # so nearly every output is bit-identical. Measured in interpret mode: >= 0.9992 on every
        # case; 0.97 leaves room for a compiled kernel's order.
        same = float(np.mean(ulps(out, base) == 0))
        print(f"bit-identical {same:.4f}")
        assert same >= 0.97


class TestReference(Base):
    pass


class TestKernelInterpret(Base):
    implementation, interpret = "pallas", True


class TestKernelInterpretBitsDecode(Base):
    implementation, interpret, decode = "pallas", True, "bits"


@pytest.mark.gpu
@needs_gpu
class TestKernelGPU(Base):
    implementation = "pallas"


@pytest.mark.gpu
@needs_gpu
class TestKernelGPUBitsDecode(Base):
    implementation, decode = "pallas", "bits"


def test_bit_decode_of_every_e4m3_code():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.asarray(kernel_gpu._e4m3_bits_f32(jnp.asarray(codes.view(np.int8)).astype(jnp.int32)))
    nan = np.isnan(want)
    assert nan.sum() == 2 and np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))  # bits, so -0 counts


@pytest.mark.parametrize(("decode", "k_splits", "n_w", "groups", "block_m", "group_sums"),
                         [("native", 1, 1, 1, 16, False), ("bits", 1, 1, 1, 16, False), ("native", 4, 1, 1, 16, False),
                          ("bits", 4, 1, 1, 16, False), ("native", 4, 2, 1, 16, False), ("native", 2, 1, 4, 16, False),
                          ("native", 1, 1, 1, 1, False), ("native", 4, 2, 1, 1, False), ("native", 2, 1, 4, 1, False),
                          ("native", 1, 1, 1, 1, True), ("native", 4, 2, 1, 1, True), ("bits", 2, 1, 4, 1, True)])
def test_kernel_lowers_to_triton_for_cuda(decode, k_splits, n_w, groups, block_m, group_sums):
    """The Pallas -> Triton lowering runs without a GPU (cross-platform lowering); n_w matrices
    in one launch, or one grouped matrix; tensor-core tiles or one row (block_m 1), its products
    scaled per element or per 32-long run (group_sums)."""
    x, w, s, _, _ = make(np.random.default_rng(0), 8 if block_m > 1 else 1, 256, 2048)
    x = jnp.tile(x, (1, groups))
    f = lambda x, w, s: kernel_gpu.fp8_matmul_many(
        x, (w,) * n_w, (s,) * n_w, block_m=block_m, block_n=64, block_k=256, k_splits=k_splits, num_warps=4,
        num_stages=3, decode=decode, interpret=False, groups=groups, group_sums=group_sums)
    text = jax.jit(f).trace(x, w, s).lower(lowering_platforms=("cuda",)).as_text()
    assert "fp8_matmul" in text


@pytest.mark.parametrize(("k_splits", "n_w", "groups"), [(1, 1, 1), (4, 2, 1), (2, 1, 4)])
def test_swapped_operand_kernel_lowers_to_triton_for_cuda(k_splits, n_w, groups):
    """`swap_ab` (the decoded weight tile as each dot's first operand) lowers for CUDA without a
    GPU: one matrix, two in one launch with K splits, a grouped matrix."""
    x, w, s, _, _ = make(np.random.default_rng(0), 64, 256, 2048)
    x = jnp.tile(x, (1, groups))
    f = lambda x, w, s: kernel_gpu.fp8_matmul_many(
        x, (w,) * n_w, (s,) * n_w, block_m=64, block_n=64, block_k=256, k_splits=k_splits, num_warps=4,
        num_stages=3, decode="native", interpret=False, groups=groups, swap_ab=True)
    lowered = jax.jit(f).trace(x, w, s).lower(lowering_platforms=("cuda",))
    assert "fp8_matmul" in lowered.as_text()
    want = (k_splits, 64, 256) if k_splits > 1 else (64, 256)
    assert [o.shape for o in lowered.out_info] == [want] * n_w


@pytest.mark.parametrize(("m", "k_splits"), [(64, 1), (37, 2)])
def test_swapped_operands_give_the_default_tiles_outputs(m, k_splits):
    """Interpret mode: `swap_ab` computes [block_n, block_m] (its dot's result in the kernel's
    program) and transposes it; its outputs are the default tiles' (the same products and K
    steps), bit for bit here; one-row launches refuse it. Through `api.linear`, the
    BlockSizes field reaches the kernel."""
    x, w, s, _, _ = make(np.random.default_rng(m), m, 128, 512)
    block_m = 16 if m < 64 else 64
    tiles = {"block_m": block_m, "block_n": 32, "block_k": 128, "k_splits": k_splits,
             "num_warps": 4, "num_stages": 3, "decode": "native", "interpret": True}
    for sw, acc in ((False, f"f32[{block_m},32] = dot_general"), (True, f"f32[32,{block_m}] = dot_general")):
        program = str(jax.make_jaxpr(lambda x, w, s, sw=sw: kernel_gpu.fp8_matmul_many(
            x, (w,), (s,), swap_ab=sw, **dict(tiles, interpret=False)))(x, w, s))
        assert acc in program, sw
    (plain,), (swapped,) = (kernel_gpu.fp8_matmul_many(x, (w,), (s,), swap_ab=sw, **tiles) for sw in (False, True))
    assert swapped.shape == plain.shape and swapped.dtype == plain.dtype
    np.testing.assert_array_equal(np.asarray(swapped, np.float32), np.asarray(plain, np.float32))
    with pytest.raises(NotImplementedError, match="swap_ab"):
        kernel_gpu.fp8_matmul_many(x[:1], (w,), (s,), swap_ab=True, **dict(tiles, block_m=1))
    seen = []
    real = kernel_gpu.fp8_matmul_many
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernel_gpu, "fp8_matmul_many", lambda *a, **kw: seen.append(kw["swap_ab"]) or real(*a, **kw))
        for rows in (m, 1):  # one-row launches ignore the field
            bs = api.BlockSizes(swap_ab=True, block_n=32, block_k=128, k_splits=k_splits)
            api.linear(x[:rows], w, s, implementation="pallas", interpret=True, block_sizes=bs)
    assert seen == [True, False]


@pytest.mark.parametrize("k_splits", [1, 2])
def test_several_matrices_in_one_launch_equal_one_launch_each_bit_for_bit(k_splits):
    """fp8_matmul_many: every output column is computed as in its own matrix's launch with the
    same tiles (interpret mode); the column blocks of the grid run through the matrices."""
    rng = np.random.default_rng(11)
    x, *_ = make(rng, 3, 32, 256)
    mats = [make(rng, 1, n, 256)[1:3] for n in (64, 96, 32)]
    tiles = {"block_m": 16, "block_n": 32, "block_k": 64, "k_splits": k_splits, "num_warps": 4, "num_stages": 3,
             "decode": "native", "interpret": True}
    outs = kernel_gpu.fp8_matmul_many(x, tuple(w for w, _ in mats), tuple(s for _, s in mats), **tiles)
    assert len(outs) == 3
    for (w, s), out in zip(mats, outs, strict=True):
        np.testing.assert_array_equal(np.asarray(out), np.asarray(kernel_gpu.fp8_matmul(x, w, s, **tiles)))
        want_shape = (k_splits, 3, w.shape[0]) if k_splits > 1 else (3, w.shape[0])
        assert out.shape == want_shape


def test_linear_many_is_linear_per_matrix():
    """The kernel path (interpret) with tiles fixed equals `linear` per matrix bit for bit; the
    reference path is `quant.linear_fp8` per matrix; a fused N that only 32 divides picks 32-column
    blocks."""
    x, w1, s1 = _linear_inputs((2, 3), n=64, k=256, seed=12)
    _, w2, s2 = _linear_inputs((1,), n=160, k=256, seed=13)
    bs = api.BlockSizes(k_splits=2)
    assert bs.resolved(6, (64, 160), 256).block_n == 32
    got = api.linear_many(x, (w1, w2), (s1, s2), implementation="pallas", interpret=True, block_sizes=bs)
    for (w, s), out in zip(((w1, s1), (w2, s2)), got, strict=True):
        assert out.shape == (2, 3, w.shape[0]) and out.dtype == jnp.bfloat16
        one = api.linear(x, w, s, implementation="pallas", interpret=True,
                         block_sizes=api.BlockSizes(k_splits=2, block_n=32))
        np.testing.assert_array_equal(np.asarray(out), np.asarray(one))
    ref_outs = api.linear_many(x, (w1, w2), (s1, s2), implementation="reference")
    for (w, s), out in zip(((w1, s1), (w2, s2)), ref_outs, strict=True):
        np.testing.assert_array_equal(np.asarray(out), np.asarray(quant.linear_fp8(x, w, s)))
    with pytest.raises(ValueError, match="one scale per weight"):
        api.linear_many(x, (w1, w2), (s1,), implementation="reference")


def _grouped_inputs(rng, lead, g, r, k):
    _, w, s, w_np, s_np = make(rng, 1, g * r, k)
    x = jnp.asarray(rng.standard_normal((*lead, g, k)) * 2, jnp.bfloat16)  # bf16 as given, not quantised
    return x, w, s, np_dense(w_np, s_np)


@pytest.mark.parametrize(("implementation", "interpret"), [
    ("reference", False), ("pallas", True), pytest.param("pallas", False, marks=[pytest.mark.gpu, needs_gpu])])
@pytest.mark.parametrize(("lead", "g", "r", "k", "over"), [((1, 1), 4, 64, 256, {}),
                                                          ((3, 2), 2, 96, 128, {"block_n": 32, "k_splits": 2})])
def test_grouped_is_block_diagonal_against_the_float64_oracle(implementation, interpret, lead, g, r, k, over):
    """grouped: group j of x times rows [j*R, (j+1)*R) of the widened matrix; on the kernel path
    (interpret) every group equals a launch of its own rows and x slice, bit for bit."""
    x, w, s, dense = _grouped_inputs(np.random.default_rng(g * r + k), lead, g, r, k)
    bs = api.BlockSizes(**over)
    out = api.grouped(x, w, s, implementation=implementation, interpret=interpret, block_sizes=bs)
    assert out.shape == (*lead, g, r) and out.dtype == jnp.bfloat16
    rows = int(np.prod(lead))
    for j in range(g):
        xj = x[..., j, :].reshape(rows, k)
        check_oracle(out[..., j, :].reshape(rows, r), xj, dense[j * r:(j + 1) * r])
        if implementation == "pallas":
            one = api.fp8_matmul(xj, w[j * r:(j + 1) * r], s[j * r // 32:(j + 1) * r // 32], implementation="pallas",
                                 interpret=interpret, block_sizes=bs.resolved(rows, (r,) * g, k))
            np.testing.assert_array_equal(np.asarray(out[..., j, :].reshape(rows, r)), np.asarray(one))
    base = ref.grouped(x, w, s)
    assert np.mean(ulps(out, base) == 0) >= 0.97


def test_grouped_takes_one_k_split_above_16_rows(monkeypatch):
    """The grouped kernel's default K split (measured on the H200: one split above 16 rows)."""
    seen = []
    original = kernel_gpu.fp8_matmul_many
    monkeypatch.setattr(kernel_gpu, "fp8_matmul_many",
                        lambda *a, **kw: seen.append(kw["k_splits"]) or original(*a, **kw))
    for rows in (16, 17):
        x, w, s, _ = _grouped_inputs(np.random.default_rng(rows), (rows,), 2, 64, 1024)
        api.grouped(x, w, s, implementation="pallas", interpret=True)
    assert seen[0] > 1 and seen[1] == 1, seen


def test_grouped_refuses_bad_shapes_and_falls_back_when_groups_cannot_be_tiled(caplog):
    x, w, s, _ = _grouped_inputs(np.random.default_rng(9), (2,), 2, 48, 128)  # R = 48: no block divides it
    with caplog.at_level(logging.WARNING):
        out = api.grouped(x, w, s, implementation="pallas", interpret=True)
    assert "fp8_matmul: kernel does not handle" in caplog.text
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref.grouped(x, w, s)))
    with pytest.raises(ValueError, match=r"x \[\.\.\., G, K\] and e4m3 w \[G\*R, K\]"):
        api.grouped(x[..., :64], w, s, implementation="reference")
    with pytest.raises(ValueError, match="s must be e8m0"):
        api.grouped(x, w, s[:1], implementation="reference")
    with pytest.raises(ValueError, match=r"x \[\.\.\., G, K\]"):
        api.grouped(x[0, 0], w, s, implementation="reference")
    with pytest.raises(NotImplementedError, match="groups"):
        kernel_gpu.fp8_matmul(x.reshape(2, -1)[:, :128], w, s, groups=2, block_m=16, block_n=32, block_k=64,
                              k_splits=1, num_warps=4, num_stages=3, decode="native", interpret=True)


def test_nan_weight_code_gives_nan_in_its_columns():
    x, _, s, w_np, _ = make(np.random.default_rng(1), 3, 64, 128)
    b = np.asarray(w_np).view(np.uint8).copy()
    b[5, 17] = 0x7F
    wn = jnp.asarray(b.view(ml_dtypes.float8_e4m3fn))
    for decode in ("native", "bits"):
        out = np.asarray(api.fp8_matmul(x, wn, s, implementation="pallas", interpret=True,
                                        block_sizes=api.BlockSizes(decode=decode)), np.float32)
        assert np.isnan(out[:, 5]).all() and np.isfinite(np.delete(out, 5, axis=1)).all()


def test_shape_the_kernel_cannot_tile_falls_back_to_reference(caplog):
    x, w, s, _, _ = make(np.random.default_rng(2), 4, 48, 128)  # N = 48: no power-of-2 block >= 32 divides it
    with caplog.at_level(logging.WARNING):
        out = api.fp8_matmul(x, w, s, implementation="pallas", interpret=True)
    assert "fp8_matmul: kernel does not handle" in caplog.text
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref.fp8_matmul(x, w, s)))


def test_bad_scale_shape_names_the_tensor():
    x, w, s, _, _ = make(np.random.default_rng(3), 2, 64, 128)
    with pytest.raises(ValueError, match=r"s must be e8m0 \[ceil\(N/32\), ceil\(K/32\)\]"):
        api.fp8_matmul(x, w, s[:1], implementation="reference")


def test_pallas_on_cpu_without_interpret_is_an_error():
    if HAS_GPU:
        pytest.skip("CPU-only check")
    x, w, s, _, _ = make(np.random.default_rng(4), 2, 64, 128)
    with pytest.raises(ValueError, match="interpret=True"):
        api.fp8_matmul(x, w, s, implementation="pallas")


def _linear_inputs(shape, n=64, k=256, seed=5):
    rng = np.random.default_rng(seed)
    _, w, s, _, _ = make(rng, 1, n, k)
    return jnp.asarray(rng.standard_normal((*shape, k)) * 2, jnp.bfloat16), w, s


def test_linear_on_the_kernel_path_matches_the_xla_linear():
    x, w, s = _linear_inputs((2, 3))
    got = api.linear(x, w, s, implementation="pallas", interpret=True)
    want = quant.linear_fp8(x, w, s)
    assert got.shape == (2, 3, 64) and got.dtype == jnp.bfloat16
    assert np.mean(ulps(got, want) == 0) >= 0.97


def test_linear_above_max_rows_and_on_cpu_auto_is_the_xla_linear_bit_for_bit():
    x, w, s = _linear_inputs((1, 20))
    want = np.asarray(quant.linear_fp8(x, w, s))
    above = api.linear(x, w, s, implementation="pallas", interpret=True, block_sizes=api.BlockSizes(max_rows=16))
    np.testing.assert_array_equal(np.asarray(above), want)
    if not HAS_GPU:
        np.testing.assert_array_equal(np.asarray(api.linear(x, w, s, implementation="auto")), want)


def test_model_linear_takes_the_kernel_choice():
    x, w, s = _linear_inputs((1, 4), n=96, k=128, seed=6)
    outs = {}
    for kernels, interp in (("reference", False), ("pallas", True)):
        lin = Linear(128, 96, "fp8", kernels=kernels, kernels_interpret=interp)
        lin.weight[...] = w
        lin.scale[...] = s
        outs[kernels] = np.asarray(lin(x))
    np.testing.assert_array_equal(outs["reference"], np.asarray(quant.linear_fp8(x, w, s)))
    assert np.mean(ulps(outs["pallas"], outs["reference"]) == 0) >= 0.97


@pytest.mark.parametrize("rows", [2, 1])
def test_model_fp8_projections_run_the_kernel_in_a_decode_step(monkeypatch, rows):
    """Every fp8 projection of the model takes `ModelArgs.kernels`; with kernels="pallas"
    (interpret) the 2-row golden decode step (and its first row alone: the one-row kernel,
    block_m 1) runs the fp8 kernel and its logits equal the reference path's (measured:
    bit-identical on the first golden set's first step on CPU; the two differ only in summation
    order, which at these sizes changes no rounding)."""
    from conftest import GOLDEN_DIRS

    from dsv41_jax import parity
    from dsv41_jax.parity import GoldenSet

    gs = GoldenSet(GOLDEN_DIRS[0])
    model = parity.load_model(gs, kernels="pallas", kernels_interpret=True)
    fp8 = [m for _, m in nnx.iter_modules(model) if isinstance(m, Linear) and m.dtype == "fp8" and m.weight.ndim == 2]
    assert fp8 and all(m.kernels == "pallas" and m.kernels_interpret for m in fp8)
    calls = []
    original = kernel_gpu.fp8_matmul_many
    monkeypatch.setattr(kernel_gpu, "fp8_matmul_many", lambda x, ws, *a, **kw: calls.append(
        (x.shape, len(ws), kw.get("groups", 1), kw.get("quantise", False),
         tuple(w.shape[0] for w in ws) if kw.get("norm") is not None else None)) or original(x, ws, *a, **kw))
    jax.clear_caches()
    cache = jax.tree.map(lambda a: a[:rows], parity.teacher_forced_cache(parity.load_model(gs), gs))

    def first_step(m):
        ids = jnp.asarray(gs["decode.input"][0], jnp.int32)[:rows]
        logits, _ = m.decode_step(ids, jnp.full(ids.shape, int(gs["decode.start_pos"][0]), jnp.int32), cache)
        return np.asarray(logits, np.float32)

    got = first_step(model)
    assert calls and all(shape[0] == rows for shape, *_ in calls)
    assert {n for _, n, *_ in calls} == {1, 2}  # wq_a with wkv, shared w1 with w3: one launch each pair
    assert {g for _, _, g, *_ in calls} == {1, gs.args.o_groups}  # wo_a: one grouped launch
    # one row: every ungrouped launch quantises its row itself (no act_quant launch); wo_a's
    # input is not quantised; two rows go through the quantiser first
    assert {(g, q) for _, _, g, q, _ in calls} == ({(1, True), (gs.args.o_groups, False)} if rows == 1
                                                    else {(1, False), (gs.args.o_groups, False)})
    # one row: attn_norm is applied by the launch of wq_a with wkv, q_norm by that of wq_b, alone
    # or with the indexer's wq_b (the layers are traced once per kind)
    a = gs.args
    normed = {(shape, norm) for shape, _, _, _, norm in calls if norm}
    assert normed == (set() if rows == 2 else {
        ((1, a.dim), (a.q_lora_rank, a.head_dim)), ((1, a.q_lora_rank), (a.n_heads * a.head_dim,)),
        ((1, a.q_lora_rank), (a.n_heads * a.head_dim, a.index_n_heads * a.index_head_dim))})
    want = first_step(parity.load_model(gs))
    np.testing.assert_array_equal(got, want)


def _quantiser_inputs(rng, k: int) -> np.ndarray:
    """[1, k] fp32: magnitudes over 60 binades (one scale per 32 elements), both signs, an
    all-zero block (amax clamped to 1e-4), and a block of exact e4m3 rounding ties (amax 448 * 2^j,
    the others midway between grid points, normal and subnormal)."""
    x = rng.standard_normal(k) * np.exp2(rng.integers(-30, 30, k // 32).repeat(32)) * np.exp2(rng.uniform(-12, 0, k))
    x[:32] = 0.0
    j = int(rng.integers(-4, 4))
    x[32] = 448.0 * 2.0**j
    m, e = rng.integers(8, 16, 31), rng.integers(-9, 8, 31)
    x[33:64] = (m + 0.5) * np.exp2(e - 3.0 + j) * rng.choice([-1.0, 1.0], 31)
    return x.astype(np.float32)[None]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_in_kernel_quantiser_equals_act_quant_bf16(dtype):
    """`_triton.act_quant_row` (the one-row kernels' quantiser) gives `quant.act_quant_bf16`'s
    values bit for bit: scales over 60 binades, zero blocks, exact e4m3 ties."""
    rng = np.random.default_rng(21)
    row = jax.jit(act_quant_row)
    want = jax.jit(lambda x: quant.act_quant_bf16(x).astype(jnp.float32))
    for _ in range(8):
        x = jnp.asarray(_quantiser_inputs(rng, 2048), dtype)
        got = np.asarray(row(x))
        np.testing.assert_array_equal(got, np.asarray(want(x)))
        assert np.all(got[0, 33:64] != np.asarray(x[0, 33:64], np.float32))  # every tie moved to a grid point


@pytest.mark.parametrize(("dtype", "n_w", "k_splits", "group_sums"),
                         [(jnp.bfloat16, 1, 1, False), (jnp.float32, 2, 2, False), (jnp.float32, 2, 2, True)])
def test_one_row_linear_quantising_in_the_kernel_equals_the_quantiser_launch(dtype, n_w, k_splits, group_sums):
    """`linear_many` at one row (interpret): the kernel quantising its own x tiles gives the same
    outputs, bit for bit, as `act_quant_bf16` followed by the kernel (K splits and two matrices
    in one launch included; products scaled per element or per 32-long run); two rows never take
    the in-kernel quantiser."""
    rng = np.random.default_rng(22)
    x = jnp.asarray(_quantiser_inputs(rng, 512), dtype)
    mats = [make(rng, 1, n, 512)[1:3] for n in (64, 96)[:n_w]]
    ws, ss = tuple(w for w, _ in mats), tuple(s for _, s in mats)
    outs = {}
    for q in (False, True):
        bs = api.BlockSizes(quantise_one_row=q, k_splits=k_splits, block_n=32, one_row_group_sums=group_sums)
        outs[q] = api.linear_many(x, ws, ss, implementation="pallas", interpret=True, block_sizes=bs)
    for a, b, (w, s) in zip(outs[False], outs[True], mats, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert np.mean(ulps(b, quant.linear_fp8(x, w, s)) == 0) >= 0.9
    for bad in (np.nan, np.inf, -np.inf):  # a non-finite x makes every output NaN on both paths
        xb = x.at[0, 100].set(bad)
        for q in (False, True):
            bs = api.BlockSizes(quantise_one_row=q, k_splits=k_splits, block_n=32, one_row_group_sums=group_sums)
            outs_bad = api.linear_many(xb, ws, ss, implementation="pallas", interpret=True, block_sizes=bs)
            assert all(np.all(np.isnan(np.asarray(o, np.float32))) for o in outs_bad)
    with pytest.raises(NotImplementedError, match="in-kernel quantiser takes one"):
        kernel_gpu.fp8_matmul_many(jnp.concatenate([x, x]), ws, ss, block_m=16, block_n=32, block_k=256, k_splits=1,
                                   num_warps=4, num_stages=3, decode="native", interpret=True, quantise=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_in_kernel_quantiser_lowers_to_triton_for_cuda(dtype):
    x, w, s, _, _ = make(np.random.default_rng(0), 1, 256, 2048)
    f = lambda x, w, s: kernel_gpu.fp8_matmul_many(
        x, (w, w), (s, s), block_m=1, block_n=64, block_k=256, k_splits=2, num_warps=4, num_stages=3,
        decode="native", interpret=False, quantise=True)
    text = jax.jit(f).trace(x.astype(dtype), w, s).lower(lowering_platforms=("cuda",)).as_text()
    assert "fp8_matmul" in text


def _norm_inputs(rng, k: int, scale_exp: int) -> np.ndarray:
    """[1, k] fp32 of bf16 values n * 2^(scale_exp - 4), |n| <= 63, so every square and every
    partial sum of squares (k <= 2048) is exact in fp32: the mean of squares is then the same in
    any summation order."""
    return (rng.integers(-63, 64, k) * 2.0 ** (scale_exp - 4)).astype(np.float32)[None]


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=[pytest.mark.gpu, needs_gpu])])
@pytest.mark.parametrize(("dtype", "n_w", "k_splits", "group_sums"),
                         [(jnp.bfloat16, 1, 1, True), (jnp.bfloat16, 2, 2, True), (jnp.float32, 2, 2, False)])
def test_one_row_norm_in_the_kernel_equals_rms_norm_then_the_kernel(dtype, n_w, k_splits, group_sums, interpret):
    """`linear_many` with an RMSNorm at one row (interpret, or compiled on a GPU): the kernel
    normalising its own x tiles gives `rms_norm` followed by the kernel bit for bit where the
    sum of squares is exact (any order), over 40 binades of row scale; on normal rows (the sums'
    orders differ) nearly all outputs are bit-identical and the rest one bf16 step apart; two
    rows and the reference path apply `rms_norm` first; a NaN in the row makes every output NaN."""
    rng = np.random.default_rng(23)
    k = 512
    mats = [make(rng, 1, n, k)[1:3] for n in (64, 96)[:n_w]]
    ws, ss = tuple(w for w, _ in mats), tuple(s for _, s in mats)
    nw = jnp.asarray(1 + 0.1 * rng.standard_normal(k), jnp.bfloat16)
    eps = 1e-6

    def both(x):
        outs = {}
        for fold in (False, True):
            bs = api.BlockSizes(norm_one_row=fold, k_splits=k_splits, block_n=32, one_row_group_sums=group_sums)
            outs[fold] = [np.asarray(o) for o in api.linear_many(
                x, ws, ss, implementation="pallas", interpret=interpret, block_sizes=bs, norm_weight=nw,
                norm_eps=eps)]
        return outs

    for scale_exp in (-20, -3, 0, 5, 20):
        x = jnp.asarray(_norm_inputs(rng, k, scale_exp), dtype)
        outs = both(x)
        for a, b, (w, s) in zip(outs[False], outs[True], mats, strict=True):
            np.testing.assert_array_equal(a, b)
            want = quant.linear_fp8(rms_norm(x, nw, eps), w, s)
            assert np.mean(ulps(b, want) == 0) >= 0.9 and np.max(ulps(b, want)) <= 2
    same = []
    for _ in range(8):
        x = jnp.asarray(rng.standard_normal((1, k)) * 3, dtype)
        outs = both(x)
        for a, b in zip(outs[False], outs[True], strict=True):
            same.append(np.mean(ulps(a, b) == 0))
            assert np.max(ulps(a, b)) <= 1
    assert np.mean(same) >= 0.95
    two = jnp.asarray(np.concatenate([_norm_inputs(rng, k, 0)] * 2), dtype)
    outs = both(two)
    for a, b, (w, s) in zip(outs[False], outs[True], mats, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(b, np.asarray(quant.linear_fp8(rms_norm(two, nw, eps), w, s)))
    x = jnp.asarray(_norm_inputs(rng, k, 0), dtype).at[0, 7].set(np.nan)
    assert all(np.all(np.isnan(o.astype(np.float32))) for o in both(x)[True])
    ref = api.linear_many(x, ws, ss, implementation="reference", norm_weight=nw, norm_eps=eps)
    assert all(np.all(np.isnan(np.asarray(o, np.float32))) for o in ref)
    with pytest.raises(ValueError, match="norm_weight"):
        api.linear_many(x, ws, ss, implementation="pallas", interpret=True, norm_weight=nw)
    with pytest.raises(NotImplementedError, match="in-kernel RMSNorm takes one row"):
        kernel_gpu.fp8_matmul_many(two, ws, ss, block_m=16, block_n=32, block_k=256, k_splits=1, num_warps=4,
                                   num_stages=3, decode="native", interpret=True, norm=(nw, eps))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_in_kernel_norm_lowers_to_triton_for_cuda(dtype):
    """The norm's float64 mean, root and reciprocal lower with the one-row kernel."""
    x, w, s, _, _ = make(np.random.default_rng(0), 1, 256, 2048)
    nw = jnp.ones((2048,), jnp.bfloat16)
    f = lambda x, w, s: kernel_gpu.fp8_matmul_many(
        x, (w, w), (s, s), block_m=1, block_n=64, block_k=256, k_splits=2, num_warps=4, num_stages=3,
        decode="native", interpret=False, quantise=True, group_sums=True, norm=(nw, 1e-6))
    text = jax.jit(f).trace(x.astype(dtype), w, s).lower(lowering_platforms=("cuda",)).as_text()
    assert "fp8_matmul" in text


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=[pytest.mark.gpu, needs_gpu])])
@pytest.mark.parametrize(("n_splits", "k_splits", "group_sums"), [(2, 1, True), (4, 2, True), (3, 2, False)])
def test_one_row_partial_sums_in_the_kernel_equal_their_sum_then_the_kernel(interpret, n_splits, k_splits,
                                                                          group_sums):
    """x as a row's fp32 K-split partial sums [S, 1, K]: the kernel adds them in split order and
    rounds to bf16 itself, bit for bit the launch on that sum (interpret mode on the CPU, or
    compiled on a GPU; on an H100 interpret mode differed in one of the three cases, XLA:GPU
    running the two kernel bodies as different programs); other layouts are refused."""
    rng = np.random.default_rng(24)
    k = 512
    parts = jnp.asarray(rng.standard_normal((n_splits, 1, k)) * np.exp2(rng.integers(-8, 8, (n_splits, 1, k))),
                        jnp.float32)
    total = parts[0]
    for sp in range(1, n_splits):
        total = total + parts[sp]
    row = jnp.asarray(np.asarray(total).astype(ml_dtypes.bfloat16))
    mats = [make(rng, 1, n, k)[1:3] for n in (64, 96)]
    ws, ss = tuple(w for w, _ in mats), tuple(s for _, s in mats)
    kw = {"block_m": 1, "block_n": 32, "block_k": 128, "k_splits": k_splits, "num_warps": 4, "num_stages": 3,
          "decode": "native", "interpret": interpret, "quantise": True, "group_sums": group_sums}
    # interpret mode on CPU: on a GPU XLA may sum the two programs' products in different orders
    with jax.default_device(jax.devices("cpu")[0] if interpret else jax.devices()[0]):
        got = kernel_gpu.fp8_matmul_many(parts, ws, ss, **kw)
        want = kernel_gpu.fp8_matmul_many(row, ws, ss, **kw)
    assert np.any(np.asarray(row, np.float32) != np.asarray(parts[0], np.float32))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(NotImplementedError, match="partial sums of one row"):
        kernel_gpu.fp8_matmul_many(jnp.concatenate([parts, parts], axis=1), ws, ss, **kw)


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=[pytest.mark.gpu, needs_gpu])])
@pytest.mark.parametrize(("lead", "k_splits"), [((1, 1), 4), ((1,), 1), ((2, 1), 2)])
def test_grouped_linear_of_one_row_chains_the_partial_sums(interpret, lead, k_splits, monkeypatch):
    """`grouped_linear` (wo_a then wo_b): one row on the kernel path hands wo_a's partial sums to
    wo_b's launch (two launches; the second takes [S, 1, N_a] fp32 when wo_a splits K) and gives
    `linear(grouped(...))`'s outputs bit for bit; two rows and the reference path are those calls."""
    rng = np.random.default_rng(25)
    g, r, k = 4, 64, 256
    x, wa, sa, _ = _grouped_inputs(rng, lead, g, r, k)
    _, wb, sb, _, _ = make(rng, 1, 96, g * r)
    bs = api.BlockSizes(k_splits=k_splits, block_n=32, block_k=64)
    seen = []
    original = kernel_gpu.fp8_matmul_many
    monkeypatch.setattr(kernel_gpu, "fp8_matmul_many", lambda x, ws, *a, **kw: seen.append(x.shape)
                        or original(x, ws, *a, **kw))
    got = api.grouped_linear(x, wa, sa, wb, sb, implementation="pallas", interpret=interpret, block_sizes=bs)
    rows = math.prod(lead)
    if rows == 1:
        assert seen == [(1, g * k), (k_splits, 1, g * r) if k_splits > 1 else (1, g * r)]
    y = api.grouped(x, wa, sa, implementation="pallas", interpret=interpret, block_sizes=bs)
    want = api.linear(y.reshape(*lead, -1), wb, sb, implementation="pallas", interpret=interpret, block_sizes=bs)
    assert got.shape == (*lead, 96)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    ref_out = api.grouped_linear(x, wa, sa, wb, sb, implementation="reference")
    np.testing.assert_array_equal(np.asarray(ref_out), np.asarray(quant.linear_fp8(
        ref.grouped(x, wa, sa).reshape(*lead, -1), wb, sb)))


def test_one_row_group_sums_against_per_element_scales_and_the_oracle():
    """One row, scale bytes over 60 binades (weights 2^-67 .. 2^-8 times the codes): summing
    each 32-long run of unscaled products before its scale multiplies it stays within the oracle's
    bound and matches per-element scaling in nearly every output (only the fp32 sums' order
    differs; interpret mode). Tensor-core tiles refuse it."""
    rng = np.random.default_rng(31)
    x, w, _, w_np, _ = make(rng, 1, 256, 1024)
    s_np = rng.integers(60, 120, (8, 32), dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)
    s = jnp.asarray(s_np)
    outs = {}
    for gs in (False, True):
        bs = api.BlockSizes(one_row_group_sums=gs, k_splits=2)
        outs[gs] = api.fp8_matmul(x, w, s, implementation="pallas", interpret=True, block_sizes=bs)
        check_oracle(outs[gs], x, np_dense(w_np, s_np))
    same = float(np.mean(ulps(outs[True], outs[False]) == 0))
    assert same >= 0.97, same
    with pytest.raises(NotImplementedError, match="group_sums is the one-row"):
        kernel_gpu.fp8_matmul_many(jnp.tile(x, (2, 1)), (w,), (s,), block_m=16, block_n=64, block_k=256, k_splits=1,
                                   num_warps=4, num_stages=3, decode="native", interpret=True, group_sums=True)


def test_k_splits_fill_the_last_wave():
    """The default K split at one row: the fewest splits giving >= target programs that fill at
    least min_wave_fill of their waves; the released projections at one row (64-column, 256-deep
    tiles); tensor-core tiles keep the fewest giving >= target."""
    f = api.split_for_waves
    assert f(80, 32, 264, 0.7) == 8  # wo_b: 320 programs fill 61% of 2 waves, 640 81% of 3
    assert f(80, 32, 264, 0.0) == 4  # no fill asked: the fewest giving >= 264 (the earlier rule)
    assert f(512, 5, 264, 0.7) == 1 and f(20, 20, 264, 0.7) == 20  # wq_b; wq_a: 400 programs, 76%
    assert f(64, 5, 264, 0.7) == 5  # indexer wq_b: 320 is the only count >= 264
    assert f(72, 20, 264, 0.7) == 10  # shared w1 + w3: 288 (55%), 360 (68%), 720 (91%)
    assert f(8, 4, 264, 0.7) == 4  # never enough programs: every K block split
    assert f(100, 6, 264, 0.9) == 6  # none fills 90%: 300 (57%) or 600 (76%), the fuller
    for name, (k, n), want in (("attn.wo_b", (8192, 5120), 8), ("attn.wq_b", (1280, 32768), 1),
                               ("shared.w2", (2304, 5120), 9)):
        assert api.BlockSizes().resolved(1, n, k).k_splits == want, name
    assert api.BlockSizes(k_splits=2).resolved(1, 5120, 8192).k_splits == 2
    assert api.BlockSizes().resolved(8, 5120, 8192).k_splits == 4  # tensor-core tiles: the fewest
