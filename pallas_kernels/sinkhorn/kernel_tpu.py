"""Pallas TPU (Mosaic) kernel for the hyper-connection Sinkhorn split (SPEC §4.3).

Layout: tokens on the 128-wide lane axis. The wrapper transposes mixes to [n_mix, t] (padded to a
whole number of token blocks), so each mix is one (1, block_tokens) row of the VMEM block and the
4x4 comb matrix is 16 such rows: every row and column sum of the Sinkhorn iterations is an
element-wise vector add, with no cross-lane reduction. scale and base are scalars in SMEM.
Outputs come back as [hc, t] / [hc * hc, t] and are transposed to the caller's layout.

Numerics mirror the reference op for op (sigmoid as 1 / (1 + exp(-x)), sums over 4 in index order,
division by (sum + eps)); Mosaic's f32 divide and exp are the TPU's, so results can differ from the
CPU oracle by a few ulps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _kernel(scale_ref, base_ref, m_ref, *rest, hc: int, iters: int, eps: float, has_rms: bool):
    # scale_ref [3], base_ref [n_mix] (SMEM); m_ref [n_mix, bt] f32; rms_ref [1, bt] (optional)
    # outputs: pre_ref [hc, bt], post_ref [hc, bt], comb_ref [hc * hc, bt]
    if has_rms:
        rms_ref, pre_ref, post_ref, comb_ref = rest
        rms = rms_ref[...]
    else:
        pre_ref, post_ref, comb_ref = rest
        rms = None

    def mix(j):
        x = m_ref[j:j + 1, :]  # [1, bt]
        return x * rms if has_rms else x

    s0, s1, s2 = scale_ref[0], scale_ref[1], scale_ref[2]
    for i in range(hc):
        pre_ref[i:i + 1, :] = 1.0 / (1.0 + jnp.exp(-(mix(i) * s0 + base_ref[i]))) + eps
    for i in range(hc):
        post_ref[i:i + 1, :] = 2.0 * (1.0 / (1.0 + jnp.exp(-(mix(hc + i) * s1 + base_ref[hc + i]))))

    c = [[mix(2 * hc + i * hc + j) * s2 + base_ref[2 * hc + i * hc + j] for j in range(hc)]
         for i in range(hc)]

    def rsum(v):
        s = v[0]
        for x in v[1:]:
            s = s + x
        return s

    def norm_rows(c, add_eps):
        r = [rsum(c[i]) for i in range(hc)]
        return [[c[i][j] / (r[i] + eps if add_eps else r[i]) for j in range(hc)] for i in range(hc)]

    def norm_cols(c):
        s = [rsum([c[i][j] for i in range(hc)]) for j in range(hc)]
        return [[c[i][j] / (s[j] + eps) for j in range(hc)] for i in range(hc)]

    mx = [functools.reduce(jnp.maximum, c[i]) for i in range(hc)]
    c = [[jnp.exp(c[i][j] - mx[i]) for j in range(hc)] for i in range(hc)]
    c = norm_rows(c, add_eps=False)
    c = norm_cols([[x + eps for x in row] for row in c])

    def body(_, flat):
        c = [list(flat[i * hc:(i + 1) * hc]) for i in range(hc)]
        c = norm_cols(norm_rows(c, add_eps=True))
        return tuple(x for row in c for x in row)

    flat = jax.lax.fori_loop(0, iters - 1, body, tuple(x for row in c for x in row))
    for k in range(hc * hc):
        comb_ref[k:k + 1, :] = flat[k]


def hc_split_sinkhorn(mixes: jax.Array, scale: jax.Array, base: jax.Array, rms: jax.Array | None, *,
                      hc: int, iters: int, eps: float, block_tokens: int,
                      interpret: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Same contract as kernel_gpu.hc_split_sinkhorn: mixes f32 [t, n_mix], rms f32 [t] or None ->
    pre [t, hc], post [t, hc], comb [t, hc * hc], f32."""
    t, n_mix = mixes.shape
    if block_tokens % 128:
        raise NotImplementedError(f"block_tokens must be a multiple of 128 lanes on TPU, got {block_tokens=}")
    bt = min(block_tokens, pl.cdiv(t, 128) * 128)
    tp = pl.cdiv(t, bt) * bt
    m_t = jnp.pad(mixes.T, ((0, 0), (0, tp - t)))  # [n_mix, tp]
    has_rms = rms is not None
    args = [scale, base, m_t]
    in_specs = [pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.SMEM),
                pl.BlockSpec((n_mix, bt), lambda i: (0, i))]
    if has_rms:
        args.append(jnp.pad(rms, (0, tp - t))[None, :])
        in_specs.append(pl.BlockSpec((1, bt), lambda i: (0, i)))
    out_shape = (jax.ShapeDtypeStruct((hc, tp), jnp.float32), jax.ShapeDtypeStruct((hc, tp), jnp.float32),
                 jax.ShapeDtypeStruct((hc * hc, tp), jnp.float32))
    out_specs = (pl.BlockSpec((hc, bt), lambda i: (0, i)), pl.BlockSpec((hc, bt), lambda i: (0, i)),
                 pl.BlockSpec((hc * hc, bt), lambda i: (0, i)))
    pre, post, comb = pl.pallas_call(
        functools.partial(_kernel, hc=hc, iters=iters, eps=float(eps), has_rms=has_rms),
        out_shape=out_shape, grid=(tp // bt,), in_specs=in_specs, out_specs=out_specs,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret, name="hc_split_sinkhorn")(*args)
    return pre[:, :t].T, post[:, :t].T, comb[:, :t].T
