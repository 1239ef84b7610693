"""Pure-jnp top-k selections: the oracles and the CPU path."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def topk_positions(scores: jax.Array, k: int) -> jax.Array:
    """scores [..., W] -> int32 [..., k]: the columns of the k largest scores (ties -> lower
    column), sorted ascending."""
    _, idx = jax.lax.top_k(scores, k)
    return jnp.sort(idx, axis=-1).astype(jnp.int32)


def router_topk(scores: jax.Array, biased: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """scores, biased [..., E] -> (weights [..., k] = scores at the indices, indices int32
    [..., k]): the columns of the k largest `biased`, in top-k order (descending; ties -> lower
    column)."""
    _, idx = jax.lax.top_k(biased, k)
    return jnp.take_along_axis(scores, idx, axis=-1), idx.astype(jnp.int32)
