"""Pallas GPU (Triton lowering) kernel for the indexer's scores (SPEC §5.7).

One program: a block of `block_s` query rows of one batch row against a block of `block_t` keys.
For each index head in order it forms the [block_s, block_t] dots on the tensor cores (bf16
operands, f32 sums), rounds them to bf16, applies relu, multiplies by the head's weight (bf16;
the product exact in f32) and rounds that to bf16, and adds it to an f32 accumulator; the head
sum is rounded to bf16 once and written. The reference's steps, with the per-head dots kept in
registers: XLA writes them to memory as f32 [b, s, h, t] (2 GiB at a 4096-token prefill of a
ratio-1 layer) before its head sum reads them back. What may differ from the reference: the
order of each dot's f32 sums (the MMA's) and of the head sum (heads in index order).

A decode call (one query row a batch row) takes another layout: one program is a batch row's
`block_t` keys, and a single dot of all heads [h, d] x [d, block_t] gives every head's scores at
once (heads padded to 16 with zero queries and weights, whose terms are +0); the head sum is a
reduction over the tile's rows (Triton's tree order). The row layout would pad each query row to
16 and loop over the heads with 16-row dots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._triton import round_bf16_f32


def _weighted(dots: jax.Array, w: jax.Array, interpret: bool) -> jax.Array:
    """f32 dots [r, c], f32 head weights [r, 1] -> round_bf16(relu(round_bf16(dots)) * w) (f32)."""
    return round_bf16_f32(jnp.maximum(round_bf16_f32(dots, interpret), 0.0) * w, interpret)


def _kernel(q_ref, k_ref, w_ref, o_ref, *, heads: int, interpret: bool):
    # q_ref [block_s, heads, d] bf16, k_ref [block_t, d] bf16, w_ref [block_s, heads] bf16,
    # o_ref [block_s, block_t] bf16
    k = k_ref[...]

    def head(i, acc):
        dots = jnp.dot(q_ref[:, i, :], k.T, preferred_element_type=jnp.float32)  # [block_s, block_t]
        return acc + _weighted(dots, w_ref[:, i].astype(jnp.float32)[:, None], interpret)

    acc = jax.lax.fori_loop(0, heads, head, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(jnp.bfloat16)


def _kernel_one_row(q_ref, k_ref, w_ref, o_ref, *, interpret: bool):
    # q_ref [hp, d] bf16, k_ref [block_t, d] bf16, w_ref [hp] bf16, o_ref [block_t] bf16
    dots = jnp.dot(q_ref[...], k_ref[...].T, preferred_element_type=jnp.float32)  # [hp, block_t]
    prod = _weighted(dots, w_ref[...].astype(jnp.float32)[:, None], interpret)
    o_ref[...] = jnp.sum(prod, axis=0).astype(jnp.bfloat16)


def _index_scores_one_row(q, k, w, *, block_t: int, num_warps: int, num_stages: int, interpret: bool):
    """q bf16 [b, 1, h, d]; k bf16 [b, tp, d] (tp a multiple of block_t); w bf16 [b, 1, h] -> bf16 [b, 1, tp]."""
    b, _, h, d = q.shape
    tp = k.shape[1]
    hp = max(h, 16)  # a tensor-core dot's least rows
    if hp != h:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, hp - h), (0, 0)))
        w = jnp.pad(w, ((0, 0), (0, 0), (0, hp - h)))
    return pl.pallas_call(
        functools.partial(_kernel_one_row, interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((b, 1, tp), jnp.bfloat16),
        grid=(b, tp // block_t),
        in_specs=[pl.BlockSpec((None, None, hp, d), lambda i, n: (i, 0, 0, 0)),
                  pl.BlockSpec((None, block_t, d), lambda i, n: (i, n, 0)),
                  pl.BlockSpec((None, None, hp), lambda i, n: (i, 0, 0))],
        out_specs=pl.BlockSpec((None, None, block_t), lambda i, n: (i, 0, n)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="index_scores_one_row")(q, k, w)


def index_scores(q: jax.Array, k: jax.Array, w: jax.Array, *, block_s: int, block_t: int, num_warps: int,
                 num_stages: int, interpret: bool) -> jax.Array:
    """q bf16 [b, s, h, d]; k bf16 [b, t, d]; w bf16 [b, s, h] -> bf16 [b, s, t] (module doc).

    Rows and keys are padded to whole blocks (the padding's scores are dropped). Raises
    NotImplementedError for shapes the Triton lowering cannot take (the caller falls back)."""
    b, s, h, d = q.shape
    t = k.shape[1]
    if any(v < 16 or v & (v - 1) for v in (block_s, block_t, d)):
        raise NotImplementedError(f"block_s, block_t and head_dim must be powers of 2 >= 16, got "
                                  f"{block_s=}, {block_t=}, {d=}")
    if h < 1 or h & (h - 1):
        raise NotImplementedError(f"heads must be a power of 2 for Triton tiles, got {h=}")
    if s == 0 or t == 0:
        raise NotImplementedError(f"empty operand ({s=}, {t=})")
    tp = pl.cdiv(t, block_t) * block_t
    if tp != t:
        k = jnp.pad(k, ((0, 0), (0, tp - t), (0, 0)))
    if s == 1:
        return _index_scores_one_row(q, k, w, block_t=block_t, num_warps=num_warps, num_stages=num_stages,
                                     interpret=interpret)[:, :, :t]
    sp = pl.cdiv(s, block_s) * block_s
    if sp != s:
        q = jnp.pad(q, ((0, 0), (0, sp - s), (0, 0), (0, 0)))
        w = jnp.pad(w, ((0, 0), (0, sp - s), (0, 0)))
    out = pl.pallas_call(
        functools.partial(_kernel, heads=h, interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((b, sp, tp), jnp.bfloat16),
        grid=(b, sp // block_s, tp // block_t),
        in_specs=[pl.BlockSpec((None, block_s, h, d), lambda i, j, n: (i, j, 0, 0)),
                  pl.BlockSpec((None, block_t, d), lambda i, j, n: (i, n, 0)),
                  pl.BlockSpec((None, block_s, h), lambda i, j, n: (i, j, 0))],
        out_specs=pl.BlockSpec((None, block_s, block_t), lambda i, j, n: (i, j, n)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="index_scores")(q, k, w)
    return out[:, :s, :t]
