"""Whole-model prefill parity with the official reference, per block with teacher forcing (SPEC §20).

Each block i gets the golden input of its step (block_out.L(i-1), or engram_out.Li on an Engram
layer, with block_premix.L(i-1)); block 0 gets golden h0 on every hc copy with the identity
pre-mix. Shared compressed KV / index keys / top-k / candidates then flow from teacher-forced
source layers. Criteria: bf16 streams |port - gold| <= 2^-7 |gold| + 2^-7 RMS(gold); routing
sets and top-k rows exactly equal; logits from the teacher-forced final stream within 1e-2.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.loading import load_hub_weights
from dsv41_jax.mhc import identity_pre_mix
from dsv41_jax.model import Transformer

NOT_IN_TEXT_MODEL = ("vision.", "aligner.", "image_start", "image_end", "image_newline", "mtp.")


@functools.lru_cache(maxsize=None)
def _model(path: str):
    from conftest import GoldenSet

    g = GoldenSet(path)
    model = Transformer(g.args)
    load_hub_weights(model, g.path, skip=NOT_IN_TEXT_MODEL)
    if model.token_map is not None:
        model.token_map.set_value(jnp.asarray(np.load(g.path / "engram_map.npy"), jnp.int32))
    return model


def bf16_close(port, gold) -> tuple[bool, float, float]:
    """The golden README's per-block criterion; returns (ok, max |diff|, worst diff / bound)."""
    p = np.asarray(port, np.float32)
    g = np.asarray(gold, np.float32)
    rms = float(np.sqrt(np.mean(g.astype(np.float64) ** 2)))
    bound = 2.0**-7 * np.abs(g) + 2.0**-7 * rms
    d = np.abs(p - g)
    return bool(np.all(d <= bound)), float(d.max()), float((d / bound).max())


def _inputs(g):
    ids = jnp.asarray(g["inputs.prompt"], jnp.int32)
    tt = g.inputs.get("token_types")
    token_types = None if tt is None else jnp.asarray(np.asarray(tt), jnp.int32)
    return ids, token_types


@nnx.jit
def _run_block(block, x, pre_mix, shared, image_mask):
    return block(x, pre_mix, shared, image_mask)


@nnx.jit
def _run_engram(engram, x, hashes, mask):
    return engram(x, hashes, mask)


def _teacher_forced_prefill(g):
    """Runs every block on its golden input; yields (layer, outputs, aux, engram_out or None)."""
    model = _model(str(g.path))
    a = g.args
    ids, token_types = _inputs(g)
    image_mask = None if token_types is None else token_types >= 0
    engram_mask = None if image_mask is None else ~image_mask
    b, s = ids.shape
    hashes = jnp.asarray(g["prefill.engram_hashes"]) if a.engram_layer_ids else None
    shared: dict = {}
    for i, layer in enumerate(model.layers):
        if i == 0:
            h0 = jnp.asarray(g["prefill.h0"], jnp.bfloat16)
            x = jnp.broadcast_to(h0[:, :, None, :], (b, s, a.hc_mult, a.dim))
            pre = identity_pre_mix(b, s, a.hc_mult)
        else:
            x = jnp.asarray(g[f"prefill.block_out.L{i - 1:02d}"], jnp.bfloat16)
            pre = jnp.asarray(g[f"prefill.block_premix.L{i - 1:02d}"])
        engram_out = None
        if layer.engram is not None:
            col = a.engram_table_index(i)
            engram_out = _run_engram(layer.engram, x, hashes[:, :, col, :].astype(jnp.int32), engram_mask)
            x = jnp.asarray(g[f"prefill.engram_out.L{i:02d}"], jnp.bfloat16)
        out, pre_out, shared, aux = _run_block(layer, x, pre, shared, image_mask)
        yield i, out, pre_out, aux, engram_out


def _collect(g, cache={}):  # noqa: B006 - per-process memo of the teacher-forced run per set
    key = str(g.path)
    if key not in cache:
        cache[key] = list(_teacher_forced_prefill(g))
    return cache[key]


# Measured: at most 246 of 53,248 elements (0.46%, tiny-c layer 8, all in one token) of a block
# output are not bit-identical to the reference. A dropped bf16 rounding point (e.g. XLA eliding
# a convert pair under jit) stays inside the elementwise bound but changes ~20% of the elements,
# so the fraction is pinned too.
MAX_DIFFERING_FRACTION = 0.01


def test_block_outputs_are_bit_identical_except_rare_rounding_flips(golden):
    for i, out, _, _, _ in _collect(golden):
        gold = golden[f"prefill.block_out.L{i:02d}"].astype(np.float32)
        frac = float(np.mean(np.asarray(out, np.float32) != gold))
        assert frac <= MAX_DIFFERING_FRACTION, f"{golden.name} layer {i}: {frac:.2%} of elements differ"


def test_every_block_output_matches_reference_within_one_bf16_ulp(golden):
    worst = []
    for i, out, _, _, _ in _collect(golden):
        ok, dmax, ratio = bf16_close(out, golden[f"prefill.block_out.L{i:02d}"])
        worst.append((i, dmax, ratio))
        assert ok, f"{golden.name} layer {i}: max |diff| {dmax:.4g}, {ratio:.3g}x the bound"
    print(golden.name, "block_out worst (layer, max|diff|, ratio-to-bound):", max(worst, key=lambda t: t[2]))


# Measured (both sets, all layers): pre-mix max |diff| 1.8e-4 and routing-weight max |diff| 4.2e-4,
# each at the one or two tokens per layer where an fp32 summation-order difference flipped a bf16
# rounding (or an e4m3 code) upstream; all other tokens agree to 1e-6. Bounds: ~1.5x measured.
PREMIX_ATOL = 3e-4
ROUTE_W_ATOL = 6e-4


def test_every_block_premix_matches_reference(golden):
    for i, _, pre, _, _ in _collect(golden):
        np.testing.assert_allclose(np.asarray(pre), golden[f"prefill.block_premix.L{i:02d}"], rtol=0,
                                   atol=PREMIX_ATOL, err_msg=f"{golden.name} layer {i}")


def test_routing_sets_equal_and_weights_close(golden):
    for i, _, _, aux, _ in _collect(golden):
        idx = np.asarray(aux["route_idx"])
        gold_idx = golden[f"prefill.route_idx.L{i:02d}"]
        np.testing.assert_array_equal(np.sort(idx, -1), np.sort(gold_idx, -1), err_msg=f"{golden.name} layer {i}")
        order = np.argsort(idx, -1)
        gorder = np.argsort(gold_idx, -1)
        w = np.take_along_axis(np.asarray(aux["route_w"]), order, -1)
        gw = np.take_along_axis(golden[f"prefill.route_w.L{i:02d}"], gorder, -1)
        np.testing.assert_allclose(w, gw, rtol=0, atol=ROUTE_W_ATOL, err_msg=f"{golden.name} layer {i}")


def test_topk_rows_and_candidates_equal_exactly(golden):
    n_checked = 0
    for i, _, _, aux, _ in _collect(golden):
        key = f"prefill.topk.L{i:02d}"
        if key in golden:
            np.testing.assert_array_equal(np.asarray(aux["topk"]), golden[key], err_msg=f"{golden.name} L{i}")
            n_checked += 1
        key = f"prefill.candidates.L{i:02d}"
        if key in golden:
            np.testing.assert_array_equal(np.asarray(aux["candidates"]), golden[key], err_msg=f"{golden.name} L{i}")
    assert n_checked == len(golden.args.index_source_layers)


def test_engram_outputs_match_reference(golden):
    n = 0
    for i, _, _, _, eo in _collect(golden):
        if eo is None:
            continue
        ok, dmax, ratio = bf16_close(eo, golden[f"prefill.engram_out.L{i:02d}"])
        assert ok, f"{golden.name} engram L{i}: max |diff| {dmax:.4g} ({ratio:.3g}x bound)"
        n += 1
    assert n == len(golden.args.engram_layer_ids)


def test_logits_from_teacher_forced_final_stream_within_1e_2(golden):
    model = _model(str(golden.path))
    last = golden.args.n_layers - 1
    x = jnp.asarray(golden[f"prefill.block_out.L{last:02d}"], jnp.bfloat16)
    pre = jnp.asarray(golden[f"prefill.block_premix.L{last:02d}"])
    logits = np.asarray(nnx.jit(lambda m, x, p: m.logits(x, p))(model, x, pre))
    gold = golden["prefill.logits"]
    err = np.abs(logits - gold).max()
    assert err <= 1e-2, err
    np.testing.assert_array_equal(logits.argmax(-1), golden["prefill.next_token"])


def test_full_prefill_jits_and_tracks_reference(golden):
    """The whole forward under one jit. End to end the tiny models are chaotic (a last-bit change
    flips near-tied routing), so this asserts shape/finiteness and reports agreement only."""
    model = _model(str(golden.path))
    ids, token_types = _inputs(golden)
    h0 = jnp.asarray(golden["prefill.h0"], jnp.bfloat16)

    @nnx.jit
    def fwd(m, ids, tt, h0):
        return m(ids, tt, h0)

    logits = np.asarray(fwd(model, ids, token_types, h0))
    assert logits.shape == (ids.shape[0], golden.args.vocab_size) and np.isfinite(logits).all()
    print(golden.name, "end-to-end max |logit diff|:", float(np.abs(logits - golden["prefill.logits"]).max()),
          "argmax equal:", (logits.argmax(-1) == golden["prefill.next_token"]).tolist())
