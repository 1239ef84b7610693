"""The oracle of the fused hc_pre + RMSNorm kernel: the model's own two steps, in order."""

from __future__ import annotations

import jax

from dsv41_jax.layers import rms_norm
from dsv41_jax.mhc import hc_pre


def hc_pre_norm(x: jax.Array, pre: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """x bf16 [..., hc, d], pre f32 [..., hc], w bf16 [d] -> bf16 [..., d] =
    rms_norm(bf16(sum_i pre[i] * x[i]), w, eps)."""
    return rms_norm(hc_pre(x, pre), w, eps)
