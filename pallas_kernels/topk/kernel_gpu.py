"""Pallas GPU (Triton lowering) kernel: the ascending top-k columns of bf16 score rows, by
threshold search instead of a sort.

One program per row holds the whole row in registers (W padded to a power of 2). Each score is
mapped to a 16-bit key that orders like the scores in IEEE total order (-0 below +0, as XLA:GPU's
own top_k orders them): the bf16 bits, magnitude bits flipped for negatives. A binary search over
the 65536 key values (16 counting passes, each a compare and a sum over the row) finds T, the
k-th largest key. The row keeps every column with a key > T and, of the columns with key == T,
the first k - #(key > T) in column order (an inclusive cumsum of the ties): exactly the set that
"score descending, column ascending" ranks first. A second cumsum gives each kept column its
output slot, so the result is written already ascending. No sort, one launch per call.

Padding lanes get a key below every real one, so they are never kept (k <= W). Rows wider than
one program (MAX_WIDTH) run in chunks and then over the chunks' candidates (`_topk_in_chunks`).

`router_topk` is the MoE gate's selection (a few of a few hundred experts, in rank order): one
program per row takes the largest 32-bit total-order key k times (ties -> lower column), masking
each pick out, and reads the pick's unbiased score by its bits. No sort either. It can also form
the scores from the gate's logits itself (sqrt(softplus) in float64, each rounded once to f32 as
torch rounds them) and add the bias, saving the launch between the logits and the selection.

`router_logits` is the gate's logits for one row that has not been through its RMSNorm yet (the
FFN norm): each program forms the row's norm itself (`_triton.rms_factor`, as the one-row fp8
kernel does), normalises and rounds each tile of the row to bf16, and sums the exact f32 products
with its block of experts' weights (one expert per program by default, the K loop unrolled so that
every tile's loads issue at once); one more program writes the normalised row and its activation
quantiser's values for the experts. The norm's two launches (mean of squares, application) leave
the path to the router.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._triton import act_quant_row, fit_block, is_pow2, rms_factor, round_bf16_f32
from pallas_kernels.topk import reference as _ref

MAX_WIDTH = 16384  # columns one program holds in registers (64 a thread at 8 warps)
_DEAD = -(1 << 16)  # below every 16-bit key
_PASSES = 16  # binary search over keys -32768 .. 32767: the bracket [lo, hi) halves from 65536 to 1


def score_keys(x: jax.Array) -> jax.Array:
    """bf16 (or its f32 widening) -> int32 keys in [-32768, 32767] ordered as IEEE total order."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    mono = (bits & 0x7FFFFFFF) ^ jax.lax.shift_right_arithmetic(bits, jnp.int32(31))
    return jax.lax.shift_right_arithmetic(mono, jnp.int32(16))


def _kernel(s_ref, o_ref, *, width: int, padded: int, k: int):
    # s_ref [R, width] bf16; o_ref [R, k] int32
    row = pl.program_id(0)
    col = jnp.arange(padded, dtype=jnp.int32)
    live = col < width
    x = plgpu.load(s_ref.at[row, col], mask=live, other=0.0)
    key = jnp.where(live, score_keys(x), jnp.int32(_DEAD))

    def count_at_least(t):
        return jnp.sum((key >= t).astype(jnp.int32))

    def step(_, bracket):  # invariant: count(key >= lo) >= k > count(key >= hi)
        lo, hi = bracket
        mid = jax.lax.shift_right_arithmetic(lo + hi, jnp.int32(1))
        ok = count_at_least(mid) >= k
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, _PASSES, step, (jnp.int32(-32768), jnp.int32(32768)))
    above = key > lo
    ties = (key == lo).astype(jnp.int32)
    need = k - jnp.sum(above.astype(jnp.int32))
    keep = above | ((ties == 1) & (jnp.cumsum(ties) <= need))
    slot = jnp.cumsum(keep.astype(jnp.int32)) - 1
    # dropped lanes aim past the row's k slots and are masked off: never onto a kept lane's slot
    plgpu.store(o_ref.at[row, jnp.where(keep, slot, k + col)], col, mask=keep)


def _row_program(rows: int, width: int, max_width: int, num_warps: int | None, cols_per_warp: int,
                 max_warps: int) -> tuple[int, int]:
    """(padded width, warps) of a one-row-per-program kernel; NotImplementedError where it does not fit."""
    padded = max(32, 1 << (width - 1).bit_length())
    if padded > max_width:
        raise NotImplementedError(f"rows of {width} columns exceed the {max_width} one program holds")
    if rows == 0:
        raise NotImplementedError("no rows")
    warps = num_warps or min(max_warps, max(1, padded // cols_per_warp))
    if not is_pow2(warps):
        raise NotImplementedError(f"num_warps must be a power of 2, got {warps}")
    return padded, warps


def topk_positions(scores: jax.Array, k: int, *, num_warps: int | None, interpret: bool) -> jax.Array:
    """scores bf16 [R, W] -> int32 [R, k] (see the module docstring).

    Raises NotImplementedError for rows this kernel does not handle (the caller falls back)."""
    r, width = scores.shape
    if scores.dtype != jnp.bfloat16:
        raise NotImplementedError(f"bf16 scores only (16-bit keys), got {scores.dtype=}")
    if not 1 <= k <= width:
        raise NotImplementedError(f"k must be in [1, W={width}], got {k=}")
    if width > MAX_WIDTH and r:
        return _topk_in_chunks(scores, k, num_warps=num_warps, interpret=interpret)
    padded, warps = _row_program(r, width, MAX_WIDTH, num_warps, 512, 8)
    kernel = functools.partial(_kernel, width=width, padded=padded, k=k)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((r, k), jnp.int32), grid=(r,), interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1), name="topk_positions")(scores)


def _topk_in_chunks(scores: jax.Array, k: int, *, num_warps: int | None, interpret: bool) -> jax.Array:
    """Rows wider than one program: cut each row into c chunks of at most MAX_WIDTH columns, take
    every chunk's top-k (candidates, ascending), then the top-k of the c * k candidates. A chunk
    ranks its columns as the whole row does (key descending, column ascending), so the row's k
    first are among its chunk's k first; the candidates stay in column order, so the second pass
    breaks ties by column as the row does. The last chunk is padded with bf16 0xFFFF (key -32768,
    the lowest) at the highest columns: a pad ranks below or after every real score, and a row has
    >= k of those. Two launches of the row kernel and two gathers instead of a sort; candidates
    wider than one program (more than 32 chunks at k = 512: rows above 524288 columns) go through
    the same steps again, each round narrowing the row (chunks hold more than k columns: 32x at
    k = 512)."""
    r, width = scores.shape
    c = -(-width // MAX_WIDTH)
    chunk = -(-width // c)
    if chunk <= k:
        raise NotImplementedError(f"rows of {width} columns: {c} chunks of {chunk} columns need k < {chunk}, "
                                  f"got {k=}")
    if c * chunk > width:
        lowest = jax.lax.bitcast_convert_type(jnp.full((r, c * chunk - width), 0xFFFF, jnp.uint16), jnp.bfloat16)
        scores = jnp.concatenate([scores, lowest], axis=1)
    local = topk_positions(scores.reshape(r * c, chunk), k, num_warps=num_warps, interpret=interpret)
    cand = (local.reshape(r, c, k) + (jnp.arange(c, dtype=jnp.int32) * chunk)[None, :, None]).reshape(r, c * k)
    pick = topk_positions(jnp.take_along_axis(scores, cand, axis=1), k, num_warps=num_warps, interpret=interpret)
    return jnp.take_along_axis(cand, pick, axis=1)


ROUTER_MAX_WIDTH = 4096  # experts one program holds in registers
# score functions `router_topk` forms in the kernel (softmax needs the whole row's sum first; the
# sigmoid stays with XLA's float64 logistic)
IN_KERNEL_SCORE_FUNCS = ("sqrtsoftplus",)
_INT_MIN = -(1 << 31)


def score_keys32(x: jax.Array) -> jax.Array:
    """f32 -> int32 keys ordered as IEEE total order (-NaN < -inf < ... < -0 < +0 < ... < +NaN)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return (bits & 0x7FFFFFFF) ^ jax.lax.shift_right_arithmetic(bits, jnp.int32(31))


def _router_kernel(s_ref, b_ref, w_ref, i_ref, *, width: int, padded: int, k: int, k_pad: int,
                   score_func: str | None, bias_rows: int, interpret: bool):
    # s_ref, b_ref [R, width] f32 (scores, biased scores); with score_func s_ref holds the
    # logits and b_ref the bias [bias_rows, width]; w_ref [R, k] f32, i_ref [R, k] int32
    row = pl.program_id(0)
    col = jnp.arange(padded, dtype=jnp.int32)
    live = col < width
    scores = plgpu.load(s_ref.at[row, col], mask=live, other=0.0)
    biased = plgpu.load(b_ref.at[row if bias_rows > 1 else 0, col], mask=live, other=0.0)
    if score_func is not None:
        scores = _ref.router_scores(scores, score_func, barrier=interpret)  # (interpret: XLA runs it)
        biased = scores + biased
    key = jnp.where(live, score_keys32(biased), jnp.int32(_INT_MIN))
    bits = jax.lax.bitcast_convert_type(scores, jnp.int32)
    slot = jnp.arange(k_pad, dtype=jnp.int32)
    picks = jnp.zeros((k_pad,), jnp.int32)
    picked_bits = jnp.zeros((k_pad,), jnp.int32)
    for t in range(k):  # k is small (the gate's top-k): unrolled
        top = jnp.max(jnp.where(live, key, jnp.int32(_INT_MIN)))
        pick = jnp.min(jnp.where(live & (key == top), col, jnp.int32(padded)))
        chosen = col == pick
        picks = jnp.where(slot == t, pick, picks)
        picked_bits = jnp.where(slot == t, jnp.sum(jnp.where(chosen, bits, 0)), picked_bits)  # one term: exact
        live = live & ~chosen
    out = slot < k
    plgpu.store(i_ref.at[row, slot], picks, mask=out)
    plgpu.store(w_ref.at[row, slot], jax.lax.bitcast_convert_type(picked_bits, jnp.float32), mask=out)


def router_topk(scores: jax.Array, biased: jax.Array, k: int, *, num_warps: int | None,
                interpret: bool, score_func: str | None = None) -> tuple[jax.Array, jax.Array]:
    """scores, biased f32 [R, E] -> (weights f32 [R, k], indices int32 [R, k]): the columns of the
    k largest `biased` in rank order (descending, IEEE total order, ties -> lower column) and
    `scores` at them, bit for bit.

    With `score_func` (one of IN_KERNEL_SCORE_FUNCS) `scores` are the gate's logits and `biased`
    its bias [1, E] or [R, E]: each program forms its row's scores itself
    (`reference.router_scores`, float64 inside the kernel) and adds the bias, in the launch
    that otherwise waits for XLA's kernel doing that.

    Raises NotImplementedError for rows this kernel does not handle (the caller falls back)."""
    r, width = scores.shape
    if scores.dtype != jnp.float32 or biased.dtype != jnp.float32:
        raise NotImplementedError(f"f32 scores only, got {scores.dtype=} {biased.dtype=}")
    if score_func is not None and (score_func not in IN_KERNEL_SCORE_FUNCS or biased.ndim != 2
                                   or biased.shape[1] != width or biased.shape[0] not in (1, r)):
        raise NotImplementedError(f"scores in the kernel: {IN_KERNEL_SCORE_FUNCS} with a bias [1 or {r}, {width}], "
                                  f"got {score_func=} bias {biased.shape}")
    if score_func is None and scores.shape != biased.shape:
        raise NotImplementedError(f"scores {scores.shape} and biased scores {biased.shape} differ")
    if not 1 <= k <= min(width, 64):
        raise NotImplementedError(f"k must be in [1, min(E={width}, 64)], got {k=}")
    padded, warps = _row_program(r, width, ROUTER_MAX_WIDTH, num_warps, 256, 4)
    kernel = functools.partial(_router_kernel, width=width, padded=padded, k=k, k_pad=max(2, 1 << (k - 1).bit_length()),
                               score_func=score_func, bias_rows=biased.shape[0], interpret=interpret)
    return pl.pallas_call(
        kernel, out_shape=(jax.ShapeDtypeStruct((r, k), jnp.float32), jax.ShapeDtypeStruct((r, k), jnp.int32)),
        grid=(r,), interpret=interpret, compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        name="router_topk")(scores, biased)


def _logits_kernel(x_ref, nw_ref, w_ref, o_ref, xn_ref, xq_ref, *, k: int, block_e: int, block_k: int, eps: float,
                   interpret: bool):
    # x_ref, nw_ref [1, K] bf16 (the row before its norm, the norm's weight); w_ref [E, K] bf16;
    # o_ref [1, E] f32 (logits); xn_ref [1, K] bf16 (the normalised row) and xq_ref [1, K] bf16
    # (its act_quant values). Programs 0 .. E / block_e - 1 form logits; the last one writes the rows.
    # The K loop is unrolled: every tile's loads are independent of the sums.
    j = pl.program_id(0)
    n_logit = o_ref.shape[1] // block_e
    factor = rms_factor(x_ref, k, block_k, eps)

    def normed(c):
        cols = pl.ds(c * block_k, block_k)
        xb = x_ref[pl.ds(0, 1), cols].astype(jnp.float32)
        nwb = nw_ref[pl.ds(0, 1), cols].astype(jnp.float32)
        return cols, round_bf16_f32(nwb * (xb * factor), interpret)  # `numerics.rms_norm`'s operations

    @pl.when(j < n_logit)
    def _logits():
        acc = jnp.zeros((1, block_e), jnp.float32)
        for c in range(k // block_k):
            cols, xn = normed(c)
            wb = w_ref[pl.ds(j * block_e, block_e), cols].astype(jnp.float32)  # [be, bk]
            acc = acc + jnp.sum(wb * xn, axis=1)[None, :]  # exact products, f32 sums
        o_ref[pl.ds(0, 1), pl.ds(j * block_e, block_e)] = acc

    @pl.when(j == n_logit)
    def _rows():
        for c in range(k // block_k):
            cols, xn = normed(c)
            xn_ref[pl.ds(0, 1), cols] = xn.astype(jnp.bfloat16)
            xq_ref[pl.ds(0, 1), cols] = act_quant_row(xn).astype(jnp.bfloat16)


def router_logits(x: jax.Array, weight: jax.Array, norm_weight: jax.Array, norm_eps: float, *,
                  block_e: int = 1, block_k: int = 1024, num_warps: int = 8,
                  interpret: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x bf16 [1, K] (before its RMSNorm), weight bf16 [E, K], norm_weight bf16 [K] ->
    (logits f32 [1, E], the normalised row bf16 [1, K], its `quant.act_quant_bf16` values bf16
    [1, K]): `reference.router_logits` with the norm and `quantise`, in one launch of E / block_e
    programs of logits and one that writes the two rows. The normalised row equals `rms_norm`'s
    where the sum of squares rounds alike (its order is one fixed tree, not XLA's); each logit sums
    its exact products tile by tile (a tree inside a tile, tiles in K order).

    Raises NotImplementedError for shapes this kernel does not handle (the caller falls back)."""
    if x.ndim != 2 or x.shape[0] != 1 or weight.ndim != 2 or weight.shape[1] != x.shape[1] \
            or norm_weight.shape != (x.shape[1],):
        raise NotImplementedError(f"one row x [1, K], weight [E, K], norm weight [K]; got {x.shape=} "
                                  f"{weight.shape=} {norm_weight.shape=}")
    if not (x.dtype == weight.dtype == norm_weight.dtype == jnp.bfloat16):
        raise NotImplementedError(f"bf16 operands only, got {x.dtype=} {weight.dtype=} {norm_weight.dtype=}")
    e, k = weight.shape
    block_k, block_e = fit_block(block_k, k, 32), fit_block(block_e, e, 1)
    if k % block_k or e % block_e or not is_pow2(block_k) or not is_pow2(block_e):
        raise NotImplementedError(f"K={k} and E={e} need power-of-2 tiles dividing them (block_k >= 32), got "
                                  f"{block_k=} {block_e=}")
    kernel = functools.partial(_logits_kernel, k=k, block_e=block_e, block_k=block_k, eps=float(norm_eps),
                               interpret=interpret)
    row = jax.ShapeDtypeStruct((1, k), jnp.bfloat16)
    return pl.pallas_call(
        kernel, out_shape=(jax.ShapeDtypeStruct((1, e), jnp.float32), row, row),
        grid=(e // block_e + 1,), interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="router_logits")(x, norm_weight.reshape(1, k), weight)
