"""Pure-jnp top-k selections: the oracles and the CPU path."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax import quant
from dsv41_jax.numerics import in_float64, rms_norm, sqrt

SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")


def topk_positions(scores: jax.Array, k: int) -> jax.Array:
    """scores [..., W] -> int32 [..., k]: the columns of the k largest scores (ties -> lower
    column), sorted ascending."""
    _, idx = jax.lax.top_k(scores, k)
    return jnp.sort(idx, axis=-1).astype(jnp.int32)


def router_topk(scores: jax.Array, biased: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """scores, biased [..., E] -> (weights [..., k] = scores at the indices, indices int32
    [..., k]): the columns of the k largest `biased`, in top-k order (descending; ties -> lower
    column)."""
    _, idx = jax.lax.top_k(biased, k)
    return jnp.take_along_axis(scores, idx, axis=-1), idx.astype(jnp.int32)


def router_scores(logits: jax.Array, score_func: str, *, barrier: bool = True) -> jax.Array:
    """The gate's scores from its f32 logits [..., E] (SPEC §6.1), as torch rounds them: softmax
    over the experts, or sigmoid / sqrt(softplus) each evaluated in float64 and rounded once (the
    square root of the rounded softplus, correctly rounded).

    barrier: the rounded softplus passes an optimization barrier before its square root. XLA:GPU
    otherwise drops the f64 -> f32 -> f64 convert pair between the two float64 evaluations and
    takes the root of the unrounded softplus (measured on an H100: 12.7% of 65536 scores one ulp
    off, each function alone exact). The Triton kernel (`kernel_gpu.router_topk`, compiled) keeps
    the rounding without one (and lowers neither the barrier nor `numerics.sqrt`'s
    reduce_precision)."""
    if score_func == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    if score_func == "sigmoid":
        return in_float64(jax.nn.sigmoid, logits)
    if score_func == "sqrtsoftplus":
        soft = in_float64(jax.nn.softplus, logits)
        if not barrier:  # (in the Triton kernel: the plain float64 root, rounded once)
            return in_float64(jnp.sqrt, soft)
        return sqrt(jax.lax.optimization_barrier(soft))
    raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")


def router_topk_scored(logits: jax.Array, bias: jax.Array, k: int, score_func: str) -> tuple[jax.Array, jax.Array]:
    """logits [N, E] f32, bias [E] or [N, E] f32 -> `router_topk(scores, scores + bias, k)` with
    scores = `router_scores(logits, score_func)`."""
    scores = router_scores(logits, score_func)
    return router_topk(scores, scores + bias, k)


def router_logits(x: jax.Array, weight: jax.Array, norm_weight: jax.Array | None = None,
                  norm_eps: float | None = None, quantise: bool = False) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The gate's logits: x [N, K] (bf16), weight [E, K] (bf16) -> (logits f32 [N, E], the row the
    gate read [N, K], its `quant.act_quant_bf16` values bf16 [N, K] with `quantise`, else None):
    the row is x, or `rms_norm(x, norm_weight, norm_eps)` when a norm is given. The products of
    bf16 values are exact in f32, summed in f32 (HIGHEST precision)."""
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, norm_eps)
    logits = jax.lax.dot_general(x.astype(jnp.float32), weight.astype(jnp.float32), (((1,), (1,)), ((), ())),
                                 precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return logits, x, quant.act_quant_bf16(x) if quantise else None
