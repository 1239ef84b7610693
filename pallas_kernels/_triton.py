"""Helpers shared by the GPU (Triton lowering) kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from dsv41_jax.numerics import exact_div, reciprocal_sqrt

SMEM_LIMIT = 232448  # bytes of shared memory one block may opt into on H100/H200


def is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def fit_block(block: int, size: int, smallest: int) -> int:
    """The largest of block, block / 2, ... down to `smallest` that divides `size` (else `smallest`;
    the kernel then rejects the shape)."""
    while block > smallest and size % block:
        block //= 2
    return block


def e8m0_f32(b: jax.Array) -> jax.Array:
    """int32 e8m0 bytes 0..255 -> fp32 2^(b-127); 0 -> 2^-127 (subnormal), 255 -> NaN (as
    `dsv41_jax.quant.e8m0_to_f32`), built from the exponent bits inside a kernel."""
    bits = jnp.where(b == 0, jnp.int32(1 << 22), jnp.where(b == 255, jnp.int32(0x7FC00000), b << 23))
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


_F32 = jnp.float32


def _bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.int32)


def _from_bits(b: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(b, _F32)


def act_quant_tile(x: jax.Array, block: int = 32) -> jax.Array:
    """`dsv41_jax.quant.act_quant_bf16` of a tile inside a kernel: x [rows, cols] (any float; cols
    a multiple of `block`) -> bf16 [rows, cols] = q * s, per `block` consecutive columns:
    amax = max(max|x|, 1e-4), s = 2^ceil(log2(amax * fp32(1/448))), q = e4m3(clamp(x / s, +-448))
    rounded to nearest, ties to even; the same values bit for bit (-0 kept).

    Every step is exact or integer: s and 1/s are built from exponent bits (x * (1/s) = x / s
    for a power of two), and e4m3 rounding is v = |y| / ulp (a power-of-two rescale to [0, 16))
    rounded half to even from floor(v) and the exact remainder v - floor(v), times ulp. No
    transcendental, division or hardware fp8 cast, so the values do not depend on the toolchain
    (nor on XLA's simplifier in interpret mode, which folds (v + c) - c to v)."""
    rows, cols = x.shape
    xb = x.astype(_F32).reshape(rows, cols // block, block)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), _F32(1e-4))
    v = _bits(amax * _F32(1.0 / 448.0))
    e_s = ((v >> 23) & 0xFF) + ((v & 0x7FFFFF) != 0).astype(jnp.int32)  # biased exponent of s
    s, inv_s = _from_bits(e_s << 23)[..., None], _from_bits((254 - e_s) << 23)[..., None]
    y = jnp.minimum(jnp.maximum(xb * inv_s, _F32(-448.0)), _F32(448.0))
    a = jnp.abs(y)
    e = jnp.maximum(((_bits(a) >> 23) & 0xFF) - 127, -6)  # e4m3 binade (subnormals: -6)
    v = a * _from_bits((130 - e) << 23)  # |y| / ulp
    low = jnp.floor(v)
    frac = v - low  # exact
    odd = (low.astype(jnp.int32) & 1) == 1
    r = jnp.where((frac > 0.5) | ((frac == 0.5) & odd), low + 1.0, low)
    q = _from_bits(_bits(r * _from_bits((124 + e) << 23)) | (_bits(y) & jnp.int32(-2**31)))
    return (q * s).reshape(rows, cols).astype(jnp.bfloat16)


def ptx_f32(code: str, *args: jax.Array) -> jax.Array:
    """One inline-PTX instruction (or block) per element of f32 operands of one shape -> f32."""
    (out,) = plgpu.elementwise_inline_asm(
        code, args=list(args), constraints="=r," + ",".join("r" * len(args)), pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, _F32)])
    return out


def rms_factor(sumsq: jax.Array, n: int, eps: float, interpret: bool) -> jax.Array:
    """1 / sqrt(sumsq / n + eps) inside a kernel, f32 [block], every step one IEEE
    round-to-nearest operation (`div.rn`, `add.rn`, `sqrt.rn`, `div.rn`), as `numerics.mean` and
    `numerics.reciprocal_sqrt` round it. Interpret mode calls those helpers: XLA:CPU would turn
    x / n into a multiply by the rounded 1/n and 1 / sqrt into its approximate rsqrt."""
    full = lambda v: jnp.full(sumsq.shape, v, _F32)
    if interpret:
        return reciprocal_sqrt(exact_div(sumsq, full(n)) + full(eps))
    var = ptx_f32("div.rn.f32 $0, $1, $2;", sumsq, full(n))
    root = ptx_f32("sqrt.rn.f32 $0, $1;", ptx_f32("add.rn.f32 $0, $1, $2;", var, full(eps)))
    return ptx_f32("div.rn.f32 $0, $1, $2;", full(1.0), root)
