"""Pure-jnp sparse attention with an attention sink (SPEC §5.10): the oracle and the CPU path."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_ACCUMULATE = {"f32": jnp.float32, "f64": jnp.float64}


def _exact_f32(x: jax.Array) -> jax.Array:
    """bf16 input -> f32 holding exactly its bf16 values. reduce_precision keeps a rounding that
    XLA fused away upstream (it may drop f32 -> bf16 -> f32 convert pairs under jit)."""
    return jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=8, mantissa_bits=7)


def _attend(q, g, valid, sink, scale, dtype):
    """q [b, m, h, d], g (gathered kv) [b, m, k, d], valid bool [b, m, k], sink [h] -> out [b, m, h, d]
    in `dtype`, before the bf16 rounding."""
    q, g, sink = _exact_f32(q).astype(dtype), _exact_f32(g).astype(dtype), sink.astype(dtype)[None, None, :]
    hi = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("bmhd,bmkd->bmhk", q, g, precision=hi) * jnp.asarray(scale, dtype)
    logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf)
    # the sink takes part in the max so that exp never overflows, even when the sink dominates
    mx = jnp.maximum(jnp.max(logits, axis=-1, initial=-jnp.inf), sink)
    e = jnp.exp(logits - mx[..., None])  # invalid slots: exp(-inf) = 0
    denom = jnp.sum(e, axis=-1) + jnp.exp(sink - mx)
    out = jnp.einsum("bmhk,bmkd->bmhd", e, g, precision=hi) / denom[..., None]
    return jnp.where(jnp.any(valid, axis=-1)[:, :, None, None], out, 0.0)


# the most bytes of gathered rows (in the accumulation dtype) one pass holds; longer query spans
# run in sequential chunks of queries (`sparse_attn`)
GATHER_BYTES = 1 << 30


@functools.partial(jax.jit, static_argnames=("scale", "accumulate", "max_gather_bytes"))
def sparse_attn(q: jax.Array, kv: jax.Array, attn_sink: jax.Array, idx: jax.Array, scale: float,
                accumulate: str = "f64", max_gather_bytes: int = GATHER_BYTES) -> jax.Array:
    """Single-KV-head attention over gathered positions; K and V are the same vectors.

    q bf16 [b, m, h, d]; kv bf16 [b, n, d]; attn_sink f32 [h]; idx int32 [b, m, k] (positions into
    kv, -1 = skip); scale: python float applied to q.kv (not to the sink) -> bf16 [b, m, h, d].

    Per (b, m, h), over the valid indices t: l_t = scale * q.kv[t];
    out = sum_t e^{l_t} kv[t] / (sum_t e^{l_t} + e^{sink_h}). The sink only enlarges the
    denominator. A row without a valid index gives 0. Max-subtracted softmax (sink included).

    accumulate: "f64" (default) computes in float64 (64-bit types enabled locally) like the golden
    oracle, so the single rounding to bf16 matches it exactly; "f32" flips about 1 in 10^4 output
    roundings, which the fp8 quantisation of the next projection can amplify to O(1e-1) in a block
    output. Gathers every listed row: b * k * d values a query position in `accumulate`'s dtype
    (a 4096-token prefill of 8 rows at k = 640, d = 512: 80 GiB in float64), so queries run in
    sequential chunks (`jax.lax.map`) whose gathered rows stay within `max_gather_bytes`; each
    query's arithmetic is the same in any chunk.
    """
    b, m, h, d = q.shape
    if kv.ndim != 3 or kv.shape[0] != b or kv.shape[2] != d:
        raise ValueError(f"kv must be [b={b}, n, d={d}], got {kv.shape}")
    if idx.shape[:2] != (b, m) or idx.ndim != 3:
        raise ValueError(f"idx must be [b={b}, m={m}, k], got {idx.shape}")
    if attn_sink.shape != (h,):
        raise ValueError(f"attn_sink must be [h={h}], got {attn_sink.shape}")
    if accumulate not in _ACCUMULATE:
        raise ValueError(f"accumulate must be one of {sorted(_ACCUMULATE)}, got {accumulate!r}")
    k = idx.shape[-1]
    per_query = b * k * d * jnp.dtype(_ACCUMULATE[accumulate]).itemsize
    n_chunks = -(-m * per_query // max(max_gather_bytes, 1))
    if n_chunks <= 1:
        return _sparse_attn(q, kv, attn_sink, idx, scale, accumulate)
    c = -(-m // n_chunks)  # queries a chunk
    n_chunks = -(-m // c)
    pad = n_chunks * c - m  # padded queries list no index (-1) and are dropped
    qc = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, n_chunks, c, h, d).swapaxes(0, 1)
    ic = jnp.pad(idx, ((0, 0), (0, pad), (0, 0)), constant_values=-1).reshape(b, n_chunks, c, k).swapaxes(0, 1)
    out = jax.lax.map(lambda a: _sparse_attn(a[0], kv, attn_sink, a[1], scale, accumulate), (qc, ic))
    return out.swapaxes(0, 1).reshape(b, n_chunks * c, h, d)[:, :m]


def _sparse_attn(q, kv, attn_sink, idx, scale, accumulate):
    """`sparse_attn` on one span of queries: gather, attend in `accumulate`, round to bf16."""
    b, m = idx.shape[:2]
    d = q.shape[-1]
    valid = idx >= 0
    k = idx.shape[-1]
    # gather [b, m*k, d]: one row of kv per (query, slot)
    g = jnp.take_along_axis(kv, jnp.where(valid, idx, 0).reshape(b, m * k, 1), axis=1).reshape(b, m, k, d)
    if accumulate == "f64":
        with jax.enable_x64(True):
            # f64 -> f32 -> bf16, the conversion path of the reference's float64 result
            out = _attend(q, g, valid, attn_sink, scale, jnp.float64).astype(jnp.float32)
    else:
        out = _attend(q, g, valid, attn_sink, scale, jnp.float32)
    return jax.lax.reduce_precision(out, exponent_bits=8, mantissa_bits=7).astype(jnp.bfloat16)
