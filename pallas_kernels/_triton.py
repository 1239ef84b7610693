"""Helpers shared by the GPU (Triton lowering) kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsv41_jax import quant

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


def round_bf16_f32(x: jax.Array, interpret: bool) -> jax.Array:
    """x rounded to bf16 values, as f32. In interpret mode XLA runs this, and XLA may drop an
    f32 -> bf16 -> f32 convert pair, so the rounding is made explicit there."""
    if interpret:
        return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def rms_factor(x_ref, k: int, block_k: int, eps: float) -> jax.Array:
    """1 / sqrt(mean(x^2) + eps) of the row x_ref [1, K] (a kernel's ref) as `numerics.rms_norm`
    forms it: the sum of squares in fp32 (K / block_k tiles added element-wise, then one tree sum:
    every program of a launch forms the same value), then the mean, the square root and the
    reciprocal each correctly rounded (float64 division and root of f32 values, rounded once).
    -> f32 [1, 1]."""
    sq = None
    for c in range(k // block_k):  # unrolled: the tiles' loads are independent
        xc = x_ref[pl.ds(0, 1), pl.ds(c * block_k, block_k)].astype(jnp.float32)
        sq = xc * xc if sq is None else sq + xc * xc
    total = jnp.sum(sq, axis=1, keepdims=True)
    with jax.enable_x64(True):
        var = (total.astype(jnp.float64) / jnp.float64(k)).astype(jnp.float32) + jnp.float32(eps)
        root = jnp.sqrt(var.astype(jnp.float64)).astype(jnp.float32)
        return (jnp.float64(1.0) / root.astype(jnp.float64)).astype(jnp.float32)


def act_quant_row(x: jax.Array) -> jax.Array:
    """x [1, bk] (bf16 / fp32; bk % 32 == 0; in a kernel body) -> fp32 [1, bk]:
    `quant.act_quant_bf16`'s values, from bit operations, multiplies by powers of two and one
    round-half-even (all exact), one scale per 32 elements. Where x is not finite the result is
    NaN (that element's quantiser output is NaN too, and every product sum it enters is NaN on
    both paths)."""
    bk = x.shape[1]
    xf = x.astype(jnp.float32).reshape(bk // 32, 32)
    amax = jnp.maximum(jnp.max(jnp.abs(xf), axis=1), jnp.float32(1e-4))
    s = quant._pow2_ceil(amax * jnp.float32(1.0 / 448.0))[:, None]
    inv = jax.lax.bitcast_convert_type((254 << 23) - jax.lax.bitcast_convert_type(s, jnp.int32), jnp.float32)
    y = jnp.minimum(jnp.maximum(xf * inv, jnp.float32(-448.0)), jnp.float32(448.0))
    # `quant._round_e4m3` without jnp.round (no Triton lowering): grid step 2^(f-3) for |y| in
    # [2^f, 2^(f+1)), f >= -6; v = |y| / step < 16 (exact) is rounded to an integer, ties to
    # even, from its truncation and the exact remainder
    a = jnp.abs(y)
    f = jnp.maximum(((jax.lax.bitcast_convert_type(a, jnp.int32) >> 23) & 0xFF) - 127, -6)
    v = a * jax.lax.bitcast_convert_type((130 - f) << 23, jnp.float32)
    n = v.astype(jnp.int32)
    rem = v - n.astype(jnp.float32)
    n = n + ((rem > 0.5) | ((rem == 0.5) & ((n & 1) == 1))).astype(jnp.int32)
    r = n.astype(jnp.float32) * jax.lax.bitcast_convert_type((124 + f) << 23, jnp.float32)
    q = jnp.where(y < 0, -r, r)
    # a NaN or infinite x makes the quantiser's output NaN (its scale is then NaN or infinite);
    # Triton's max ignores NaN, so such elements are set to NaN explicitly
    finite = jnp.abs(xf) <= jnp.float32(3.4028234663852886e38)
    return jnp.where(finite, q * s, jnp.float32(jnp.nan)).reshape(1, bk)
