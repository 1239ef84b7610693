"""Dispatch for the indexer's scores (SPEC §5.7).

`implementation`: "reference" (pure jnp, `reference.index_scores`: the oracle), "pallas" (the GPU
kernel), or "auto" (the kernel on a GPU, the reference elsewhere: no TPU kernel). A shape the
kernel does not handle falls back to the reference with a logged warning naming the shape and the
reason. The model's indexers call it with their `kernels` (`Indexer.score_kernel`, on by default:
prefills since benchmarks/README.md's forty-fifth session, decode steps since its forty-sixth).
On a mesh that splits `data` the kernel runs per batch shard (`_dispatch.split_batch`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Literal

import jax

from pallas_kernels._dispatch import gpu_kernel, split_batch
from pallas_kernels.index_scores import kernel_gpu
from pallas_kernels.index_scores import reference as _ref

logger = logging.getLogger(__name__)

Implementation = Literal["auto", "reference", "pallas"]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles of the GPU kernel: query rows and keys a program, Triton warps and stages. block_s
    is unused by a decode call (one query row a batch row: the one-row layout); block_t None:
    128 keys for a decode call (the fastest of 128 / 256 / 512 with 4 or 8 warps at batch 1, 8
    and 64 on an H100: benchmarks/README.md, forty-sixth session), 64 otherwise."""
    block_s: int = 64
    block_t: int | None = None
    num_warps: int = 4
    num_stages: int = 2


def index_scores(q: jax.Array, k: jax.Array, w: jax.Array, *, implementation: Implementation = "auto",
                 block_sizes: BlockSizes | None = None, interpret: bool = False) -> jax.Array:
    """score[b, s, t] = sum_h relu(q[b,s,h].k[b,t]) * w[b,s,h] in the reference's bf16 steps.
    q bf16 [b, s, h, d]; k bf16 [b, t, d]; w bf16 [b, s, h] -> bf16 [b, s, t]
    (`reference.index_scores`; the kernel differs only in the order of its f32 sums)."""
    if q.ndim != 4 or k.ndim != 3 or w.shape != q.shape[:3] or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[3]:
        raise ValueError(f"index_scores: q [b, s, h, d], k [b, t, d], w [b, s, h], got {q.shape=} {k.shape=} "
                         f"{w.shape=}")
    if not gpu_kernel(implementation, interpret, "index_scores"):
        return _ref.index_scores(q, k, w)
    bs = block_sizes or BlockSizes()

    def kernel(q, k, w):  # per data shard on a mesh (split_batch)
        try:
            return kernel_gpu.index_scores(
                q, k, w, block_s=bs.block_s, block_t=bs.block_t or (128 if q.shape[1] == 1 else 64),
                num_warps=bs.num_warps, num_stages=bs.num_stages, interpret=interpret)
        except NotImplementedError as e:
            logger.warning("index_scores: the GPU kernel does not handle q %s k %s (%s); using the reference",
                           q.shape, k.shape, e)
            return _ref.index_scores(q, k, w)

    return split_batch(kernel, (q, k, w), (True, True, True), "index_scores")
