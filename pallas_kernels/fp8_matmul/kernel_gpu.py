"""Pallas GPU (Triton lowering) kernel: bf16 rows times a block-scaled fp8 (e4m3) matrix, the
weight widened inside the kernel (never in HBM).

One program per (M block, N block, K split). The program walks its share of K in `block_k`
steps: loads the e4m3 weight tile [block_n, block_k] and its e8m0 scale bytes
[block_n / 32, block_k / 32] (one scale per 32 x 32 block), widens the codes to fp32, multiplies
by the power-of-two scale (exact), rounds to bf16 (exact: an e4m3 value times a power of two
has <= 4 significant bits) and feeds the tensor cores with the matching x tile [block_m, block_k].
fp32 accumulation; with one K split the result is rounded to bf16 and stored, with several each
split stores its fp32 partial sums and the caller adds them (few output blocks at few rows: the
splits give the SMs enough programs to stream the weight).

Measured on the H200 (benchmarks/README.md): this layout beats one fp16 dot per 32-column scale
group with the scales applied to the accumulator by 1.4x at 1-64 rows.

Decoding ("decode"): "native" lets Triton convert e4m3 (hardware cvt on sm89+); "bits" builds the
fp32 value from the code's bits (exponent and mantissa moved into place and rebiased; the
subnormal codes through an int -> float conversion). Both are exact; "bits" is the fallback for
a toolchain without the cast. NaN codes (0x7f, 0xff) become NaN in both.

One row ("block_m" = 1, a decode step's single token): no tensor-core tile (15 of its 16 rows
would be padding); each program multiplies the widened, scaled weight tile by the row element by
element in fp32 (exact products, as the tensor cores form them) and sums each output column's
products, so the decoded tile never goes through shared memory into the MMA layout.

With "group_sums" (one row only) each 32-long run of a column's unscaled products w * x (one
weight scale block) is summed first and the run's sum multiplied by the block's scale, then the
runs are added: a power-of-two scale commutes with every fp32 rounding (outside the subnormal
range), so this is the same sum in another order, with one multiply a weight element fewer.

With "quantise" (one row only) the kernel takes the row before the activation quantiser (bf16 or
fp32) and applies it to each x tile it loads: per 32 elements amax = max(max|x|, 1e-4), scale
s = 2^ceil(log2(amax * fp32(1/448))), x / s clamped to +-448 and rounded to the e4m3 grid (ties to
even), times s: the values of `quant.act_quant_bf16`, so the launch of that quantiser is saved.

With "norm" (one row only) the kernel also takes the row before its RMSNorm and the norm's
weight: every program forms the row's sum of squares (the whole row, in one fixed order, so all
programs agree), then 1 / sqrt(mean + eps) with the mean, root and reciprocal correctly rounded
(float64 division and root, rounded once to fp32) as `numerics.rms_norm`, and normalises each x
tile it loads (w * (x * r), rounded to bf16 for a bf16 row) before the quantiser: the launches of
the norm's mean and its application are saved. Only the sum of squares can round otherwise than
XLA's (its order; compiled, Triton may also fuse a square into its add).

Grouped ("groups" = G > 1, the attention's block-diagonal `wo_a`): x [M, G*K] holds G inputs
side by side and the weight's N rows form G equal groups; output column n belongs to group
n // (N/G) and reads only its group's K columns of x (block_n divides N/G).

Swapped operands ("swap_ab", tensor-core tiles only): each dot takes the decoded weight tile
[block_n, block_k] as its first operand and the x tile as its second, accumulating [block_n,
block_m], transposed once before the store. On sm_90 the MMA's first operand can come from
registers, where the decode leaves the weight tile, and the second from shared memory, where x
arrives, so the decoded tile need not be written to shared memory and read back in the MMA's
layout (the expert kernel's `swap_ab`). Same products and K steps.

Numerics: every product is exact (bf16 x bf16 in fp32), so the result differs from the XLA path
(widen to bf16, one dot) only in the order the fp32 products are added.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._triton import SMEM_LIMIT, act_quant_row, e8m0_f32, is_pow2, rms_factor, round_bf16_f32

QBLOCK = 32  # weight scale block (rows and columns)


def _e4m3_bits_f32(code: jax.Array) -> jax.Array:
    """int32 e4m3 bytes (sign-extended or not) -> fp32 values. Normal codes (exponent field e >= 1):
    the 7 magnitude bits shifted to fp32 bits 20..26 and the exponent rebiased by 127 - 7;
    subnormal codes (e = 0): mantissa * 2^-9; 0x7f / 0xff: NaN."""
    mag = code & 0x7F
    normal = jax.lax.bitcast_convert_type((mag << 20) + jnp.int32(120 << 23), jnp.float32)
    sub = mag.astype(jnp.float32) * jnp.float32(2.0**-9)
    v = jnp.where(mag < 8, sub, normal)
    v = jnp.where(mag == 0x7F, jnp.float32(jnp.nan), v)
    return jnp.where((code & 0x80) != 0, -v, v)


def _kernel(x_ref, *refs, m: int, block_m: int, block_n: int, block_k: int, k_steps: int, decode: str,
            split: bool, col_blocks: tuple[int, ...], group_cols: int, k: int, quantise: bool, group_sums: bool,
            norm_eps: float | None, interpret: bool, x_splits: int, swap_ab: bool = False):
    # x_ref [M, K] bf16 (grouped: [M, G*K], output column n reads from column (n // group_cols) * K;
    # x_splits > 1: [x_splits, 1, K] fp32 partial sums of the row);
    # with norm_eps, nw_ref [1, K] bf16 (the RMSNorm weight); then per weight t: w_ref [N_t, K]
    # e4m3 ("native") or int8 ("bits"), then s_ref [N_t/32, K/32] uint8, then o_ref [M, N_t] bf16
    # or [splits, M, N_t] fp32 when split.
    # Column block j of the grid belongs to the weight whose range of col_blocks holds it.
    nw_ref = None
    if norm_eps is not None:
        nw_ref, refs = refs[0], refs[1:]
    n_w = len(col_blocks)
    w_refs, s_refs, o_refs = refs[:n_w], refs[n_w:2 * n_w], refs[2 * n_w:]
    i, j, ks = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m0 = i * block_m
    sn, sk = block_n // QBLOCK, block_k // QBLOCK
    rows = m0 + jax.lax.broadcasted_iota(jnp.int32, (block_m, block_k), 0)
    dims = (((1,), (1,)), ((), ()))

    def e8m0_wide(sb):  # [bn/32, bk/32] scale bytes -> fp32 [bn, bk], one scale per 32 x 32 block
        return jnp.broadcast_to(e8m0_f32(sb)[:, None, :, None], (sn, QBLOCK, sk, QBLOCK)).reshape(block_n, block_k)

    factor = None if nw_ref is None else rms_factor(x_ref, k, block_k, norm_eps)

    def one_block(w_ref, s_ref, o_ref, n0):
        x0 = 0 if group_cols is None else (n0 // group_cols) * k

        def body(step, acc):
            kb = ks * k_steps + step
            if x_splits > 1:  # the row's partial sums, added in split order and rounded to bf16
                xb = x_ref[0, pl.ds(0, 1), pl.ds(kb * block_k, block_k)]
                for sp in range(1, x_splits):
                    xb = xb + x_ref[sp, pl.ds(0, 1), pl.ds(kb * block_k, block_k)]
                xb = round_bf16_f32(xb, interpret)
            else:
                xb = plgpu.load(x_ref.at[pl.ds(m0, block_m), pl.ds(x0 + kb * block_k, block_k)], mask=rows < m,
                                other=0.0)
            wb = w_ref[pl.ds(n0, block_n), pl.ds(kb * block_k, block_k)]
            sb = s_ref[pl.ds(n0 // QBLOCK, sn), pl.ds(kb * sk, sk)].astype(jnp.int32)  # [bn/32, bk/32]
            wf = wb.astype(jnp.float32) if decode == "native" else _e4m3_bits_f32(wb.astype(jnp.int32))
            if block_m == 1:  # one row: exact fp32 products on the CUDA cores, summed per column
                if factor is not None:  # the RMSNorm, as `numerics.rms_norm` applies it
                    nwb = nw_ref[pl.ds(0, 1), pl.ds(kb * block_k, block_k)].astype(jnp.float32)
                    xb = nwb * (xb.astype(jnp.float32) * factor)
                    if x_ref.dtype == jnp.bfloat16:
                        xb = round_bf16_f32(xb, interpret)
                xf = act_quant_row(xb) if quantise else xb.astype(jnp.float32)
                if group_sums:  # each 32-long run of unscaled products summed, then times its scale
                    runs = jnp.sum((wf * xf).reshape(block_n, sk, QBLOCK), axis=2)  # [bn, bk/32]
                    s_runs = jnp.broadcast_to(e8m0_f32(sb)[:, None, :], (sn, QBLOCK, sk)).reshape(block_n, sk)
                    return acc + jnp.sum(runs * s_runs, axis=1)[None, :]
                return acc + jnp.sum((wf * e8m0_wide(sb)) * xf, axis=1)[None, :]
            wv = (wf * e8m0_wide(sb)).astype(jnp.bfloat16)  # exact
            a, b = (wv, xb) if swap_ab else (xb, wv)
            return acc + jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

        shape = (block_n, block_m) if swap_ab else (block_m, block_n)
        acc = jax.lax.fori_loop(0, k_steps, body, jnp.zeros(shape, jnp.float32))
        if swap_ab:
            acc = acc.T
        out_rows = m0 + jax.lax.broadcasted_iota(jnp.int32, (block_m, block_n), 0)
        cols = pl.ds(n0, block_n)
        if split:
            plgpu.store(o_ref.at[ks, pl.ds(m0, block_m), cols], acc, mask=out_rows < m)
        else:
            plgpu.store(o_ref.at[pl.ds(m0, block_m), cols], acc.astype(o_ref.dtype), mask=out_rows < m)

    if n_w == 1:
        one_block(w_refs[0], s_refs[0], o_refs[0], j * block_n)
        return
    first = 0
    for t, blocks in enumerate(col_blocks):
        @pl.when((j >= first) & (j < first + blocks))
        def _(t=t, first=first):
            one_block(w_refs[t], s_refs[t], o_refs[t], (j - first) * block_n)
        first += blocks


def fp8_matmul(x: jax.Array, w: jax.Array, s: jax.Array, *, groups: int = 1, **tiles) -> jax.Array:
    """x bf16 [M, K] (act-quantised rows; [M, G*K] with `groups` G, module docstring); w e4m3
    [N, K]; s e8m0 (or uint8) [N/32, K/32] -> bf16 [M, N] when k_splits == 1, else fp32 partial
    sums [k_splits, M, N] (the caller adds them in split order). `tiles`: as `fp8_matmul_many`.

    Raises NotImplementedError for shapes the Triton tiles cannot take (the caller falls back)."""
    return fp8_matmul_many(x, (w,), (s,), groups=groups, **tiles)[0]


def fp8_matmul_many(x: jax.Array, ws: tuple[jax.Array, ...], ss: tuple[jax.Array, ...], *, block_m: int,
                    block_n: int, block_k: int, k_splits: int, num_warps: int, num_stages: int, decode: str,
                    interpret: bool, groups: int = 1, quantise: bool = False, group_sums: bool = False,
                    norm: tuple[jax.Array, float] | None = None, swap_ab: bool = False) -> tuple[jax.Array, ...]:
    """The same rows x bf16 [M, K] times several block-scaled matrices ws[t] e4m3 [N_t, K] (scales
    ss[t] [N_t/32, K/32]) in one launch: one tuple entry per matrix, each as `fp8_matmul` returns
    it. The grid's column blocks run through the matrices in order; every output column is
    computed by the same program code, K steps and split as a launch of its matrix alone with
    these tiles (bit-identical results), and the weights stream in one launch instead of several.

    `groups` G > 1: one matrix, x [M, G*K], output column n reading group n // (N/G) of x.
    `quantise`: x [1, K] bf16 or fp32 before the activation quantiser, applied in the kernel
    (block_m 1, no groups; module docstring).
    `group_sums`: one row (block_m 1) with each 32-long run of products summed before its
    scale multiplies it (module docstring).
    `norm` (weight bf16 [K], eps): one row (block_m 1, no groups) before its RMSNorm, applied in
    the kernel (module docstring): the launch takes `numerics.rms_norm(x, weight, eps)`'s place.
    `swap_ab`: tensor-core tiles (block_m >= 16) with the decoded weight tile as each dot's first
    operand (module docstring).
    x may also be fp32 [S, 1, K]: one row as the S K-split partial sums of the launch before
    (block_m 1, no groups, no norm), added in split order and rounded to bf16 as each x tile is
    loaded, in place of the caller's sum.

    Raises NotImplementedError for shapes the Triton tiles cannot take (the caller falls back)."""
    x_splits = x.shape[0] if x.ndim == 3 else 1
    if x.ndim == 3 and (x.shape[1] != 1 or x.dtype != jnp.float32 or block_m != 1 or groups != 1
                        or norm is not None):
        raise NotImplementedError(f"partial sums of one row: fp32 [S, 1, K] with block_m 1, no groups, no norm; "
                                  f"got {x.shape=} {x.dtype=} {block_m=} {groups=} norm={norm is not None}")
    xv = jax.ShapeDtypeStruct(x.shape[1:], x.dtype) if x.ndim == 3 else x  # the row(s) [M, K] the checks see
    m = xv.shape[0]
    k = ws[0].shape[-1] if ws else xv.shape[1]
    if groups < 1 or (groups > 1 and len(ws) != 1) or xv.shape[1] != groups * k:
        raise NotImplementedError(f"x [M, groups * K] with groups >= 1 (one matrix when > 1), got {xv.shape=} "
                                  f"{groups=} K={k} for {len(ws)} matrices")
    if quantise and (block_m != 1 or groups != 1 or xv.dtype not in (jnp.bfloat16, jnp.float32)):
        raise NotImplementedError(f"the in-kernel quantiser takes one bf16 or fp32 row (block_m 1, no groups), got "
                                  f"{block_m=} {groups=} {x.dtype=}")
    if norm is not None and (block_m != 1 or groups != 1 or norm[0].shape != (k,)):
        raise NotImplementedError(f"the in-kernel RMSNorm takes one row (block_m 1, no groups) and a weight [{k}], "
                                  f"got {block_m=} {groups=} weight {norm[0].shape}")
    if swap_ab and block_m == 1:
        raise NotImplementedError("swap_ab swaps the operands of tensor-core tiles (block_m >= 16), got block_m=1")
    if group_sums and block_m != 1:
        raise NotImplementedError(f"group_sums is the one-row (block_m 1) product sum, got {block_m=}")
    if xv.dtype != jnp.bfloat16 and not quantise:
        raise NotImplementedError(f"bf16 rows only, got {x.dtype=}")
    if not ws or len(ws) != len(ss):
        raise NotImplementedError(f"one scale per weight, got {len(ws)} weights and {len(ss)} scales")
    if decode not in ("native", "bits"):
        raise NotImplementedError(f"decode must be 'native' or 'bits', got {decode=}")
    if block_m != 1 and (not is_pow2(block_m) or block_m < 16):
        raise NotImplementedError(f"block_m must be 1 (one row, no tensor cores) or a power of 2 >= 16 for "
                                  f"tensor-core tiles, got {block_m=}")
    if not is_pow2(block_k) or block_k < QBLOCK or k % block_k:
        raise NotImplementedError(f"block_k must be a power of 2 >= {QBLOCK} dividing {k=}, got {block_k=}")
    if k_splits < 1 or (k // block_k) % k_splits:
        raise NotImplementedError(f"k_splits={k_splits} must divide the {k // block_k} K blocks")
    for w, s in zip(ws, ss):
        n = w.shape[0]
        if w.dtype != jnp.float8_e4m3fn or w.ndim != 2 or w.shape[1] != k:
            raise NotImplementedError(f"e4m3 weights [N, {k}] only, got {w.shape=} {w.dtype=}")
        if not is_pow2(block_n) or block_n < QBLOCK or n % groups or (n // groups) % block_n:
            raise NotImplementedError(f"block_n must be a power of 2 >= {QBLOCK} dividing {n=} / {groups=}, "
                                      f"got {block_n=}")
        if s.shape != (n // QBLOCK, k // QBLOCK):
            raise NotImplementedError(f"scale {s.shape} is not [{n // QBLOCK}, {k // QBLOCK}]")
        if max(n * k, m * max(groups * k, n) * k_splits) >= 2**31:
            raise NotImplementedError(f"operands too large for int32 element offsets ({w.shape=}, {x.shape=})")
    smem = num_stages * (block_m * block_k * xv.dtype.itemsize * x_splits + block_n * block_k
                         + (block_n // QBLOCK) * (block_k // QBLOCK))
    if smem > SMEM_LIMIT:
        raise NotImplementedError(f"tiles need ~{smem} B of shared memory > {SMEM_LIMIT} "
                                  f"({block_m=}, {block_n=}, {block_k=}, {num_stages=})")
    ss = tuple(s if s.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(s, jnp.uint8) for s in ss)
    if decode == "bits":
        ws = tuple(jax.lax.bitcast_convert_type(w, jnp.int8) for w in ws)
    split = k_splits > 1
    col_blocks = tuple(w.shape[0] // block_n for w in ws)
    kernel = functools.partial(_kernel, m=m, block_m=block_m, block_n=block_n, block_k=block_k,
                               k_steps=k // block_k // k_splits, decode=decode, split=split, col_blocks=col_blocks,
                               group_cols=ws[0].shape[0] // groups if groups > 1 else None, k=k,
                               quantise=quantise, group_sums=group_sums,
                               norm_eps=None if norm is None else float(norm[1]), interpret=interpret,
                               x_splits=x_splits, swap_ab=swap_ab)
    out_shape = tuple(jax.ShapeDtypeStruct((k_splits, m, w.shape[0]), jnp.float32) if split
                      else jax.ShapeDtypeStruct((m, w.shape[0]), jnp.bfloat16) for w in ws)
    whole = lambda shape: pl.BlockSpec(shape, lambda i, j, ks: (0,) * len(shape))
    nw = () if norm is None else (norm[0].reshape(1, k),)
    return tuple(pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(pl.cdiv(m, block_m), sum(col_blocks), k_splits),
        in_specs=[whole(x.shape)] + [whole(a.shape) for a in nw] + [whole(w.shape) for w in ws]
        + [whole(s.shape) for s in ss],
        out_specs=[whole(o.shape) for o in out_shape],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="fp8_matmul",
    )(x, *nw, *ws, *ss))
