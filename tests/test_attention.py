"""Attention (SPEC §5): sparse attention with sink, window indices, candidate blocks, Compressor,
Indexer, the per-role compressed branch, and golden teacher-forced prefill per layer (SPEC §20)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import quant
from dsv41_jax.attention import (
    Attention,
    Compressor,
    Indexer,
    resolve_attn_accumulate,
    select_candidate_blocks,
    window_ring,
    window_topk_idxs,
)
from dsv41_jax.checkpoint import HubCheckpoint
from dsv41_jax.config import ModelArgs
from dsv41_jax.layers import Linear, RMSNorm, apply_rope
from dsv41_jax.loading import load_hub_weights
from dsv41_jax.mhc import hc_pre, identity_pre_mix
from pallas_kernels.index_scores import api as index_scores_api
from pallas_kernels.index_scores.reference import index_scores
from pallas_kernels.sparse_attention.reference import sparse_attn

BF16 = ml_dtypes.bfloat16


def f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def bf16_round(a) -> np.ndarray:
    """float64 -> bf16 the way torch casts a float64 result (through f32), back as float64."""
    return np.asarray(a, np.float64).astype(np.float32).astype(BF16).astype(np.float64)


def bf16_ulp(v) -> np.ndarray:
    """Spacing of bf16 numbers at |v| (8 significant bits)."""
    a = np.maximum(np.abs(np.asarray(v, np.float64)), 2.0**-126)
    return 2.0 ** (np.floor(np.log2(a)) - 7)


def randomize(module: nnx.Module, seed: int) -> nnx.Module:
    """Hub-like random weights: fp8 projections quantised from N(0, 1/in), bf16/f32 projections
    holding bf16 values, RMSNorm weights 1 + 0.1 N, attn_sink U[0.5, 3.5]."""
    rng = np.random.default_rng(seed)
    for _, node in nnx.iter_graph(module):
        if isinstance(node, Linear):
            w = rng.normal(size=(node.out_features, node.in_features)) / math.sqrt(node.in_features)
            if node.dtype == "fp8":
                q, s = quant.quantize_fp8_weight(w)
                node.weight.set_value(jnp.asarray(q))
                node.scale.set_value(jnp.asarray(s))
            else:
                node.weight.set_value(jnp.asarray(w.astype(BF16)).astype(node.weight[...].dtype))
        elif isinstance(node, RMSNorm):
            node.weight.set_value(jnp.asarray((1 + 0.1 * rng.normal(size=node.weight[...].shape)).astype(BF16)))
    if isinstance(module, Attention):
        module.attn_sink.set_value(jnp.asarray(rng.uniform(0.5, 3.5, size=module.n_heads), jnp.float32))
    return module


def rand_bf16(rng, shape, scale=1.0) -> jax.Array:
    return jnp.asarray((rng.normal(size=shape) * scale).astype(BF16))


# tiny: layers 0,1 window; 2 ratio-2 source; 3 reuse; 4 ratio-1 source + candidate source; 5 reuse;
# 6 reindex. window 8, topk 6, 4 candidate blocks of 2.
ARGS = ModelArgs.tiny()
S = 64  # tokens of the tiny stack


def run_stack(args: ModelArgs, x: jax.Array):
    """Runs layers 0..n-1 (weights seeded by layer id) on the same input: not a model, just the
    shared-state flow. Returns ({layer: out}, final shared, {layer: aux})."""
    shared, outs, auxs = {}, {}, {}
    for i in range(args.n_layers):
        outs[i], shared, auxs[i] = randomize(Attention(i, args), i)(x, shared)
    return outs, shared, auxs


# ----------------------------------------------------------------------------- sparse_attn


def np_sparse_attn(q, kv, sink, idx, scale):
    q, kv, sink = f64(q), f64(kv), f64(sink)
    b, m, h, d = q.shape
    out = np.zeros((b, m, h, d))
    for bi in range(b):
        for mi in range(m):
            rows = [t for t in np.asarray(idx[bi, mi]) if t >= 0]
            if not rows:
                continue
            k = kv[bi, rows]  # [n, d]
            for hi in range(h):
                logits = scale * (k @ q[bi, mi, hi])
                top = max(logits.max(), sink[hi])
                e = np.exp(logits - top)
                out[bi, mi, hi] = (e @ k) / (e.sum() + np.exp(sink[hi] - top))
    return out


def test_sparse_attn_matches_float64_loop_with_sink_skipped_slots_and_empty_rows():
    rng = np.random.default_rng(0)
    b, m, h, d, n, k = 2, 5, 3, 32, 9, 6
    q, kv = rand_bf16(rng, (b, m, h, d)), rand_bf16(rng, (b, n, d))
    sink = jnp.asarray(rng.uniform(-1, 3, size=h), jnp.float32)
    idx = rng.integers(0, n, size=(b, m, k)).astype(np.int32)
    idx[rng.random(size=idx.shape) < 0.3] = -1
    idx[0, 2] = -1  # a row with nothing to attend to
    idx[1, 4] = [3, 3, 3, -1, -1, 0]  # a repeated position counts every time it is listed
    want = np_sparse_attn(q, kv, sink, idx, 0.3)
    got = sparse_attn(q, kv, sink, jnp.asarray(idx), 0.3)
    assert got.dtype == jnp.bfloat16 and got.shape == (b, m, h, d)
    np.testing.assert_array_equal(f64(got), bf16_round(want))  # float64 inside: the same rounding
    assert np.all(f64(got)[0, 2] == 0)
    got32 = sparse_attn(q, kv, sink, jnp.asarray(idx), 0.3, accumulate="f32")
    assert np.all(np.abs(f64(got32) - want) <= bf16_ulp(want) + 1e-30)


def test_sparse_attn_sink_enters_the_denominator_unscaled():
    # one valid position: out = kv * e^{s l} / (e^{s l} + e^{sink}); scale 0.5 must not touch the sink
    d = 32
    v = np.zeros(d)
    v[0] = 1.0
    kv = jnp.asarray(v[None, None].astype(BF16))
    q = jnp.asarray((2 * v)[None, None, None].astype(BF16))
    idx = jnp.asarray([[[0, -1]]], jnp.int32)
    got = f64(sparse_attn(q, kv, jnp.asarray([1.0], jnp.float32), idx, 0.5))[0, 0, 0, 0]
    want = math.exp(1.0) / (math.exp(1.0) + math.exp(1.0))
    assert got == pytest.approx(want, rel=2**-8)


def test_sparse_attn_stays_finite_for_huge_logits_and_sinks():
    rng = np.random.default_rng(1)
    q, kv = rand_bf16(rng, (1, 2, 2, 32), 30.0), rand_bf16(rng, (1, 4, 32), 30.0)
    idx = jnp.asarray([[[0, 1, 2, 3], [3, 2, -1, -1]]], jnp.int32)
    for sink in ([300.0, -300.0], [-300.0, 300.0]):
        want = np_sparse_attn(q, kv, np.asarray(sink), np.asarray(idx), 1.0)
        for accumulate in ("f64", "f32"):
            got = f64(sparse_attn(q, kv, jnp.asarray(sink, jnp.float32), idx, 1.0, accumulate=accumulate))
            assert np.all(np.isfinite(got))
            assert np.all(np.abs(got - want) <= bf16_ulp(want) + 1e-30)


# ------------------------------------------------------------------------- window indices


def test_window_topk_idxs_prefill_rows_list_each_querys_causal_window():
    got = np.asarray(window_topk_idxs(4, 6, 0))
    want = [[0, -1, -1, -1], [0, 1, -1, -1], [0, 1, 2, -1], [0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5]]
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(window_topk_idxs(8, 3, 0)), [[0, -1, -1], [0, 1, -1], [0, 1, 2]])


def test_window_topk_idxs_decode_lists_ring_slots_oldest_first():
    np.testing.assert_array_equal(np.asarray(window_topk_idxs(4, 1, 5)), [[2, 3, 0, 1]])
    np.testing.assert_array_equal(np.asarray(window_topk_idxs(4, 1, 7)), [[0, 1, 2, 3]])
    np.testing.assert_array_equal(np.asarray(window_topk_idxs(4, 1, 2)), [[-1, 0, 1, 2]])
    traced = jax.jit(lambda p: window_topk_idxs(4, 1, p))(jnp.int32(5))
    np.testing.assert_array_equal(np.asarray(traced), [[2, 3, 0, 1]])
    with pytest.raises(ValueError, match="exactly one token"):
        window_topk_idxs(4, 2, 3)


def test_window_ring_holds_position_p_in_slot_p_mod_window():
    kv = jnp.arange(1, 11, dtype=jnp.float32)[None, :, None] * jnp.ones((1, 1, 2))
    np.testing.assert_array_equal(np.asarray(window_ring(kv, 4))[0, :, 0], [9, 10, 7, 8])  # positions 8, 9, 6, 7
    np.testing.assert_array_equal(np.asarray(window_ring(kv[:, :3], 4))[0, :, 0], [1, 2, 3, 0])


# ------------------------------------------------------------------------ candidate blocks


def np_candidate_blocks(scores, lens, topk_blocks, bs):
    """Direct per-row transcription of SPEC §5.8 (ties -> lower block)."""
    *lead, w = scores.shape
    nb = -(-w // bs)
    flat, fl = scores.reshape(-1, w), np.broadcast_to(lens, (*lead, 1)).reshape(-1)
    mask = np.zeros(flat.shape, bool)
    blocks = np.full((flat.shape[0], nb), -np.inf)
    for r in range(flat.shape[0]):
        for j in range(nb):
            blocks[r, j] = flat[r, j * bs:(j + 1) * bs].max()
            if j == (fl[r] - 1) // bs:
                blocks[r, j] = np.inf
        order = sorted(range(nb), key=lambda j: (-blocks[r, j], j))[:min(topk_blocks, nb)]
        for j in order:
            if blocks[r, j] > -np.inf:
                mask[r, j * bs:(j + 1) * bs] = True
    return mask.reshape(scores.shape), blocks.reshape(*lead, nb)


def test_select_candidate_blocks_pins_newest_block_and_drops_unreachable_ones():
    ninf = -np.inf
    scores = np.array([
        [5.0, 1.0, 9.0, 2.0, 0.5, ninf, ninf],  # sees 5: newest block 2 pinned although it scores lowest
        [3.0, ninf, ninf, ninf, ninf, ninf, ninf],  # sees 1: only block 0 reachable, fewer than topk
        [ninf] * 7,  # sees nothing: no block
        [1.0, 4.0, 4.0, 0.0, 4.0, 1.0, 2.0],  # sees 7: tie 4/4/4 between blocks 0,1,2 -> lower blocks
    ])
    lens = np.array([[5], [1], [0], [7]])
    mask, blocks = select_candidate_blocks(jnp.asarray(scores, jnp.bfloat16), jnp.asarray(lens), 2, 2)
    want = [
        [False, False, True, True, True, True, False],  # whole blocks survive, -inf members too
        [True, True, False, False, False, False, False],
        [False] * 7,
        [True, True, False, False, False, False, True],
    ]
    np.testing.assert_array_equal(np.asarray(mask), want)
    np.testing.assert_array_equal(f64(blocks)[0], [5.0, 9.0, np.inf, ninf])
    np.testing.assert_array_equal(f64(blocks)[3], [4.0, 4.0, 4.0, np.inf])


def test_select_candidate_blocks_matches_direct_transcription_on_random_rows():
    rng = np.random.default_rng(3)
    s, w = 24, 22
    scores = np.round(rng.normal(size=(2, s, w)) * 2) / 2  # coarse values: many ties
    lens = np.arange(-1, s - 1)[:, None]  # includes queries that see nothing (-1, 0)
    scores = np.where(np.arange(w) >= lens, -np.inf, scores)
    for topk_blocks, bs in [(3, 4), (2, 3), (50, 2)]:
        mask, blocks = select_candidate_blocks(jnp.asarray(scores, jnp.bfloat16), jnp.asarray(lens), topk_blocks, bs)
        want_mask, want_blocks = np_candidate_blocks(scores, lens, topk_blocks, bs)
        np.testing.assert_array_equal(np.asarray(mask), want_mask)
        np.testing.assert_array_equal(f64(blocks), want_blocks)


# ----------------------------------------------------------------------------- compressor


def test_ratio2_compressor_pools_pairs_by_channel_softmax_and_parks_an_odd_last_token():
    rng = np.random.default_rng(4)
    comp = randomize(Compressor(2, ARGS), 4)
    assert comp.wkv.weight[...].dtype == jnp.float32 and comp.wgate.weight[...].dtype == jnp.float32
    x = rand_bf16(rng, (2, 5, ARGS.dim))
    latent, kv_state, score_state = comp(x)
    assert latent.shape == (2, 2, ARGS.head_dim) and latent.dtype == jnp.bfloat16
    wkv, wg = f64(comp.wkv.weight[...]), f64(comp.wgate.weight[...])
    kv, sc = f64(x) @ wkv.T, f64(x) @ wg.T
    # the trailing token waits in slot 0; slot 1 keeps its initial value
    np.testing.assert_allclose(f64(kv_state[:, 0]), kv[:, 4], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(f64(score_state[:, 0]), sc[:, 4], rtol=1e-6, atol=1e-6)
    assert np.all(f64(kv_state[:, 1]) == 0) and np.all(f64(score_state[:, 1]) == -np.inf)
    # group j pools tokens 2j, 2j+1 with a per-channel softmax, cast to bf16, then the norm
    g_kv, g_sc = kv[:, :4].reshape(2, 2, 2, -1), sc[:, :4].reshape(2, 2, 2, -1)
    w = np.exp(g_sc - g_sc.max(axis=2, keepdims=True))
    pooled = bf16_round((g_kv * w / w.sum(axis=2, keepdims=True)).sum(axis=2))
    want = f64(comp.norm.weight[...]) * pooled / np.sqrt((pooled**2).mean(-1, keepdims=True) + ARGS.norm_eps)
    got = f64(latent)
    assert np.mean(got != bf16_round(want)) < 0.02  # f32 vs f64 may flip a rounding here and there
    assert np.all(np.abs(got - want) <= 2 * bf16_ulp(want))
    # an even prefill leaves the states untouched, and the latent does not depend on the parked token
    latent4, kv4, sc4 = comp(x[:, :4])
    np.testing.assert_array_equal(f64(latent4), got)
    assert np.all(f64(kv4) == 0) and np.all(f64(sc4) == -np.inf)


def test_ratio1_compressor_is_the_normed_bf16_projection_of_every_token():
    rng = np.random.default_rng(5)
    comp = randomize(Compressor(4, ARGS), 5)
    assert comp.wkv.weight[...].dtype == jnp.bfloat16 and not hasattr(comp, "wgate")
    x = rand_bf16(rng, (1, 3, ARGS.dim))
    latent, kv_state, score_state = comp(x)
    assert kv_state is None and score_state is None
    np.testing.assert_array_equal(f64(latent), f64(comp.norm(comp.wkv(x))))


# -------------------------------------------------------------------------------- indexer


def np_index_scores(q, k, w):
    """SPEC §5.7 step 4 in float64 with the reference's bf16 rounding points."""
    dots = bf16_round(np.einsum("bshd,btd->bsht", f64(q), f64(k)))
    prod = bf16_round(np.maximum(dots, 0) * f64(w)[..., None])
    return bf16_round(prod.sum(axis=2))


def test_index_scores_round_dots_products_and_head_sum_to_bf16_like_the_reference():
    # at this size XLA CPU fuses the dot, the element-wise steps and the head sum into one kernel
    # that would skip plain f32 -> bf16 -> f32 roundings (1464 of 4096 scores off by an ulp)
    rng = np.random.default_rng(6)
    q = quant.fp4_quant_dequant_ue8m0(rand_bf16(rng, (2, 64, 8, 32)))
    k = quant.fp4_quant_dequant_ue8m0(rand_bf16(rng, (2, 32, 32)))
    w = rand_bf16(rng, (2, 64, 8), 0.1)
    got = index_scores(q, k, w)
    assert got.dtype == jnp.bfloat16 and got.shape == (2, 64, 32)
    np.testing.assert_array_equal(f64(got), np_index_scores(q, k, w))


@pytest.mark.parametrize("s, t, block_bytes", [(64, 300, 64 * 8 * 4 * 2 * 128), (1, 1000, 3 * 8 * 4 * 2)])
def test_index_scores_in_key_blocks_equal_the_reference_rounding(s, t, block_bytes):
    # block_bytes gives 128-key blocks (300 keys: two full and one padded block) for the prefill
    # shape and 3-key blocks (a ragged last block) for a decode row
    rng = np.random.default_rng(7)
    q = quant.fp4_quant_dequant_ue8m0(rand_bf16(rng, (2, s, 8, 32)))
    k = quant.fp4_quant_dequant_ue8m0(rand_bf16(rng, (2, t, 32)))
    w = rand_bf16(rng, (2, s, 8), 0.1)
    got = index_scores(q, k, w, block_bytes=block_bytes)
    assert got.dtype == jnp.bfloat16 and got.shape == (2, s, t)
    np.testing.assert_array_equal(f64(got), np_index_scores(q, k, w))
    np.testing.assert_array_equal(f64(got), f64(index_scores(q, k, w)))


HAS_GPU = jax.default_backend() == "gpu"


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.skipif(not HAS_GPU,
                                                                                        reason="needs a GPU"))])
@pytest.mark.parametrize("b, s, h, d, t", [(2, 37, 8, 32, 50), (3, 1, 8, 32, 300), (1, 64, 32, 128, 200)])
def test_index_scores_kernel_equals_the_reference_rounding(b, s, h, d, t, interpret):
    """The GPU kernel (`pallas_kernels.index_scores`, interpret mode on CPU, compiled on a GPU):
    the reference's bf16 steps bit for bit on inputs whose f32 sums are exact in any order (FP4
    values), with rows and keys that are no multiple of its blocks and single-row (decode) calls."""
    rng = np.random.default_rng(9)
    q = quant.fp4_quant_dequant_ue8m0(rand_bf16(rng, (b, s, h, d)))
    k = quant.fp4_quant_dequant_ue8m0(rand_bf16(rng, (b, t, d)))
    w = rand_bf16(rng, (b, s, h), 0.1)
    got = jax.jit(lambda q, k, w: index_scores_api.index_scores(q, k, w, implementation="pallas",
                                                                interpret=interpret))(q, k, w)
    assert got.dtype == jnp.bfloat16 and got.shape == (b, s, t)
    np.testing.assert_array_equal(f64(got), np_index_scores(q, k, w))


@pytest.fixture
def index_kernel_calls(monkeypatch):
    """The q shapes of the index-score kernel's calls (the kernel still runs)."""
    from pallas_kernels.index_scores import kernel_gpu

    calls = []
    real = kernel_gpu.index_scores
    monkeypatch.setattr(kernel_gpu, "index_scores", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    return calls


def test_indexer_score_kernel_switch_runs_the_kernel(index_kernel_calls):
    """`Indexer.score_kernel` (on by default) hands the scores to the kernel where `kernels`
    picks it; off (the `index_score_reference` switch), the reference runs."""
    calls = index_kernel_calls
    idx = Indexer(2, ARGS.replace(kernels="pallas", kernels_interpret=True))
    rng = np.random.default_rng(10)
    q, k = rand_bf16(rng, (1, 20, 4, 32)), rand_bf16(rng, (1, 24, 32))
    w = rand_bf16(rng, (1, 20, 4), 0.1)
    assert idx.score_kernel is True
    got = idx.scores(q, k, w)
    assert calls == [(1, 20, 4, 32)]
    idx.score_kernel = False
    want = idx.scores(q, k, w)
    assert calls == [(1, 20, 4, 32)]
    np.testing.assert_array_equal(f64(got), f64(want))


def test_index_scores_auto_runs_the_kernel_for_prefill_and_decode_calls(index_kernel_calls):
    """"auto" runs the kernel for several query rows a batch row and for one row (decode: the
    one-row layout, all heads in one dot); both give the reference's scores (FP4 inputs, as the
    model's queries and keys are)."""
    calls = index_kernel_calls
    rng = np.random.default_rng(11)
    k = quant.fp4_quant_dequant_ue8m0(rand_bf16(rng, (3, 70, 32)))
    for s in (5, 1):
        q = quant.fp4_quant_dequant_ue8m0(rand_bf16(rng, (3, s, 8, 32)))
        w = rand_bf16(rng, (3, s, 8), 0.1)
        got = index_scores_api.index_scores(q, k, w, implementation="auto", interpret=True)
        np.testing.assert_array_equal(f64(got), np_index_scores(q, k, w))
    assert calls == [(3, 5, 8, 32), (3, 1, 8, 32)]


def np_topk(scores, lens, k, offset):
    """Lower index first among equal scores, then position order; unreachable -> -1."""
    out = np.zeros(scores.shape[:-1] + (k,), np.int64)
    for ix in np.ndindex(scores.shape[:-1]):
        row = scores[ix]
        pick = sorted(sorted(range(len(row)), key=lambda t: (-row[t], t))[:k])
        ln = np.broadcast_to(lens, scores.shape[:-1] + (1,))[ix][0]
        out[ix] = [t + offset if t < ln else -1 for t in pick]
    return out


@pytest.fixture(scope="module")
def tiny_stack():
    """Layers 0..6 of the tiny config on one random input (S = 64 > window 8, golden-like shapes)."""
    x = rand_bf16(np.random.default_rng(7), (2, S, ARGS.dim))
    return x, run_stack(ARGS, x)


def test_indexer_masks_positions_a_query_cannot_see_and_never_selects_them(tiny_stack):
    x, (_, _, auxs) = tiny_stack
    s = x.shape[1]
    for layer in (2, 4, 6):
        r = ARGS.compress_ratios[layer]
        score, topk = f64(auxs[layer]["index_score"]), np.asarray(auxs[layer]["topk"])
        lens = (np.arange(1, s + 1) // r)[:, None]
        hidden = np.broadcast_to(np.arange(s // r)[None, :] >= lens, score.shape)
        if ARGS.uses_candidates(layer):  # checked in the candidate test below
            hidden = hidden | ~np.asarray(auxs[ARGS.candidate_source_layer]["candidates"])
        assert np.all(score[hidden] == -np.inf) and np.all(np.isfinite(score[~hidden]))
        k = min(ARGS.index_topk, s // r)
        assert topk.shape == (2, s, k) and topk.dtype == np.int32
        np.testing.assert_array_equal(topk, np_topk(score, lens, k, s))
        valid = topk >= 0
        assert np.all(topk[valid] - s < np.broadcast_to(lens[None], topk.shape)[valid])
        # a query gets min(k, its compress_len) rows
        np.testing.assert_array_equal(valid.sum(-1), np.broadcast_to(np.minimum(lens[:, 0], k), (2, s)))
        if not ARGS.uses_candidates(layer):  # every selected position has a real score
            assert np.all(np.isfinite(np.take_along_axis(score, np.maximum(topk - s, 0), -1)[valid]))


def test_candidate_source_publishes_mask_and_reindex_layer_scores_only_inside_it(tiny_stack):
    x, (_, shared, auxs) = tiny_stack
    cand = np.asarray(auxs[4]["candidates"])
    assert cand.shape == (2, S, S) and cand.dtype == np.bool_
    np.testing.assert_array_equal(np.asarray(shared["candidates"]), cand)
    lens = np.arange(1, S + 1)[:, None]
    want, _ = np_candidate_blocks(f64(auxs[4]["index_score"]), lens, ARGS.candidate_topk_blocks,
                                  ARGS.candidate_block_size)
    np.testing.assert_array_equal(cand, want)
    assert cand.sum(-1).max() <= ARGS.candidate_topk_blocks * ARGS.candidate_block_size
    assert np.any(~cand & (np.arange(S) < lens))  # the mask really removes reachable positions
    score6 = f64(auxs[6]["index_score"])
    assert np.all(score6[~cand] == -np.inf)
    picked = np.asarray(auxs[6]["topk"])
    bi, rows, slots = np.nonzero(picked >= 0)
    assert np.all(cand[bi, rows, picked[bi, rows, slots] - S])  # enough candidates: none chosen outside
    assert "candidates" not in auxs[6] and "candidates" not in auxs[2]


def test_reuse_layers_attend_to_the_latest_sources_compressed_kv_and_topk(tiny_stack):
    x, (_, _, auxs) = tiny_stack
    shared = {}
    for i in range(ARGS.n_layers):
        att = randomize(Attention(i, ARGS), i)
        q, kv, idx, new_shared, aux = att.prefill_operands(x, shared)
        w = min(S, ARGS.window_size)
        window_idx = np.asarray(window_topk_idxs(ARGS.window_size, S, 0))
        np.testing.assert_array_equal(np.asarray(idx[:, :, :w]), np.broadcast_to(window_idx, (2, S, w)))
        if ARGS.compress_ratios[i]:
            np.testing.assert_array_equal(f64(kv[:, S:]), f64(new_shared["compress_kv"]))
            np.testing.assert_array_equal(np.asarray(idx[:, :, w:]), np.asarray(new_shared["topk"]))
            src, isrc = ARGS.kv_source_of(i), ARGS.index_source_of(i)
            np.testing.assert_array_equal(f64(new_shared["compress_kv"]), f64(auxs[src]["compress_kv"]))
            np.testing.assert_array_equal(np.asarray(new_shared["topk"]), np.asarray(auxs[isrc]["topk"]))
        else:
            assert kv.shape[1] == S and idx.shape[-1] == w
        if ARGS.attn_role(i) in ("reuse", "window"):
            assert new_shared.keys() == shared.keys() and set(aux) == {"window_kv"}
        shared = new_shared


def test_compressed_kv_and_index_keys_are_rotated_at_group_starts_and_quantised(tiny_stack):
    x, (_, _, auxs) = tiny_stack
    for layer in (2, 4):
        att = randomize(Attention(layer, ARGS), layer)
        r = ARGS.compress_ratios[layer]
        latent, _, _ = att.compressor(x)
        cos, sin = att.rope(jnp.arange(S // r) * r)
        want_kv = quant.fp4_quant_dequant_e4m3(apply_rope(latent, cos, sin, ARGS.rope_head_dim), 16)
        np.testing.assert_array_equal(f64(auxs[layer]["compress_kv"]), f64(want_kv))
        ix = att.indexer
        k = apply_rope(ix.k_norm(ix.wk(latent)), cos, sin, ARGS.rope_head_dim)
        np.testing.assert_array_equal(f64(auxs[layer]["index_k"]), f64(quant.fp4_quant_dequant_ue8m0(k, 32)))
        # RoPE at position j*r, not j: rotating at 0..n-1 gives other keys (the tail is not position-free)
        cos_j, sin_j = att.rope(jnp.arange(S // r))
        if r > 1:
            other = quant.fp4_quant_dequant_e4m3(apply_rope(latent, cos_j, sin_j, ARGS.rope_head_dim), 16)
            assert np.any(f64(other) != f64(auxs[layer]["compress_kv"]))


def test_compressed_kv_rounds_exact_e2m1_ties_to_the_even_code():
    att = Attention(2, ARGS)
    block = np.zeros(ARGS.head_dim)
    # first 16-block: amax 2.8125 -> scale e4m3(2.8125/6) = 0.46875; 1.171875 / 0.46875 = 2.5 exactly,
    # a tie between the e2m1 values 2 (even code 4) and 3 (code 5) -> 2 * 0.46875 = 0.9375;
    # 0.5859375 / 0.46875 = 1.25, a tie between 1 (code 2) and 1.5 (code 3) -> 0.46875
    block[:3] = [2.8125, 1.171875, 0.5859375]
    latent = jnp.asarray(block.astype(BF16))[None, None]
    cos, sin = att.rope(jnp.zeros((1,), jnp.int32))  # position 0: RoPE is the identity
    got = f64(att.compress_latent(latent, cos, sin))[0, 0, :3]
    np.testing.assert_array_equal(got, [2.8125, 0.9375, 0.46875])


# ------------------------------------------------------------------------ output + layer


def test_output_projection_derotates_then_projects_each_group_with_its_own_wo_a_block():
    rng = np.random.default_rng(8)
    att = randomize(Attention(3, ARGS), 8)
    b, s, h, hd, g, r = 1, 3, ARGS.n_heads, ARGS.head_dim, ARGS.o_groups, ARGS.o_lora_rank
    o = rand_bf16(rng, (b, s, h, hd))
    cos, sin = att.rope(jnp.arange(s))
    got = att.output(o, cos, sin)
    od = f64(apply_rope(o, cos, sin, ARGS.rope_head_dim, inverse=True)).reshape(b, s, g, h * hd // g)
    assert att.wo_a.weight[...].dtype == jnp.float8_e4m3fn  # kept as shipped, widened in the matmul
    wa = f64(quant.dequant_fp8_weight(att.wo_a.weight[...], att.wo_a.scale[...], jnp.float32)).reshape(g, r, h * hd // g)
    y = np.stack([od[:, :, gi] @ wa[gi].T for gi in range(g)], axis=2).reshape(b, s, g * r)
    y = jnp.asarray(bf16_round(y).astype(BF16))
    # wo_a is the only step computed here, so its bf16 output may differ by one rounding
    want = f64(att.wo_b(y))
    diff = np.abs(f64(got) - want)
    assert np.all(diff <= 0.02 * np.sqrt((want**2).mean()) + 2 * bf16_ulp(want)), diff.max()
    # the inverse rotation really undoes the forward one on the rope tail
    back = apply_rope(apply_rope(o, cos, sin, ARGS.rope_head_dim), cos, sin, ARGS.rope_head_dim, inverse=True)
    assert np.max(np.abs(f64(back) - f64(o))) <= 2 * bf16_ulp(np.abs(f64(o)).max())


def test_attention_call_is_sparse_attn_over_window_plus_compressed_rows_then_output(tiny_stack):
    x, (outs, _, _) = tiny_stack
    shared = {}
    for i in range(5):
        att = randomize(Attention(i, ARGS), i)
        q, kv, idx, shared, _ = att.prefill_operands(x, shared)
        cos, sin = att.rope(jnp.arange(S))
        o = sparse_attn(q, kv, att.attn_sink[...], idx, ARGS.head_dim**-0.5)
        np.testing.assert_array_equal(f64(outs[i]), f64(att.output(o, cos, sin)))
        assert outs[i].shape == x.shape and outs[i].dtype == jnp.bfloat16


def test_attn_accumulate_auto_is_float64_except_on_tpu(monkeypatch):
    backend = jax.default_backend()
    if backend == "tpu":
        assert resolve_attn_accumulate("auto") == "f32"
    else:
        assert resolve_attn_accumulate("f64") == "f64" and resolve_attn_accumulate("f32") == "f32"
        assert resolve_attn_accumulate("auto") == "f64"
        assert Attention(0, ARGS).accumulate == "f64"  # the model's layers resolve ModelArgs' "auto"
    assert Attention(0, ARGS.replace(attn_accumulate="f32")).accumulate == "f32"
    with pytest.raises(ValueError, match="attn_accumulate"):
        resolve_attn_accumulate("bf16")
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert resolve_attn_accumulate("auto") == "f32" and resolve_attn_accumulate("f32") == "f32"
    with pytest.raises(ValueError, match="TPUs do not have"):
        resolve_attn_accumulate("f64")


def test_one_token_prefill_on_a_ratio2_source_has_no_compressed_rows_and_parks_the_token():
    x = rand_bf16(np.random.default_rng(9), (1, 1, ARGS.dim))
    att = randomize(Attention(2, ARGS), 2)
    out, shared, aux = att(x, {})
    assert shared["compress_kv"].shape == (1, 0, ARGS.head_dim) and shared["topk"].shape == (1, 1, 0)
    assert np.all(np.isfinite(f64(out)))
    assert np.any(f64(aux["kv_state"][:, 0]) != 0) and np.all(f64(aux["score_state"][:, 1]) == -np.inf)


def test_layers_reading_unpublished_state_fail_with_a_clear_error():
    x = rand_bf16(np.random.default_rng(10), (1, 4, ARGS.dim))
    with pytest.raises(KeyError, match="compress_kv"):
        Attention(3, ARGS)(x, {})


def test_parameters_are_named_shaped_and_typed_like_the_reference():
    args = ModelArgs()  # released config; eval_shape allocates nothing
    hd, d, H = args.head_dim, args.dim, args.n_heads

    def params(i):
        state = nnx.state(nnx.eval_shape(lambda: Attention(i, args)), nnx.Param)
        return {".".join(map(str, p)): (tuple(v.shape), v.dtype) for p, v in nnx.to_flat_state(state)}

    src20, window0, reuse3, reindex24, src2 = params(20), params(0), params(3), params(24), params(2)
    assert src20["attn_sink"] == ((H,), jnp.float32)
    assert src20["wq_a.weight"] == ((args.q_lora_rank, d), jnp.float8_e4m3fn)
    assert src20["wq_a.scale"] == ((40, 160), jnp.float8_e8m0fnu)
    assert src20["wq_b.weight"] == ((H * hd, args.q_lora_rank), jnp.float8_e4m3fn)
    assert src20["wkv.weight"] == ((hd, d), jnp.float8_e4m3fn)
    assert src20["wo_a.weight"] == ((args.o_groups * args.o_lora_rank, H * hd // args.o_groups), jnp.float8_e4m3fn)
    assert src20["wo_a.scale"] == ((256, 128), jnp.float8_e8m0fnu)
    assert src20["wo_b.weight"] == ((d, args.o_groups * args.o_lora_rank), jnp.float8_e4m3fn)
    assert src20["q_norm.weight"] == ((args.q_lora_rank,), jnp.bfloat16)
    assert src20["kv_norm.weight"] == ((hd,), jnp.bfloat16)
    assert src20["compressor.wkv.weight"] == ((hd, d), jnp.bfloat16) and "compressor.wgate.weight" not in src20
    assert src2["compressor.wkv.weight"] == ((hd, d), jnp.float32)
    assert src2["compressor.wgate.weight"] == ((hd, d), jnp.float32)
    ih, ihd = args.index_n_heads, args.index_head_dim
    assert src20["indexer.wq_b.weight"] == ((ih * ihd, args.q_lora_rank), jnp.float8_e4m3fn)
    assert src20["indexer.weights_proj.weight"] == ((args.index_n_heads, d), jnp.bfloat16)
    assert src20["indexer.wk.weight"] == ((args.index_head_dim, hd), jnp.bfloat16)
    assert src20["indexer.k_norm.weight"] == ((args.index_head_dim,), jnp.bfloat16)
    assert not any(k.startswith(("compressor", "indexer")) for k in window0)
    assert not any(k.startswith(("compressor", "indexer")) for k in reuse3)
    assert not any(k.startswith(("compressor", "indexer.wk", "indexer.k_norm")) for k in reindex24)
    assert "indexer.wq_b.weight" in reindex24 and "indexer.weights_proj.weight" in reindex24


@pytest.mark.parametrize("layer", [2, 4])
def test_source_layers_jit_to_the_eager_result_bit_for_bit(tiny_stack, layer):
    # jit fuses dots with the element-wise ops after them; every bf16 rounding point must survive
    x, (outs, _, auxs) = tiny_stack
    shared = {}
    for i in range(layer):
        _, shared, _ = randomize(Attention(i, ARGS), i)(x, shared)
    att = randomize(Attention(layer, ARGS), layer)
    out, _, aux = nnx.jit(lambda m, x, sh: m(x, sh))(att, x, shared)
    np.testing.assert_array_equal(f64(out), f64(outs[layer]))
    assert aux.keys() == auxs[layer].keys()
    for key in aux:
        np.testing.assert_array_equal(f64(aux[key]), f64(auxs[layer][key]), err_msg=key)


# ------------------------------------------------------------------------------- golden


GOLDEN_NAMES = {"kv_state": "compressor_kv_state", "score_state": "compressor_score_state"}


@pytest.fixture(scope="module")
def golden_run(golden):
    """Teacher-forced prefill of every backbone layer's attention on one golden set (eager: the
    jitted path is checked against eager on the tiny stack).

    Layer i's input is attn_norm(hc_pre(stream, pre_mix)) with the golden stream entering block i
    (h0 expanded for i = 0, engram_out for Engram layers, else block_out of i-1) and the golden
    pre-mix handed over by block i-1; layers run in order so `shared` comes from the
    teacher-forced source layers. Returns {layer: aux}.
    """
    args = golden.args
    ckpt = HubCheckpoint(golden.path)
    shared, auxs = {}, {}
    for i in range(args.n_layers):
        if i == 0:
            h0 = jnp.asarray(golden["prefill.h0"])
            b, s, d = h0.shape
            stream = jnp.broadcast_to(h0[:, :, None, :], (b, s, args.hc_mult, d))
            pre_mix = identity_pre_mix(b, s, args.hc_mult)
        else:
            key = f"prefill.engram_out.L{i:02d}" if i in args.engram_layer_ids else f"prefill.block_out.L{i - 1:02d}"
            stream = jnp.asarray(golden[key])
            pre_mix = jnp.asarray(golden[f"prefill.block_premix.L{i - 1:02d}"])
        norm = RMSNorm(args.dim, args.norm_eps)
        load_hub_weights(norm, ckpt, f"layers.{i}.attn_norm.")
        att = Attention(i, args)
        load_hub_weights(att, ckpt, f"layers.{i}.attn.")
        _, shared, auxs[i] = att(norm(hc_pre(stream, pre_mix)), shared)
    return auxs


def _pairs(golden, auxs, name):
    """(layer, ours, gold) for every layer of the golden set that records `name`, after checking that
    exactly those layers produce it."""
    key = GOLDEN_NAMES.get(name, name)
    gold_layers = {i for i in auxs if f"prefill.{key}.L{i:02d}" in golden}
    ours = {i for i, a in auxs.items() if name in a}
    assert gold_layers == ours, f"{name}: golden layers {sorted(gold_layers)}, port produces it on {sorted(ours)}"
    assert gold_layers or name in ("kv_state", "score_state"), f"golden set records no {name}"
    return [(i, np.asarray(auxs[i][name]), np.asarray(golden[f"prefill.{key}.L{i:02d}"])) for i in sorted(gold_layers)]


@pytest.mark.parametrize("name", ["window_kv", "index_k", "kv_state", "score_state"])
def test_golden_window_kv_index_keys_and_compressor_states_are_bit_exact(golden, golden_run, name):
    for i, ours, gold in _pairs(golden, golden_run, name):
        assert ours.shape == gold.shape, (i, ours.shape, gold.shape)
        np.testing.assert_array_equal(ours.astype(np.float64), gold.astype(np.float64), err_msg=f"{name} L{i:02d}")


def test_golden_compressed_kv_is_bit_exact(golden, golden_run):
    for i, ours, gold in _pairs(golden, golden_run, "compress_kv"):
        assert ours.shape == gold.shape
        o, g = ours.astype(np.float64), gold.astype(np.float64)
        assert np.array_equal(o, g), f"L{i:02d}: {(o != g).sum()} of {o.size} differ, max {np.abs(o - g).max()}"


def test_golden_compressed_kv_differs_at_most_by_isolated_single_fp4_steps(golden, golden_run):
    for i, ours, gold in _pairs(golden, golden_run, "compress_kv"):
        o, g = ours.astype(np.float64), gold.astype(np.float64)
        diff = o != g
        assert diff.mean() <= 1e-3, f"L{i:02d}: {diff.sum()} of {diff.size} differ"
        # a flip moves one value to a neighbouring e2m1 code: at most 2 scale steps, scale ~ amax/6
        amax = np.abs(g.reshape(*g.shape[:-1], -1, 16)).max(-1, keepdims=True)
        step = np.broadcast_to(amax / 3, (*amax.shape[:-1], 16)).reshape(g.shape)
        assert np.all(np.abs(o - g)[diff] <= step[diff] * 1.01), f"L{i:02d}"


@pytest.mark.parametrize("name", ["topk", "candidates"])
def test_golden_topk_rows_and_candidate_masks_are_identical(golden, golden_run, name):
    for i, ours, gold in _pairs(golden, golden_run, name):
        assert ours.shape == gold.shape and ours.dtype == gold.dtype, (i, ours.shape, gold.shape, ours.dtype)
        np.testing.assert_array_equal(ours, gold, err_msg=f"{name} L{i:02d}")


@pytest.mark.parametrize("name", ["index_score", "cand_block_score"])
def test_golden_index_and_block_scores_match_within_bf16_rounding(golden, golden_run, name):
    for i, ours, gold in _pairs(golden, golden_run, name):
        assert ours.shape == gold.shape
        o, g = ours.astype(np.float64), gold.astype(np.float64)
        fin = np.isfinite(g)
        np.testing.assert_array_equal(o[~fin], g[~fin], err_msg=f"{name} L{i:02d}: infinities differ")
        rms = np.sqrt(np.mean(g[fin] ** 2))
        bad = np.abs(o[fin] - g[fin]) > 2**-7 * np.abs(g[fin]) + 2**-7 * rms
        assert not bad.any(), f"{name} L{i:02d}: {bad.sum()} elements outside bf16 tolerance"
        assert np.mean(o[fin] != g[fin]) <= 1e-3, f"{name} L{i:02d}: too many differing elements"
