"""Rounding points that survive XLA's optimisations.

Under jit, XLA may drop a convert pair f32 -> bf16 -> f32 (excess precision) or fuse a dot with
the element-wise ops after it and ignore the narrowing in between; it may also turn `a / b` into
`a * (1/b)`. The reference rounds to bf16 at specific points and divides exactly, and parity
depends on both, so every such point goes through these helpers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def round_bf16(x: jax.Array) -> jax.Array:
    """Rounds to bf16 values (RNE), returned as f32; `reduce_precision` is never elided."""
    return jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=8, mantissa_bits=7)


def cast(x: jax.Array, dtype) -> jax.Array:
    """x.astype(dtype), with the bf16 rounding made explicit so a later upcast sees it."""
    if jnp.dtype(dtype) == jnp.bfloat16 and x.dtype != jnp.bfloat16:
        return round_bf16(x).astype(jnp.bfloat16)
    return x.astype(dtype)


def to_bf16(x: jax.Array) -> jax.Array:
    return cast(x, jnp.bfloat16)


def exact_div(a: jax.Array, b) -> jax.Array:
    """a / b with IEEE division: the barrier on the full-shape divisor keeps XLA from rewriting
    it as a * (1 / b) (which it does for a broadcast divisor)."""
    b = jnp.broadcast_to(jnp.asarray(b, a.dtype), jnp.broadcast_shapes(a.shape, jnp.shape(b)))
    return a / jax.lax.optimization_barrier(b)
