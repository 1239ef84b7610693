"""Pallas GPU (Triton lowering) kernel: tiles of bf16 rows times one routed expert's packed fp4
matrix each, widened inside the kernel (never in HBM).

One program per (tile, N block). A tile is up to `rows` consecutive rows of x that all use one
expert (the MoE's gather path: one (token, expert) pair per tile; the grouped path: rows sorted by
expert). The program reads its tile's expert id, first row and row count from three int32 arrays,
then walks K in blocks: loads the packed codes as int32 words [block_n, block_k/8] and the e8m0
bytes [block_n, block_k/32] of that expert, decodes the 8 codes of each word to bf16 times the
power-of-two scale (exact: <= 4 significant bits) and feeds the tensor cores, one dot per code
position, with the matching x columns [rows, block_k/8] (optionally loading only the tile's valid
rows), or with `one_dot` one dot on the 8 code positions concatenated along K. fp32
accumulation, one bf16 rounding, a masked store of the tile's valid rows. A dead tile (0 rows)
stores nothing. One launch can take G weights of one shape (an expert's w1 and w3): each
program then keeps G accumulators and loads its x columns once per K step for all G.

One row (`rows` = 1, the decode's gather path: a tile is one (token, expert) pair): no tensor
cores. Each program multiplies the decoded codes by the row's matching x columns element by
element in fp32 (exact products) and adds them into a [block_n, block_k/8] fp32 accumulator (one
running sum per column and word position), summed along its second axis once after the K loop.
No padding rows are loaded or multiplied (a 16-row tensor-core tile of one pair is 15 rows of
padding); each code then costs an fp32 conversion and an FMA instead of a share of an MMA.

K splits (`k_splits` > 1): a third grid axis; program (t, j, ks) walks the ks-th of k_splits
equal runs of K blocks and stores its fp32 sums, unrounded, to partials [k_splits, M, N] that the
caller adds in split order and rounds once (more programs for launches of under two waves).

Stream-K (`stream_k` programs): a one-axis grid; program p walks the global steps
[p*S/P, (p+1)*S/P) of the launch's S = tiles x column blocks x K blocks in block-major order, one
K loop per output block its run touches, and stores each piece as an fp32 partial (slot i: the
block's i-th program); the program that ends a block writes -0.0 to the block's unused slots.
Every program gets the same share of the work (with one program a block, the one-token w1 + w3's
216 programs on 132 SMs of two each leave 48 SMs one program, idle half the launch).

Decodes (`decode`), all exact:
  * "select": integer select of the fp32 bits per code, fp32 scale multiply, bf16 rounding;
  * "subnormal": the three magnitude bits moved into an fp32 subnormal, x 2^126, x scale (five
    integer operations a code);
  * "pairs": inline PTX on two words at a time: a byte permute puts the same byte of both words
    side by side, shifts and masks turn one code of each into a bf16 pair (a bf16 subnormal:
    the code's value times 2^-126), and two packed bf16 multiplies (x 2^126, x scale) finish it:
    about 3 integer and 1 floating operation a code against about 8 for "subnormal"; with
    `scale_fold` (every scale byte <= 128) one multiply by scale x 2^126 = 2^(b-1). GPU only
    (no interpret twin: the PTX has no CPU lowering); `_pairs_emulated` mirrors its bit logic.
  * "relaid": "pairs" on words whose bits were re-laid once (`relay`, `RELAID_SLOTS`): one byte
    permute serves four codes, three of them a mask and at most one shift away from their pair,
    the fourth three shifts: 2 permutes and 22 integer steps per 16 codes against 4 and 40, the
    same pairs bit for bit (`_relaid_emulated`). The caller passes re-laid weights.

Numerics: every product is exact (bf16 x bf16 in fp32), so the result differs from the XLA path
(dequantise to bf16, one dot) only in the order the fp32 products are added.
Scales: byte 0 is 2^-127 (an fp32 subnormal) and 0xff NaN, as `quant.e8m0_to_f32`.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._triton import SMEM_LIMIT, e8m0_f32, is_pow2


def _e2m1_f32(code: jax.Array) -> jax.Array:
    """int32 codes 0..15 -> fp32 e2m1 values. Magnitude codes 2..7 are (1 + m/2) * 2^(e-1) with
    e = code >> 1, m = code & 1: their fp32 bits are ((e + 126) << 23) | (m << 22); code 1 is 0.5,
    code 0 is 0; bit 3 is the sign (so code 8 is -0)."""
    mag = code & 7
    normal = (((mag >> 1) + 126) << 23) | ((mag & 1) << 22)
    bits = jnp.where(mag >= 2, normal, jnp.where(mag == 1, jnp.int32(126 << 23), jnp.int32(0)))
    bits = bits | ((code & 8) << 28)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)



def _e2m1_subnormal_f32(words: jax.Array, j: int) -> jax.Array:
    """Code j (bits 4j..4j+3) of int32 words -> fp32 e2m1 values, through a subnormal: the three
    magnitude bits moved straight to bits 22..24 (the exponent's two low bits and the mantissa's
    top bit: the value times 2^-126, code 1 being the subnormal 2^-127) and the sign bit to bit
    31, then one multiply by 2^126. Five integer operations per code against about a dozen for
    `_e2m1_f32` of a shifted code; exact unless the hardware flushes subnormals (XLA on CPU does,
    so interpret mode uses `_e2m1_f32`; the compiled-GPU oracle tests check it on the device)."""
    mag = (words << (22 - 4 * j)) if 4 * j <= 22 else jax.lax.shift_right_logical(words, jnp.int32(4 * j - 22))
    bits = (mag & 0x01C00000) | ((words << (28 - 4 * j)) & jnp.int32(-(2**31)))
    return jax.lax.bitcast_convert_type(bits, jnp.float32) * jnp.float32(2.0**126)


# "pairs": per byte p of the words (codes 2p, 2p+1): the prmt selector that puts byte p of word
# a in byte 0 and byte p of word b in byte 2, and per code (index, magnitude shift, sign shift)
# that moves its three magnitude bits to bf16 bits 6..8 (22..24) and its sign to bit 15 (31)
PAIRS_BYTES = tuple((p | p << 4 | (4 + p) << 8 | (4 + p) << 12, ((2 * p, 6, 12), (2 * p + 1, 2, 8)))
                    for p in range(4))
PAIRS_MAG, PAIRS_SIGN = 0x01C001C0, 0x80008000
BF16X2_2P126 = 0x7E807E80  # bf16 2^126 in both halves


def _pairs_ptx(j: int, scale_fold: bool = False) -> str:
    """PTX for `elementwise_inline_asm` with pack=2 (one result: the lowering takes one): $0 =
    code j of words $1 (low half) and $2 (high half) as bf16 times the bf16 scales in $3 (one
    per word). `scale_fold`: $3 holds each scale times 2^126 (`_e8m0_bf16_x2p126`), so one
    packed multiply finishes the pair instead of two."""
    sel, codes = PAIRS_BYTES[j // 2]
    _, ms, ss = codes[j % 2]
    regs = ["{", ".reg .b32 r_u, r_m, r_g;"] if scale_fold else [
        "{", ".reg .b32 r_u, r_m, r_g, r_k;", f"mov.b32 r_k, {BF16X2_2P126:#x};"]
    x2p126 = [] if scale_fold else ["mul.rn.bf16x2 r_m, r_m, r_k;"]
    return "\n".join([
        *regs, f"prmt.b32 r_u, $1, $2, {sel:#x};",
        f"shl.b32 r_m, r_u, {ms};", f"and.b32 r_m, r_m, {PAIRS_MAG:#x};",
        f"shl.b32 r_g, r_u, {ss};", f"and.b32 r_g, r_g, {PAIRS_SIGN:#x};",
        "or.b32 r_m, r_m, r_g;", *x2p126, "mul.rn.bf16x2 $0, r_m, $3;", "}"])


PAIRS_PTX = tuple(_pairs_ptx(j) for j in range(8))
PAIRS_PTX_FOLDED = tuple(_pairs_ptx(j, scale_fold=True) for j in range(8))
# the largest e8m0 byte whose scale times 2^126, 2^(b - 1), is still a finite bf16 (2^127)
FOLD_MAX_BYTE = 128


def _pairs_emulated(a, b) -> list:
    """The integer part of `_pairs_ptx` in numpy terms (uint32 words a, b -> for each code j the
    uint32 holding the bf16-subnormal pair), so a CPU test can check its selectors and masks."""
    import numpy as np

    a, b = np.asarray(a, np.uint64), np.asarray(b, np.uint64)
    out = [None] * 8
    for sel, codes in PAIRS_BYTES:
        u = _prmt_emulated(a, b, sel)
        for j, ms, ss in codes:
            m = ((u << np.uint64(ms)) & np.uint64(PAIRS_MAG)) | ((u << np.uint64(ss)) & np.uint64(PAIRS_SIGN))
            out[j] = m.astype(np.uint32)
    return out


# "relaid": the packed words' bits re-laid once (`relay`) so that each code j sits where one byte
# permute of two words and at most three shift-and-mask steps put code j of both words in a bf16
# pair (the "pairs" form: the value times 2^-126). RELAID_SLOTS[j]: the word bits that hold code
# j's magnitude bits 0, 1, 2 and its sign. Codes 0-2 fill byte 0 and four bits of byte 1 (their
# magnitudes in byte 0 at bits 6-8, 3-5, 0-2 of the 16-bit window bytes 0-1, each a left shift of
# 0, 3, 6 from the pair's place), code 3 the other four bits of byte 1 (three shifts); codes 4-7
# the same in bytes 2-3. Per two words: 2 byte permutes and 22 integer steps for 16 codes, against
# 4 and 40 for "pairs" (the packed multiplies are the same).
RELAID_SLOTS = ((6, 7, 8, 15), (3, 4, 5, 12), (0, 1, 2, 9), (10, 11, 14, 13),
                (22, 23, 24, 31), (19, 20, 21, 28), (16, 17, 18, 25), (26, 27, 30, 29))
# per code j: the prmt selector (bytes 0-1 or 2-3 of word a in the low half, of word b in the high
# half) and the (left shift, mask) terms whose OR is the pair (a negative shift is a logical right
# shift)
_RELAID_WINDOW = (((0, 0x81C081C0),), ((3, 0x81C081C0),), ((6, 0x81C081C0),),
                  ((-4, 0x00C000C0), (-6, 0x01000100), (2, 0x80008000)))
RELAID_OPS = tuple((0x5410 if j < 4 else 0x7632, _RELAID_WINDOW[j % 4]) for j in range(8))


def _move_bits(w: jax.Array, moves) -> jax.Array:
    """int8 [..., K/2] read as int32 words: bit src of each word moved to bit dst, for (src, dst) in
    `moves` (a permutation of 0..31)."""
    words = jax.lax.bitcast_convert_type(w.reshape(*w.shape[:-1], w.shape[-1] // 4, 4), jnp.uint32)
    out = jnp.zeros_like(words)
    for src, dst in moves:
        out = out | (((words >> src) & 1) << dst)
    return jax.lax.bitcast_convert_type(out, jnp.int8).reshape(w.shape)


# (released bit, re-laid bit): bit b of code j (bits 4j..4j+3) goes to RELAID_SLOTS[j][b]
_RELAY_MOVES = tuple((4 * j + b, dst) for j, slot in enumerate(RELAID_SLOTS) for b, dst in enumerate(slot))


def relay(w: jax.Array) -> jax.Array:
    """Packed e2m1 codes int8 [..., K/2] (released layout: code j of each 4-byte word at bits 4j..4j+3)
    -> int8 [..., K/2] with each word's bits re-laid for the "relaid" decode (`RELAID_SLOTS`).
    Same bytes per word, same words: a bit permutation within each int32 word."""
    return _move_bits(w, _RELAY_MOVES)


def unrelay(w: jax.Array) -> jax.Array:
    """The inverse of `relay`: re-laid int8 [..., K/2] -> the released layout."""
    return _move_bits(w, tuple((dst, src) for src, dst in _RELAY_MOVES))


def _relaid_ptx(j: int, scale_fold: bool = False) -> str:
    """PTX for `elementwise_inline_asm` (pack=2), as `_pairs_ptx`: $0 = code j of re-laid words $1
    (low half) and $2 (high half) as bf16 times the scales in $3, from `RELAID_OPS[j]`."""
    sel, terms = RELAID_OPS[j]
    regs = ["{", ".reg .b32 r_u, r_m, r_t;"] if scale_fold else [
        "{", ".reg .b32 r_u, r_m, r_t, r_k;", f"mov.b32 r_k, {BF16X2_2P126:#x};"]
    lines = [*regs, f"prmt.b32 r_u, $1, $2, {sel:#x};"]
    for i, (shift, mask) in enumerate(terms):
        dst = "r_m" if i == 0 else "r_t"
        src = "r_u"
        if shift:
            lines.append(f"{'shl' if shift > 0 else 'shr'}.b32 {dst}, r_u, {abs(shift)};")
            src = dst
        lines.append(f"and.b32 {dst}, {src}, {mask:#x};")
        if i:
            lines.append("or.b32 r_m, r_m, r_t;")
    if not scale_fold:
        lines.append("mul.rn.bf16x2 r_m, r_m, r_k;")
    return "\n".join([*lines, "mul.rn.bf16x2 $0, r_m, $3;", "}"])


RELAID_PTX = tuple(_relaid_ptx(j) for j in range(8))
RELAID_PTX_FOLDED = tuple(_relaid_ptx(j, scale_fold=True) for j in range(8))


def _prmt_emulated(a, b, sel):
    """prmt.b32 d, a, b, sel (default mode) on uint64 arrays holding uint32 words."""
    import numpy as np

    both = a | (b << np.uint64(32))  # the source bytes 0..7
    d = np.zeros_like(a)
    for i in range(4):
        src = (sel >> (4 * i)) & 7
        d |= ((both >> np.uint64(8 * src)) & np.uint64(0xFF)) << np.uint64(8 * i)
    return d


def _relaid_emulated(a, b) -> list:
    """The integer part of `_relaid_ptx` in numpy terms (uint32 re-laid words a, b -> per code j
    the uint32 bf16-subnormal pair), as `_pairs_emulated`."""
    import numpy as np

    a, b = np.asarray(a, np.uint64), np.asarray(b, np.uint64)
    out = []
    for sel, terms in RELAID_OPS:
        u = _prmt_emulated(a, b, sel)
        r = np.zeros_like(u)
        for shift, mask in terms:
            v = (u << np.uint64(shift)) if shift >= 0 else (u >> np.uint64(-shift))
            r |= v & np.uint64(mask)
        out.append(r.astype(np.uint32))
    return out


def _e8m0_bf16(b: jax.Array) -> jax.Array:
    """int32 e8m0 bytes -> bf16 2^(b-127): 0 -> 2^-127 (a bf16 subnormal), 255 -> NaN."""
    bits = jnp.where(b == 0, jnp.int32(0x40), jnp.where(b == 255, jnp.int32(0x7FC0), b << 7))
    return jax.lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.bfloat16)


def _e8m0_bf16_x2p126(b: jax.Array) -> jax.Array:
    """int32 e8m0 bytes 0..FOLD_MAX_BYTE -> bf16 2^(b-127) x 2^126 = 2^(b-1), exact (normal, at
    most 2^127). Larger bytes give inf or NaN: their scales must take `_e8m0_bf16`."""
    return jax.lax.bitcast_convert_type(((b + 126) << 7).astype(jnp.int16), jnp.bfloat16)


def _concat_k(parts: list) -> jax.Array:
    """8 arrays [bn, kw] -> [bn, 8 kw], part j at columns [j kw, (j + 1) kw): two-way stacks along a
    new last axis (Triton joins), the three stacked axes moved in front of the columns, merged."""
    bn, kw = parts[0].shape
    level = [jnp.stack([parts[j], parts[j + 1]], axis=-1) for j in range(0, 8, 2)]  # bit 0 of j
    level = [jnp.stack([level[j], level[j + 1]], axis=-1) for j in range(0, 4, 2)]  # bit 1
    full = jnp.stack(level, axis=-1)  # [bn, kw, 2 (bit 0), 2 (bit 1), 2 (bit 2)]
    return jnp.transpose(full, (0, 4, 3, 2, 1)).reshape(bn, 8 * kw)


def stream_k_plan(units: int, n_kblocks: int, programs: int) -> tuple[int, int]:
    """A static even split of `units` output blocks x `n_kblocks` K blocks over `programs`
    programs (program p walks the global K steps [p*S//P, (p+1)*S//P), S = units * n_kblocks,
    in unit-major order; 1 <= programs <= S, so none is empty) -> (segments: the most units one
    program touches, pieces: the most programs one unit is split over)."""
    total = units * n_kblocks
    if not 1 <= programs <= total:
        raise ValueError(f"stream-K over {total} steps needs 1..{total} programs, got {programs}")
    bounds = [p * total // programs for p in range(programs + 1)]
    segments = max((hi - 1) // n_kblocks - lo // n_kblocks + 1 for lo, hi in itertools.pairwise(bounds))
    first = [None] * units  # the program that starts each unit's K range
    last = [0] * units
    for p, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        for u in range(lo // n_kblocks, (hi - 1) // n_kblocks + 1):
            first[u] = p if first[u] is None else first[u]
            last[u] = p
    return segments, max(b - a + 1 for a, b in zip(first, last))


def _kernel(te_ref, row0_ref, valid_ref, x_ref, *refs, g: int, rows: int, block_n: int, block_k: int,
            n_kblocks: int, decode: str, mask_x: bool, one_dot: bool, scale_fold: bool, split: bool,
            stream_k: tuple[int, int, int, int] | None = None, swap_ab: bool = False, half_tiles: int = 0):
    # te/row0/valid_ref [T] int32; x_ref [M, K] bf16, columns permuted per K block (see
    # `expert_matmul`); then g weights w_ref [E, N, K/8] int32 (8 codes a word), g scales s_ref
    # [E, N, K/32] uint8 and g outputs o_ref [M, N] bf16, or [k_splits, M, N] fp32 when split
    # (this program writes rows [row0, row0 + valid) x [n0, n0 + block_n) of each, K blocks
    # [ks * n_kblocks, (ks + 1) * n_kblocks) when split). stream_k = (programs, units per tile,
    # segments, pieces): a one-axis grid of even K-step ranges (`stream_k_plan`), o_ref
    # [pieces, M, N] fp32, a unit's piece i from the i-th program that works on it. half_tiles: a
    # tile runs its K loop on the fewest of rows, rows / 2, ... rows / 2^half_tiles rows that hold
    # its valid rows (the same per-row sums).
    w_refs, s_refs, o_refs = refs[:g], refs[g:2 * g], refs[2 * g:]
    kw, ks = block_k // 8, block_k // 32
    dims = (((1,), (1,)), ((), ()))
    one_row = rows == 1

    def codes(words, sb):
        """[bn, kw] int32 words, [bn, ks] int32 e8m0 bytes -> 8 bf16 [bn, kw]: code j of each word
        times its scale. Word c holds K columns 8c .. 8c+7, all in scale group c // 4."""
        def per_word(v):
            return jnp.broadcast_to(v[:, :, None], (block_n, ks, 4)).reshape(block_n, kw)
        if decode in ("pairs", "relaid"):
            ptxs = {("pairs", False): PAIRS_PTX, ("pairs", True): PAIRS_PTX_FOLDED,
                    ("relaid", False): RELAID_PTX, ("relaid", True): RELAID_PTX_FOLDED}[decode, scale_fold]
            scales = _e8m0_bf16_x2p126 if scale_fold else _e8m0_bf16
            sw = per_word(scales(sb))
            out = jax.ShapeDtypeStruct((block_n, kw), jnp.bfloat16)
            return [plgpu.elementwise_inline_asm(ptx, args=[words, sw], constraints="=r,r,r,r", pack=2,
                                                 result_shape_dtypes=[out])[0] for ptx in ptxs]
        sf = per_word(e8m0_f32(sb))
        return [((_e2m1_subnormal_f32(words, j) if decode == "subnormal" else _e2m1_f32((words >> (4 * j)) & 0xF))
                 * sf).astype(jnp.bfloat16) for j in range(8)]

    def k_loop(e, row0, valid, n0, lo, hi, offset=0, rows=rows):
        """The tile's fp32 sums over K blocks [offset + lo, offset + hi): g accumulators
        [rows, bn] (one row: [1, bn]) of the tile's first `rows` rows."""
        def x_cols(c0, width):
            """x columns [c0, c0 + width) of the tile's rows: [rows, width] bf16; with `mask_x` rows
            past `valid` are not read (zeros: they belong to other tiles and are never stored)."""
            ref = x_ref.at[pl.ds(row0, rows), pl.ds(c0, width)]
            if not mask_x or one_row:  # (one row: the program runs only for a valid row)
                return ref[...]
            r = jax.lax.broadcasted_iota(jnp.int32, (rows, width), 0)
            return plgpu.load(ref, mask=r < valid, other=0.0)

        def body(step, accs):
            jb = offset + step
            if one_dot:  # the step's x columns at once: code j of word c is column j*kw + c
                xb = x_cols(jb * block_k, block_k)
            else:  # code j of every word: x columns j*kw + c
                xs = [x_cols(jb * block_k + j * kw, kw) for j in range(8)]
            if one_row:  # [1, kw] fp32 rows, broadcast over the tile's columns
                xs = [xj.astype(jnp.float32) for xj in xs]
            new = []
            for w_ref, s_ref, acc in zip(w_refs, s_refs, accs):
                words = w_ref[e, pl.ds(n0, block_n), pl.ds(jb * kw, kw)]  # [bn, bk/8] int32
                sb = s_ref[e, pl.ds(n0, block_n), pl.ds(jb * ks, ks)].astype(jnp.int32)  # [bn, bk/32]
                if one_row:  # exact products, added per word column (no tensor cores)
                    for xj, wj in zip(xs, codes(words, sb)):
                        acc = acc + wj.astype(jnp.float32) * xj
                else:  # dots of x [rows, .] and the decoded codes [bn, .] along their second axes
                    pairs = [(xb, _concat_k(codes(words, sb)))] if one_dot else zip(xs, codes(words, sb))
                    for xj, wj in pairs:
                        a, b = (wj, xj) if swap_ab else (xj, wj)
                        acc = acc + jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
                new.append(acc)
            return tuple(new)

        zero = jnp.zeros((block_n, kw) if one_row else (block_n, rows) if swap_ab else (rows, block_n), jnp.float32)
        accs = jax.lax.fori_loop(lo, hi, body, (zero,) * g)
        if one_row:  # each column's kw running sums, added once after the K loop
            accs = tuple(jnp.sum(acc, axis=1)[None, :] for acc in accs)
        elif swap_ab:
            accs = tuple(acc.T for acc in accs)
        return accs

    def store(o_ref, acc, row0, valid, n0, slot=None):
        r = jax.lax.broadcasted_iota(jnp.int32, acc.shape, 0)
        cols, height = pl.ds(n0, block_n), acc.shape[0]
        if slot is None:
            plgpu.store(o_ref.at[pl.ds(row0, height), cols], acc.astype(o_ref.dtype), mask=r < valid)
        else:
            plgpu.store(o_ref.at[slot, pl.ds(row0, height), cols], acc, mask=r < valid)

    if stream_k is None:
        t = pl.program_id(0)
        n0 = pl.program_id(1) * block_n
        ks_id = pl.program_id(2)
        e, row0, valid = te_ref[t], row0_ref[t], valid_ref[t]

        def run(height):
            accs = k_loop(e, row0, valid, n0, 0, n_kblocks, offset=ks_id * n_kblocks, rows=height)
            for o_ref, acc in zip(o_refs, accs):
                store(o_ref, acc, row0, valid, n0, ks_id if split else None)

        heights = [rows >> i for i in range(half_tiles + 1)]  # each holds the tiles above the next
        for height, below in zip(heights, heights[1:] + [0]):
            pl.when((valid > below) & (valid <= height))(functools.partial(run, height))
        return

    programs, n_blocks, segments, pieces = stream_k
    total = te_ref.shape[0] * n_blocks * n_kblocks
    p = pl.program_id(0)
    start, end = p * total // programs, (p + 1) * total // programs

    def segment(i):
        """This program's steps in the i-th unit its run touches (none past the run's end)."""
        u = start // n_kblocks + i
        lo = jnp.maximum(start - u * n_kblocks, 0)
        hi = jnp.minimum(end - u * n_kblocks, n_kblocks)
        t, n0 = u // n_blocks, (u % n_blocks) * block_n
        # this piece's index: programs before p that work on unit u (the first starts at u's step 0)
        piece = p - ((u * n_kblocks + 1) * programs + total - 1) // total + 1

        @pl.when((hi > lo) & (valid_ref[jnp.minimum(t, te_ref.shape[0] - 1)] > 0))
        def _():
            e, row0, valid = te_ref[t], row0_ref[t], valid_ref[t]
            accs = k_loop(e, row0, valid, n0, lo, hi)
            for o_ref, acc in zip(o_refs, accs):
                store(o_ref, acc, row0, valid, n0, piece)
            # the unit's last piece fills its unused slots with -0.0 (x + -0.0 == x, so the
            # caller's sum over all slots is the sum of the pieces)
            negative_zero = jnp.full(accs[0].shape, -0.0, jnp.float32)
            for extra in range(1, pieces):
                @pl.when((hi == n_kblocks) & (piece + extra < pieces))
                def _(slot=piece + extra):
                    for o_ref in o_refs:
                        store(o_ref, negative_zero, row0, valid, n0, slot)

    for i in range(segments):  # the units this program's K steps fall in, in order
        segment(i)


def expert_matmul(x: jax.Array, w, s, tile_expert: jax.Array, tile_row0: jax.Array,
                  tile_valid: jax.Array, *, rows: int, block_n: int, block_k: int, num_warps: int,
                  num_stages: int, interpret: bool, decode: str = "select", mask_x: bool = False,
                  one_dot: bool = False, scale_fold: bool = False, k_splits: int = 1, stream_k: int = 0,
                  swap_ab: bool = False, half_tiles: int = 0):
    """x bf16 [M, K] (M >= max(row0) + rows); w int8 [E, N, K/2]; s e8m0 (or uint8) [E, N, K/32];
    tile_* int32 [T] -> bf16 [M, N], or with k_splits > 1 fp32 partial sums [k_splits, M, N]
    (program (t, j, ks) sums the ks-th of k_splits equal runs of K blocks; the caller adds the
    partials in split order). Rows no tile covers are left unwritten (undefined).

    stream_k > 0: that many programs (at most one a step) share the launch's T x N/block_n x
    K/block_k block steps evenly (`stream_k_plan`; a program's run can span the end of one output
    block's K range and the start of the next) and the result is fp32 partials [pieces, M, N] in
    K order, a block's unused slots -0.0, which the caller adds and rounds once as for K splits.

    w and s may also be tuples of G such matrices (the same shape: an expert's w1 and w3): then
    one launch computes all G products of the same rows, each program loading its x columns once
    for the G weight tiles, and the result is a tuple of G outputs.

    The packed weight is read as int32 words [E, N, K/8]: element offsets then stay below 2^31
    for the released experts (384 x 2304 x 2560 bytes would not), and each word yields 8 codes
    with shifts. Instead of interleaving the decoded codes back into K order, x's columns are
    permuted to match within each K block (a dot's result does not depend on the K order beyond
    fp32 summation order).

    decode: "select", "subnormal", "pairs" or "relaid" (module docstring; "relaid" reads weights
    re-laid by `relay`). mask_x: load only the tile's
    valid rows of x (the others read as zeros; either way they are never stored). one_dot: the 8
    decoded code positions concatenated along K ([block_n, block_k], in x's permuted column
    order) for one dot a K step, instead of 8 dots whose results are added (Pallas gives each dot
    a zero accumulator and adds it after: an fp32 add per accumulator element per dot).
    swap_ab: the decoded weight tile is each dot's first operand (accumulators [block_n, rows],
    transposed once after the K loop): on sm_90 the MMA's A operand, taken from the registers
    the decode wrote, and x the B operand from shared memory (wgmma when block_n is a multiple of
    64), instead of x's A fragments assembled by register moves.
    scale_fold: the caller guarantees every byte of s is <= FOLD_MAX_BYTE (128: scales <= 2): the
    "pairs" decode then takes its x 2^126 in the scale, one packed multiply per two codes fewer,
    bit-identical. Not checked here (a larger byte gives inf); the loaders check
    (`dsv41_jax.loading.resolve_fp4_scale_fold`). Other decodes ignore it.
    half_tiles: up to this many halvings of a tile's height: a tile whose valid rows fit rows / 2
    (an expert's last, partly filled tile) runs a K loop of rows / 2 rows, with half the MMA
    work, one that fits rows / 4 a loop of rows / 4 (with 2 or more), and so on down to 16 rows;
    the program's branch is chosen per tile, so every height's loop is compiled. Each output
    row's sums are the same products in the same order. Needs tensor-core tiles of at least
    16 x 2^half_tiles rows and no stream-K.

    Raises NotImplementedError for shapes the Triton tiles cannot take (the caller falls back)."""
    many = isinstance(w, (tuple, list))
    ws, ss = (tuple(w), tuple(s)) if many else ((w,), (s,))
    if len(ws) != len(ss) or not ws or any(v.shape != ws[0].shape for v in ws):
        raise ValueError(f"expert_matmul: weights {[v.shape for v in ws]} and scales {len(ss)} must pair up "
                         "and share one shape")
    if decode not in ("select", "subnormal", "pairs", "relaid"):
        raise ValueError(f"decode must be 'select', 'subnormal', 'pairs' or 'relaid', got {decode=}")
    if decode in ("pairs", "relaid") and interpret:
        raise NotImplementedError(f"the {decode!r} decode is inline PTX: no interpret mode")
    g = len(ws)
    m, k = x.shape
    n_exp, n, k2 = ws[0].shape
    if x.dtype != jnp.bfloat16:
        raise NotImplementedError(f"bf16 rows only, got {x.dtype=}")
    if rows != 1 and (not is_pow2(rows) or rows < 16):
        raise NotImplementedError(f"rows per tile must be 1 (no tensor cores) or a power of 2 >= 16 for "
                                  f"tensor-core tiles, got {rows=}")
    if rows == 1 and (one_dot or swap_ab):
        raise NotImplementedError(f"one_dot / swap_ab need tensor-core tiles (rows >= 16), got rows=1 "
                                  f"({one_dot=}, {swap_ab=})")
    if not is_pow2(block_n) or block_n < 16 or n % block_n:
        raise NotImplementedError(f"block_n must be a power of 2 >= 16 dividing {n=}, got {block_n=}")
    if not is_pow2(block_k) or block_k < 128 or k % block_k:
        raise NotImplementedError(f"block_k must be a power of 2 >= 128 dividing {k=}, got {block_k=}")
    if k_splits < 1 or (k // block_k) % k_splits:
        raise NotImplementedError(f"k_splits={k_splits} must divide the {k // block_k} K blocks")
    if stream_k < 0 or (stream_k and k_splits != 1):
        raise NotImplementedError(f"stream_k={stream_k} must be 0 (off) or a program count, with k_splits=1")
    if half_tiles < 0 or (half_tiles and (rows < 16 << half_tiles or stream_k)):
        raise NotImplementedError(f"half_tiles={half_tiles} needs tiles of >= {16 << max(half_tiles, 0)} rows "
                                  f"without stream-K, got {rows=}, {stream_k=}")
    t = tile_expert.shape[0]
    programs = min(stream_k, t * (n // block_n) * (k // block_k))  # none without a K step
    plan = (programs, n // block_n) + stream_k_plan(t * (n // block_n), k // block_k, programs) if stream_k else None
    slots = plan[3] if plan else k_splits  # fp32 partial sums a row and column, or 1 (bf16 out)
    if max(n_exp * n * (k // 8), m * max(k, n * slots)) >= 2**31:
        raise NotImplementedError(f"operands too large for int32 element offsets ({ws[0].shape=}, {x.shape=})")
    smem = num_stages * (rows * block_k * 2 + g * (block_n * block_k // 2 + block_n * block_k // 32))
    if smem > SMEM_LIMIT:
        raise NotImplementedError(f"tiles need ~{smem} B of shared memory > {SMEM_LIMIT} "
                                  f"({g=}, {rows=}, {block_n=}, {block_k=}, {num_stages=})")
    ss = tuple(v if v.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(v, jnp.uint8) for v in ss)
    words = tuple(jax.lax.bitcast_convert_type(v.reshape(n_exp, n, k // 8, 4), jnp.int32)  # little-endian bytes
                  for v in ws)
    kw = block_k // 8
    # within each K block, column 8c + j moves to j * kw + c (code j of word c)
    xp = x.reshape(m, k // block_k, kw, 8).transpose(0, 1, 3, 2).reshape(m, k)
    grid = (programs, 1, 1) if plan else (t, n // block_n, k_splits)
    split = k_splits > 1 or plan is not None
    kernel = functools.partial(_kernel, g=g, rows=rows, block_n=block_n, block_k=block_k,
                               n_kblocks=k // block_k // k_splits, decode=decode, mask_x=mask_x, one_dot=one_dot,
                               scale_fold=scale_fold and decode in ("pairs", "relaid"), split=split, stream_k=plan,
                               swap_ab=swap_ab, half_tiles=half_tiles)
    whole = lambda shape: pl.BlockSpec(shape, lambda i, j, ks: (0,) * len(shape))
    o_shape = (slots, m, n) if split else (m, n)
    out = pl.pallas_call(
        kernel,
        out_shape=tuple(jax.ShapeDtypeStruct(o_shape, jnp.float32 if split else jnp.bfloat16) for _ in range(g)),
        grid=grid,
        in_specs=[whole((t,)), whole((t,)), whole((t,)), whole((m, k))] + [whole((n_exp, n, k // 8))] * g
        + [whole((n_exp, n, k // 32))] * g,
        out_specs=tuple(whole(o_shape) for _ in range(g)),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="expert_matmul_fp4" if g == 1 else f"expert_matmul_fp4_x{g}",
    )(tile_expert.astype(jnp.int32), tile_row0.astype(jnp.int32), tile_valid.astype(jnp.int32), xp, *words, *ss)
    return tuple(out) if many else out[0]
