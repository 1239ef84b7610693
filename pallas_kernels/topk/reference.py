"""Pure-jnp top-k positions: the oracle and the CPU path."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def topk_positions(scores: jax.Array, k: int) -> jax.Array:
    """scores [..., W] -> int32 [..., k]: the columns of the k largest scores (ties -> lower
    column), sorted ascending."""
    _, idx = jax.lax.top_k(scores, k)
    return jnp.sort(idx, axis=-1).astype(jnp.int32)
