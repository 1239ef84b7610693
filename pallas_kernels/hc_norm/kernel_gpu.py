"""Pallas GPU (Triton lowering) kernel: hc_pre then RMSNorm for one token per program.

Per token (x [hc, d] bf16, pre [hc] f32, w [d] bf16), in `block_d`-wide chunks of d:
  pass 1: s = pre[0] * x[0] + pre[1] * x[1] + ... (fp32, in index order), rounded to bf16 (the
          hc_pre output), and the sum of its squares accumulated per lane;
  then    r = 1 / sqrt(sum / d + eps), a correctly rounded square root and division;
  pass 2: the bf16 s of each chunk is formed again (same operations, same bits; no store and
          reload) and y = bf16(w * (s * r)) stored.
One launch replaces XLA's hc_pre fusion, the mean-of-squares reduction and the reciprocal square
root (the scaled output then feeds the fp8 kernel, which quantises it itself).

Numerics: the products and sums of hc_pre and the scaling are single `mul.rn` / `add.rn`
instructions (never contracted into an FMA, as the reference computes them); the mean's division,
the square root and the reciprocal are `div.rn` / `sqrt.rn` (`_triton.rms_factor`). The one difference from the jnp path is the order in which
the d squares are added (per lane across chunks, then Triton's tree over lanes), which XLA does
not fix either. Interpret mode (CPU) runs the same steps as plain jnp operations (see `_Ops`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._triton import is_pow2, ptx_f32, rms_factor

_F32 = jnp.float32


class _Ops:
    """f32 arithmetic that compiles to exactly one IEEE round-to-nearest instruction each on the
    GPU (inline PTX, so nothing is contracted or approximated), plain jnp in interpret mode.
    XLA:CPU contracts p * x + s into an FMA (as it does in the jnp path), so at a cancelling
    sum an interpret-mode run can round hc_pre to the neighbouring bf16 value where the GPU
    kernel, like the reference's separate multiply and sum, does not."""

    def __init__(self, interpret: bool):
        self.interpret = interpret

    def mul(self, a, b):
        return a * b if self.interpret else ptx_f32("mul.rn.f32 $0, $1, $2;", a, b)

    def add(self, a, b):
        return a + b if self.interpret else ptx_f32("add.rn.f32 $0, $1, $2;", a, b)

    def bf16(self, a):
        """a rounded to bf16 (RNE), kept f32. XLA may drop an f32 -> bf16 -> f32 pair in
        interpret mode, so there the rounding is explicit."""
        if self.interpret:
            return jax.lax.reduce_precision(a, exponent_bits=8, mantissa_bits=7)
        return a.astype(jnp.bfloat16).astype(_F32)


def _kernel(x_ref, pre_ref, w_ref, o_ref, *, hc: int, d: int, block_d: int, eps: float, interpret: bool):
    # x_ref [t, hc * d] bf16; pre_ref [t, hc] f32; w_ref [d] bf16; o_ref [t, d] bf16
    tok = pl.program_id(0)
    ops = _Ops(interpret)
    pre = [jnp.full((block_d,), pre_ref[tok, i], _F32) for i in range(hc)]
    n_chunks = pl.cdiv(d, block_d)

    def collapsed(c):
        cols = c * block_d + jnp.arange(block_d, dtype=jnp.int32)
        live = cols < d
        s = None
        for i in range(hc):
            xi = plgpu.load(x_ref.at[tok, pl.ds(i * d + c * block_d, block_d)], mask=live, other=0.0).astype(_F32)
            p = ops.mul(pre[i], xi)
            s = p if s is None else ops.add(s, p)
        return ops.bf16(s), live

    def squares(c, acc):
        s, _ = collapsed(c)
        return ops.add(acc, ops.mul(s, s))

    acc = jax.lax.fori_loop(0, n_chunks, squares, jnp.zeros((block_d,), _F32))
    r = rms_factor(jnp.broadcast_to(jnp.sum(acc), (block_d,)), d, eps, interpret)

    def scaled(c, carry):
        s, live = collapsed(c)
        w = plgpu.load(w_ref.at[pl.ds(c * block_d, block_d)], mask=live, other=0.0).astype(_F32)
        y = ops.mul(w, ops.mul(s, r))
        plgpu.store(o_ref.at[tok, pl.ds(c * block_d, block_d)], y.astype(jnp.bfloat16), mask=live)
        return carry

    jax.lax.fori_loop(0, n_chunks, scaled, 0)


def hc_pre_norm(x: jax.Array, pre: jax.Array, w: jax.Array, *, eps: float, block_d: int, num_warps: int,
                interpret: bool) -> jax.Array:
    """x bf16 [t, hc, d], pre f32 [t, hc], w bf16 [d] -> bf16 [t, d]; one program per token.

    Raises NotImplementedError for what the kernel does not take (the caller falls back)."""
    t, hc, d = x.shape
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise NotImplementedError(f"bf16 stream and weight only, got {x.dtype=} {w.dtype=}")
    if not is_pow2(block_d) or block_d < 32:
        raise NotImplementedError(f"block_d must be a power of 2 >= 32, got {block_d=}")
    if t * hc * d >= 2**31:
        raise NotImplementedError(f"stream too large for int32 element offsets ({x.shape=})")
    kernel = functools.partial(_kernel, hc=hc, d=d, block_d=block_d, eps=float(eps), interpret=interpret)
    whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((t, d), jnp.bfloat16),
        grid=(t,),
        in_specs=[whole((t, hc * d)), whole((t, hc)), whole((d,))],
        out_specs=whole((t, d)),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="hc_pre_norm",
    )(x.reshape(t, hc * d), pre.astype(_F32), w)
