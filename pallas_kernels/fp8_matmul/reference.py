"""jnp reference for the dense fp8 matmul: the XLA path of `dsv41_jax.quant.linear_fp8` after the
activation quantiser.

w e4m3 [N, K] with e8m0 scales [ceil(N/32), ceil(K/32)] (one per 32 x 32 block) is widened to
bf16 (exact; on an accelerator XLA writes the widened matrix to HBM before a GEMM) and multiplied
by bf16 rows x [M, K] already act-quantised (exact e4m3 x power-of-two values): every product is
exact in fp32, the dot accumulates in fp32 and rounds once to bf16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax import quant
from dsv41_jax.numerics import to_bf16


def fp8_matmul(x: jax.Array, w: jax.Array, s: jax.Array) -> jax.Array:
    """x bf16 [M, K] (act-quantised rows), w e4m3 [N, K], s e8m0 [ceil(N/32), ceil(K/32)]
    -> bf16 [M, N]."""
    wd = quant.dequant_fp8_weight(w, s, jnp.bfloat16)
    y = jax.lax.dot_general(x.astype(jnp.bfloat16), wd, (((1,), (1,)), ((), ())),
                            precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return to_bf16(y)


def grouped(x: jax.Array, w: jax.Array, s: jax.Array) -> jax.Array:
    """x bf16 [..., G, K] (not quantised), w e4m3 [G*R, K], s e8m0 [G*R/32, ceil(K/32)] -> bf16
    [..., G, R]: `grouped_dense` of the widened matrix."""
    return grouped_dense(x, quant.dequant_fp8_weight(w, s, jnp.bfloat16))


def grouped_dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x bf16 [..., G, K], w bf16 [G*R, K] -> bf16 [..., G, R]: group g of x times rows
    [g*R, (g+1)*R) of w (block-diagonal), one bf16 einsum with fp32 accumulation (bf16 x bf16
    products are exact in fp32), one rounding."""
    g = x.shape[-2]
    wg = w.reshape(g, w.shape[0] // g, w.shape[1])
    return to_bf16(jnp.einsum("...gd,grd->...gr", x.astype(jnp.bfloat16), wg, preferred_element_type=jnp.float32))
