"""MoE (SPEC §6): router cases checked by hand, SwiGLU clamp and routing-weight placement (each
with the wrong twin that must fail), the fp32 ascending-expert combine, the two execution paths,
and the golden checkpoints' MoE layers against a float64 numpy re-statement of the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import quant
from dsv41_jax.config import ModelArgs
from dsv41_jax.loading import load_hub_weights
from dsv41_jax.moe import Expert, Gate, MoE, combine, swiglu

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
F32 = np.float32


# ------------------------------------------------------------------------- numpy re-statement
# Everything below is float64 numpy with the reference's rounding points made explicit; the
# GEMMs are exact (float64) and rounded once to fp32 and then bf16, as the reference's are.


def bf16(a) -> np.ndarray:
    """Round to bf16 (through fp32, like a torch fp32 -> bf16 cast of an fp32 result)."""
    return np.asarray(a, np.float64).astype(F32).astype(BF16).astype(F32)


def np_act_quant_dq(x: np.ndarray) -> np.ndarray:
    """act_quant then dequantise, per 32 along the last axis: amax floored at 1e-4, scale
    2^ceil(log2(amax * fp32(1/448))), q = e4m3(clamp(x / s, 448)) RNE -> float64 q * s."""
    xb = np.asarray(x, F32).reshape(*x.shape[:-1], -1, 32)
    amax = np.maximum(np.abs(xb).max(-1), F32(1e-4))
    mant, exp = np.frexp(amax * F32(1.0 / 448.0))  # v = mant * 2^exp, mant in [0.5, 1)
    s = np.ldexp(1.0, np.where(mant == 0.5, exp - 1, exp))
    q = np.clip(xb / s[..., None], -448, 448).astype(E4M3).astype(np.float64)
    return (q * s[..., None]).reshape(x.shape)


_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def np_fp4_dense(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """packed int8 [..., N, K/2] (element 2k in the low nibble), e8m0 [..., N, K/32] -> float64."""
    b = np.asarray(w).view(np.uint8)
    v = np.stack([_E2M1[b & 15], _E2M1[b >> 4]], -1).reshape(*b.shape[:-1], 2 * b.shape[-1])
    return v * np.repeat(np.exp2(np.asarray(s).view(np.uint8).astype(np.float64) - 127), 32, -1)


def np_fp8_dense(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    n, k = w.shape
    sf = np.exp2(np.asarray(s).view(np.uint8).astype(np.float64) - 127)
    return np.asarray(w).astype(np.float64) * np.repeat(np.repeat(sf, 32, 0)[:n], 32, 1)[:, :k]


def np_silu(g: np.ndarray) -> np.ndarray:
    g = np.asarray(g, np.float64)
    with np.errstate(over="ignore"):
        return (g / (1.0 + np.exp(-g))).astype(F32)


def np_expert(x, w1, w3, w2, limit, weight=None, *, quantised=True, clamp_gate_below=False,
              weight_after_w2=False):
    """Reference Expert.forward on bf16 values x [n, dim] with dense float64 weights -> bf16 values.
    The keyword twins are the classic mistakes the module must not make."""
    lin = (lambda a, w: bf16(np_act_quant_dq(a) @ w.T)) if quantised else (lambda a, w: bf16(a @ w.T))
    g, u = lin(x, w1), lin(x, w3)
    if limit > 0:
        u = np.clip(u, -limit, limit)
        g = np.clip(g, -limit, limit) if clamp_gate_below else np.minimum(g, F32(limit))
    h = np_silu(g) * u
    if weight is not None and not weight_after_w2:
        h = F32(weight) * h
    out = lin(bf16(h), w2)
    if weight is not None and weight_after_w2:
        out = bf16(F32(weight) * out)
    return out


def np_gate(x, p, args, image_mask=None, k=None):
    """Reference Gate.forward -> (weights f32 [n, k], indices [n, k]) in top-k order."""
    k = k or args.n_activated_experts
    logits = (np.asarray(x, np.float64) @ p["gate.weight"].T).astype(F32) / F32(args.gate_temp)
    if args.score_func == "softmax":
        e = np.exp(logits.astype(np.float64) - logits.max(-1, keepdims=True))
        scores = (e / e.sum(-1, keepdims=True)).astype(F32)
    elif args.score_func == "sigmoid":
        scores = (1.0 / (1.0 + np.exp(-logits.astype(np.float64)))).astype(F32)
    else:
        scores = np.sqrt(np.logaddexp(0.0, logits.astype(np.float64)).astype(F32))
    bias = np.broadcast_to(p["gate.bias"], scores.shape)
    if image_mask is not None and "gate.bias_vl" in p:
        bias = np.where(np.asarray(image_mask)[:, None], p["gate.bias_vl"], bias)
    idx = np.argsort(-(scores + bias), axis=-1, kind="stable")[:, :k]  # ties -> lower id
    w = np.take_along_axis(scores, idx, -1)
    if args.norm_topk_prob and k > 1:
        total = w[:, 0].copy()
        for j in range(1, k):
            total = total + w[:, j]
        w = w / (total + F32(1e-20))[:, None]
    return w * F32(args.route_scale), idx


def np_moe(x, p, args, image_mask=None, **twins):
    """Reference MoE.forward: loop over experts in ascending id, y[tokens] += expert(x[tokens], w)
    in fp32, then the shared expert, then bf16. x bf16 values [n, dim]."""
    w, idx = np_gate(x, p, args, image_mask, k=p["k"])
    y = np.zeros(x.shape, F32)
    for e in range(p["w1"].shape[0]):
        tok, slot = np.nonzero(idx == e)
        if len(tok):
            y[tok] += np_expert(x[tok], p["w1"][e], p["w3"][e], p["w2"][e], args.swiglu_limit,
                                w[tok, slot, None], **twins)
    sh = {kk: twins[kk] for kk in ("clamp_gate_below",) if kk in twins}
    y += np_expert(x, p["s1"], p["s3"], p["s2"], args.swiglu_limit, **sh)
    return bf16(y), w, idx


def moe_params(m: MoE) -> dict:
    """The module's weights, dequantised to float64 with the independent numpy decoders."""
    ex, sh = m.experts, m.shared_experts
    p = {
        "k": m.topk,
        "gate.weight": np.asarray(m.gate.weight[...]).astype(np.float64),
        "gate.bias": np.asarray(m.gate.bias[...]),
        "w1": np_fp4_dense(ex.w1.weight[...], ex.w1.scale[...]),
        "w3": np_fp4_dense(ex.w3.weight[...], ex.w3.scale[...]),
        "w2": np_fp4_dense(ex.w2.weight[...], ex.w2.scale[...]),
        "s1": np_fp8_dense(sh.w1.weight[...], sh.w1.scale[...]),
        "s3": np_fp8_dense(sh.w3.weight[...], sh.w3.scale[...]),
        "s2": np_fp8_dense(sh.w2.weight[...], sh.w2.scale[...]),
    }
    if m.gate.bias_vl is not None:
        p["gate.bias_vl"] = np.asarray(m.gate.bias_vl[...])
    return p


def bf16_ulps(a, b) -> np.ndarray:
    """Distance in bf16 ulps (monotone map of the bit patterns)."""
    def ordered(v):
        u = np.asarray(v, F32).astype(BF16).view(np.int16).astype(np.int64)
        return np.where(u < 0, -(u & 0x7FFF), u)
    return np.abs(ordered(a) - ordered(b))


# --------------------------------------------------------------------------- hand-made modules


def random_moe(args: ModelArgs, seed: int, gain: float = 6.0, layer_id: int = 0, **kw) -> MoE:
    """An MoE with random quantised weights; `gain` sets the w1 / w3 output spread for unit-RMS
    inputs (6 makes both SwiGLU clamps fire on a fair share of hidden units)."""
    rng = np.random.default_rng(seed)
    m = MoE(layer_id, args, **kw)
    e, d, i = m.n_experts, args.dim, args.moe_inter_dim

    def fill(lin, shape, quantise, g):
        w = (rng.standard_normal(shape) * g / np.sqrt(shape[-1])).astype(F32)
        q, s = quantise(w)
        lin.weight.set_value(jnp.asarray(q))
        lin.scale.set_value(jnp.asarray(s))

    ex, sh = m.experts, m.shared_experts
    for lin, shape, g in ((ex.w1, (e, i, d), gain), (ex.w3, (e, i, d), gain), (ex.w2, (e, d, i), 1.0)):
        fill(lin, shape, quant.quantize_fp4_weight, g)
    for lin, shape, g in ((sh.w1, (i, d), gain), (sh.w3, (i, d), gain), (sh.w2, (d, i), 1.0)):
        fill(lin, shape, quant.quantize_fp8_weight, g)
    m.gate.weight.set_value(jnp.asarray(rng.standard_normal((e, d)) / np.sqrt(d), jnp.bfloat16))
    m.gate.bias.set_value(jnp.asarray(rng.standard_normal(e) * 0.3, jnp.float32))
    if m.gate.bias_vl is not None:
        m.gate.bias_vl.set_value(jnp.asarray(rng.standard_normal(e) * 0.3, jnp.float32))
    return m


def unit_inputs(seed: int, shape) -> np.ndarray:
    return bf16(np.random.default_rng(seed).standard_normal(shape))


def hand_gate(args: ModelArgs, logits, bias=None, bias_vl=None) -> Gate:
    """A gate whose logits for the one-hot input e_0 are exactly `logits` (bf16 values)."""
    g = Gate(0, args)
    w = np.zeros((args.n_routed_experts, args.dim), F32)
    w[:, 0] = logits
    g.weight.set_value(jnp.asarray(w, jnp.bfloat16))
    if bias is not None:
        g.bias.set_value(jnp.asarray(bias, jnp.float32))
    if bias_vl is not None:
        g.bias_vl.set_value(jnp.asarray(bias_vl, jnp.float32))
    return g


def e0(args, n=1):
    x = np.zeros((n, args.dim), F32)
    x[:, 0] = 1
    return jnp.asarray(x, jnp.bfloat16)


LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0, -4.0])


def sqrt_softplus(v):
    return np.sqrt(np.log1p(np.exp(np.asarray(v, np.float64))))


# ---------------------------------------------------------------------------------------- Gate


def test_gate_bias_selects_experts_but_weights_come_from_unbiased_scores():
    args = ModelArgs.tiny()  # 8 experts, top-2, route_scale 1.5
    bias = np.zeros(8)
    bias[3] = 10.0  # lifts expert 3 (score 0.83) above expert 1 (score 1.31)
    w, idx = Gate.__call__(hand_gate(args, LOGITS, bias), e0(args))
    np.testing.assert_array_equal(np.asarray(idx), [[3, 0]])  # top-k order: highest biased first
    s = sqrt_softplus(LOGITS)
    want = 1.5 * s[[3, 0]] / (s[3] + s[0])  # [0.545, 0.955]
    np.testing.assert_allclose(np.asarray(w), [want], rtol=1e-6)
    biased = 1.5 * (s[[3, 0]] + bias[[3, 0]]) / (s[3] + s[0] + 10.0)  # [1.32, 0.18]: the wrong twin
    assert np.abs(np.asarray(w)[0] - biased).min() > 0.1
    assert w.dtype == jnp.float32 and idx.dtype == jnp.int32


def test_gate_uses_bias_vl_only_for_image_tokens():
    args = ModelArgs.tiny(vision_n_layers=1)
    bias, bias_vl = np.zeros(8), np.zeros(8)
    bias[5], bias_vl[6] = 10.0, 10.0
    gate = hand_gate(args, LOGITS, bias, bias_vl)
    w, idx = gate(e0(args, 3), jnp.asarray([False, True, False]))
    np.testing.assert_array_equal(np.asarray(idx), [[5, 0], [6, 0], [5, 0]])
    s = sqrt_softplus(LOGITS)
    np.testing.assert_allclose(np.asarray(w)[1], 1.5 * s[[6, 0]] / (s[6] + s[0]), rtol=1e-6)
    _, idx_text = gate(e0(args, 2), None)  # no mask: every token is text
    np.testing.assert_array_equal(np.asarray(idx_text), [[5, 0], [5, 0]])


def test_gate_without_vision_has_no_bias_vl_and_ignores_the_image_mask():
    args = ModelArgs.tiny()
    assert not args.vision_enabled
    bias = np.zeros(8)
    bias[5] = 10.0
    gate = hand_gate(args, LOGITS, bias)
    assert gate.bias_vl is None
    _, idx = gate(e0(args, 2), jnp.asarray([True, False]))
    np.testing.assert_array_equal(np.asarray(idx), [[5, 0], [5, 0]])


def test_gate_normaliser_is_sum_plus_1e_minus_20():
    # sigmoid scores near 1e-20 make the epsilon visible: 1.05e-20 and 3.9e-21 over 2.44e-20
    args = ModelArgs.tiny(score_func="sigmoid")
    logits = np.array([-46.0, -47.0] + [-60.0] * 6)
    w, idx = hand_gate(args, logits)(e0(args))
    np.testing.assert_array_equal(np.asarray(idx), [[0, 1]])
    s = (1.0 / (1.0 + np.exp(-logits[:2]))).astype(F32)
    want = F32(1.5) * (s / (s[0] + s[1] + F32(1e-20)))
    np.testing.assert_allclose(np.asarray(w)[0], want, rtol=1e-5)
    assert abs(float(np.asarray(w).sum()) - 1.5 * 1.4406 / 2.4406) < 1e-3  # not 1.5: eps is there
    # top-1 is never normalised: its weight is the raw score times route_scale
    w1, _ = hand_gate(args.replace(n_activated_experts=1), logits)(e0(args))
    np.testing.assert_allclose(np.asarray(w1)[0], [1.5 * s[0]], rtol=1e-6)


def test_gate_route_scale_multiplies_the_normalised_weights():
    args = ModelArgs.tiny()
    w15, idx = hand_gate(args, LOGITS)(e0(args))
    w10, idx10 = hand_gate(args.replace(route_scale=1.0), LOGITS)(e0(args))
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(idx10))
    np.testing.assert_allclose(float(np.asarray(w10).sum()), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(w15), np.asarray(w10) * F32(1.5))
    wraw, _ = hand_gate(args.replace(norm_topk_prob=False), LOGITS)(e0(args))
    s = sqrt_softplus(LOGITS)
    np.testing.assert_allclose(np.asarray(wraw)[0], 1.5 * s[[0, 1]], rtol=1e-6)


@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "softmax", "sigmoid"])
def test_gate_score_functions_match_the_numpy_statement(score_func):
    args = ModelArgs.tiny(score_func=score_func, n_activated_experts=3, vision_n_layers=1)
    m = random_moe(args, seed=1)
    x = unit_inputs(2, (40, args.dim))
    mask = np.arange(40) % 3 == 0
    w, idx = jax.jit(lambda x, mk: m.gate(x, mk))(jnp.asarray(x, jnp.bfloat16), jnp.asarray(mask))
    w_ref, idx_ref = np_gate(x, moe_params(m), args, mask)
    np.testing.assert_array_equal(np.asarray(idx), idx_ref)
    np.testing.assert_allclose(np.asarray(w), w_ref, rtol=2e-6)


def test_gate_ties_go_to_the_lower_expert_id():
    args = ModelArgs.tiny(n_activated_experts=3)
    bias = np.zeros(8)
    bias[[2, 5, 7]] = 1.0
    _, idx = hand_gate(args, np.zeros(8), bias)(e0(args))
    np.testing.assert_array_equal(np.asarray(idx), [[2, 5, 7]])
    _, idx = hand_gate(args, np.zeros(8))(e0(args))
    np.testing.assert_array_equal(np.asarray(idx), [[0, 1, 2]])


# ---------------------------------------------------------------------------- SwiGLU, weights


def identity_expert(g_vals, u_vals, limit=10.0) -> Expert:
    """bf16 Expert (dim = inter = 64): for the input e_0, w1 / w3 outputs are exactly g / u and
    w2 is the identity, so the output is the bf16 w2 input itself."""
    ex = Expert(64, 64, "bf16", swiglu_limit=limit)
    w1, w3 = np.zeros((64, 64), F32), np.zeros((64, 64), F32)
    w1[:, 0], w3[:, 0] = g_vals, u_vals
    ex.w1.weight.set_value(jnp.asarray(w1, jnp.bfloat16))
    ex.w3.weight.set_value(jnp.asarray(w3, jnp.bfloat16))
    ex.w2.weight.set_value(jnp.eye(64, dtype=jnp.bfloat16))
    return ex


def _e0_64():
    return jnp.zeros((1, 64), jnp.bfloat16).at[0, 0].set(1)


def test_swiglu_clamps_up_on_both_sides_but_gate_only_from_above():
    g = np.array([-20.0, -12.0, 20.0, 12.0, 5.0, -5.0] + [1.0] * 58)
    u = np.array([3.0, 3.0, -30.0, 30.0, -15.0, 15.0] + [2.0] * 58)
    got = np.asarray(identity_expert(g, u)(_e0_64())[0], F32)
    want = bf16(np_silu(np.minimum(g, 10)) * np.clip(u, -10, 10))
    np.testing.assert_array_equal(got, want)
    # by hand: silu(-20) * 3 = -1.24e-7 (the gate is NOT lifted to -10), silu(10) * -10 = -99.9955
    np.testing.assert_allclose(got[[0, 2]], [-20 / (1 + np.exp(20)) * 3, -10 / (1 + np.exp(-10)) * 10], rtol=2**-8)
    twin = bf16(np_silu(np.clip(g, -10, 10)) * np.clip(u, -10, 10))  # clamping g from below too
    assert np.abs(got[:2] - twin[:2]).min() > 1e-4
    no_up_clamp = bf16(np_silu(np.minimum(g, 10)) * u)
    assert np.abs(got[2:6] - no_up_clamp[2:6]).min() > 0.1  # silu(-5) * 15 vs * 10 is the smallest gap
    direct = swiglu(jnp.asarray(g, jnp.bfloat16), jnp.asarray(u, jnp.bfloat16), 10.0)
    np.testing.assert_array_equal(np.asarray(direct, F32), want)


def test_swiglu_limit_zero_disables_both_clamps():
    g = np.array([-20.0, 20.0] + [1.0] * 62)
    u = np.array([30.0, -30.0] + [1.0] * 62)
    got = np.asarray(identity_expert(g, u, limit=0.0)(_e0_64())[0], F32)
    np.testing.assert_array_equal(got, bf16(np_silu(g) * u))


def test_routing_weight_multiplies_before_w2_in_fp32():
    rng = np.random.default_rng(3)
    g = bf16(rng.uniform(-3, 8, 64))
    u = bf16(rng.uniform(-8, 8, 64))
    wt = F32(0.3137)
    got = np.asarray(identity_expert(g, u)(_e0_64(), jnp.asarray([[wt]]))[0], F32)
    h = np_silu(np.minimum(g, 10)) * np.clip(u, -10, 10)
    np.testing.assert_array_equal(got, bf16(wt * h))
    after = bf16(wt * bf16(h))  # the twin: weight applied to the bf16 expert output
    assert np.sum(got != after) >= 5, np.sum(got != after)


# ------------------------------------------------------------------------------------ combine


def test_combine_adds_in_ascending_expert_order_in_fp32():
    one, tiny_ = 1.0, 2.0**-24
    # token slots hold experts (2, 0, 1) with outputs (-1, 1, 2^-24); ascending order computes
    # (0 + 1) + 2^-24 -> 1 (tie to even), then + (-1) -> 0
    pair = jnp.asarray([[[-one], [one], [tiny_]]], jnp.bfloat16)
    idx = jnp.asarray([[2, 0, 1]], jnp.int32)
    got = float(combine(pair, idx, jnp.zeros((1, 1), jnp.bfloat16))[0, 0])
    assert got == 0.0
    slot_order = (np.float32(-one) + np.float32(one)) + np.float32(tiny_)  # 2^-24
    descending = (np.float32(-one) + np.float32(tiny_)) + np.float32(one)  # 2^-24
    assert slot_order == descending == np.float32(tiny_) != got
    # fp32 accumulation: 1 + 2^-8 + 2^-8 (shared) = 1 + 2^-7 is a bf16 value; a bf16 running sum
    # would round 1 + 2^-8 to 1 (tie to even) twice
    pair = jnp.asarray([[[one], [2.0**-8]]], jnp.bfloat16)
    got = float(combine(pair, jnp.asarray([[0, 1]], jnp.int32), jnp.full((1, 1), 2.0**-8, jnp.bfloat16))[0, 0])
    assert got == 1.0 + 2.0**-7


# ---------------------------------------------------------------------------------------- MoE


MOE_ARGS = ModelArgs.tiny(n_activated_experts=3, vision_n_layers=1)  # dim 64, inter 64, 8 experts


@pytest.fixture(scope="module")
def moe3():
    return random_moe(MOE_ARGS, seed=7)


def _run(m, x, mask=None, path="auto"):
    return jax.jit(lambda x, mk: m(x, mk, path=path))(x, mask)


def test_moe_matches_the_reference_loop_and_not_its_wrong_twins(moe3):
    x = unit_inputs(11, (2, 48, 64))
    mask = np.zeros((2, 48), bool)
    mask[0, 10:20] = True
    p = moe_params(moe3)
    want, w_ref, idx_ref = np_moe(x.reshape(-1, 64), p, MOE_ARGS, mask.reshape(-1))
    for path in ("gather", "grouped"):
        y, aux = _run(moe3, jnp.asarray(x, jnp.bfloat16), jnp.asarray(mask), path)
        assert y.shape == (2, 48, 64) and y.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(aux["route_idx"]), idx_ref)
        np.testing.assert_allclose(np.asarray(aux["route_w"]), w_ref, rtol=2e-6)
        d = bf16_ulps(np.asarray(y, F32).reshape(-1, 64), want)
        # measured: bit-identical; fp32 summation order inside the GEMMs may move rare elements by 1 ulp
        assert np.mean(d == 0) >= 0.999 and d.max() <= 1, (path, np.mean(d == 0), d.max())
    got = np.asarray(y, F32).reshape(-1, 64)
    for twin in ({"clamp_gate_below": True}, {"weight_after_w2": True}):
        wrong, _, _ = np_moe(x.reshape(-1, 64), p, MOE_ARGS, mask.reshape(-1), **twin)
        assert np.mean(bf16_ulps(got, wrong) > 0) > 0.005, twin  # measured: 1.1% and 93% of the outputs


def test_gather_and_grouped_paths_give_identical_outputs():
    """Both paths share every rounding point, so only XLA's fp32 summation order inside the GEMMs
    could tell them apart. Measured: identical here (CPU, and an H200 with excess precision off);
    at dim 2048 / inter 1024 / 64 experts / top-6 on the H200, 14 of 2.1M outputs differed."""
    args = MOE_ARGS
    for seed, n_tok, tile in ((1, 1, 4), (3, 37, 8), (5, 64, 256)):
        m = random_moe(args, seed=seed, tile_rows=tile)
        x = jnp.asarray(unit_inputs(seed, (1, n_tok, 64)), jnp.bfloat16)
        ya, aux_a = _run(m, x, None, "gather")
        yb, aux_b = _run(m, x, None, "grouped")
        np.testing.assert_array_equal(np.asarray(aux_a["route_idx"]), np.asarray(aux_b["route_idx"]))
        np.testing.assert_array_equal(np.asarray(ya, F32), np.asarray(yb, F32), err_msg=f"{n_tok} tokens, tile {tile}")


def test_grouped_path_covers_experts_with_no_tokens_and_many_tiles():
    # a gate bias that sends every token to experts 6 and 7 leaves 0..5 empty and needs many tiles
    m = random_moe(MOE_ARGS.replace(n_activated_experts=2), seed=9, tile_rows=4)
    m.gate.bias.set_value(jnp.asarray([0, 0, 0, 0, 0, 0, 50, 50], jnp.float32))
    x = jnp.asarray(unit_inputs(9, (2, 13, 64)), jnp.bfloat16)
    ya, aux = _run(m, x, None, "gather")
    yb, _ = _run(m, x, None, "grouped")
    assert set(np.unique(np.asarray(aux["route_idx"]))) == {6, 7}
    np.testing.assert_array_equal(np.asarray(ya, F32), np.asarray(yb, F32))
    want, _, _ = np_moe(np.asarray(x, F32).reshape(-1, 64), moe_params(m), MOE_ARGS, None)
    assert np.mean(bf16_ulps(np.asarray(yb, F32).reshape(-1, 64), want) == 0) >= 0.999


def test_moe_equals_reference_loop_built_from_linear_fp4(moe3):
    """Same structure as the reference MoE.forward, but on the project's own linear_fp4 per expert."""
    x = jnp.asarray(unit_inputs(12, (1, 40, 64)), jnp.bfloat16)
    y, aux = _run(moe3, x)
    idx = np.asarray(aux["route_idx"])

    @jax.jit
    def reference_loop(x, w):
        xf = x.reshape(-1, 64)
        acc = jnp.zeros((40, 64), jnp.float32)
        for e in range(8):  # ascending expert id, each on the tokens routed to it
            tok, slot = np.nonzero(idx == e)
            if len(tok):
                out = moe3.experts.apply_one(e, xf[tok], w[tok, slot][:, None])
                acc = acc.at[tok].add(out.astype(jnp.float32))
        acc = acc + moe3.shared_experts(xf).astype(jnp.float32)
        return acc.astype(jnp.bfloat16)

    want = reference_loop(x, aux["route_w"])
    np.testing.assert_array_equal(np.asarray(y, F32).reshape(40, 64), np.asarray(want, F32))


def test_auto_path_is_gather_for_few_pairs_and_grouped_scan_for_many(moe3):
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU the grouped path runs the fp4 kernel, not the reference's scan")

    def has_scan(n_tok):
        x = jnp.zeros((1, n_tok, 64), jnp.bfloat16)
        return "scan" in str(jax.make_jaxpr(lambda x: moe3(x))(x))

    assert moe3.gather_max_pairs == 64 and moe3.topk == 3
    assert not has_scan(21)  # 63 pairs
    assert has_scan(22)  # 66 pairs
    with pytest.raises(ValueError, match="path"):
        moe3(jnp.zeros((1, 2, 64), jnp.bfloat16), path="dense")


def test_moe_params_have_hub_names_dtypes_and_shapes_and_build_abstractly():
    args = ModelArgs.tiny(vision_n_layers=1)
    m = nnx.eval_shape(lambda: MoE(0, args))
    got = {".".join(map(str, k)): (v.shape, v.dtype) for k, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}
    e8m0, e4m3 = jnp.float8_e8m0fnu, jnp.float8_e4m3fn
    assert got == {
        "gate.weight": ((8, 64), jnp.bfloat16), "gate.bias": ((8,), jnp.float32), "gate.bias_vl": ((8,), jnp.float32),
        "experts.w1.weight": ((8, 64, 32), jnp.int8), "experts.w1.scale": ((8, 64, 2), e8m0),
        "experts.w3.weight": ((8, 64, 32), jnp.int8), "experts.w3.scale": ((8, 64, 2), e8m0),
        "experts.w2.weight": ((8, 64, 32), jnp.int8), "experts.w2.scale": ((8, 64, 2), e8m0),
        "shared_experts.w1.weight": ((64, 64), e4m3), "shared_experts.w1.scale": ((2, 2), e8m0),
        "shared_experts.w3.weight": ((64, 64), e4m3), "shared_experts.w3.scale": ((2, 2), e8m0),
        "shared_experts.w2.weight": ((64, 64), e4m3), "shared_experts.w2.scale": ((2, 2), e8m0),
    }


def test_moe_under_nnx_jit_matches_jax_jit_of_the_bound_module(moe3):
    x = jnp.asarray(unit_inputs(13, (2, 3, 64)), jnp.bfloat16)
    y_jit, aux_jit = nnx.jit(lambda m, x: m(x))(moe3, x)
    y, aux = _run(moe3, x)
    np.testing.assert_array_equal(np.asarray(y_jit, F32), np.asarray(y, F32))
    np.testing.assert_array_equal(np.asarray(aux_jit["route_idx"]), np.asarray(aux["route_idx"]))


# ------------------------------------------------------------------------------------- golden


def _golden_moe_layers(g):
    a = g.args
    layers = [(i, f"layers.{i}.ffn.") for i in range(a.n_layers)]
    if a.dspark_enabled:
        layers += [(a.n_layers + j, f"mtp.{j}.ffn.") for j in range(a.n_mtp_layers)]
    return layers


def test_golden_moe_layers_load_and_match_the_float64_reference(golden):
    """Every MoE of the golden checkpoint (backbone and DSpark stages) loads strictly by name and,
    on unit-RMS inputs (a tenth of them image tokens where the set has bias_vl), both paths match
    the float64 reference loop built from the numpy-dequantised checkpoint tensors."""
    a = golden.args
    x = unit_inputs(21, (64, a.dim))
    mask = (np.arange(64) % 10 == 3) if a.vision_enabled else None
    xj = jnp.asarray(x, jnp.bfloat16)[None]
    mk = None if mask is None else jnp.asarray(mask)[None]
    modules: dict = {}  # one module (and one compilation per path) per expert-count shape
    worst = {"gather": 0, "grouped": 0}
    for layer, prefix in _golden_moe_layers(golden):
        key = a.moe_experts(layer)
        if key not in modules:
            m = MoE(layer, a)
            gd = nnx.graphdef(m)
            modules[key] = (m, {path: jax.jit(lambda st, x, mk, path=path, gd=gd: nnx.merge(gd, st)(x, mk, path=path))
                                for path in ("gather", "grouped")})
        m, runners = modules[key]
        load_hub_weights(m, golden.path, prefix, strict=True)
        want, w_ref, idx_ref = np_moe(x, moe_params(m), a, mask)
        for path, run in runners.items():
            y, aux = run(nnx.state(m), xj, mk)
            np.testing.assert_array_equal(np.asarray(aux["route_idx"]), idx_ref, err_msg=f"{prefix} {path}")
            np.testing.assert_allclose(np.asarray(aux["route_w"]), w_ref, rtol=2e-6, err_msg=f"{prefix} {path}")
            d = bf16_ulps(np.asarray(y, F32)[0], want)
            worst[path] = max(worst[path], int(d.max()))
            assert np.mean(d == 0) >= 0.999 and d.max() <= 1, (prefix, path, np.mean(d == 0), d.max())
    print(f"{golden.name}: max bf16-ulp distance to the float64 reference per path: {worst}")


def test_golden_routed_expert_matches_float64_from_the_checkpoint(golden):
    """Each routed expert of one layer alone (Experts.apply_one, the plain linear_fp4 dispatch) with
    a routing weight, against the float64 Expert built from the hub tensors read directly."""
    from dsv41_jax.checkpoint import HubCheckpoint

    a = golden.args
    ck = HubCheckpoint(golden.path)
    m = MoE(3, a)
    load_hub_weights(m, ck, "layers.3.ffn.", strict=True)
    x = unit_inputs(22, (16, a.dim))
    wt = np.linspace(0.2, 1.4, 16, dtype=F32)[:, None]
    run = jax.jit(lambda st, e, x, w: nnx.merge(nnx.graphdef(m), st).experts.apply_one(e, x, w), static_argnums=1)
    worst = 0
    for e in range(m.n_experts):
        name = f"layers.3.ffn.experts.{e}"
        dense = [np_fp4_dense(ck.get(f"{name}.{n}.weight"), ck.get(f"{name}.{n}.scale")) for n in ("w1", "w3", "w2")]
        want = np_expert(x, *dense, a.swiglu_limit, wt)
        got = np.asarray(run(nnx.state(m), e, jnp.asarray(x, jnp.bfloat16), jnp.asarray(wt)), F32)
        d = bf16_ulps(got, want)
        worst = max(worst, int(d.max()))
        assert np.mean(d == 0) >= 0.999 and d.max() <= 1, (e, np.mean(d == 0), d.max())
    print(f"{golden.name}: routed experts of layer 3, max bf16-ulp distance to float64: {worst}")


def test_gate_divides_its_logits_by_gate_temp_as_torch_does():
    """gate_temp != 1: each logit / gate_temp is the correctly rounded quotient (XLA turns a
    division by a constant into a multiply by its rounded reciprocal: a third of the quotients
    by 3 differ in the last bit). One-hot inputs scaled by bf16 factors make every logit exact,
    so the weights must equal the numpy statement bit for bit."""
    args = ModelArgs.tiny(gate_temp=3.0, n_activated_experts=3)
    rng = np.random.default_rng(3)
    x = np.zeros((256, args.dim), F32)
    x[:, 0] = bf16(rng.uniform(0.5, 2.0, 256))
    g = hand_gate(args, bf16(rng.standard_normal(8) * 2))
    w, idx = jax.jit(lambda v: g(v))(jnp.asarray(x, jnp.bfloat16))
    p = {"gate.weight": np.asarray(g.weight[...], np.float64), "gate.bias": np.zeros(8, F32)}
    w_ref, idx_ref = np_gate(x, p, args)
    np.testing.assert_array_equal(np.asarray(idx), idx_ref)
    np.testing.assert_array_equal(np.asarray(w).view(np.int32), w_ref.view(np.int32))


def test_fp4_scale_fold_is_resolved_against_every_routed_scale_byte(golden):
    """`loading.resolve_fp4_scale_fold` on the loaded golden model: "off" leaves the kernel's x 2^126
    where it is; "auto" (the default) folds it when every routed-expert e8m0 byte of the checkpoint is <= 128
    (read here from the hub tensors); one byte of 129 in any expert turns "auto" off and makes
    "on" an error naming that hub tensor."""
    from conftest import max_routed_scale_byte

    from dsv41_jax.checkpoint import CheckpointError
    from dsv41_jax.loading import resolve_fp4_scale_fold
    from dsv41_jax.moe import Experts
    from dsv41_jax.parity import load_model

    top = max_routed_scale_byte(golden.path)
    assert load_model(golden).args.fp4_scale_fold == ("on" if top <= 128 else "off")  # the default: "auto"
    model = load_model(golden, fp4_scale_fold="off")
    experts = {".".join(map(str, p)): m for p, m in nnx.iter_graph(model) if isinstance(m, Experts)}
    assert model.args.fp4_scale_fold == "off" and not any(m.scale_fold for m in experts.values())
    assert set(experts) == {f"layers.{i}.ffn.experts" for i in range(golden.args.n_layers)}  # the text model
    args = resolve_fp4_scale_fold(model, golden.args.replace(fp4_scale_fold="auto"))
    assert args.fp4_scale_fold == ("on" if top <= 128 else "off") == model.args.fp4_scale_fold
    assert all(m.scale_fold is (top <= 128) for m in experts.values())
    path, m = list(experts.items())[-1]
    bad = np.asarray(m.w2.scale[...]).view(np.uint8).copy()
    bad[1, -1, -1] = 129
    m.w2.scale[...] = jnp.asarray(bad.view(ml_dtypes.float8_e8m0fnu))
    assert resolve_fp4_scale_fold(model, golden.args.replace(fp4_scale_fold="auto")).fp4_scale_fold == "off"
    assert not any(m.scale_fold for m in experts.values())
    with pytest.raises(CheckpointError, match=rf"{path}\.1\.w2\.scale holds e8m0 scale byte 129"):
        resolve_fp4_scale_fold(model, golden.args.replace(fp4_scale_fold="on"), source=str(golden.path))
