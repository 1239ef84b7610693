"""Dispatch for the ascending top-k positions of score rows (the indexer's `select_topk`,
SPEC §5.7).

`implementation`: "reference" (jnp: `lax.top_k`, then a sort of the k columns), "pallas" (the
GPU kernel: a threshold search, no sort), "auto" (the kernel on a GPU, the reference elsewhere).
Both keep the columns of the k largest scores with ties to the lower column, in ascending column
order; scores are ordered as IEEE total order (-0 below +0), as XLA:GPU's top_k orders them. A
shape the kernel does not handle (non-bf16 scores; rows wider than `kernel_gpu.MAX_WIDTH` run in
chunks, unless a chunk holds no more than k columns) falls back to the reference with a logged
warning. On a mesh that splits `data` the kernel runs per
batch shard.

`router_topk` is the MoE gate's selection: the k largest biased scores in rank order with the
unbiased scores there (`lax.top_k` + a gather on the reference path; one launch, no sort, on the
kernel path), f32 keys in the same total order. `router_topk_scored` takes the gate's logits
and bias instead (the scores formed in the same launch where the kernel can). `router_logits`
forms the gate's logits, for a single row with the FFN's RMSNorm applied in the same launch
(`BlockSizes.norm_logits`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Literal

import jax
import jax.numpy as jnp

from pallas_kernels._dispatch import gpu_kernel, split_batch
from pallas_kernels.topk import kernel_gpu
from pallas_kernels.topk import reference as _ref

logger = logging.getLogger(__name__)

Implementation = Literal["auto", "reference", "pallas"]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """num_warps: Triton warps per row program (None: one per 512 padded columns, 1 to 8).
    norm_logits: `router_logits` of a single row given with its RMSNorm runs the norm and the
      logits in one launch (`kernel_gpu.router_logits`) instead of XLA's norm (two launches) and
      logits. Off by default until timed and checked on a GPU."""
    num_warps: int | None = None
    norm_logits: bool = False


def topk_positions(scores: jax.Array, k: int, *, implementation: Implementation = "auto",
                   interpret: bool = False, block_sizes: BlockSizes | None = None) -> jax.Array:
    """scores [..., W] (bf16 on the kernel path) -> int32 [..., k]: the columns of the k largest
    scores (ties -> lower column), ascending."""
    if scores.ndim < 1:
        raise ValueError(f"scores must be [..., W], got {scores.shape=}")
    width = scores.shape[-1]
    if not isinstance(k, int) or not 1 <= k <= width:
        raise ValueError(f"k must be an int in [1, {width}] for scores {scores.shape}, got {k=}")
    if not gpu_kernel(implementation, interpret, "topk_positions"):
        return _ref.topk_positions(scores, k)
    lead = scores.shape[:-1]
    bs = block_sizes or BlockSizes()

    def local(s):  # per data shard on a mesh (split_batch)
        rows = s.reshape(math.prod(s.shape[:-1]), width)
        try:
            out = kernel_gpu.topk_positions(rows, k, num_warps=bs.num_warps, interpret=interpret)
        except NotImplementedError as e:
            logger.warning("topk_positions: kernel does not handle scores %s (%s); using the reference",
                           s.shape, e)
            return _ref.topk_positions(s, k)
        return out.reshape(*s.shape[:-1], k)

    if math.prod(lead) == 0:
        return _ref.topk_positions(scores, k)
    return split_batch(local, (scores,), (True,), "topk_positions") if scores.ndim > 1 else local(scores)


def router_topk(scores: jax.Array, biased: jax.Array, k: int, *, implementation: Implementation = "auto",
                interpret: bool = False, block_sizes: BlockSizes | None = None) -> tuple[jax.Array, jax.Array]:
    """scores, biased [N, E] (f32 on the kernel path) -> (weights [N, k] = scores at the picks,
    indices int32 [N, k]): the columns of the k largest `biased` in top-k order (descending,
    ties -> lower column)."""
    if biased.ndim != 2 or scores.shape != biased.shape:
        raise ValueError(f"scores and biased must be the same [N, E], got {scores.shape=} {biased.shape=}")
    width = biased.shape[-1]
    if not isinstance(k, int) or not 1 <= k <= width:
        raise ValueError(f"k must be an int in [1, {width}] for scores {biased.shape}, got {k=}")
    if biased.shape[0] == 0 or not gpu_kernel(implementation, interpret, "router_topk"):
        return _ref.router_topk(scores, biased, k)
    bs = block_sizes or BlockSizes()

    def local(s, b):  # per data shard on a mesh (split_batch)
        try:
            return kernel_gpu.router_topk(s, b, k, num_warps=bs.num_warps, interpret=interpret)
        except NotImplementedError as e:
            logger.warning("router_topk: kernel does not handle scores %s (%s); using the reference", b.shape, e)
            return _ref.router_topk(s, b, k)

    return split_batch(local, (scores, biased), (True, True), "router_topk")


def router_topk_scored(logits: jax.Array, bias: jax.Array, k: int, score_func: str, *,
                       implementation: Implementation = "auto", interpret: bool = False,
                       block_sizes: BlockSizes | None = None) -> tuple[jax.Array, jax.Array]:
    """The gate from its logits: logits f32 [N, E], bias f32 [E] (or [N, E]: per-row biases) ->
    `router_topk(scores, scores + bias, k)` with scores = `reference.router_scores(logits,
    score_func)`. On the kernel path a score function of `kernel_gpu.IN_KERNEL_SCORE_FUNCS` is
    formed inside the selection's launch (the same float64 operations), others by XLA first."""
    if logits.ndim != 2 or bias.shape not in ((logits.shape[1],), logits.shape):
        raise ValueError(f"logits [N, E] and bias [E] or [N, E], got {logits.shape=} {bias.shape=}")
    if score_func not in _ref.SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {_ref.SCORE_FUNCS}, got {score_func!r}")
    width = logits.shape[-1]
    if not isinstance(k, int) or not 1 <= k <= width:
        raise ValueError(f"k must be an int in [1, {width}] for logits {logits.shape}, got {k=}")
    in_kernel = score_func in kernel_gpu.IN_KERNEL_SCORE_FUNCS and logits.dtype == bias.dtype == jnp.float32
    if logits.shape[0] == 0 or not in_kernel or not gpu_kernel(implementation, interpret, "router_topk"):
        scores = _ref.router_scores(logits, score_func)
        return router_topk(scores, scores + bias, k, implementation=implementation, interpret=interpret,
                           block_sizes=block_sizes)
    bs = block_sizes or BlockSizes()
    per_row = bias.ndim == 2

    def local(lg, b):  # per data shard on a mesh (split_batch)
        try:
            return kernel_gpu.router_topk(lg, b if per_row else b.reshape(1, width), k, num_warps=bs.num_warps,
                                          interpret=interpret, score_func=score_func)
        except NotImplementedError as e:
            logger.warning("router_topk: kernel does not handle logits %s (%s); using the reference", lg.shape, e)
            return _ref.router_topk_scored(lg, b, k, score_func)

    return split_batch(local, (logits, bias), (True, per_row), "router_topk")


def router_logits(x: jax.Array, weight: jax.Array, *, norm_weight: jax.Array | None = None,
                  norm_eps: float | None = None, quantise: bool = False, implementation: Implementation = "auto",
                  interpret: bool = False, block_sizes: BlockSizes | None = None
                  ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The gate's logits: x bf16 [N, K], weight bf16 [E, K] -> (logits f32 [N, E], the row the
    logits read [N, K]: x, or `rms_norm(x, norm_weight, norm_eps)` with a norm; with `quantise`
    that row's `quant.act_quant_bf16` values bf16 [N, K] (the routed experts' input), else None).
    On the kernel path with `block_sizes.norm_logits`, a single row with a norm is normalised
    (and quantised) inside the logits' launch (`kernel_gpu.router_logits`: only the order of the
    norm's sum of squares and of the logits' f32 sums differ from the reference); else
    `reference.router_logits`."""
    if x.ndim != 2 or weight.ndim != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"x [N, K] and weight [E, K], got {x.shape=} {weight.shape=}")
    if (norm_weight is None) != (norm_eps is None) or (norm_weight is not None and norm_weight.shape != x.shape[1:]):
        raise ValueError(f"router_logits: norm_weight [{x.shape[1]}] and norm_eps go together, got "
                         f"{None if norm_weight is None else norm_weight.shape} and {norm_eps}")
    bs = block_sizes or BlockSizes()
    if (norm_weight is None or x.shape[0] != 1 or not bs.norm_logits
            or not gpu_kernel(implementation, interpret, "router_logits")):
        return _ref.router_logits(x, weight, norm_weight, norm_eps, quantise)
    try:
        logits, xn, xq = kernel_gpu.router_logits(x, weight, norm_weight, norm_eps, interpret=interpret)
    except NotImplementedError as e:
        logger.warning("router_logits: kernel does not handle x %s, weight %s (%s); using the reference",
                       x.shape, weight.shape, e)
        return _ref.router_logits(x, weight, norm_weight, norm_eps, quantise)
    return logits, xn, xq if quantise else None
