"""Dispatch for reading a weight ahead of its use (the one-row decode step's `wo_a`,
`Attention.read_ahead`).

At one row a projection's launch streams its weight from HBM, while the kernels before it (the
attention's RoPE, scores, softmax) move almost no bytes. `read_ahead(w, after)` launches a
kernel that reads all of `w`'s bytes once `after` is computed and returns its token, which the
projection's launch takes as an operand (never read): the reading runs beside the kernels
between `after` and the projection, which then finds its weight in L2 (50 MB on an H100 / H200),
if nothing evicts it first. Values never change: the token only orders launches (XLA would drop
a kernel whose result no launch takes, so the ordering travels as operands of the two kernels).

`implementation`: "pallas" / "auto" on a GPU run the kernel (`kernel_gpu.read_words`);
"reference", the CPU and TPUs launch nothing and get None (there is nothing to compute), as does
a matrix whose bytes are not whole rows of 16 words (logged).
"""

from __future__ import annotations

import logging
from typing import Literal

import jax
import jax.numpy as jnp

from pallas_kernels._dispatch import gpu_kernel
from pallas_kernels.prefetch import kernel_gpu

logger = logging.getLogger(__name__)

Implementation = Literal["auto", "reference", "pallas"]


def as_words(w: jax.Array) -> jax.Array:
    """An array of a dtype of <= 4 bytes -> its bytes as int32 [rows, cols] (`kernel_gpu.layout`;
    a reinterpretation, no arithmetic). NotImplementedError where they do not lay out so."""
    if w.dtype.itemsize > 4 or 4 % w.dtype.itemsize:
        raise NotImplementedError(f"dtype {w.dtype} does not pack into 32-bit words")
    rows, cols, _ = kernel_gpu.layout(w.size * w.dtype.itemsize)
    per_word = 4 // w.dtype.itemsize
    flat = w.reshape(-1, per_word) if per_word > 1 else w.reshape(-1)
    return jax.lax.bitcast_convert_type(flat, jnp.int32).reshape(rows, cols)


def read_ahead(w: jax.Array, after: jax.Array, *, implementation: Implementation = "auto",
               interpret: bool = False) -> jax.Array | None:
    """w (any dtype of <= 4 bytes), after (any array of >= 16 elements) -> a token int32 [P, 16]
    from a kernel that reads every byte of w and starts no earlier than `after` is computed, for
    the launch that uses w to take as its `after` operand (`fp8_matmul.grouped_linear`); None
    where nothing runs (not the GPU kernel path, or a shape it does not take)."""
    if not gpu_kernel(implementation, interpret, "read_ahead"):
        return None
    try:
        return kernel_gpu.read_words(as_words(w), after, interpret=interpret)
    except NotImplementedError as e:
        logger.warning("read_ahead: %s %s not read ahead (%s)", w.shape, w.dtype, e)
        return None
