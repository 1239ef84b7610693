"""Dispatch for hc_pre + RMSNorm (SPEC §4.4 then §5's RMSNorm): the input of every attention and
FFN sublayer, `rms_norm(hc_pre(x, pre), w, eps)`.

`implementation`: "reference" (the model's two jnp steps), "pallas" (the GPU kernel), "auto" (the
kernel on a GPU, the reference elsewhere; no TPU kernel: a TPU runs the reference with a logged
warning). A shape the kernel does not take falls back to the reference with a logged warning.
The kernel and the reference share every rounding point; they may differ only in the order the
d squares of the norm are added (kernel_gpu.py). Gradients come from the reference (custom VJP).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax

from pallas_kernels._dispatch import gpu_kernel, split_batch
from pallas_kernels.hc_norm import kernel_gpu
from pallas_kernels.hc_norm import reference as _ref

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """block_d: columns of d per chunk (a power of 2; d need not be a multiple). num_warps:
    Triton warps per program (one token per program)."""
    block_d: int = 1024
    num_warps: int = 4


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fused(x, pre, w, eps, config):
    block_sizes, interpret = config
    return kernel_gpu.hc_pre_norm(x, pre, w, eps=eps, block_d=block_sizes.block_d,
                                  num_warps=block_sizes.num_warps, interpret=interpret)


def _fused_fwd(x, pre, w, eps, config):
    return _fused(x, pre, w, eps, config), (x, pre, w)


def _fused_bwd(eps, config, res, ct):
    return jax.vjp(lambda x, p, w: _ref.hc_pre_norm(x, p, w, eps), *res)[1](ct)


_fused.defvjp(_fused_fwd, _fused_bwd)


def hc_pre_norm(x: jax.Array, pre: jax.Array, w: jax.Array, eps: float, *, implementation: str = "auto",
                interpret: bool = False, block_sizes: BlockSizes | None = None) -> jax.Array:
    """x bf16 [..., hc, d] (the hyper-connection stream), pre f32 [..., hc], w bf16 [d] (the
    RMSNorm weight) -> bf16 [..., d] = rms_norm(bf16(sum_i pre[i] * x[i]), w, eps)."""
    *lead, hc, d = x.shape
    if tuple(pre.shape) != (*lead, hc):
        raise ValueError(f"hc_pre_norm: pre must be {(*lead, hc)} for x {x.shape}, got {pre.shape}")
    if w.shape != (d,):
        raise ValueError(f"hc_pre_norm: the norm weight must be [{d}], got {w.shape}")
    if not gpu_kernel(implementation, interpret, "hc_pre_norm"):
        return _ref.hc_pre_norm(x, pre, w, eps)
    bs = block_sizes or BlockSizes()
    t = math.prod(lead)

    def local(x2, pre2):  # per data shard on a mesh (split_batch): tokens are batch-major
        try:
            if x2.shape[0] == 0:
                raise NotImplementedError("zero tokens")
            jax.eval_shape(functools.partial(kernel_gpu.hc_pre_norm, eps=eps, block_d=bs.block_d,
                                             num_warps=bs.num_warps, interpret=interpret), x2, pre2, w)
        except NotImplementedError as e:
            logger.warning("hc_pre_norm: kernel does not handle x %s (%s); using the reference", x2.shape, e)
            return _ref.hc_pre_norm(x2, pre2, w, eps)
        return _fused(x2, pre2, w, float(eps), (bs, interpret))

    x2, pre2 = x.reshape(t, hc, d), pre.reshape(t, hc)
    out = split_batch(local, (x2, pre2), (True, True), "hc_pre_norm") if t else local(x2, pre2)
    return out.reshape(*lead, d)
