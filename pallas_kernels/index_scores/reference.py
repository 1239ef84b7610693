"""Pure-jnp indexer scores (SPEC §5.7): the oracle and the CPU path."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv41_jax.numerics import round_bf16, to_bf16

# The per-head dots of `index_scores` (f32 [b, s, h, t]) are formed this many bytes at a time:
# a 16k-token prefill would otherwise hold 32 GiB of them before the sum over heads.
INDEX_SCORE_BLOCK_BYTES = 1 << 30


@functools.partial(jax.jit, static_argnames="block_bytes")
def index_scores(q: jax.Array, k: jax.Array, w: jax.Array, block_bytes: int = INDEX_SCORE_BLOCK_BYTES) -> jax.Array:
    """score[b, s, t] = sum_h relu(q[b,s,h].k[b,t]) * w[b,s,h], in the reference's bf16 steps.

    q bf16 [b, s, h, d]; k bf16 [b, t, d]; w bf16 [b, s, h] -> bf16 [b, s, t].
    Each dot is accumulated in f32 and rounded to bf16 once; relu; the product with w rounded to
    bf16 (exact in f32 first); the head sum accumulated in f32 and rounded to bf16 once.
    Keys are taken in blocks (a sequential map) so that at most `block_bytes` of per-head dots
    exist at once; every score is computed the same way whatever the blocking.
    """
    b, s, h, _ = q.shape
    t = k.shape[1]
    cols = index_score_block(b, s, h, t, block_bytes)
    if cols == t:
        return _index_scores_block(q, k, w)
    n = -(-t // cols)
    blocks = jnp.pad(k, ((0, 0), (0, n * cols - t), (0, 0))).reshape(b, n, cols, -1).swapaxes(0, 1)
    out = jax.lax.map(lambda kb: _index_scores_block(q, kb, w), blocks)  # [n, b, s, cols]
    return jnp.moveaxis(out, 0, 2).reshape(b, s, n * cols)[..., :t]


def index_score_block(b: int, s: int, h: int, t: int, block_bytes: int = INDEX_SCORE_BLOCK_BYTES) -> int:
    """Keys per block of `index_scores` for q [b, s, h, d] and t keys: t when the f32 dots of all
    keys fit in `block_bytes`, else the most that fit, rounded down to a multiple of 128."""
    cols = max(1, block_bytes // (4 * b * s * h))
    if t <= cols:
        return t
    return cols // 128 * 128 if cols >= 128 else cols


def _index_scores_block(q: jax.Array, k: jax.Array, w: jax.Array) -> jax.Array:
    dots = round_bf16(jnp.einsum("bshd,btd->bsht", q, k, precision=jax.lax.Precision.HIGHEST,
                                 preferred_element_type=jnp.float32))
    prod = round_bf16(jnp.maximum(dots, 0) * round_bf16(w)[..., None])  # exact product, one rounding
    return to_bf16(jnp.sum(prod, axis=2))
