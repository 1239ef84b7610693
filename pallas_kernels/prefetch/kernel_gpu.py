"""Pallas GPU (Triton lowering) kernel: read a matrix's bytes once, so that they sit in L2 when
the next kernel that needs them starts.

The matrix is viewed as 32-bit words [rows, cols] (`layout`: 4 KiB rows where the size allows);
program p reads its `steps` tiles of [tile rows, cols] words (32 KiB where the size allows) and
stores their maximum in row p of a small int32 token
[P, 16]. The token's value means nothing: a later launch that takes it as an operand (and never
reads it) waits for this one. Likewise this launch takes `after` as an operand it never reads,
so it starts no earlier than `after` is computed (and is not hoisted out of a decode loop).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._triton import ORDER_SPEC, as_order_operand

MAX_COLS, MAX_TILE_ROWS = 1024, 8  # a tile: up to 8 rows of 1024 words, 32 KiB
MAX_PROGRAMS = 512


def layout(n_bytes: int) -> tuple[int, int, int]:
    """(rows, cols, tile rows) of `n_bytes` as int32 words [rows, cols]: cols the largest power of
    2 <= MAX_COLS dividing the words, tile rows the largest <= MAX_TILE_ROWS dividing rows.
    NotImplementedError where the bytes are not whole rows of >= 16 words."""
    words = n_bytes // 4
    cols = MAX_COLS
    while cols >= 16 and (n_bytes % 4 or words % cols):
        cols //= 2
    if cols < 16:
        raise NotImplementedError(f"{n_bytes} bytes are not whole rows of >= 16 32-bit words")
    rows = words // cols
    tile_rows = MAX_TILE_ROWS
    while rows % tile_rows:
        tile_rows //= 2
    return rows, cols, tile_rows


def grid_for(rows: int, tile_rows: int) -> tuple[int, int]:
    """(programs, tiles a program): the fewest tiles a program with at most MAX_PROGRAMS programs."""
    tiles = rows // tile_rows
    steps = next(s for s in range(1, tiles + 1) if tiles % s == 0 and tiles // s <= MAX_PROGRAMS)
    return tiles // steps, steps


def _kernel(w_ref, after_ref, o_ref, *, steps: int, tile_rows: int):
    del after_ref  # an ordering operand, never read

    def body(i, acc):
        tile = w_ref[pl.ds(i * tile_rows, tile_rows), :]
        return jnp.maximum(acc, jnp.max(tile))

    m = jax.lax.fori_loop(0, steps, body, jnp.int32(-(2 ** 31)))
    o_ref[...] = jnp.full(o_ref.shape, m, jnp.int32)


def read_words(words: jax.Array, after: jax.Array, *, num_warps: int = 4, interpret: bool = False) -> jax.Array:
    """words int32 [rows, cols] as `layout` gives them, after: any array of >= 16 elements (an
    ordering operand) -> token int32 [P, 16]: row p is the maximum word of program p's rows
    (every word is read once)."""
    rows, cols = words.shape
    if words.dtype != jnp.int32 or layout(words.size * 4)[:2] != (rows, cols):
        raise NotImplementedError(f"words must be int32 as `layout` lays them out, got {words.shape} {words.dtype}")
    tile_rows = layout(words.size * 4)[2]
    programs, steps = grid_for(rows, tile_rows)
    return pl.pallas_call(
        functools.partial(_kernel, steps=steps, tile_rows=tile_rows),
        out_shape=jax.ShapeDtypeStruct((programs, 16), jnp.int32),
        in_specs=[pl.BlockSpec((steps * tile_rows, cols), lambda p: (p, 0)), ORDER_SPEC],
        out_specs=pl.BlockSpec((1, 16), lambda p: (p, 0)),
        grid=(programs,), interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        name="read_ahead")(words, as_order_operand(after))
