"""Dispatch for the hyper-connection Sinkhorn split (SPEC §4.3) and its call site `hc_mixes` (§4.2).

`implementation`: "reference" (pure jnp, the oracle), "pallas" (the kernel for `target`), or "auto"
(the kernel on GPU/TPU, the reference on CPU). A shape the kernel does not handle falls back to the
reference with a logged warning naming the shape and the reason; bad arguments raise ValueError
before anything is traced into a kernel. Gradients always come from the reference math
(custom VJP), so the kernel is a drop-in forward replacement.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Literal

import jax
import jax.numpy as jnp

from dsv41_jax.numerics import mean, reciprocal_sqrt
from pallas_kernels._dispatch import platform, split_batch
from pallas_kernels._dispatch import resolve as _resolve
from pallas_kernels.sinkhorn import kernel_gpu, kernel_tpu
from pallas_kernels.sinkhorn import reference as _ref

logger = logging.getLogger(__name__)

Implementation = Literal["auto", "reference", "pallas"]
Target = Literal["gpu", "tpu"]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles of the split kernel. block_tokens: tokens per program (GPU: a power of 2, one token
    per thread; TPU: a multiple of the 128 lanes). num_warps: Triton warps per program (GPU).
    division (GPU): "rcp_fma" (one correctly rounded reciprocal per sum, then an FMA-corrected
    product per element) or "div_rn" (one div.rn.f32 per element); both give IEEE quotients.
    None: "div_rn" with `lanes` (each lane divides once: 4.7 against 5.2 us a call at 1 and 64
    tokens on an H200), else "rcp_fma" (one reciprocal for a token's four quotients: 10.1
    against 21.2 us).
    lanes (GPU): one comb entry per lane (kernel_gpu's docstring), `lane_tokens` tokens a program
    with hc * hc * lane_tokens / 32 warps; the same bits as one token per lane."""
    block_tokens: int = 128
    num_warps: int = 4
    division: str | None = None
    lanes: bool = True
    lane_tokens: int = 8

    def gpu_launch(self, hc: int) -> tuple[int, int, str]:
        """(tokens a program, warps, division) of the GPU kernel for hc copies."""
        if self.lanes:
            return self.lane_tokens, max(1, min(8, hc * hc * self.lane_tokens // 32)), self.division or "div_rn"
        return self.block_tokens, self.num_warps, self.division or "rcp_fma"

    @classmethod
    def get_default(cls, target: Target) -> BlockSizes:
        return cls(block_tokens=128 if target == "gpu" else 512)


def _validate(mixes, scale, base, hc, iters, eps):
    if not isinstance(hc, int) or hc < 1:
        raise ValueError(f"hc must be a positive int, got {hc=}")
    n_mix = (2 + hc) * hc
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be an int >= 1, got {iters=}")
    if mixes.ndim < 1 or mixes.shape[-1] != n_mix:
        raise ValueError(f"mixes must be [..., (2 + hc) * hc = {n_mix}], got {mixes.shape=} with {hc=}")
    if scale.shape != (3,):
        raise ValueError(f"scale must be [3], got {scale.shape=}")
    if base.shape != (n_mix,):
        raise ValueError(f"base must be [{n_mix}], got {base.shape=}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps=}")


def _kernel_split(mixes2d, scale, base, rms, *, hc, iters, eps, target, block_sizes, interpret):
    if target == "gpu":
        bt, warps, division = block_sizes.gpu_launch(hc)
        return kernel_gpu.hc_split_sinkhorn(
            mixes2d, scale, base, rms, hc=hc, iters=iters, eps=eps, block_tokens=bt, num_warps=warps,
            division=division, interpret=interpret, lanes=block_sizes.lanes)
    return kernel_tpu.hc_split_sinkhorn(mixes2d, scale, base, rms, hc=hc, iters=iters, eps=eps,
                                        block_tokens=block_sizes.block_tokens, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _split(mixes2d, scale, base, rms, config):
    """Kernel forward; the backward differentiates the reference (rms: None or [t])."""
    hc, iters, eps, target, block_sizes, interpret = config
    return _kernel_split(mixes2d, scale, base, rms, hc=hc, iters=iters, eps=eps, target=target,
                         block_sizes=block_sizes, interpret=interpret)


def _split_fwd(mixes2d, scale, base, rms, config):
    return _split(mixes2d, scale, base, rms, config), (mixes2d, scale, base, rms)


def _split_bwd(config, res, cts):
    hc, iters, eps = config[:3]

    def ref(m, s, b, r):
        m = m if r is None else m * r[:, None]
        pre, post, comb = _ref.hc_split_sinkhorn(m, s, b, hc=hc, iters=iters, eps=eps)
        return pre, post, comb.reshape(comb.shape[0], hc * hc)

    return jax.vjp(ref, *res)[1](cts)


_split.defvjp(_split_fwd, _split_bwd)


def hc_split_sinkhorn(mixes: jax.Array, scale: jax.Array, base: jax.Array, *, hc: int, iters: int, eps: float,
                      rms: jax.Array | None = None, implementation: Implementation = "auto",
                      target: Target | None = None, block_sizes: BlockSizes | None = None,
                      interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """mixes f32 [..., (2 + hc) * hc], scale f32 [3], base f32 [(2 + hc) * hc] ->
    pre f32 [..., hc], post f32 [..., hc], comb f32 [..., hc, hc]; the reference's math and order
    (`reference.hc_split_sinkhorn`). rms: None, or f32 [...] multiplying the mixes first (the RMS
    factor of the site; the kernel fuses the multiply).

    target: which kernel ("gpu" Triton, "tpu" Mosaic); defaults to the default backend's (GPU on
    CPU, for interpret-mode runs). interpret: run the kernel in Pallas interpret mode (CPU tests).
    """
    if rms is not None and rms.shape != mixes.shape[:-1]:
        raise ValueError(f"rms must be [{mixes.shape[:-1]}] (one factor per token), got {rms.shape=}")
    return _dispatch(mixes, scale, base, rms, hc=hc, iters=iters, eps=eps, implementation=implementation,
                     target=target, block_sizes=block_sizes, interpret=interpret)


def _dispatch(mixes, scale, base, rms, *, hc, iters, eps, implementation, target, block_sizes, interpret):
    """rms: None, or the per-token RMS factor [...] that multiplies the mixes first (hc_mixes)."""
    _validate(mixes, scale, base, hc, iters, eps)
    use_kernel, target = _resolve(implementation, target, interpret)
    lead = mixes.shape[:-1]
    t = 1
    for n in lead:
        t *= n

    def reference(mixes, rms, scale=scale, base=base):
        m = mixes if rms is None else mixes * rms[..., None]
        return _ref.hc_split_sinkhorn(m, scale, base, hc=hc, iters=iters, eps=eps)

    if not use_kernel:
        return reference(mixes, rms)
    bs = block_sizes or BlockSizes.get_default(target)
    mixes2d = mixes.astype(jnp.float32).reshape(t, mixes.shape[-1])
    rms1d = None if rms is None else rms.astype(jnp.float32).reshape(t)
    scale32, base32 = scale.astype(jnp.float32), base.astype(jnp.float32)
    config = (hc, iters, float(eps), target, bs, interpret)

    def kernel(mixes2d, rms1d):  # per data shard on a mesh (split_batch)
        try:
            if mixes2d.shape[0] == 0:
                raise NotImplementedError("zero tokens")
            # trace the kernel once here so an unsupported case surfaces before custom_vjp wraps it
            jax.eval_shape(functools.partial(_kernel_split, hc=hc, iters=iters, eps=float(eps), target=target,
                                             block_sizes=bs, interpret=interpret), mixes2d, scale32, base32, rms1d)
        except NotImplementedError as e:
            logger.warning("hc_split_sinkhorn: %s kernel does not handle mixes %s (%s); using the reference",
                           target, mixes2d.shape, e)
            return reference(mixes2d, rms1d, scale32, base32)
        return _split(mixes2d, scale32, base32, rms1d, config)

    # tokens are batch-major, so the flattened rows split over `data` as the batch does
    pre, post, comb = split_batch(kernel, (mixes2d, rms1d), (True, True), "hc_split_sinkhorn") if t else \
        kernel(mixes2d, rms1d)
    return pre.reshape(*lead, hc), post.reshape(*lead, hc), comb.reshape(*lead, hc, hc)


def hc_mixes(x: jax.Array, fn: jax.Array, scale: jax.Array, base: jax.Array, *, norm_eps: float, iters: int,
             hc_eps: float, implementation: Implementation = "auto", target: Target | None = None,
             block_sizes: BlockSizes | None = None, interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The whole Sinkhorn site (SPEC §4.2): x [b, s, hc, d] -> (pre, post, comb), f32.

    mixes = (fn @ u) * rsqrt(mean(u^2) + norm_eps) over the flattened stream u = x [b, s, hc * d];
    the projection (`project_rounded_once`) and the mean of squares
    stay in XLA; the kernel applies the RMS factor and the split in one launch (the reference path
    multiplies first: the same f32 product). This is the model's site (`dsv41_jax.mhc.hc_mixes`
    calls it).
    Gradients (also on the kernel path) come from the reference math.
    """
    b, s, hc, d = x.shape
    n_mix = (2 + hc) * hc
    if fn.shape != (n_mix, hc * d):
        raise ValueError(f"fn must be [{n_mix}, {hc * d}] for x {x.shape}, got {fn.shape=}")
    u = x.reshape(b, s, hc * d).astype(jnp.float32)
    rsqrt = reciprocal_sqrt(mean(jnp.square(u), axis=-1) + jnp.float32(norm_eps))  # [b, s]
    proj = project_rounded_once(u, fn.astype(jnp.float32))
    return _dispatch(proj, scale, base, rsqrt, hc=hc, iters=iters, eps=hc_eps, implementation=implementation,
                     target=target, block_sizes=block_sizes, interpret=interpret)


def project_rounded_once(u: jax.Array, fn: jax.Array) -> jax.Array:
    """u f32 [b, s, K] @ fn^T f32 [m, K] -> f32 [b, s, m], accumulated in float64 and rounded once,
    as the reference's fp32 linear is evaluated (the 20480-long sum otherwise moves the mixes by an
    fp32 ulp, enough to flip a bf16 rounding of the stream now and then). TPUs have no float64:
    there the sum stays fp32 (HIGHEST).

    The dot takes float64 copies of both operands. Asking a dot of the f32 operands for a float64
    result (`preferred_element_type`) avoids the copy of the stream (671 MB a site in a
    4096-token prefill at the released width; 1% of that prefill on an H100) and is exact on the
    CPU, but XLA:GPU compiles it (jax 0.10.2, for an H100) to a Triton GEMM that accumulates in
    f32 (`fma.rn.f32`) and only converts the sums to float64, which is the f32 sum this function
    exists to avoid; with float64 operands it runs float64 MMA (`mma.sync ... f64`)
    (benchmarks/README.md, forty-third session)."""
    if platform() == "tpu":
        return jnp.einsum("bsk,mk->bsm", u, fn, precision=jax.lax.Precision.HIGHEST)
    with jax.enable_x64(True):
        y = jax.lax.dot_general(u.astype(jnp.float64), fn.astype(jnp.float64), (((2,), (1,)), ((), ())),
                                precision=jax.lax.Precision.HIGHEST)
        return y.astype(jnp.float32)
