"""Quantisation formats of DeepSeek V4.1 (SPEC §13, §16): storage decoders, activation quantisers,
QDQ helpers, the block-scaled reference GEMMs and the fast linear paths.

Formats
  * e4m3 = `float8_e4m3fn` (max 448, no inf, NaN at 0x7f/0xff).
  * e8m0 = `float8_e8m0fnu`: a pure power of two 2^(b-127), byte b; 0xff is NaN.
  * e2m1: 4-bit code, bit 3 = sign, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; packed two per byte
    along K, element 2k in the LOW nibble, 2k+1 in the high nibble.

Rounding is done arithmetically in fp32 (exact power-of-two rescaling + round-half-even), never by
a narrowing cast followed by a widening one: XLA may delete such convert pairs (it does on GPU,
jax 0.11: `x.astype(float8_e4m3fn).astype(float32)` inside jit returns x unchanged), which would
silently skip the quantisation. Narrowing casts are only applied to values already on the target
grid (the e4m3 `q` that `act_quant` returns, e8m0 scales built from exact powers of two). Besides:
  * fp32 -> e4m3 is RNE but not saturating (|v| >= 464 becomes NaN); values are clamped to +-448.
  * fp32 -> e8m0 rounds to the nearest power of two (1.5 -> 2) and maps 0 to NaN, whereas the
    scales need 2^ceil(log2 v); they are built from the fp32 exponent bits instead.

The jnp functions are wrapped in jax.jit (block sizes and output dtypes static) and accept any
leading batch dims.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv41_jax.numerics import exact_div, to_bf16

BLOCK = 32
FP8_MAX = 448.0
FP4_MAX = 6.0

# Value of each 4-bit e2m1 code (index = code, bit 3 = sign).
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST


# ------------------------------------------------------------------------------------ helpers


def _pow2_ceil(v: jax.Array) -> jax.Array:
    """2^ceil(log2 v) for positive normal fp32 v, from the exponent bits: exponent of v, plus one
    when its mantissa bits are non-zero. Returns fp32 (exact power of two)."""
    bits = jax.lax.bitcast_convert_type(v.astype(_F32), jnp.int32)
    biased_exp = (bits >> 23) & 0xFF
    mant_nonzero = ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    return jax.lax.bitcast_convert_type((biased_exp + mant_nonzero) << 23, _F32)


def _np_pow2_ceil_exp(v: np.ndarray) -> np.ndarray:
    """numpy twin of `_pow2_ceil`, returning the unbiased exponent as int32 (v = 0 gives -127)."""
    bits = np.ascontiguousarray(v, dtype=np.float32).view(np.uint32).astype(np.int64)
    return (((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0) - 127).astype(np.int32)


@jax.jit
def e8m0_to_f32(s: jax.Array) -> jax.Array:
    """e8m0 (or its raw uint8 bytes) [...] -> fp32 [...] = 2^(b-127); b = 0 gives 2^-127, 0xff NaN."""
    b = s if s.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(s, jnp.uint8)
    b = b.astype(jnp.int32)
    normal = jax.lax.bitcast_convert_type(b << 23, _F32)
    v = jnp.where(b == 0, _F32(2.0**-127), normal)
    return jnp.where(b == 0xFF, _F32(jnp.nan), v)


def _round_e2m1(y: jax.Array) -> jax.Array:
    """Round fp32 y (already clamped to [-6, 6]) to the e2m1 grid, nearest, ties to the even code.

    On [0,2) the code is 2|y|, on [2,4) it is |y|+2, on [4,6] it is |y|/2+4, so rounding |y|*m
    (m = 2, 1, 1/2; exact power-of-two rescaling) half-to-even picks the even code on ties.
    """
    a = jnp.abs(y)
    m = jnp.where(a < 2.0, _F32(2.0), jnp.where(a < 4.0, _F32(1.0), _F32(0.5)))
    r = jnp.round(a * m) / m  # jnp.round is round-half-to-even
    return jnp.copysign(r, y)


def _round_e4m3(y: jax.Array) -> jax.Array:
    """Round fp32 y (|y| <= 448) to the float8_e4m3fn grid, nearest, ties to even; stays fp32.

    The grid spacing is 2^(e-3) for |y| in [2^e, 2^(e+1)), e >= -6, and 2^-9 below 2^-6
    (subnormals); y / spacing is an exact power-of-two rescaling, so one round-half-even is exact.
    """
    a = jnp.abs(y)
    e = jnp.maximum(((jax.lax.bitcast_convert_type(a, jnp.int32) >> 23) & 0xFF) - 127, -6)
    inv_ulp = jax.lax.bitcast_convert_type((127 + 3 - e) << 23, _F32)
    ulp = jax.lax.bitcast_convert_type((127 - 3 + e) << 23, _F32)
    return jnp.copysign(jnp.round(a * inv_ulp) * ulp, y)


def _e2m1_codes(q: jax.Array) -> jax.Array:
    """e2m1 values (fp32, on the grid; the sign of -0 is kept) -> uint8 codes 0..15."""
    a = jnp.abs(q)
    mag = jnp.where(a < 2.0, a * 2.0, jnp.where(a < 4.0, a + 2.0, a * 0.5 + 4.0)).astype(jnp.uint8)
    return mag | (jnp.signbit(q).astype(jnp.uint8) << 3)


def _blocks(x: jax.Array, block: int) -> jax.Array:
    """[..., K] -> [..., K/block, block]; K must be a multiple of block."""
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"last dim {k} is not a multiple of the block size {block}")
    return x.reshape(*x.shape[:-1], k // block, block)


# ---------------------------------------------------------------------------------------- FP4


@jax.jit
def unpack_fp4(packed: jax.Array) -> jax.Array:
    """Packed e2m1 int8/uint8 [..., K2] -> fp32 [..., 2*K2]; element 2k is the low nibble of byte k."""
    b = packed if packed.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(packed, jnp.uint8)
    table = jnp.asarray(E2M1_VALUES)
    lo = table[(b & 0x0F).astype(jnp.int32)]
    hi = table[(b >> 4).astype(jnp.int32)]
    return jnp.stack([lo, hi], axis=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])


@jax.jit
def pack_fp4(x: jax.Array) -> jax.Array:
    """Float [..., K] (K even) -> int8 [..., K/2]: each value rounded to e2m1 (RNE, ties to the even
    code, clamped to +-6; a negative value rounding to 0 gives code 8 = -0), element 2k in the low
    nibble. Inverse of `unpack_fp4` on representable values."""
    if x.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dim, got {x.shape[-1]}")
    q = _round_e2m1(jnp.clip(x.astype(_F32), -FP4_MAX, FP4_MAX))
    codes = _e2m1_codes(q).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    byte = codes[..., 0] | (codes[..., 1] << 4)
    return jax.lax.bitcast_convert_type(byte, jnp.int8)


# ------------------------------------------------------------------------------ weight storage


@partial(jax.jit, static_argnames="dtype")
def dequant_fp8_weight(w: jax.Array, s: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """FP8 weight -> dense. w e4m3 [..., N, K]; s e8m0 [..., ceil(N/32), ceil(K/32)];
    value = w * s[row//32, col//32], returned as `dtype` [..., N, K]. Exact in bf16 (e4m3 times a
    power of two)."""
    n, k = w.shape[-2:]
    sf = e8m0_to_f32(s)
    sf = jnp.repeat(sf, BLOCK, axis=-2)[..., :n, :]
    sf = jnp.repeat(sf, BLOCK, axis=-1)[..., :k]
    return (w.astype(_F32) * sf).astype(dtype)


@partial(jax.jit, static_argnames="dtype")
def dequant_fp4_weight(w: jax.Array, s: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """FP4 weight -> dense. w packed int8 [..., N, K/2]; s e8m0 [..., N, K/32];
    value = e2m1 * s[row, col//32], returned as `dtype` [..., N, K] (leading dims, e.g. stacked
    experts, allowed). Exact in bf16."""
    v = unpack_fp4(w)
    sf = jnp.repeat(e8m0_to_f32(s), BLOCK, axis=-1)
    return (v * sf).astype(dtype)


def quantize_fp8_weight(w) -> tuple[np.ndarray, np.ndarray]:
    """numpy: float [..., N, K] -> (e4m3 [..., N, K], e8m0 [..., ceil(N/32), ceil(K/32)]).

    Per 32x32 block scale 2^ceil(log2(amax/448)) (amax/448 in fp32), q = e4m3(clamp(w/s, +-448))
    RNE. An all-zero block gets scale 2^-127."""
    w = np.asarray(w, dtype=np.float32)
    *lead, n, k = w.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    pad = [(0, 0)] * len(lead) + [(0, nb * BLOCK - n), (0, kb * BLOCK - k)]
    wp = np.pad(w, pad).reshape(*lead, nb, BLOCK, kb, BLOCK)
    amax = np.abs(wp).max(axis=(-3, -1))
    e = np.clip(_np_pow2_ceil_exp(amax / np.float32(FP8_MAX)), -127, 127)
    sf = np.ldexp(np.float64(1.0), e)  # exact powers of two (float64 keeps 2^-127 normal)
    full = np.repeat(np.repeat(sf, BLOCK, axis=-2)[..., :n, :], BLOCK, axis=-1)[..., :k]
    q = np.clip(w.astype(np.float64) / full, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    scale = (e + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
    return q, scale


def quantize_fp4_weight(w) -> tuple[np.ndarray, np.ndarray]:
    """numpy: float [..., N, K] (K % 32 == 0) -> (packed int8 [..., N, K/2], e8m0 [..., N, K/32]).

    Per row and 32 columns scale 2^ceil(log2(amax/6)) (amax/6 in fp32), q = e2m1(clamp(w/s, +-6))
    RNE, ties to the even code. An all-zero group gets scale 2^-127."""
    w = np.asarray(w, dtype=np.float32)
    if w.shape[-1] % BLOCK:
        raise ValueError(f"quantize_fp4_weight needs K % {BLOCK} == 0, got {w.shape[-1]}")
    wb = w.reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    amax = np.abs(wb).max(axis=-1)
    e = np.clip(_np_pow2_ceil_exp(amax / np.float32(FP4_MAX)), -127, 127)
    y = (wb.astype(np.float64) / np.ldexp(np.float64(1.0), e)[..., None]).astype(np.float32)
    with jax.default_device(jax.devices("cpu")[0]):
        packed = np.asarray(pack_fp4(jnp.asarray(y.reshape(w.shape))))
    scale = (e + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
    return packed, scale


# ---------------------------------------------------------------------------------- activations


@partial(jax.jit, static_argnames="block")
def act_quant(x: jax.Array, block: int = BLOCK) -> tuple[jax.Array, jax.Array]:
    """Activation quantiser before every fp8/fp4 GEMM (SPEC §13).

    x [..., K] (any float dtype, K % block == 0) -> (q e4m3 [..., K], s fp32 [..., K/block]).
    Per `block` consecutive elements, in fp32: amax = max(max|x|, 1e-4);
    s = 2^ceil(log2(amax * fp32(1/448))) (exponent-bit trick); q = e4m3(clamp(x/s, +-448)) RNE.
    """
    q, s = _act_quant_f32(x, block)
    return q.reshape(x.shape).astype(jnp.float8_e4m3fn), s


def _act_quant_f32(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """`act_quant` with q kept as fp32 (values on the e4m3 grid), shape [..., K/block, block]."""
    xb = _blocks(x.astype(_F32), block)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), _F32(1e-4))
    s = _pow2_ceil(amax * _F32(1.0 / FP8_MAX))
    q = _round_e4m3(jnp.clip(xb / s[..., None], -FP8_MAX, FP8_MAX))
    return q, s


@partial(jax.jit, static_argnames="block")
def act_quant_dequant(x: jax.Array, block: int = BLOCK) -> jax.Array:
    """FP8 QDQ with `act_quant` (e4m3, UE8M0 scale per `block`): x [..., K] -> x.dtype [..., K].
    (Window KV: block 32.) q*s is exact in bf16."""
    q, s = _act_quant_f32(x, block)
    return (q * s[..., None]).reshape(x.shape).astype(x.dtype)


@partial(jax.jit, static_argnames="block")
def fp4_quant_dequant_e4m3(x: jax.Array, block: int = 16) -> jax.Array:
    """FP4 QDQ with E4M3 scales (compressed KV): x [..., K] -> x.dtype [..., K].

    Per `block` elements, in fp32: s = e4m3(max(amax, 6*2^-9) / 6) (RNE); q = e2m1(clamp(x/s, +-6))
    RNE ties to the even code; result q*s (exact in fp32 and bf16). amax/6 is clamped to 448 before
    the e4m3 cast (saturating) so huge blocks cannot produce a NaN scale.
    """
    xb = _blocks(x.astype(_F32), block)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), _F32(FP4_MAX * 2.0**-9))
    # exact divisions: XLA may otherwise use x * (1/s), which moves exact e2m1 ties off the tie
    s = _round_e4m3(jnp.minimum(exact_div(amax, FP4_MAX), _F32(FP8_MAX)))
    q = _round_e2m1(jnp.clip(exact_div(xb, s[..., None]), -FP4_MAX, FP4_MAX))
    return (q * s[..., None]).reshape(x.shape).astype(x.dtype)


@partial(jax.jit, static_argnames="block")
def fp4_quant_dequant_ue8m0(x: jax.Array, block: int = BLOCK) -> jax.Array:
    """FP4 QDQ with UE8M0 scales (indexer q and k): x [..., K] -> x.dtype [..., K].

    Per `block` elements, in fp32: s = 2^ceil(log2(max(amax, 6*2^-126) / 6)) (exponent-bit trick);
    q = e2m1(clamp(x/s, +-6)) RNE ties to the even code; result q*s.
    """
    xb = _blocks(x.astype(_F32), block)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), _F32(FP4_MAX * 2.0**-126))
    s = _pow2_ceil(exact_div(amax, FP4_MAX))
    q = _round_e2m1(jnp.clip(xb / s[..., None], -FP4_MAX, FP4_MAX))
    return (q * s[..., None]).reshape(x.shape).astype(x.dtype)


# --------------------------------------------------------------------- reference-order GEMMs


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Error-free sum: s + e == a + b exactly, s = fl(a + b)."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


def _block_scaled_gemm(af: jax.Array, a_s: jax.Array, wf: jax.Array, ws: jax.Array) -> jax.Array:
    """af fp32 [M, K], a_s fp32 [M, KB], wf fp32 [N, K], ws fp32 [N, KB] -> bf16 [M, N].

    Each 32-wide block dot is formed exactly and rounded once to fp32: the products of e4m3 by
    e4m3 (or e2m1) values are exact in fp32 and lie on a 2^-18 grid below 2^18, so accumulating
    them with TwoSum keeps (hi, lo) exact (lo stays below 2^3 on that grid, within fp32's 24
    bits) and fl(hi + lo) is the correctly rounded block dot. The block results, times both
    scales, are then added in K order in fp32.
    """
    m, k = af.shape
    n = wf.shape[0]
    kb = k // BLOCK
    a_blk = af.reshape(m, kb, BLOCK).transpose(1, 0, 2)  # [KB, M, 32]
    w_blk = wf.reshape(n, kb, BLOCK).transpose(1, 0, 2)  # [KB, N, 32]

    def step(acc, inputs):
        a, w, sa, sw = inputs  # [M,32], [N,32], [M], [N]
        p = a[:, None, :] * w[None, :, :]  # [M, N, 32], exact
        hi = p[..., 0]
        lo = jnp.zeros_like(hi)
        for j in range(1, BLOCK):
            hi, err = _two_sum(hi, p[..., j])
            lo = lo + err
        d = hi + lo
        return acc + d * sa[:, None] * sw[None, :], None

    acc0 = jnp.zeros((m, n), _F32)
    acc, _ = jax.lax.scan(step, acc0, (a_blk, w_blk, a_s.T, ws.T))
    return acc.astype(jnp.bfloat16)


def _gemm_flatten(a, a_s):
    k = a.shape[-1]
    if k % BLOCK:
        raise ValueError(f"K = {k} is not a multiple of {BLOCK}")
    return a.reshape(-1, k).astype(_F32), a_s.reshape(-1, k // BLOCK).astype(_F32)


@jax.jit
def fp8_gemm(a: jax.Array, a_s: jax.Array, w: jax.Array, w_s: jax.Array) -> jax.Array:
    """Reference-order block-scaled FP8 GEMM (test oracle).

    a e4m3 [..., K], a_s fp32 [..., K/32], w e4m3 [N, K], w_s e8m0 [ceil(N/32), K/32] -> bf16 [..., N].
    C = sum over K blocks kb, in K order, fp32: (exact block dot, rounded to fp32) * a_s[kb] * w_s[n//32, kb].
    """
    lead = a.shape[:-1]
    af, asf = _gemm_flatten(a, a_s)
    n = w.shape[0]
    ws = jnp.repeat(e8m0_to_f32(w_s), BLOCK, axis=0)[:n]
    out = _block_scaled_gemm(af, asf, w.astype(_F32), ws)
    return out.reshape(*lead, n)


@jax.jit
def fp4_gemm(a: jax.Array, a_s: jax.Array, w: jax.Array, w_s: jax.Array) -> jax.Array:
    """Reference-order block-scaled FP4 GEMM (test oracle).

    a e4m3 [..., K], a_s fp32 [..., K/32], w packed e2m1 int8 [N, K/2], w_s e8m0 [N, K/32]
    -> bf16 [..., N]. Same summation as `fp8_gemm` with per-row weight scales w_s[n, kb].
    """
    lead = a.shape[:-1]
    af, asf = _gemm_flatten(a, a_s)
    n = w.shape[0]
    out = _block_scaled_gemm(af, asf, unpack_fp4(w), e8m0_to_f32(w_s))
    return out.reshape(*lead, n)


# -------------------------------------------------------------------------------- fast linears
#
# Why one bf16 dot equals the block-scaled GEMM up to fp32 summation order: the activation
# scale s (act_quant) and the weight scales (e8m0) are powers of two, and an e4m3 or e2m1 value
# times a power of two is exactly representable in bf16 (<= 4 significant bits, exponent well
# inside bf16's range). So the bf16 operands hold exactly q*s and w*s_w, each bf16 x bf16
# product (<= 8 significant bits) is exact in fp32, and (dot of block) * s * s_w equals the dot
# of the pre-scaled block exactly. The only difference from the reference is the order in
# which the exact products are added in fp32 (and the single bf16 rounding at the end).


@jax.jit
def act_quant_bf16(x: jax.Array) -> jax.Array:
    """The activation side of the fast linears: x [..., K] -> bf16 [..., K] = q * s of
    `act_quant` (block 32), exact in bf16."""
    q, s = _act_quant_f32(x, BLOCK)
    return (q * s[..., None]).reshape(x.shape).astype(jnp.bfloat16)


def _linear_bf16(x: jax.Array, wd: jax.Array) -> jax.Array:
    xq = act_quant_bf16(x)
    y = jax.lax.dot_general(
        xq, wd, (((x.ndim - 1,), (1,)), ((), ())), precision=_HIGHEST, preferred_element_type=_F32
    )
    return to_bf16(y)


@jax.jit
def linear_fp8(x: jax.Array, w: jax.Array, w_s: jax.Array) -> jax.Array:
    """Fast FP8 linear: x [..., K] (bf16/fp32), w e4m3 [N, K], w_s e8m0 [ceil(N/32), ceil(K/32)]
    -> bf16 [..., N]. act_quant(x), dequantise activation and weight to bf16 (exact), one bf16
    dot with fp32 accumulation."""
    return _linear_bf16(x, dequant_fp8_weight(w, w_s, jnp.bfloat16))


@jax.jit
def linear_fp4(x: jax.Array, w: jax.Array, w_s: jax.Array) -> jax.Array:
    """Fast FP4 linear: x [..., K], w packed e2m1 int8 [N, K/2], w_s e8m0 [N, K/32] -> bf16 [..., N].
    Same scheme as `linear_fp8`."""
    return _linear_bf16(x, dequant_fp4_weight(w, w_s, jnp.bfloat16))
