"""Basic layers shared by every block: Linear (fp8 / fp4 / bf16 / fp32), RMSNorm, Embedding, RoPE.

Parameter names equal the reference's (`weight`, `scale`), so a hub tensor `X.weight` / `X.scale`
lands on `X.weight` / `X.scale` of the module tree. Quantised weights stay quantised in the state;
they are widened only inside the matmul: by XLA (`dsv41_jax.quant.linear_fp8`) or, for fp8 at few
rows on a GPU, inside the Pallas kernel (`pallas_kernels.fp8_matmul`), as `kernels` picks.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax import quant
from dsv41_jax.config import QUANT_BLOCK, ceil_div
from dsv41_jax.numerics import cast, rms_norm
from pallas_kernels.fp8_matmul import api as fp8_matmul

WeightDtype = Literal["fp8", "fp4", "bf16", "fp32"]

_PLAIN = {"bf16": jnp.bfloat16, "fp32": jnp.float32}


class Linear(nnx.Module):
    """y = x @ W^T, computed as the reference's `linear()` dispatch (SPEC §3).

    fp8: weight e4m3 [*stack, out, in], scale e8m0 [*stack, ceil(out/32), ceil(in/32)].
    fp4: weight int8 [*stack, out, in/2] (two e2m1 codes per byte, even element low nibble),
         scale e8m0 [*stack, out, in/32].
    bf16 / fp32: weight [*stack, out, in], no scale.
    `stack` adds leading axes (e.g. the routed experts [E, ...]); `__call__` then expects the
    caller to have selected one slice (see `weights_for`).
    `kernels` / `kernels_interpret` (the ModelArgs fields): the fp8 matmul's implementation
    ("auto": the Pallas kernel on a GPU for few rows, XLA otherwise; pallas_kernels/fp8_matmul).
    """

    def __init__(self, in_features: int, out_features: int, dtype: WeightDtype = "fp8", stack: tuple[int, ...] = (),
                 *, kernels: str = "reference", kernels_interpret: bool = False):
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.kernels, self.kernels_interpret = kernels, kernels_interpret
        stack = tuple(stack)
        if dtype == "fp8":
            self.weight = nnx.Param(jnp.zeros((*stack, out_features, in_features), jnp.float8_e4m3fn))
            self.scale = nnx.Param(
                jnp.ones((*stack, ceil_div(out_features, QUANT_BLOCK), ceil_div(in_features, QUANT_BLOCK)), jnp.float8_e8m0fnu)
            )
        elif dtype == "fp4":
            if in_features % QUANT_BLOCK:
                raise ValueError(f"fp4 Linear needs in_features % {QUANT_BLOCK} == 0, got {in_features}")
            self.weight = nnx.Param(jnp.zeros((*stack, out_features, in_features // 2), jnp.int8))
            self.scale = nnx.Param(jnp.ones((*stack, out_features, in_features // QUANT_BLOCK), jnp.float8_e8m0fnu))
        elif dtype in _PLAIN:
            self.weight = nnx.Param(jnp.zeros((*stack, out_features, in_features), _PLAIN[dtype]))
            self.scale = None
        else:
            raise ValueError(f"Linear dtype must be fp8/fp4/bf16/fp32, got {dtype!r}")

    def __call__(self, x: jax.Array) -> jax.Array:
        return apply_linear(x, self.weight[...], None if self.scale is None else self.scale[...], self.dtype,
                            kernels=self.kernels, interpret=self.kernels_interpret)


def linear_kernels(args) -> dict:
    """The kernel choice of an fp8 `Linear`, from a ModelArgs (`kernels`, `kernels_interpret`)."""
    return {"kernels": args.kernels, "kernels_interpret": args.kernels_interpret}


def apply_linear(x: jax.Array, w: jax.Array, s: jax.Array | None, dtype: WeightDtype, *,
                 kernels: str = "reference", interpret: bool = False) -> jax.Array:
    """The reference's dispatch on the weight dtype.

    fp8/fp4: activation quantised to e4m3 per 32 along K, block-scaled matmul, bf16 out (fp8:
    through `pallas_kernels.fp8_matmul.linear` unless `kernels` is "reference").
    bf16/fp32: plain x @ W^T in the promoted dtype of (x, W), fp32 accumulation.
    """
    if dtype == "fp8":
        if kernels != "reference" and w.ndim == 2:
            return fp8_matmul.linear(x, w, s, implementation=kernels, interpret=interpret)
        return quant.linear_fp8(x, w, s)
    if dtype == "fp4":
        return quant.linear_fp4(x, w, s)
    out_dtype = jnp.promote_types(x.dtype, w.dtype)
    y = jax.lax.dot_general(
        x.astype(out_dtype), w.astype(out_dtype), (((x.ndim - 1,), (w.ndim - 1,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
    )
    return cast(y, out_dtype)


def apply_linears(x: jax.Array, linears: tuple[Linear, ...], norm: RMSNorm | None = None) -> tuple[jax.Array, ...]:
    """tuple(lin(x) for lin in linears), or of lin(norm(x)) with `norm`; fp8 matrices of the
    same input in one kernel launch where the fp8 kernel runs (`fp8_matmul.linear_many`: the
    rows quantised once, a single row normalised there too, the weights streamed together; its K
    splits are picked for the combined grid, so on that path a result may differ from its own
    call only in the order of its fp32 sums). Other dtypes, the reference path and stacked
    weights: the norm, then one call each."""
    lead = linears[0]
    fused = (len(linears) > 1 or norm is not None) and lead.kernels != "reference" and all(
        lin.dtype == "fp8" and lin.weight.ndim == 2 and lin.in_features == lead.in_features
        and (lin.kernels, lin.kernels_interpret) == (lead.kernels, lead.kernels_interpret) for lin in linears)
    if not fused:
        x = x if norm is None else norm(x)
        return tuple(lin(x) for lin in linears)
    return fp8_matmul.linear_many(x, tuple(lin.weight[...] for lin in linears),
                                  tuple(lin.scale[...] for lin in linears), implementation=lead.kernels,
                                  interpret=lead.kernels_interpret,
                                  norm_weight=None if norm is None else norm.weight[...],
                                  norm_eps=None if norm is None else norm.eps)


class RMSNorm(nnx.Module):
    """y = w * x / sqrt(mean(x^2) + eps), in fp32, cast back to x.dtype. weight bf16 [dim]."""

    def __init__(self, dim: int, eps: float, dtype=jnp.bfloat16):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


class Embedding(nnx.Module):
    """Token embedding: weight bf16 [vocab, dim]; ids [...] -> [..., dim] bf16."""

    def __init__(self, vocab_size: int, dim: int):
        self.weight = nnx.Param(jnp.zeros((vocab_size, dim), jnp.bfloat16))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)


# ---------------------------------------------------------------------------------------- RoPE


def rope_freqs(rd: int, original_seq_len: int, base: float, factor: float, beta_fast: int, beta_slow: int) -> np.ndarray:
    """Per-pair frequencies f'_k, k < rd/2, fp32, with YaRN when original_seq_len > 0 (SPEC §5.2).

    Computed in numpy fp32 at trace time, in the reference's operation order.
    """
    freqs = (np.float32(1.0) / (np.float32(base) ** (np.arange(0, rd, 2, dtype=np.float32) / np.float32(rd)))).astype(np.float32)
    if original_seq_len > 0:
        def corrected_dim(rotations):
            return rd * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corrected_dim(beta_fast)), 0)
        high = min(math.ceil(corrected_dim(beta_slow)), rd - 1)
        ramp = np.clip((np.arange(rd // 2, dtype=np.float32) - np.float32(low)) / np.float32(max(high - low, 1e-3)), 0, 1)
        smooth = (np.float32(1) - ramp).astype(np.float32)
        freqs = (freqs / np.float32(factor) * (np.float32(1) - smooth) + freqs * smooth).astype(np.float32)
    return freqs


def rope_angles(freqs: np.ndarray, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin of positions x freqs: positions int [...] -> two fp32 [..., rd/2]."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs, jnp.float32)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, rd: int, inverse: bool = False) -> jax.Array:
    """Rotates the last `rd` dims of x as interleaved pairs (2k, 2k+1) -> complex numbers.

    x [b, s, (h,) d]; cos/sin [b or 1, s, rd/2] (broadcast over the head axis when x has one).
    Computed in fp32, written back in x.dtype; `inverse` rotates by the conjugate.
    """
    if x.ndim == 4 and cos.ndim == 3:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    head, tail = x[..., :-rd], x[..., -rd:].astype(jnp.float32)
    re, im = tail[..., 0::2], tail[..., 1::2]
    if inverse:
        sin = -sin
    out_re = re * cos - im * sin
    out_im = re * sin + im * cos
    rot = cast(jnp.stack([out_re, out_im], axis=-1).reshape(tail.shape), x.dtype)
    return jnp.concatenate([head, rot], axis=-1)
