"""Dispatch for sparse attention with a sink (SPEC §5.10).

`implementation`: "reference" (gather + jnp, `reference.sparse_attn`, float64 by default: the
oracle), "pallas" (the kernel for `target`), or "auto" (the kernel on GPU/TPU, the reference on
CPU). A shape the kernel does not handle falls back to the reference with a logged warning naming
the shape and the reason; bad arguments raise ValueError first. Gradients come from the reference
math in f32 (custom VJP). On a mesh that splits `data` the kernel runs per batch shard
(`_dispatch.split_batch`).

`accumulate` is the precision: "f64" (the default) is the float64 oracle's rounding (an
f32-accurate result rounds 0.04-0.2% of outputs to the other bf16 neighbour, and on the golden
sets such flips, amplified by the next fp8 quantisation and by routing, break block parity). On
the kernel path a float64 request runs the reference (with a logged note), or the GPU kernel's
float64 program with `BlockSizes.f64_kernel` (TPUs have no float64). "f32" runs the f32 kernels
(`BlockSizes.split_probs`); see benchmarks/README.md for cost and error of each. The model
passes `ModelArgs.attn_accumulate` ("auto": "f64" except on TPU, which has no float64, "f32"
there; `dsv41_jax.attention.resolve_attn_accumulate`) and `Attention.f64_kernel`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._dispatch import resolve as _resolve
from pallas_kernels._dispatch import split_batch
from pallas_kernels.sparse_attention import kernel_gpu, kernel_tpu
from pallas_kernels.sparse_attention import reference as _ref

logger = logging.getLogger(__name__)

Implementation = Literal["auto", "reference", "pallas"]
Target = Literal["gpu", "tpu"]

_SMS = 132  # H200/H100 multiprocessors, for the index-split heuristic


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles of the sparse-attention kernels; None picks a default from the shape.

    block_k: index slots per inner step (GPU: power of 2 >= 16; TPU: multiple of 128 on hardware).
    block_d: output columns per program (GPU; a divisor of head_dim: below head_dim the logits
      are recomputed per column block, which buys parallelism for few query rows).
    block_h: heads per program (GPU; a power of 2 >= 16, clipped to the heads padded to a power
      of 2): below all heads the programs of a query re-read its gathered rows (from L2) but
      recompute nothing, and the accumulator shrinks.
    num_splits: index splits per query row (GPU; > 1 writes f32 partials and combines them).
    num_warps, num_stages: Triton launch parameters (GPU).
    Defaults (GPU, measured on the H200, benchmarks/README.md): all columns per program and
    16 heads with 4 warps up to 1024 query rows (decode), 32 heads with 8 warps above (prefill);
    block_k 64 from 64 rows up, 32 below.
    split_probs: p.V with p as two bf16 terms (f32-accurate: on the H200 0.2% of outputs round
      differently from the float64 oracle) rather than one bf16 rounding of p (34-36% differ by
      an ulp; with its own tiles, all heads per program, 68.8 us at decode B=64 against 53.9 for
      the default mode, benchmarks/README.md).
    f64_kernel: float64 requests (`accumulate="f64"`) run the GPU kernel's float64 program
      (kernel_gpu's docstring) instead of the jnp reference. Tiles: 16 heads, all columns, 8
      warps, 32-slot steps; index splits as for f32. Off: on an H100 it matches the reference bit
      for bit but one decode row took 238 µs a call against the reference's 110, and the sm_90
      code of a 64-row step spills (601 spill operations a 32-slot step, 3697 a 64-slot one;
      benchmarks/README.md, twenty-sixth session).
    """
    block_k: int | None = None
    block_d: int | None = None
    block_h: int | None = None
    num_splits: int | None = None
    num_warps: int | None = None
    num_stages: int = 2
    split_probs: bool = True
    f64_kernel: bool = False

    def resolved(self, target: Target, rows: int, d: int, k: int, h: int = 64, f64: bool = False) -> BlockSizes:
        hp = max(16, pl.next_power_of_2(h))
        num_warps = self.num_warps
        if target == "gpu" and f64:
            block_k = self.block_k or 32
            block_d = min(self.block_d or d, d)
            block_h = min(self.block_h or 16, hp)
            num_warps = num_warps or 8
        elif target == "gpu" and self.split_probs:
            # head blocks shrink the [heads, d] f32 accumulator instead of splitting the columns
            # (which recomputes the logits): 16 heads x 512 at 4 warps for decode, 32 heads at 8
            # warps once there are enough rows; 64-slot steps from 64 rows up, 32 below (short
            # index splits for few rows). Each choice measured on the H200, benchmarks/README.md
            decode = rows <= 1024
            block_k = self.block_k or (64 if rows >= 64 else 32)
            block_d = min(self.block_d or d, d)
            block_h = min(self.block_h or (16 if decode else 32), hp)
            num_warps = num_warps or (4 if decode else 8)
        elif target == "gpu":
            block_k = self.block_k or 64
            block_d = min(self.block_d or d, d)
            block_h = min(self.block_h or hp, hp)
            num_warps = num_warps or 8
        else:
            block_k, block_d, block_h = self.block_k or 128, d, h
        num_splits = self.num_splits
        if num_splits is None:
            programs = rows * (d // block_d if d % block_d == 0 else 1) * max(1, hp // block_h)
            # a program is heavy (all heads, every listed row): half a wave of them already beats
            # paying for f32 partials (measured on H200); below that, split the index list
            num_splits = 1 if programs >= _SMS // 2 else max(1, min(pl_cdiv(k, block_k), pl_cdiv(_SMS, programs)))
        return dataclasses.replace(self, block_k=block_k, block_d=block_d, block_h=block_h, num_splits=num_splits,
                                   num_warps=num_warps or 8)


def pl_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _validate(q, kv, attn_sink, idx, scale):
    if q.ndim != 4:
        raise ValueError(f"q must be [b, m, h, d], got {q.shape=}")
    b, m, h, d = q.shape
    if kv.ndim != 3 or kv.shape[0] != b or kv.shape[2] != d:
        raise ValueError(f"kv must be [b={b}, n, d={d}], got {kv.shape=}")
    if idx.ndim != 3 or idx.shape[:2] != (b, m):
        raise ValueError(f"idx must be [b={b}, m={m}, k], got {idx.shape=}")
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise ValueError(f"idx must be integer, got {idx.dtype=}")
    if attn_sink.shape != (h,):
        raise ValueError(f"attn_sink must be [h={h}], got {attn_sink.shape=}")
    if not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a python float (static), got {type(scale)=}")


def _run_kernel(q, kv, attn_sink, idx, *, scale, target, bs, interpret, f64=False):
    if target == "gpu":
        return kernel_gpu.sparse_attn(q, kv, attn_sink, idx, scale, block_k=bs.block_k, block_d=bs.block_d,
                                      block_h=bs.block_h, num_splits=bs.num_splits, num_warps=bs.num_warps,
                                      num_stages=bs.num_stages, split_probs=bs.split_probs, interpret=interpret,
                                      f64=f64)
    return kernel_tpu.sparse_attn(q, kv, attn_sink, idx, scale, block_k=bs.block_k, split_probs=bs.split_probs,
                                  interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attn(q, kv, attn_sink, idx, config):
    scale, target, bs, interpret, f64 = config
    return _run_kernel(q, kv, attn_sink, idx, scale=scale, target=target, bs=bs, interpret=interpret, f64=f64)


def _attn_fwd(q, kv, attn_sink, idx, config):
    return _attn(q, kv, attn_sink, idx, config), (q, kv, attn_sink, idx)


def _attn_bwd(config, res, ct):
    q, kv, attn_sink, idx = res
    _, vjp = jax.vjp(lambda a, b, c: _ref.sparse_attn(a, b, c, idx, config[0], accumulate="f32"), q, kv, attn_sink)
    return (*vjp(ct), None)


_attn.defvjp(_attn_fwd, _attn_bwd)


def sparse_attn(q: jax.Array, kv: jax.Array, attn_sink: jax.Array, idx: jax.Array, scale: float, *,
                implementation: Implementation = "auto", accumulate: str = "f64", target: Target | None = None,
                block_sizes: BlockSizes | None = None, interpret: bool = False) -> jax.Array:
    """Single-KV-head attention over gathered positions; K and V are the same vectors.

    q bf16 [b, m, h, d]; kv bf16 [b, n, d]; attn_sink f32 [h]; idx int32 [b, m, k] (positions into
    kv, -1 = skip); scale: python float on q.kv (not on the sink) -> bf16 [b, m, h, d].
    out = sum_t e^{l_t} kv[t] / (sum_t e^{l_t} + e^{sink_h}); a row with no valid index gives 0.

    accumulate: "f64" (the oracle's rounding: the reference, logged when a kernel was asked for,
    or the GPU kernel's float64 program with `block_sizes.f64_kernel`) or "f32" (the kernels' f32
    online softmax on the tensor cores, see kernel_gpu for the error budget; the reference in f32
    where no kernel runs).
    target: which kernel ("gpu" Triton, "tpu" Mosaic), default from the backend (GPU on CPU, for
    interpret runs).
    interpret: run the kernel in Pallas interpret mode (CPU tests).
    """
    _validate(q, kv, attn_sink, idx, scale)
    if accumulate not in ("f32", "f64"):
        raise ValueError(f"accumulate must be 'f32' or 'f64', got {accumulate=}")
    use_kernel, target = _resolve(implementation, target, interpret)

    def reference(q, kv, attn_sink, idx):
        return _ref.sparse_attn(q, kv, attn_sink, idx, float(scale), accumulate=accumulate)

    if not use_kernel:
        return reference(q, kv, attn_sink, idx)
    f64 = accumulate == "f64"
    if f64 and not (target == "gpu" and (block_sizes or BlockSizes()).f64_kernel):
        # "auto" meets this on every GPU/TPU trace of the model (its default): a note, not a warning
        logger.log(logging.INFO if implementation == "auto" else logging.WARNING,
                   "sparse_attn: the %s kernel computes in f32, float64 rounding was asked for (q %s); "
                   "using the reference in float64", target, q.shape)
        return reference(q, kv, attn_sink, idx)

    def kernel(q, kv, attn_sink, idx):  # per data shard on a mesh (split_batch)
        b, m, h, d = q.shape
        bs = (block_sizes or BlockSizes()).resolved(target, b * m, d, idx.shape[-1], h, f64=f64)
        config = (float(scale), target, bs, interpret, f64)
        try:
            # trace once here so an unsupported case surfaces (and falls back) outside custom_vjp
            jax.eval_shape(functools.partial(_run_kernel, scale=float(scale), target=target, bs=bs,
                                             interpret=interpret, f64=f64), q, kv, attn_sink, idx)
        except NotImplementedError as e:
            logger.warning("sparse_attn: %s kernel does not handle q %s kv %s idx %s (%s); using the reference",
                           target, q.shape, kv.shape, idx.shape, e)
            return reference(q, kv, attn_sink, idx)
        return _attn(q, kv, attn_sink, idx, config)

    return split_batch(kernel, (q, kv, attn_sink, idx), (True, True, False, True), "sparse_attn")
