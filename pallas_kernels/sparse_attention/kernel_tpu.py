"""Pallas TPU (Mosaic) kernel for sparse attention with a sink (SPEC §5.10).

One program per query row, all heads together. The latent cache stays in HBM; the rows a query
lists are gathered by one small DMA each into a double-buffered VMEM tile [2, block_k, d] (the next
block's DMAs are in flight while the current block is on the MXU). The row indices are read as
scalars from SMEM (to address the DMAs) and as a lane vector from VMEM (to mask -1 slots, which
fetch row 0). Online softmax in f32 with the running max starting at the sink logit, probabilities
split into two bf16 terms (`split_probs`) for f32-accurate p.V, one rounding to bf16 at the end.
Tested in interpret mode only (CPU): block_k must be a multiple of 128 lanes on hardware.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _kernel(idx_s_ref, idx_v_ref, q_ref, sink_ref, kv_hbm, o_ref, buf, sem, *, scale: float, block_k: int,
            n_blocks: int, m_rows: int, split_probs: bool):
    # idx_s_ref [kp] int32 (SMEM); idx_v_ref [1, kp] int32 (VMEM); q_ref [h, d] bf16; sink_ref [h, 1] f32
    # kv_hbm [b, n, d] bf16 (HBM); o_ref [h, d] bf16; buf [2, bk, d] VMEM; sem: 2 DMA semaphores
    batch = pl.program_id(0) // m_rows

    def copy(row, slot, t):
        return pltpu.make_async_copy(kv_hbm.at[batch, pl.ds(row, 1), :], buf.at[slot, pl.ds(t, 1), :],
                                     sem.at[slot])

    def fetch(j, slot):
        def issue(t, carry):
            copy(jnp.maximum(idx_s_ref[j * block_k + t], 0), slot, t).start()
            return carry
        jax.lax.fori_loop(0, block_k, issue, 0)

    def wait(slot):
        def one(t, carry):
            copy(0, slot, t).wait()  # same-sized descriptor: each wait retires one row's DMA
            return carry
        jax.lax.fori_loop(0, block_k, one, 0)

    fetch(0, 0)
    q = q_ref[...]
    sink = sink_ref[...]
    dims = (((1,), (1,)), ((), ()))

    def body(j, carry):
        m_i, l_i, acc = carry
        slot = j % 2

        @pl.when(j + 1 < n_blocks)
        def _():
            fetch(j + 1, 1 - slot)

        wait(slot)
        k = buf[slot]  # [bk, d]
        valid = idx_v_ref[:, pl.ds(pl.multiple_of(j * block_k, block_k), block_k)] >= 0  # [1, bk]
        s = jax.lax.dot_general(q, k, dims, preferred_element_type=jnp.float32) * scale  # [h, bk]
        s = jnp.where(valid, s, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1, keepdims=True))  # [h, 1], >= sink
        alpha = jnp.exp(m_i - m_new)
        p = jnp.exp(s - m_new)
        l_new = l_i * alpha + jnp.sum(p, axis=1, keepdims=True)
        p_hi = p.astype(k.dtype)
        pv = jnp.dot(p_hi, k, preferred_element_type=jnp.float32)
        if split_probs:
            pv = pv + jnp.dot((p - p_hi.astype(jnp.float32)).astype(k.dtype), k, preferred_element_type=jnp.float32)
        return m_new, l_new, acc * alpha + pv

    h, d = q_ref.shape
    init = (sink, jnp.zeros((h, 1), jnp.float32), jnp.zeros((h, d), jnp.float32))
    m_i, l_i, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    o_ref[...] = (acc / (l_i + jnp.exp(sink - m_i))).astype(o_ref.dtype)


def sparse_attn(q: jax.Array, kv: jax.Array, attn_sink: jax.Array, idx: jax.Array, scale: float, *,
                block_k: int, split_probs: bool, interpret: bool) -> jax.Array:
    """Same contract as kernel_gpu.sparse_attn (one program per query row, no index splits)."""
    b, m, h, d = q.shape
    n, k = kv.shape[1], idx.shape[-1]
    if q.dtype != jnp.bfloat16 or kv.dtype != jnp.bfloat16:
        raise NotImplementedError(f"bf16 q and kv only, got {q.dtype=} {kv.dtype=}")
    if block_k % 8:
        raise NotImplementedError(f"block_k must be a multiple of 8 sublanes, got {block_k=}")
    if n == 0 or k == 0 or b * m == 0:
        raise NotImplementedError(f"empty operand ({n=}, {k=}, rows={b * m})")
    n_blocks = pl.cdiv(k, block_k)
    kp = n_blocks * block_k
    rows = b * m
    idx2 = jnp.pad(idx.astype(jnp.int32).reshape(rows, k), ((0, 0), (0, kp - k)), constant_values=-1)
    kernel = functools.partial(_kernel, scale=float(scale), block_k=block_k, n_blocks=n_blocks, m_rows=m,
                               split_probs=split_probs)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows, h, d), jnp.bfloat16),
        grid=(rows,),
        in_specs=[
            pl.BlockSpec((None, kp), lambda r: (r, 0), memory_space=pltpu.SMEM),  # idx, scalars
            pl.BlockSpec((None, 1, kp), lambda r: (r, 0, 0)),  # idx, lane vector
            pl.BlockSpec((None, h, d), lambda r: (r, 0, 0)),  # q
            pl.BlockSpec((h, 1), lambda r: (0, 0)),  # sink
            pl.BlockSpec(memory_space=pl.ANY),  # kv stays in HBM
        ],
        out_specs=pl.BlockSpec((None, h, d), lambda r: (r, 0, 0)),
        scratch_shapes=[pltpu.VMEM((2, block_k, d), kv.dtype), pltpu.SemaphoreType.DMA((2,))],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="sparse_attn",
    )(idx2, idx2[:, None, :], q.reshape(rows, h, d), attn_sink.astype(jnp.float32).reshape(h, 1), kv)
    return out.reshape(b, m, h, d)
