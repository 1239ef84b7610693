"""Helpers shared by the GPU (Triton lowering) kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
