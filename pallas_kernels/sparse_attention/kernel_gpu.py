"""Pallas GPU (Triton lowering) kernel for sparse attention with a sink (SPEC §5.10).

One program per (query row, index split, head block, output-column block): the shared K=V latent
rows a query lists are gathered once per program ([block_k, d] tiles, -1 slots read row 0 and are
masked) and feed both products, q [block_h, d] x kv^T -> logits [block_h, block_k] and
p [block_h, block_k] x kv -> [block_h, block_d]. Head blocks below all heads re-read the same
gathered rows (from L2 when the programs of one query run together) without recomputing anything;
column blocks below head_dim recompute the logits.

Numerics of the f32 program (stated against the float64 oracle `reference.sparse_attn`):
* logits: bf16 x bf16 products are exact; the d-long sums accumulate in f32.
* online softmax in f32, the running max starting at the head's sink logit (so it equals the
  oracle's max(logits, sink) and never meets -inf); the sink enters the denominator once, at the end.
* probabilities: with `split_probs` (the default) p = p_hi + p_lo, two bf16 terms holding ~16
  mantissa bits, and p.V = p_hi.V + p_lo.V, both accumulated in f32; this keeps the result at f32
  accuracy. Without it p is rounded once to bf16 (the upstream tilelang kernel's choice), faster,
  about 2^-9 relative error per weight.
* the final division is IEEE round-to-nearest (`div.rn.f32`), then one rounding to bf16.
With several index splits the kernel writes f32 partials (acc, running max, sum) and a small XLA
combine rescales and adds them in f32.

The float64 program (`f64`): the oracle's arithmetic in the oracle's precision. q and the
gathered rows are widened to f64 (exact), both products are formed element by element in f64 on
the CUDA cores (`_f64_body`: the f64 tensor-core dot is wrong in jaxlib 0.11.2's Triton), the
online softmax, the sink and the division (IEEE) are f64, and the result is rounded to f32 and
then to bf16, the reference's conversion path. It differs from the oracle only in the order of
f64 operations (the online max rescaling, the summation order): ~1e-16 relative, so an output
rounds to another bf16 value only where the f64 result lies within that of a rounding boundary
of f32 or bf16. Split partials are f64, combined in f64.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._triton import SMEM_LIMIT, is_pow2, round_bf16_f32


def _div_rn(a: jax.Array, b: jax.Array, interpret: bool) -> jax.Array:
    """a / b (same shape, f32), IEEE round-to-nearest."""
    if interpret:
        return a / b
    (out,) = plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
    return out


def _kernel(idx_ref, q_ref, kv_ref, sink_ref, *out_refs, scale: float, block_k: int, n_blocks: int,
            block_d: int, n_col: int, finalize: bool, split_probs: bool, f64: bool, interpret: bool):
    # idx_ref [ks] int32 (this split's slots); q_ref [block_h, d] bf16; kv_ref [n, d] bf16;
    # sink_ref [block_h] f32. finalize: out_refs = (o_ref [block_h, block_d] bf16,)
    # else: out_refs = (acc_ref [block_h, block_d], m_ref [block_h], l_ref [block_h]) in f32 (f64)
    h, d = q_ref.shape
    d0 = (pl.program_id(2) % n_col) * block_d
    if f64:
        _f64_body(idx_ref, q_ref, kv_ref, sink_ref, out_refs, scale=scale, block_k=block_k, n_blocks=n_blocks,
                  block_d=block_d, d0=d0, finalize=finalize, interpret=interpret)
        return
    q = q_ref[...]
    sink = sink_ref[...]
    dims = (((1,), (1,)), ((), ()))

    def body(j, carry):
        m_i, l_i, acc = carry
        ids = idx_ref[pl.ds(j * block_k, block_k)]  # [bk]
        valid = ids >= 0
        rows = jnp.where(valid, ids, 0)
        k = kv_ref[rows, :]  # [bk, d] gathered latent rows
        s = jax.lax.dot_general(q, k, dims, preferred_element_type=jnp.float32) * scale  # [h, bk]
        s = jnp.where(valid[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))  # >= sink: finite
        alpha = jnp.exp(m_i - m_new)
        p = jnp.exp(s - m_new[:, None])  # masked slots: exp(-inf) = 0
        l_new = l_i * alpha + jnp.sum(p, axis=1)
        v = k if block_d == d else kv_ref[rows, pl.ds(d0, block_d)]  # [bk, block_d]
        if split_probs:
            p_hi = round_bf16_f32(p, interpret)
            pv = jnp.dot(p_hi.astype(v.dtype), v, preferred_element_type=jnp.float32)
            pv = pv + jnp.dot((p - p_hi).astype(v.dtype), v, preferred_element_type=jnp.float32)
        else:
            pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, l_new, acc * alpha[:, None] + pv

    init = (sink, jnp.zeros((h,), jnp.float32), jnp.zeros((h, block_d), jnp.float32))
    m_i, l_i, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    if finalize:
        (o_ref,) = out_refs
        den = l_i + jnp.exp(sink - m_i)  # the sink enlarges the denominator only
        o_ref[...] = _div_rn(acc, jnp.broadcast_to(den[:, None], acc.shape), interpret).astype(o_ref.dtype)
    else:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...] = acc
        m_ref[...] = m_i
        l_ref[...] = l_i


F64_COLS = 16  # head_dim columns a term of the float64 products ([heads, slots, 16] f64 in registers)


def _f64_body(idx_ref, q_ref, kv_ref, sink_ref, out_refs, *, scale, block_k, n_blocks, block_d, d0, finalize,
              interpret):
    """The float64 program: q and the gathered rows widened to f64 (exact), both products formed
    element by element on the CUDA cores (f64 multiply-adds, `F64_COLS` columns a term), the
    online softmax, the sink and the division in f64; the result rounded to f32 and then to bf16,
    the reference's conversion path. Not `dot` in f64: the Triton of jaxlib 0.11.2 computes an
    f64 tensor-core dot wrongly on an H100 (relative error ~1; benchmarks/README.md, twenty-sixth
    session), while its f64 multiplies, sums, exp and division are exact there."""
    h, d = q_ref.shape
    f64 = jnp.float64
    sink = sink_ref[...].astype(f64)
    chunks, v_chunks = range(0, d, F64_COLS), range(0, block_d, F64_COLS)  # q.k^T columns; p.V's from d0

    def body(j, carry):
        m_i, l_i, acc = carry
        ids = idx_ref[pl.ds(j * block_k, block_k)]
        valid = ids >= 0
        rows = jnp.where(valid, ids, 0)
        k = [kv_ref[rows, pl.ds(c, F64_COLS)] for c in chunks]  # [bk, 16] bf16 each, widened where used
        s = None
        for c, kc in zip(chunks, k):  # q . k^T, 16 columns a term, terms added in column order
            t = jnp.sum(q_ref[:, pl.ds(c, F64_COLS)].astype(f64)[:, None, :] * kc.astype(f64)[None, :, :], axis=2)
            s = t if s is None else s + t
        s = jnp.where(valid[None, :], s * jnp.asarray(scale, f64), -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))  # >= sink: finite
        alpha = jnp.exp(m_i - m_new)
        p = jnp.exp(s - m_new[:, None])
        v = k if block_d == d else [kv_ref[rows, pl.ds(d0 + c, F64_COLS)] for c in v_chunks]
        acc = tuple(a * alpha[:, None] + jnp.sum(p[:, :, None] * vc.astype(f64)[None, :, :], axis=1) for a, vc in zip(acc, v))
        return m_new, l_i * alpha + jnp.sum(p, axis=1), acc

    init = (sink, jnp.zeros((h,), f64), tuple(jnp.zeros((h, F64_COLS), f64) for _ in v_chunks))
    m_i, l_i, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    cols = [pl.ds(c, F64_COLS) for c in v_chunks]
    if finalize:
        (o_ref,) = out_refs
        den = l_i + jnp.exp(sink - m_i)
        for col, a in zip(cols, acc):
            out = (a / den[:, None]).astype(jnp.float32)  # div.rn.f64, then the reference's f64 -> f32
            o_ref[:, col] = round_bf16_f32(out, interpret).astype(o_ref.dtype)
    else:
        acc_ref, m_ref, l_ref = out_refs
        for col, a in zip(cols, acc):
            acc_ref[:, col] = a
        m_ref[...] = m_i
        l_ref[...] = l_i


def _combine(acc, m, l, sink):
    """acc [r, s, h, d], m/l [r, s, h] (each split's max starts at the sink), sink [h] -> bf16 [r, h, d]."""
    mx = jnp.max(m, axis=1)  # [r, h]
    w = jnp.exp(m - mx[:, None])
    num = jnp.sum(acc * w[..., None], axis=1)
    den = jnp.sum(l * w, axis=1) + jnp.exp(sink[None, :] - mx)
    # the barrier keeps XLA from turning the broadcast division into a reciprocal multiply
    out = num / jax.lax.optimization_barrier(jnp.broadcast_to(den[..., None], num.shape))
    return jax.lax.reduce_precision(out.astype(jnp.float32), exponent_bits=8, mantissa_bits=7).astype(jnp.bfloat16)


def sparse_attn(q: jax.Array, kv: jax.Array, attn_sink: jax.Array, idx: jax.Array, scale: float, *,
                block_k: int, block_d: int, block_h: int, num_splits: int, num_warps: int, num_stages: int,
                split_probs: bool, interpret: bool, f64: bool = False) -> jax.Array:
    """q bf16 [b, m, h, d]; kv bf16 [b, n, d]; attn_sink f32 [h]; idx int32 [b, m, k] -> bf16 [b, m, h, d].

    block_h: heads per program (a power of 2 >= 16; the heads are padded to a power of 2 >= 16,
    block_h is clipped to that). split_probs: p.V from two bf16 terms of p (module doc).
    f64: the float64 program (module doc; split_probs ignored); traced with 64-bit types on.
    Raises NotImplementedError for shapes the Triton lowering cannot take (the caller falls back)."""
    b, m, h, d = q.shape
    n, k = kv.shape[1], idx.shape[-1]
    if q.dtype != jnp.bfloat16 or kv.dtype != jnp.bfloat16:
        raise NotImplementedError(f"bf16 q and kv only, got {q.dtype=} {kv.dtype=}")
    if not is_pow2(d) or d < 16:
        raise NotImplementedError(f"head_dim must be a power of 2 >= 16 for Triton tiles, got {d=}")
    if not is_pow2(block_d) or block_d < 16 or d % block_d:
        raise NotImplementedError(f"block_d must be a power of 2 >= 16 dividing {d=}, got {block_d=}")
    if not is_pow2(block_k) or block_k < 16:
        raise NotImplementedError(f"block_k must be a power of 2 >= 16, got {block_k=}")
    if n == 0 or k == 0 or b * m == 0:
        raise NotImplementedError(f"empty operand ({n=}, {k=}, rows={b * m})")
    # heads: tensor-core tiles need >= 16 rows and a power of 2; padded heads are dropped after
    hp = max(16, pl.next_power_of_2(h))
    block_h = min(block_h, hp)
    if not is_pow2(block_h) or block_h < 16:
        raise NotImplementedError(f"block_h must be a power of 2 >= 16, got {block_h=}")
    # shared memory: the q tile, plus num_stages buffers of the gathered [block_k, d] rows (and of
    # the [block_k, block_d] value slice when it is loaded separately); Hopper allows 227 KiB a block
    cols = d + (block_d if block_d < d else 0)
    smem = 2 * (block_h * d + num_stages * block_k * cols) + 4096
    if smem > SMEM_LIMIT:
        raise NotImplementedError(f"tiles need ~{smem} B of shared memory > {SMEM_LIMIT} "
                                  f"({block_h=}, {d=}, {block_k=}, {block_d=}, {num_stages=})")
    if hp != h:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, hp - h), (0, 0)))
        attn_sink = jnp.pad(attn_sink, (0, hp - h))
    n_blocks = pl.cdiv(pl.cdiv(k, num_splits), block_k)  # index blocks per split
    ks = n_blocks * block_k
    idx = jnp.pad(idx.astype(jnp.int32), ((0, 0), (0, 0), (0, ks * num_splits - k)), constant_values=-1)
    rows = b * m
    q3 = q.reshape(rows, hp, d)
    idx3 = idx.reshape(rows, num_splits, ks)
    finalize = num_splits == 1
    n_col = d // block_d
    # grid axis 2 enumerates (head block, column block) pairs: Triton grids have three axes
    grid = (rows, num_splits, (hp // block_h) * n_col)
    in_specs = [
        pl.BlockSpec((None, None, ks), lambda r, s, g: (r, s, 0)),  # idx
        pl.BlockSpec((None, block_h, d), lambda r, s, g: (r, g // n_col, 0)),  # q
        pl.BlockSpec((None, n, d), lambda r, s, g: (r // m, 0, 0)),  # kv: the whole cache of batch r // m
        pl.BlockSpec((block_h,), lambda r, s, g: (g // n_col,)),  # sink
    ]
    if finalize:
        out_shape = jax.ShapeDtypeStruct((rows, hp, d), jnp.bfloat16)
        out_specs = pl.BlockSpec((None, block_h, block_d), lambda r, s, g: (r, g // n_col, g % n_col))
    else:
        part = jnp.float64 if f64 else jnp.float32
        out_shape = (jax.ShapeDtypeStruct((rows, num_splits, hp, d), part),
                     jax.ShapeDtypeStruct((rows, num_splits, hp), part),
                     jax.ShapeDtypeStruct((rows, num_splits, hp), part))
        out_specs = (pl.BlockSpec((None, None, block_h, block_d), lambda r, s, g: (r, s, g // n_col, g % n_col)),
                     pl.BlockSpec((None, None, block_h), lambda r, s, g: (r, s, g // n_col)),
                     pl.BlockSpec((None, None, block_h), lambda r, s, g: (r, s, g // n_col)))
    kernel = functools.partial(_kernel, scale=float(scale), block_k=block_k, n_blocks=n_blocks, block_d=block_d,
                               n_col=n_col, finalize=finalize, split_probs=split_probs, f64=f64, interpret=interpret)
    with jax.enable_x64(True) if f64 else contextlib.nullcontext():
        out = pl.pallas_call(
            kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs, interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            name="sparse_attn_f64" if f64 else "sparse_attn")(idx3, q3, kv, attn_sink.astype(jnp.float32))
        if not finalize:
            out = _combine(*out, attn_sink.astype(out[0].dtype))
    return out.reshape(b, m, hp, d)[:, :, :h]
