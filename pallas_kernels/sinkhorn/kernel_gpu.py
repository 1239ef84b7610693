"""Pallas GPU (Triton lowering) kernel for the hyper-connection Sinkhorn split (SPEC §4.3).

Two layouts (`lanes`), the same arithmetic op for op, so the same bits:
  * tokens (`lanes=False`): one token per lane, so a program handles `block_tokens` tokens and
    every per-token quantity is a [block_tokens] vector; the 4x4 comb matrix is 16 such vectors
    and the row and column sums are plain vector additions. One thread runs a token's 40
    dependent normalisations alone: about 10 us at any token count on an H200, the latency of
    that serial chain (benchmarks/README.md, eleventh run).
  * entries (`lanes=True`): one comb entry per lane, a program's comb a [block_tokens, hc, hc]
    tensor, so the 16 divisions of a normalisation run side by side. A row (column) sum is the
    index-order sum of the row's entries, each taken to every lane of the row by a masked sum
    over the row (one nonzero term: exact), then added in index order as the reference adds.
One launch either way, no transposes: inputs and outputs keep the caller's layout.

Numerics follow the reference op for op: sigmoid as 1 / (1 + exp(-x)), exp through libdevice,
sums over 4 in index order, and correctly rounded division (Triton's own f32 division is the
approximate `div.full`, which would drift from the reference's exact division): see `_Divider`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _asm(code: str, *args: jax.Array) -> jax.Array:
    (out,) = plgpu.elementwise_inline_asm(
        code, args=list(args), constraints="=r," + ",".join("r" * len(args)), pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)])
    return out


class _Divider:
    """x / s with IEEE round-to-nearest for [block] f32 vectors, several numerators per divisor.

    "div_rn": one `div.rn.f32` per quotient. "rcp_fma": r = rcp.rn(s) once per divisor, then
    q0 = x * r, e = fma(-s, q0, x) (exact), q = fma(e, r, q0) per quotient: the correctly rounded
    quotient (Markstein's correction; checked against IEEE division on 10^5 random and edge-case
    f32 pairs in this value range). With one token per lane a token's four quotients share a
    reciprocal (the split 10.1 against 21.2 us with div.rn on an H200); with one entry per lane
    each lane divides once and div.rn is the faster (4.7 against 5.2 us). Interpret mode divides."""

    def __init__(self, mode: str, interpret: bool):
        if mode not in ("div_rn", "rcp_fma"):
            raise NotImplementedError(f"division must be 'div_rn' or 'rcp_fma', got {mode=}")
        self.mode, self.interpret = mode, interpret

    def prepare(self, s: jax.Array):
        if self.interpret or self.mode == "div_rn":
            return s, None
        return s, _asm("rcp.rn.f32 $0, $1;", s)

    def __call__(self, x: jax.Array, prepared) -> jax.Array:
        s, r = prepared
        if self.interpret:  # the barrier keeps XLA from dividing by a broadcast divisor's reciprocal
            return x / jax.lax.optimization_barrier(s)
        if r is None:
            return _asm("div.rn.f32 $0, $1, $2;", x, s)
        return _asm("{ .reg .f32 qq, ee, nn; mul.rn.f32 qq, $1, $3; neg.f32 nn, $2; "
                    "fma.rn.f32 ee, nn, qq, $1; fma.rn.f32 $0, ee, $3, qq; }", x, s, r)


def _kernel(m_ref, scale_ref, base_ref, *rest, hc: int, iters: int, eps: float, n_tokens: int,
            block_tokens: int, has_rms: bool, division: str, interpret: bool):
    # m_ref [t, (2 + hc) * hc] f32; scale_ref [3]; base_ref [(2 + hc) * hc]; rms_ref [t] (optional)
    # outputs: pre_ref [t, hc], post_ref [t, hc], comb_ref [t, hc * hc], all f32
    rms_ref, pre_ref, post_ref, comb_ref = rest if has_rms else (None, *rest)
    tok = pl.program_id(0) * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)  # [block]
    live = tok < n_tokens
    # masked-off lanes keep their out-of-range token ids: never clamp them onto a real row, whose
    # value a masked store would otherwise race with
    rms = plgpu.load(rms_ref.at[tok], mask=live, other=0.0) if has_rms else None
    div = _Divider(division, interpret)
    one = jnp.full((block_tokens,), 1.0, jnp.float32)

    def mix(j):
        x = plgpu.load(m_ref.at[tok, j], mask=live, other=0.0)
        return x * rms if has_rms else x

    s0, s1, s2 = scale_ref[0], scale_ref[1], scale_ref[2]
    for i in range(hc):
        z = mix(i) * s0 + base_ref[i]
        plgpu.store(pre_ref.at[tok, i], div(one, div.prepare(1.0 + jnp.exp(-z))) + eps, mask=live)
    for i in range(hc):
        z = mix(hc + i) * s1 + base_ref[hc + i]
        plgpu.store(post_ref.at[tok, i], 2.0 * div(one, div.prepare(1.0 + jnp.exp(-z))), mask=live)

    # c[i][j]: row i (source copy), column j; "row" sums run over j, "column" sums over i
    c = [[mix(2 * hc + i * hc + j) * s2 + base_ref[2 * hc + i * hc + j] for j in range(hc)]
         for i in range(hc)]

    def row_sums(c):
        out = []
        for i in range(hc):
            s = c[i][0]
            for j in range(1, hc):
                s = s + c[i][j]
            out.append(s)
        return out

    def col_sums(c):
        out = []
        for j in range(hc):
            s = c[0][j]
            for i in range(1, hc):
                s = s + c[i][j]
            out.append(s)
        return out

    def norm_rows(c, add_eps):
        r = [div.prepare(x + eps if add_eps else x) for x in row_sums(c)]
        return [[div(c[i][j], r[i]) for j in range(hc)] for i in range(hc)]

    def norm_cols(c):
        s = [div.prepare(x + eps) for x in col_sums(c)]
        return [[div(c[i][j], s[j]) for j in range(hc)] for i in range(hc)]

    mx = []
    for i in range(hc):
        m = c[i][0]
        for j in range(1, hc):
            m = jnp.maximum(m, c[i][j])
        mx.append(m)
    c = [[jnp.exp(c[i][j] - mx[i]) for j in range(hc)] for i in range(hc)]
    c = norm_rows(c, add_eps=False)
    c = [[c[i][j] + eps for j in range(hc)] for i in range(hc)]
    c = norm_cols(c)

    def body(_, flat):
        c = [list(flat[i * hc:(i + 1) * hc]) for i in range(hc)]
        c = norm_cols(norm_rows(c, add_eps=True))
        return tuple(x for row in c for x in row)

    flat = jax.lax.fori_loop(0, iters - 1, body, tuple(x for row in c for x in row))
    for k in range(hc * hc):
        plgpu.store(comb_ref.at[tok, k], flat[k], mask=live)


def _lanes_kernel(m_ref, scale_ref, base_ref, *rest, hc: int, iters: int, eps: float, n_tokens: int,
                  block_tokens: int, has_rms: bool, division: str, interpret: bool):
    # as `_kernel`; every quantity a [block_tokens, hc] or [block_tokens, hc, hc] tensor
    rms_ref, pre_ref, post_ref, comb_ref = rest if has_rms else (None, *rest)
    bt = block_tokens
    tok2 = pl.program_id(0) * bt + jax.lax.broadcasted_iota(jnp.int32, (bt, hc), 0)
    col2 = jax.lax.broadcasted_iota(jnp.int32, (bt, hc), 1)
    tok3 = pl.program_id(0) * bt + jax.lax.broadcasted_iota(jnp.int32, (bt, hc, hc), 0)
    row3 = jax.lax.broadcasted_iota(jnp.int32, (bt, hc, hc), 1)  # i: source copy
    col3 = jax.lax.broadcasted_iota(jnp.int32, (bt, hc, hc), 2)  # j
    live2, live3 = tok2 < n_tokens, tok3 < n_tokens
    div = _Divider(division, interpret)
    s0, s1, s2 = scale_ref[0], scale_ref[1], scale_ref[2]

    def logits(offset, scale, tok, col, live):
        x = plgpu.load(m_ref.at[tok, offset + col], mask=live, other=0.0)
        if has_rms:
            x = x * plgpu.load(rms_ref.at[tok], mask=live, other=0.0)
        return x * scale + plgpu.load(base_ref.at[offset + col])

    one2 = jnp.full((bt, hc), 1.0, jnp.float32)
    z = logits(0, s0, tok2, col2, live2)
    plgpu.store(pre_ref.at[tok2, col2], div(one2, div.prepare(1.0 + jnp.exp(-z))) + eps, mask=live2)
    z = logits(hc, s1, tok2, col2, live2)
    plgpu.store(post_ref.at[tok2, col2], 2.0 * div(one2, div.prepare(1.0 + jnp.exp(-z))), mask=live2)

    c = logits(2 * hc, s2, tok3, row3 * hc + col3, live3)
    zero = jnp.zeros((bt, hc, hc), jnp.float32)

    def entries(c, axis):
        """The hc [bt, hc] slices of c along `axis` (2: entry k of each row, 1: of each column),
        each a masked sum with one nonzero term: exact, and in every lane of its row / column."""
        idx = col3 if axis == 2 else row3
        return [jnp.sum(jnp.where(idx == k, c, zero), axis=axis) for k in range(hc)]

    def normalise(c, axis, add_eps):
        s = functools.reduce(jnp.add, entries(c, axis))  # in index order, as the token layout adds
        if add_eps:
            s = s + eps
        s = jnp.broadcast_to(s[:, :, None] if axis == 2 else s[:, None, :], (bt, hc, hc))
        return div(c, div.prepare(s))

    mx = functools.reduce(jnp.maximum, entries(c, 2))
    c = jnp.exp(c - jnp.broadcast_to(mx[:, :, None], (bt, hc, hc)))
    c = normalise(c, 2, add_eps=False) + eps
    c = normalise(c, 1, add_eps=True)
    c = jax.lax.fori_loop(0, iters - 1, lambda _, c: normalise(normalise(c, 2, True), 1, True), c)
    plgpu.store(comb_ref.at[tok3, row3 * hc + col3], c, mask=live3)


def hc_split_sinkhorn(mixes: jax.Array, scale: jax.Array, base: jax.Array, rms: jax.Array | None, *,
                      hc: int, iters: int, eps: float, block_tokens: int, num_warps: int, division: str,
                      interpret: bool, lanes: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """mixes f32 [t, (2 + hc) * hc]; scale f32 [3]; base f32 [(2 + hc) * hc]; rms f32 [t] or None
    (multiplies the mixes first: the RMS factor of `hc_mixes`, fused) ->
    pre f32 [t, hc], post f32 [t, hc], comb f32 [t, hc * hc] (row-major hc x hc).
    lanes: one comb entry per lane (module docstring; hc a power of 2), else one token per lane.

    Raises NotImplementedError for layouts this kernel does not handle (the caller falls back)."""
    t = mixes.shape[0]
    if block_tokens <= 0 or block_tokens & (block_tokens - 1):
        raise NotImplementedError(f"block_tokens must be a power of 2 for Triton, got {block_tokens=}")
    if t == 0:
        raise NotImplementedError(f"no tokens ({mixes.shape=})")
    _Divider(division, interpret)  # validates the mode
    if lanes and (hc & (hc - 1) or hc < 2):
        raise NotImplementedError(f"one comb entry per lane needs hc a power of 2 >= 2 for Triton, got {hc=}")
    has_rms = rms is not None
    kernel = functools.partial(_lanes_kernel if lanes else _kernel, hc=hc, iters=iters, eps=float(eps), n_tokens=t,
                               block_tokens=block_tokens, has_rms=has_rms, division=division, interpret=interpret)
    args = (mixes, scale, base) + ((rms,) if has_rms else ())
    out_shape = (jax.ShapeDtypeStruct((t, hc), jnp.float32), jax.ShapeDtypeStruct((t, hc), jnp.float32),
                 jax.ShapeDtypeStruct((t, hc * hc), jnp.float32))
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(pl.cdiv(t, block_tokens),), interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="hc_split_sinkhorn")(*args)
