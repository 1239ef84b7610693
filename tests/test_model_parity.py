"""Whole-model prefill parity with the official reference, per block with teacher forcing (SPEC §20).

Each block i gets the golden input of its step (block_out.L(i-1), or engram_out.Li on an Engram
layer, with block_premix.L(i-1)); block 0 gets golden h0 on every hc copy with the identity
pre-mix. Shared compressed KV / index keys / top-k / candidates then flow from teacher-forced
source layers. Criteria (dsv41_jax.parity): bf16 streams |port - gold| <= 2^-7 |gold| +
2^-7 RMS(gold); top-k, candidates, hashes, routing sets exactly equal; measured bounds for the
pre-mix and routing weights; logits from the golden final stream within 1e-2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import parity
from dsv41_jax.mhc import hc_post as _HC_POST
from dsv41_jax.moe import swiglu as _swiglu
from dsv41_jax.parity import GoldenSet, load_model
from pallas_kernels.sinkhorn.reference import hc_split_sinkhorn as _sinkhorn

# Measured: at most 246 of 53,248 elements (0.46%, tiny-c layer 8, all in one token) of a block
# output are not bit-identical to the reference. A dropped bf16 rounding point (e.g. XLA eliding
# a convert pair under jit) stays inside the elementwise bound but changes ~20% of the elements,
# so the fraction is pinned too.
MAX_DIFFERING_FRACTION = 0.01


@functools.lru_cache(maxsize=None)
def _model(path: str):
    return load_model(GoldenSet(path))


@functools.lru_cache(maxsize=None)
def _port(path: str):
    return parity.teacher_forced_prefill(_model(path), GoldenSet(path))


def bf16_close(port, gold) -> tuple[bool, float, float]:
    """The per-block stream criterion; returns (ok, max |diff|, worst diff / bound)."""
    p = np.asarray(port, np.float32)
    g = np.asarray(gold, np.float32)
    rms = float(np.sqrt(np.mean(g.astype(np.float64) ** 2)))
    bound = 2.0**-7 * np.abs(g) + 2.0**-7 * rms
    d = np.abs(p - g)
    return bool(np.all(d <= bound)), float(d.max()), float((d / bound).max())


def _inputs(g):
    ids = jnp.asarray(g["inputs.prompt"], jnp.int32)
    tt = g.token_types()
    return ids, None if tt is None else jnp.asarray(tt)


def _rows(golden, prefix: str):
    port = _port(str(golden.path))
    rows = [r for r in parity.compare(port, golden) if r[0].startswith(prefix)]
    assert rows, f"no {prefix} arrays compared"
    return rows


def _assert_rows(golden, prefix):
    rows = _rows(golden, prefix)
    worst = max(rows, key=lambda r: r[3])
    print(f"{golden.name} {prefix}: worst {worst[0]} max|err| {worst[2]:.4g} err/RMS {worst[3]:.3g}")
    bad = [r for r in rows if not r[1]]
    assert not bad, bad


@pytest.mark.parametrize("kind", [
    "block_out", "block_premix", "engram_out", "window_kv", "compress_kv", "index_k", "compressor_kv_state",
    "compressor_score_state", "index_score", "cand_block_score", "h0",
])
def test_prefill_arrays_match_reference(golden, kind):
    _assert_rows(golden, f"prefill.{kind}")


@pytest.mark.parametrize("kind", ["topk", "candidates", "engram_hashes", "route_idx", "index_k_owner"])
def test_prefill_discrete_decisions_equal_reference_exactly(golden, kind):
    _assert_rows(golden, f"prefill.{kind}")


def test_routing_weights_close(golden):
    _assert_rows(golden, "prefill.route_w")


def test_logits_from_teacher_forced_final_stream_within_1e_2(golden):
    _assert_rows(golden, "prefill.logits")
    _assert_rows(golden, "prefill.next_token")


def test_every_golden_prefill_array_is_computed(golden):
    port = _port(str(golden.path))
    missing = [k for k in golden.keys() if k.startswith("prefill.") and k.removesuffix(".bf16") not in port]
    assert not missing


def test_block_outputs_are_bit_identical_except_rare_rounding_flips(golden):
    port = _port(str(golden.path))
    for i in range(golden.args.n_layers):
        key = f"prefill.block_out.L{i:02d}"
        frac = float(np.mean(np.asarray(port[key], np.float32) != golden[key].astype(np.float32)))
        assert frac <= MAX_DIFFERING_FRACTION, f"{golden.name} layer {i}: {frac:.2%} of elements differ"


def test_full_prefill_compiles_once_per_shape_and_tracks_reference(golden):
    """The whole forward under one jit: one trace per input shape. End to end the tiny models are
    chaotic (a last-bit change flips near-tied routing), so values are reported, not asserted."""
    model = _model(str(golden.path))
    ids, token_types = _inputs(golden)
    h0 = jnp.asarray(golden["prefill.h0"], jnp.bfloat16)
    traces = []

    @nnx.jit
    def fwd(m, ids, tt, h0):
        traces.append(ids.shape)
        return m(ids, tt, h0)

    logits = np.asarray(fwd(model, ids, token_types, h0))
    np.asarray(fwd(model, ids, token_types, h0))
    assert len(traces) == 1
    assert logits.shape == (ids.shape[0], golden.args.vocab_size) and np.isfinite(logits).all()
    print(golden.name, "end-to-end max |logit diff|:", float(np.abs(logits - golden["prefill.logits"]).max()),
          "argmax equal:", (logits.argmax(-1) == golden["prefill.next_token"]).tolist())


@pytest.mark.parametrize("width", [8, 64])
def test_collapsed_hand_off_equals_each_block_collapsing_its_own_input(width, monkeypatch):
    """Blocks hand the next block hc_pre of its input (`mhc.hc_post_pre`: formed again from the
    FFN output up to RECOMPUTE_ROWS rows, 2 x 8 here; from the new stream at 2 x 64), and an
    Engram between two blocks changes the stream, so the hand-off is dropped there. The whole
    forward equals, bit for bit, a stack where every block collapses its own input (on the first
    golden set: the hand-off's code is the same for every config with an Engram between blocks;
    tiny-c passed too when measured)."""
    from dsv41_jax.mhc import RECOMPUTE_ROWS
    from dsv41_jax.model import Block

    golden = GoldenSet(_first_golden())
    assert golden.args.engram_layer_ids, "the golden configs put an Engram between blocks"
    model = _model(str(golden.path))
    ids, _ = _inputs(golden)
    ids = ids[:, :width]
    assert (ids.shape[0] * width <= RECOMPUTE_ROWS) == (width == 8)
    fwd = nnx.jit(lambda m, i: m(i, all_logits=True))
    handed = np.asarray(fwd(model, ids))
    call = Block.__call__
    monkeypatch.setattr(Block, "__call__", lambda self, *a, collapsed=None, **k: call(self, *a, **k))
    jax.clear_caches()
    own = np.asarray(nnx.jit(lambda m, i: m(i, all_logits=True))(model, ids))
    monkeypatch.undo()
    np.testing.assert_array_equal(handed, own)


def test_parity_cli_writes_golden_keys_and_encodings(tmp_path, capsys):
    gs = GoldenSet(parity.GoldenSet(_first_golden()).path)
    out = tmp_path / "result.npz"
    rc = parity.main([str(gs.path), "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "arrays ok" in text and "FAIL" not in text
    res = np.load(out)
    for k in res.files:
        assert k in gs.keys(), k
        assert res[k].shape == gs._npz[k].shape and res[k].dtype == gs._npz[k].dtype, k
    assert {k for k in gs.keys() if k.startswith("prefill.")} <= set(res.files)


def test_parity_cli_exits_nonzero_on_a_missing_set(tmp_path):
    assert parity.main([str(tmp_path / "nope")]) == 2


def _first_golden():
    from conftest import GOLDEN_DIRS

    return GOLDEN_DIRS[0]


# ------------------------------------------------------------------------------ negative twins
# Each known trap (SPEC §18), put back into the port, must make the golden parity fail.


def _twin_hc_post_transposed(f, residual, post, comb):
    return _HC_POST(f, residual, post, jnp.swapaxes(comb, -1, -2))


def _twin_sinkhorn_eps_after_column_pass(mixes, scale, base, *, hc, iters, eps):
    pre, post, comb = _sinkhorn(mixes, scale, base, hc=hc, iters=iters, eps=0.0)
    return pre + eps, post, comb + eps  # eps moved out of the softmax / the divisions


def _twin_swiglu_without_clamp(gate, up, limit, weights=None, out_dtype=jnp.bfloat16):
    return _swiglu(gate, up, 0.0, weights, out_dtype)


def _twin_swiglu_up_clamped_like_the_gate(gate, up, limit, weights=None, out_dtype=jnp.bfloat16):
    # up clamped from above only (the gate's one-sided rule) instead of symmetrically. The other
    # symmetry slip, a lower clamp on the gate, moves silu(g < -10) by < 5e-4 and hides inside
    # the bf16 bound on these sets; tests/test_moe.py pins it on hand-made values instead.
    from dsv41_jax.numerics import cast

    g = jnp.minimum(gate.astype(jnp.float32), limit)
    h = jax.nn.silu(g) * jnp.minimum(up.astype(jnp.float32), limit)
    if weights is not None:
        h = weights.astype(jnp.float32) * h
    return cast(h, out_dtype)


def _twin_rope_on_first_dims(x, cos, sin, rd, inverse=False):
    from dsv41_jax.layers import apply_rope

    flipped = jnp.concatenate([x[..., rd:], x[..., :rd]], axis=-1)
    y = apply_rope(flipped, cos, sin, rd, inverse)
    return jnp.concatenate([y[..., -rd:], y[..., :-rd]], axis=-1)


def _twin_gate_bias_in_weights(original):
    def route(self, logits, image_mask=None):
        _, idx = original(self, logits, image_mask)
        scores = jnp.sqrt(jax.nn.softplus(logits))
        bias = self.bias[...]
        if image_mask is not None and self.bias_vl is not None:
            bias = jnp.where(image_mask[:, None], self.bias_vl[...], bias)
        w = jnp.take_along_axis(scores + bias, idx, -1)
        return w / (w.sum(-1, keepdims=True) + 1e-20) * self.route_scale, idx

    return route


TWINS = {
    # the blocks call it through mhc.hc_post_pre
    "hc_post contracts the second comb index": ("dsv41_jax.mhc", "hc_post", _twin_hc_post_transposed),
    # the site's jnp path (pallas_kernels.sinkhorn.api) calls the reference module's function
    "sinkhorn eps outside the normalisations": ("pallas_kernels.sinkhorn.reference", "hc_split_sinkhorn",
                                                _twin_sinkhorn_eps_after_column_pass),
    "swiglu clamp missing": ("dsv41_jax.moe", "swiglu", _twin_swiglu_without_clamp),
    "swiglu up clamped only from above": ("dsv41_jax.moe", "swiglu", _twin_swiglu_up_clamped_like_the_gate),
    "rope on the first dims": ("dsv41_jax.attention", "apply_rope", _twin_rope_on_first_dims),
    "routing bias enters the weights": ("dsv41_jax.moe", "Gate.route", None),
}


@pytest.mark.parametrize("trap", list(TWINS))
def test_known_trap_breaks_golden_parity(trap, monkeypatch):
    import importlib

    module, attr, twin = TWINS[trap]
    mod = importlib.import_module(module)
    if attr == "Gate.route":
        monkeypatch.setattr(mod.Gate, "route", _twin_gate_bias_in_weights(mod.Gate.route))
    else:
        monkeypatch.setattr(mod, attr, twin)
    gs = GoldenSet(_first_golden())
    jax.clear_caches()
    try:
        port = parity.teacher_forced_prefill(_model(str(gs.path)), gs, n_layers=2)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    failed = [r[0] for r in parity.compare(port, gs) if not r[1]]
    assert failed, f"{trap}: golden parity still passes"
    port_ok = _port(str(gs.path))
    assert all(r[1] for r in parity.compare({k: port_ok[k] for k in port}, gs))
