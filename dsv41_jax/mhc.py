"""Hyper-connections (mHC): the residual stream as `hc` parallel copies mixed per token (SPEC §4).

Shapes: x [b, s, hc, d] bf16; mixes [b, s, (2 + hc) * hc] f32; pre/post [b, s, hc] f32;
comb [b, s, hc, hc] f32 (row i = source copy, column j = destination copy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.numerics import cast
from pallas_kernels.sinkhorn import api as sinkhorn_api


def hc_mixes(x: jax.Array, fn: jax.Array, scale: jax.Array, base: jax.Array, *, norm_eps: float,
             iters: int, hc_eps: float, implementation: str = "auto",
             interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per token: mixes = (fn @ u) * rsqrt(mean(u^2) + eps) over the flattened hc*d stream u, then
    the Sinkhorn split; returns (pre, post, comb), all f32. The site lives in the kernels' api
    (`pallas_kernels.sinkhorn.api.hc_mixes`: projection accumulated in float64 and rounded once,
    the Pallas split where `implementation` / `interpret` pick it, else the jnp reference)."""
    return sinkhorn_api.hc_mixes(x, fn, scale, base, norm_eps=norm_eps, iters=iters, hc_eps=hc_eps,
                                 implementation=implementation, interpret=interpret)


def hc_pre(x: jax.Array, pre_mix: jax.Array) -> jax.Array:
    """Collapse the copies: sum_i pre_mix[..., i] * x[..., i, :] in f32, cast to x.dtype. -> [b, s, d]"""
    return cast(jnp.sum(pre_mix[..., None] * x.astype(jnp.float32), axis=-2), x.dtype)


def hc_post(f: jax.Array, residual: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """out[..., j, :] = post[j] * f + sum_i comb[i, j] * residual[..., i, :], f32, cast to f.dtype.

    The contraction runs over the FIRST comb index: copy i feeds output copy j with comb[i][j].
    """
    y = post[..., None] * f[..., None, :].astype(jnp.float32)
    y = y + jnp.sum(comb[..., None] * residual[..., :, None, :].astype(jnp.float32), axis=-3)
    return cast(y, f.dtype)


# rows (b * s) up to which `hc_post_pre` forms the collapse from f and the residual again
RECOMPUTE_ROWS = 32


def hc_post_pre(f: jax.Array, residual: jax.Array, post: jax.Array, comb: jax.Array,
                pre: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(out, hc_pre(out, pre)) for out = hc_post(f, residual, post, comb): the new stream [b, s, hc,
    d] and the next sublayer's collapsed input [b, s, d], bit for bit the two calls.

    Up to RECOMPUTE_ROWS rows the collapse is formed from f and residual again rather than from
    out (post and comb pass an optimization barrier, so XLA keeps the two computations apart), so
    on GPUs its kernel does not wait for the kernel that writes the new stream: one launch fewer
    per sublayer on a decode step's chain of dependent launches at 1-32 rows (XLA then also
    repeats the small split-K sum of f's projection in both kernels). At 64 rows XLA writes that
    sum once for the two and the chain grows by one launch a layer instead, and for prefill the
    second read of the stream is not worth it (benchmarks/README.md, thirtieth session)."""
    out = hc_post(f, residual, post, comb)
    if f.shape[0] * f.shape[1] > RECOMPUTE_ROWS:
        return out, hc_pre(out, pre)
    post_, comb_ = jax.lax.optimization_barrier((post, comb))
    return out, hc_pre(hc_post(f, residual, post_, comb_), pre)


def identity_pre_mix(b: int, s: int, hc: int) -> jax.Array:
    """One-hot mix on copy 0, f32 [b, s, hc]: block 0's attention input is copy 0."""
    return jnp.zeros((b, s, hc), jnp.float32).at[..., 0].set(1.0)
