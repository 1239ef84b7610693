"""Dispatch for the window-KV row of a decode step (`Attention.decode`): kv_norm, RoPE and FP8 QDQ
of the wkv projection's row, written into its ring slot.

`implementation`: "reference" (jnp: `rms_norm`, `apply_rope`, `act_quant_dequant`,
`cache.write_row`), "pallas" (the GPU kernel, one launch, for a one-row batch), "auto" (the kernel
on a GPU, the reference elsewhere). Other batches, and shapes the kernel does not take (logged),
run the reference.
"""

from __future__ import annotations

import logging
from typing import Literal

import jax

from pallas_kernels._dispatch import gpu_kernel
from pallas_kernels.window_kv import kernel_gpu
from pallas_kernels.window_kv import reference as _ref

logger = logging.getLogger(__name__)

Implementation = Literal["auto", "reference", "pallas"]


def write_window_row(ring: jax.Array, slot: jax.Array, kv: jax.Array, norm_weight: jax.Array, eps: float,
                     cos: jax.Array, sin: jax.Array, rope_dim: int, *, implementation: Implementation = "auto",
                     interpret: bool = False) -> jax.Array:
    """ring bf16 [b, W, hd], slot int [b], kv bf16 [b, hd] (the wkv row before kv_norm),
    norm_weight bf16 [hd], cos / sin f32 [b, rope_dim / 2] -> the ring with row
    `act_quant_dequant(rope(rms_norm(kv)))` at each slot (`reference.write_window_row`). On the
    kernel path a one-row batch runs `kernel_gpu.write_window_row` (only the order of the norm's
    sum of squares can differ)."""
    if kv.ndim != 2 or ring.ndim != 3 or ring.shape[0] != kv.shape[0] or ring.shape[2] != kv.shape[1]:
        raise ValueError(f"ring [b, W, hd] and kv [b, hd], got {ring.shape=} {kv.shape=}")
    if ring.shape[0] != 1 or not gpu_kernel(implementation, interpret, "window_kv_row"):
        return _ref.write_window_row(ring, slot, kv, norm_weight, eps, cos, sin, rope_dim)
    try:
        return kernel_gpu.write_window_row(ring, slot, kv, norm_weight, eps, cos, sin, rope_dim, interpret=interpret)
    except NotImplementedError as e:
        logger.warning("window_kv_row: kernel does not handle ring %s, kv %s (%s); using the reference",
                       ring.shape, kv.shape, e)
        return _ref.write_window_row(ring, slot, kv, norm_weight, eps, cos, sin, rope_dim)
