"""Pure-jnp window-KV row: the oracle and the CPU path."""

from __future__ import annotations

import jax

from dsv41_jax.cache import write_row
from dsv41_jax.config import QUANT_BLOCK
from dsv41_jax.layers import apply_rope
from dsv41_jax.numerics import rms_norm
from dsv41_jax.quant import act_quant_dequant


def window_row(kv: jax.Array, norm_weight: jax.Array, eps: float, cos: jax.Array, sin: jax.Array,
               rope_dim: int) -> jax.Array:
    """kv bf16 [b, hd] (the wkv projection) -> bf16 [b, hd]: `rms_norm`, RoPE of the last
    `rope_dim` dims (cos / sin f32 [b, rope_dim / 2]), then FP8 QDQ per 32 (`act_quant_dequant`)."""
    y = apply_rope(rms_norm(kv, norm_weight, eps)[:, None], cos[:, None], sin[:, None], rope_dim)[:, 0]
    return act_quant_dequant(y, QUANT_BLOCK)


def write_window_row(ring: jax.Array, slot: jax.Array, kv: jax.Array, norm_weight: jax.Array, eps: float,
                     cos: jax.Array, sin: jax.Array, rope_dim: int) -> jax.Array:
    """ring bf16 [b, W, hd] with ring[i, slot[i]] = `window_row(kv, ...)[i]` (`cache.write_row`'s
    indices: negative ones from the end, others outside [-W, W) dropped)."""
    return write_row(ring, slot, window_row(kv, norm_weight, eps, cos, sin, rope_dim))
