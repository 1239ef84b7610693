"""Pallas GPU (Triton lowering) kernel: a one-row decode step's window-KV row, from the wkv
projection to its ring slot, in one launch.

One program: the row's RMSNorm factor (`_triton.rms_factor`: the same sum of squares tree as the
one-row fp8 kernel, the mean, root and reciprocal correctly rounded), then per tile of T columns
the norm applied and rounded to bf16 as `numerics.rms_norm` does, the RoPE of the tail in the
last tile, the FP8 quantiser (`_triton.act_quant_row`, exact), and the store into the ring row,
which the call aliases in place. XLA otherwise runs the norm's mean, the quantiser's block maxima
and the write as three dependent kernels.

RoPE as a [T, T] matrix product: `rotation(cos, sin, T, rope_dim)` is the identity on the tile's
first T - rope_dim columns and the pairs' 2 x 2 rotations on the rest, so each output is one
product (x 1, exact) or the sum of two products rounded once, as `layers.apply_rope` forms
re*cos - im*sin and re*sin + im*cos; the zero terms add nothing (only the sign of an exact zero
result can differ).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._triton import act_quant_row, is_pow2, rms_factor, round_bf16_f32


def tile_for(hd: int, rope_dim: int) -> int:
    """The tile width T: the smallest power of two >= max(32, rope_dim) dividing hd (0: none)."""
    t = 32
    while t < rope_dim:
        t *= 2
    return t if hd % t == 0 else 0


def rotation(cos: jax.Array, sin: jax.Array, tile: int, rope_dim: int) -> jax.Array:
    """cos, sin f32 [rope_dim / 2] -> f32 [tile, tile] with row @ R = the tile with its last
    rope_dim columns rotated as interleaved pairs (2m, 2m+1): out[2m] = re cos - im sin,
    out[2m+1] = re sin + im cos; identity on the columns before them. One elementwise fusion
    (constant masks and a gather of the angle's column)."""
    lead = tile - rope_dim
    i, j = np.arange(tile)[:, None], np.arange(tile)[None, :]
    rot = (i >= lead) & (j >= lead) & ((i - lead) // 2 == (j - lead) // 2)  # the pairs' 2 x 2 blocks
    m = np.clip((j - lead) // 2, 0, rope_dim // 2 - 1) + 0 * i  # the pair of column j
    diag, below = rot & (i == j), rot & (i > j)  # cos on the diagonal, -sin below it (im -> re), sin above
    return jnp.where(diag, cos[m], jnp.where(below, -sin[m], jnp.where(rot, sin[m], jnp.float32(i == j))))


def _kernel(kv_ref, nw_ref, rot_ref, slot_ref, ring_ref, out_ref, *, hd: int, tile: int, eps: float, window: int,
            interpret: bool):
    # kv_ref, nw_ref [1, hd] bf16; rot_ref [T, T] f32; slot_ref [1] int32; ring_ref / out_ref
    # [1, window, hd] bf16 (one buffer: only the slot's row is written)
    del ring_ref
    factor = rms_factor(kv_ref, hd, tile, eps)
    s = slot_ref[0]
    live = jnp.full((1, 1, tile), (s >= 0) & (s < window))
    row = jnp.clip(s, 0, window - 1)
    last = hd // tile - 1
    for c in range(hd // tile):  # unrolled: one row of a few tiles
        cols = pl.ds(c * tile, tile)
        if c < last:
            xb = kv_ref[pl.ds(0, 1), cols].astype(jnp.float32)
            nwb = nw_ref[pl.ds(0, 1), cols].astype(jnp.float32)
            y = round_bf16_f32(nwb * (xb * factor), interpret)  # `numerics.rms_norm`'s operations
        else:  # the tail tile as a column, normalised alike, times the rotation
            xc = kv_ref[0, cols].astype(jnp.float32)[:, None]
            nwc = nw_ref[0, cols].astype(jnp.float32)[:, None]
            yc = round_bf16_f32(nwc * (xc * factor[0, 0]), interpret)  # [T, 1]
            y = round_bf16_f32(jnp.sum(yc * rot_ref[...], axis=0)[None, :], interpret)
        plgpu.store(out_ref.at[pl.ds(0, 1), pl.ds(row, 1), cols], act_quant_row(y).astype(jnp.bfloat16)[None],
                    mask=live)


def write_window_row(ring: jax.Array, slot: jax.Array, kv: jax.Array, norm_weight: jax.Array, eps: float,
                     cos: jax.Array, sin: jax.Array, rope_dim: int, *, num_warps: int = 4,
                     interpret: bool) -> jax.Array:
    """ring bf16 [1, W, hd], slot int [1] (negative: from the end), kv bf16 [1, hd], norm_weight
    bf16 [hd], cos / sin f32 [1, rope_dim / 2] -> the ring with `reference.window_row` written at
    the slot (aliased: the rest of the ring is not copied). The normalised row equals
    `rms_norm`'s where the sum of squares rounds alike (one fixed order, not XLA's).

    Raises NotImplementedError for shapes this kernel does not handle (the caller falls back)."""
    if ring.ndim != 3 or ring.shape[0] != 1 or kv.shape != (1, ring.shape[2]) or norm_weight.shape != kv.shape[1:]:
        raise NotImplementedError(f"one row: ring [1, W, hd], kv [1, hd], norm weight [hd]; got {ring.shape=} "
                                  f"{kv.shape=} {norm_weight.shape=}")
    if not (ring.dtype == kv.dtype == norm_weight.dtype == jnp.bfloat16):
        raise NotImplementedError(f"bf16 only, got {ring.dtype=} {kv.dtype=} {norm_weight.dtype=}")
    _, window, hd = ring.shape
    tile = tile_for(hd, rope_dim)
    if not tile or rope_dim % 2 or not is_pow2(tile) or cos.shape != (1, rope_dim // 2):
        raise NotImplementedError(f"hd={hd} needs a power-of-2 tile >= max(32, rope_dim={rope_dim}) dividing it, "
                                  f"cos / sin [1, {rope_dim // 2}]; got {cos.shape=}")
    s = jnp.asarray(slot, jnp.int32).reshape(1)
    s = jnp.where(s < 0, s + window, s)
    rot = rotation(cos[0], sin[0], tile, rope_dim)
    kernel = functools.partial(_kernel, hd=hd, tile=tile, eps=float(eps), window=window, interpret=interpret)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(ring.shape, ring.dtype), grid=(1,), interpret=interpret,
        input_output_aliases={4: 0}, compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="window_kv_row")(kv, norm_weight.reshape(1, hd), rot, s, ring)
