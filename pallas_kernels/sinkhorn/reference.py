"""Pure-jnp hyper-connection Sinkhorn split (SPEC §4.3): the oracle and the CPU path."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.numerics import exact_div
from pallas_kernels._dispatch import platform


def hc_split_sinkhorn(mixes: jax.Array, scale: jax.Array, base: jax.Array, *, hc: int, iters: int,
                      eps: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """mixes f32 [..., (2 + hc) * hc], scale f32 [3], base f32 [(2 + hc) * hc] ->
    pre f32 [..., hc], post f32 [..., hc], comb f32 [..., hc, hc].

    pre = sigmoid(m*s0 + b) + eps; post = 2 * sigmoid(m*s1 + b);
    comb = row-softmax(m*s2 + b) + eps, then one column normalisation, then (iters - 1) pairs of
    (row, column) normalisations, each dividing by (sum + eps). The order matters for parity.
    """
    m = mixes.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    base = base.astype(jnp.float32)
    eps = jnp.float32(eps)
    pre = jax.nn.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * jax.nn.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = m[..., 2 * hc:] * scale[2] + base[2 * hc:]
    c = logits.reshape(*logits.shape[:-1], hc, hc)
    c = jnp.exp(c - jnp.max(c, axis=-1, keepdims=True))
    # exact divisions: XLA otherwise multiplies by a reciprocal of the broadcast sums
    c = exact_div(c, jnp.sum(c, axis=-1, keepdims=True)) + eps
    c = exact_div(c, jnp.sum(c, axis=-2, keepdims=True) + eps)

    def body(_, c):
        c = exact_div(c, jnp.sum(c, axis=-1, keepdims=True) + eps)
        return exact_div(c, jnp.sum(c, axis=-2, keepdims=True) + eps)

    # unrolled on GPUs: with the rolled loop XLA:GPU ran the plain-jnp decode step of
    # benchmarks/model_speed.py at 3462 µs of device time but 7591 µs of wall time (on CPU the
    # rolled loop compiles faster and runs as fast)
    c = jax.lax.fori_loop(0, iters - 1, body, c, unroll=platform() == "gpu")
    return pre, post, c
