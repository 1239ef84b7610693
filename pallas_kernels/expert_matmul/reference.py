"""jnp reference for the routed-expert matmul: the math of dsv41_jax.moe's gather and grouped
paths, one projection at a time.

Weights are the stacked routed experts of one projection: w packed e2m1 int8 [E, N, K/2] (element
2k in the low nibble), s e8m0 [E, N, K/32]. Activations x are bf16 rows already act-quantised
(exact e4m3 x power-of-two values), so every product x * w is exact in fp32; the dot accumulates
in fp32 and rounds once to bf16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax import quant
from dsv41_jax.numerics import cast

_F32 = jnp.float32
_BF16 = jnp.bfloat16
_HIGHEST = jax.lax.Precision.HIGHEST


def dequant(w: jax.Array, s: jax.Array) -> jax.Array:
    """Packed int8 [..., N, K/2] with e8m0 [..., N, K/32] -> bf16 [..., N, K] (exact)."""
    return quant.dequant_fp4_weight(w, s, _BF16)


def gather_matmul(x: jax.Array, w: jax.Array, s: jax.Array, expert: jax.Array) -> jax.Array:
    """x bf16 [R, K], expert int32 [R] -> bf16 [R, N]: row r times expert[r]'s matrix.

    The selected experts' packed bytes are gathered, widened to bf16 (in HBM on an accelerator:
    R * N * K * 2 bytes) and multiplied with one batched dot."""
    wd = dequant(jnp.take(w, expert, axis=0), jnp.take(s, expert, axis=0))  # [R, N, K]
    y = jax.lax.dot_general(x.astype(_BF16), wd, (((1,), (2,)), ((0,), (0,))), precision=_HIGHEST,
                            preferred_element_type=_F32)
    return cast(y, _BF16)


def grouped_matmul(x: jax.Array, w: jax.Array, s: jax.Array, tile_expert: jax.Array, tile_row0: jax.Array,
                   tile_valid: jax.Array, rows_per_tile: int) -> jax.Array:
    """Tiles of rows, each multiplied by one expert (the grouped path of the MoE).

    x bf16 [M, K] with M >= max(tile_row0) + rows_per_tile (callers pad); tile t covers rows
    [tile_row0[t], tile_row0[t] + tile_valid[t]) and multiplies them by expert tile_expert[t];
    tile_valid 0 marks a dead tile. Returns bf16 [M, N]; rows no tile covers are 0.
    A `lax.scan` over the tiles widens one expert's matrix per tile."""
    c = rows_per_tile
    n = w.shape[1]

    def step(out, tile):
        e, row0, valid = tile
        wd = dequant(w[e], s[e])  # [N, K]
        rows = jax.lax.dynamic_slice_in_dim(x, row0, c)
        y = cast(jax.lax.dot_general(rows.astype(_BF16), wd, (((1,), (1,)), ((), ())), precision=_HIGHEST,
                                     preferred_element_type=_F32), _BF16)
        old = jax.lax.dynamic_slice_in_dim(out, row0, c)
        keep = (jnp.arange(c) < valid)[:, None]
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, y, old), row0, 0), None

    out, _ = jax.lax.scan(step, jnp.zeros((x.shape[0], n), _BF16), (tile_expert, tile_row0, tile_valid))
    return out
