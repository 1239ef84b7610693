"""Dispatch for the routed-expert fp4 matmul (SPEC §6.2, §13: the experts' `linear()` with packed
e2m1 weights and e8m0 scales per row and 32 columns).

Two entry points, one kernel:
  * `gather_matmul(x [R, K], w, s, expert [R])`: row r times expert[r]'s matrix (the MoE decode
    path, one (token, expert) pair per row);
  * `grouped_matmul(x [M, K], w, s, tiles)`: rows sorted by expert, cut into tiles of one expert
    each by `grouped_tiles` (the prefill path).
Both take w and s as one matrix stack or as tuples of stacks of one shape (an expert's w1 and w3,
which multiply the same rows), and then return a tuple; on the kernel path such a tuple runs as
one launch (`BlockSizes.fuse`).
`implementation`: "reference" (jnp: widen the selected experts to bf16, then dot; reference.py),
"pallas" (kernel_gpu: read packed fp4 + scales, widen inside the kernel), "auto" (the kernel on a
GPU, the reference on CPU; pallas_kernels/_dispatch.py). A shape the kernel does not handle falls
back to the reference with a logged warning; a TPU falls back the same way (no TPU kernel yet).
Both give the same exact products with fp32 accumulation and one bf16 rounding; they may differ
only in the order the products are summed (measured: benchmarks/README.md).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from dsv41_jax.numerics import to_bf16
from pallas_kernels._dispatch import gpu_kernel, split_batch
from pallas_kernels._triton import fit_block
from pallas_kernels.expert_matmul import kernel_gpu
from pallas_kernels.expert_matmul import reference as _ref
from pallas_kernels.fp8_matmul.api import split_for_waves

logger = logging.getLogger(__name__)

Implementation = Literal["auto", "reference", "pallas"]
# one-row K splits: the dense fp8 kernel's rule (two programs per SM of an H100/H200, waves at
# least 70% full)
TARGET_PROGRAMS, MIN_WAVE_FILL = 264, 0.7

@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles of the GPU kernel; None picks a default from the rows per tile.

    block_n: output columns per program (power of 2 >= 16 dividing N).
    block_k: reduction step (power of 2 >= 128 dividing K; 32-column scale groups stay whole).
    num_warps, num_stages: Triton launch parameters. Defaults by rows per tile: up to 16 rows
      (decode batches) 4 warps, 64-column blocks stepping K by 512, 3 stages; more rows
      (prefill-sized batches) 8 warps, 256 x 128 blocks, 3 stages. On an H100 the 4096-token
      prefill's w1 / w2 launches took 3.30 / 3.33 ms in 64-row tiles of 128 x 128 blocks, 4
      warps, 2 stages (the earlier default), 2.81 / 2.82 in 64-row tiles of the new blocks and
      2.63 / 2.64 in 128-row ones; 16384 tokens 9.47 / 9.38, 8.25 / 8.10 and 6.75 / 6.75 ms;
      outputs identical bit for bit (benchmarks/README.md, forty-second session).
    decode: how the codes become bf16 (kernel_gpu's docstring): "select", "subnormal" (five
      integer operations a code through an fp32 subnormal) or "pairs" (inline PTX: a byte permute,
      four integer operations and two packed bf16 multiplies per two codes). With "pairs" the
      decode no longer bounds the kernel: a variant that skips it (wrong values, timing only)
      runs no faster at 1, 8 or 64 tokens (benchmarks/README.md, seventh run). None: "pairs" for
      compiled GPU kernels (1.3-1.6x faster than "subnormal" on the H200; exact: the compiled
      oracle tests pass), "select" in interpret mode (PTX has no CPU path; XLA on CPU flushes
      subnormals). "relaid": the caller passes weights re-laid by `kernel_gpu.relay` (a bit
      permutation within each int32 word) and the kernel decodes them with fewer integer steps
      than "pairs" (same bf16 values, same products, the same sums in the same order: bit-identical
      outputs). Where the reference runs instead (CPU, interpret mode, a shape the kernel
      refuses) the weights are put back in the released layout first (`kernel_gpu.unrelay`).
    Defaults measured on the released w1 (N 2304, K 5120) and w2 (N 5120, K 2304) on the H200
    (device time from profiles, benchmarks/README.md, ninth run): at up to 16 rows per tile
    64-column blocks (one token, w1: 26.9 against 35.6 µs with 128 columns, 28.9 with 32; w2
    27.4 against 27.6; eight tokens: w1 140.0 against 147.4 with 32), block_k 512 (1.25-1.3x
    faster than 256 with "pairs"; w2's K 2304 takes 256) and 3 stages (2: 30.1 µs); splitting K
    over 2-5 programs gains nothing there (27.1-28.1 µs). Larger tiles: see num_warps.
    fuse: a tuple of weights (w1, w3) in one launch whose programs load x once per K step for
      both weight tiles (else one launch per weight). None: fused at <= 16-row tiles (decode),
      one launch each above (prefill).
    mask_x: each program loads only its tile's valid rows of x (a gather tile holds one pair, so
      15 of its 16 rows are other pairs' rows that are never stored; a 64-token decode's grouped
      tiles hold 1-2 pairs).
    one_dot: one dot a K step on the 8 decoded code positions concatenated along K, instead of a
      dot per code position plus an add of its result (kernel_gpu.expert_matmul). Compiled without
      a GPU (benchmarks/triton_sass.py, triton 3.9.0): the K loop's instructions fall 5% (w1 + w3
      at decode tiles), 8% (w1) and 41% (64-row prefill tiles), the fused launch's spills mostly
      go. On the H200 (twenty-third run) no faster at decode, hence off. One-row programs have no dot
      (ignored there).
    swap_ab: each dot takes the decoded weight tile as its first operand and x as its second
      (kernel_gpu.expert_matmul): the MMA's A operand then comes from the registers the decode
      wrote, and x (the B operand) from shared memory. Compiled without a GPU
      (benchmarks/triton_sass.py, triton 3.9.0, relaid decode with the fold, instructions a warp a
      K step): w1 + w3 at the one-token tile 2004 -> 1753 (-13%; 460 register moves that assemble
      x's A fragments go, wgmma replaces mma.sync), w2 610 -> 556; with `one_dot` 1584 (-21%) and
      446 (-27%), and the 64-row prefill tile 999 -> 494 with no decoded tile stored to shared
      memory. Same products, fp32 sums in another order. Timed on an H100 (benchmarks/README.md,
      thirty-eighth session; device time, one token, relaid with the fold): w2 23.05 -> 20.53 µs
      with `one_dot` (-11%), 23.49 without; the fused w1 + w3 slower, 41.42 -> 47.06 µs with
      `one_dot` and 54.00 without, despite fewer instructions; hence off. Compiled, the fused
      launch's K step decodes a whole weight tile into registers, issues its wgmma chain and
      waits for it before the next tile (no overlap of decode and MMA inside a program), and its
      shared memory (116 KB at 3 stages of 512) holds one program an SM where the default holds
      two: its 216 one-token programs take 1.64 waves instead of 0.82 (`benchmarks.triton_sass`,
      "programs / SM"); w2's 480 keep 4 an SM either way. None of the fused launch's residency
      variants beat its default on an H100 (thirty-ninth session: 2 stages 46.18, block_k 256
      43.95 against 42.17 µs; 64 tokens +11%, +4% at block_k 256).
    swap_ab_single: `swap_ab` and `one_dot` for the launches of one weight matrix alone (w2, and
      w1 / w3 where they are not fused: tiles of more than 16 rows), the fused w1 + w3 launch
      keeps the defaults. Timed on an H100 (thirty-ninth session, device time a launch, outputs
      bit-identical to the default's at every site): w2 23.42 -> 20.85 µs at one token (-11%),
      662.5 -> 661.0 at 64 tokens; a 4096-token prefill's w1 3588 -> 3364 µs (-6.2%) and w2
      3603 -> 3444 (-4.4%). In the six-layer model (fortieth session, paired rounds in one
      process, every round faster): the decode step 1540.1 -> 1525.6 µs at batch 1 (-0.9%),
      15219.6 -> 15180.8 at batch 64 (-0.3%), a 4096-token prefill 130.7 -> 127.6 ms (-2.4%); the
      prefill tile's residency variants with it (block_n 64, 8 warps, 3 stages) were not faster.
      On by default.
    one_row: the gather path (one (token, expert) pair a tile: decode at up to 64 pairs) runs
      one-row programs without tensor cores (kernel_gpu's docstring) instead of 16-row
      tensor-core tiles of which 15 rows are padding. Same products, fp32 sums in another order.
      Compiled without a GPU (benchmarks/triton_sass.py) its K loop has no MMA, no spills and fewer
      registers, but more instructions a code (5.9 against 4.6 for w1 + w3 with the fold). On an
      H100 the decode step is 11% slower with it at batch 1 and 25% at batch 8 (benchmarks/README.md,
      twenty-seventh session), hence off.
    k_splits: programs sharing one output block's K range (fp32 partials [k_splits, rows, N],
      added in split order and rounded to bf16 once by a small XLA reduction after the launch);
      more programs in flight for launches of under two waves (the one-token decode's w1 + w3 is
      216 programs of 64 columns on 132 SMs). Same products, fp32 sums in another order. None:
      1 for tensor-core tiles; for one-row programs the dense fp8 kernel's rule
      (`fp8_matmul.api.split_for_waves`: the fewest splits giving >= 264 programs whose waves
      are >= 70% full; 2 for the one-token w1 + w3, 1 for its w2 of 480 programs).
    stream_k: programs (0: off) that share a launch's tile x column-block x K-block steps evenly
      (`kernel_gpu.stream_k_plan`; a program's run can end inside one output block and go on into
      the next), for launches of under two waves whose waves leave SMs idle: the one-token decode's
      w1 + w3 is 216 programs on 132 SMs of two programs each, so 48 SMs hold one. Each piece of an
      output block is an fp32 partial, added in K order and rounded to bf16 once by a small XLA
      reduction after the launch (same products, fp32 sums in another order). Applied only where
      the launch has fewer output blocks than 2 x stream_k (else 0: its waves are full enough);
      with K splits it is off. Timed on an H100 at 264 programs (benchmarks/README.md,
      thirty-eighth session; device time, one token): w1 + w3 41.50 against 41.42 µs, w2 25.98
      against 23.05: no gain, hence off (0).
    half_tiles: up to this many halvings of a tile's height (never below 16 rows): a tile whose
      valid rows fit half the tile (an expert's last tile, partly filled) runs a K loop of half
      the rows, one that fits a quarter (with 2 or more) a quarter, and so on: less MMA work on
      padding rows, the same decode; each row's sums are the same products in the same order.
      The MoE sets it by `halvings_for` (3 where 128-row tiles hold at most 64 pairs an expert
      on average, else 0). On an H100 (benchmarks/README.md, forty-third session, device time,
      uniform random routing): the 4096-token prefill's w1 2645 -> 2649 µs, w2 2674 -> 2626 with
      3 halvings; 16384 tokens' w1 6750 -> 6839 (+1.3%: most tiles full, the larger kernel
      slower); 2048 tokens' 64-row w1 2059 -> 2096; in the six-layer model (its random gate
      routes less evenly: more partly filled tiles) a 4096-token prefill 120.71 -> 118.55 ms
      (-1.8%, paired rounds, the same logits). Default 0 here.
    scale_fold: the caller has checked that every e8m0 byte of the scales is <= 128 (scales <=
      2; `dsv41_jax.loading.resolve_fp4_scale_fold` does it once at load): the "pairs" decode then
      multiplies each code pair once, by scale x 2^126, instead of by 2^126 and by the scale
      (bit-identical for those bytes; larger bytes would give inf). Dropping that multiply (wrong
      values, timing only) made w1 7-9% faster at 8 and 64 tokens on the H200 (seventh run); the
      fold made w1 at 64 tokens 7% faster and a decode step 3% (batch 1) and 7.5% (batch 64)
      (twenty-third run). Other decodes ignore it.
    Measured in the six-layer decode step on the H200 (benchmarks/README.md, tenth run, device
    time a step, against the ninth run's unmasked, unfused kernels): w2 with masked x 133 against
    147 µs at one token, 3847 against 4408 at 64 tokens; w1 and w3 fused with masked x 267
    against 281 µs (two launches) at one token, 7560 against 7516 at 64 tokens. In one session,
    unfused with masked x the whole step took 0.6% longer (2118 / 15833 against 2106 / 15731 µs
    at batch 1 / 64); a 4096-token prefill took 120.7 ms fused and 115.6 ms unfused.
    """
    block_n: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    decode: str | None = None
    fuse: bool | None = None
    mask_x: bool = True
    one_dot: bool = False
    swap_ab: bool = False
    swap_ab_single: bool = True
    scale_fold: bool = False
    one_row: bool = False
    k_splits: int | None = None
    stream_k: int = 0
    half_tiles: int = 0

    def resolved(self, rows: int, n: int, k: int, interpret: bool = False, tiles: int = 0,
                 weights: int = 1) -> BlockSizes:
        """Tiles for `tiles` tiles of `rows` rows times `weights` [n, k] matrices (`tiles` only sets
        one-row K splits; 0: unknown, no split; `weights` > 1: a tuple, fused or not by `fuse`)."""
        # few rows: the program streams weight bytes, 64-column blocks; many rows: 256 x 128
        # blocks of 8 warps (each decoded weight byte serves all the tile's rows). Defaults
        # halve until they divide the shape (the kernel rejects what still does not).
        block_n = self.block_n or fit_block(64 if rows <= 16 else 256, n, 16)
        block_k = self.block_k or fit_block(512 if rows <= 16 else 128, k, 128)
        num_stages = self.num_stages or 3
        num_warps = self.num_warps or (4 if rows <= 16 else 8)
        decode = self.decode or ("select" if interpret else "pairs")
        fuse = rows <= 16 if self.fuse is None else self.fuse
        k_splits = self.k_splits
        if k_splits is None:
            k_splits = 1
            if rows == 1 and tiles:
                k_splits = split_for_waves(tiles * (n // block_n), max(k // block_k, 1), TARGET_PROGRAMS,
                                           MIN_WAVE_FILL)
        stream_k = self.stream_k if k_splits == 1 and 0 < tiles * (n // block_n) < 2 * self.stream_k else 0
        single = self.swap_ab_single and (weights == 1 or not fuse)
        if self.half_tiles < 0:
            raise ValueError(f"BlockSizes.half_tiles must be >= 0 (halvings of a tile's height), got {self.half_tiles}")
        # lower loops down to 16 rows (tensor-core tiles only)
        halvings = 0 if stream_k or rows <= 16 else min(self.half_tiles, (rows // 16).bit_length() - 1)
        return dataclasses.replace(self, block_n=block_n, block_k=block_k, num_stages=num_stages,
                                   num_warps=num_warps, decode=decode,
                                   fuse=fuse, one_dot=(self.one_dot or single) and rows > 1,
                                   swap_ab=(self.swap_ab or single) and rows > 1, k_splits=k_splits,
                                   stream_k=stream_k, half_tiles=halvings)

    def kernel_args(self) -> dict:
        """The `kernel_gpu.expert_matmul` keyword arguments of resolved block sizes."""
        return {"block_n": self.block_n, "block_k": self.block_k, "num_warps": self.num_warps,
                "num_stages": self.num_stages, "decode": self.decode, "mask_x": self.mask_x, "one_dot": self.one_dot,
                "scale_fold": self.scale_fold, "k_splits": self.k_splits, "stream_k": self.stream_k, "swap_ab": self.swap_ab,
                "half_tiles": self.half_tiles}


def _many(w, s) -> bool:
    """Whether (w, s) are tuples of matrix stacks rather than one stack each."""
    if isinstance(w, (tuple, list)) != isinstance(s, (tuple, list)) or (
            isinstance(w, (tuple, list)) and (not w or len(w) != len(s))):
        raise ValueError("w and s must both be arrays or both tuples of the same length")
    return isinstance(w, (tuple, list))


def _validate(x, w, s, what: str):
    if _many(w, s):
        for wi, si in zip(w, s):
            _validate(x, wi, si, what)
        if len({wi.shape for wi in w}) != 1:
            raise ValueError(f"{what}: a tuple of weights must share one shape, got {[wi.shape for wi in w]}")
        return
    if x.ndim != 2:
        raise ValueError(f"{what}: x must be [rows, K], got {x.shape=}")
    if w.ndim != 3 or w.dtype not in (jnp.int8, jnp.uint8):
        raise ValueError(f"{what}: w must be packed e2m1 int8 [E, N, K/2], got {w.shape=} {w.dtype=}")
    k = x.shape[1]
    if k % 32 or w.shape[2] * 2 != k:
        raise ValueError(f"{what}: x has K={k}, w holds K={w.shape[2] * 2} (K must be a multiple of 32)")
    if s.shape != (*w.shape[:2], k // 32):
        raise ValueError(f"{what}: s must be e8m0 [E, N, K/32] = {(*w.shape[:2], k // 32)}, got {s.shape=}")


def _kernel_or_none(x, w, s, te, row0, valid, rows, interpret, block_sizes):
    """The kernel's output (a tuple for tuple weights), or None when the reference must run (a
    shape the kernel refuses); callers check `gpu_kernel` first."""
    many = _many(w, s)
    w0 = w[0] if many else w
    bs = (block_sizes or BlockSizes()).resolved(rows, w0.shape[1], x.shape[1], interpret, tiles=te.shape[0],
                                                weights=len(w) if many else 1)

    def call(w, s):
        out = kernel_gpu.expert_matmul(x.astype(jnp.bfloat16), w, s, te, row0, valid, rows=rows,
                                       interpret=interpret, **bs.kernel_args())
        if bs.k_splits == 1 and not bs.stream_k:
            return out
        return tuple(to_bf16(jnp.sum(o, axis=0)) for o in out) if isinstance(out, tuple) else to_bf16(
            jnp.sum(out, axis=0))

    try:
        if many and not bs.fuse:
            return tuple(call(wi, si) for wi, si in zip(w, s))
        return call(tuple(w), tuple(s)) if many else call(w, s)
    except NotImplementedError as e:
        logger.warning("expert_matmul: kernel does not handle x %s w %s (%s); using the reference",
                       x.shape, w0.shape, e)
        return None


def _released(w, block_sizes):
    """w as the reference reads it: re-laid weights (decode "relaid") back in the released layout
    (`kernel_gpu.unrelay`, a pass over the stack: the reference path of re-laid weights is for
    shapes the kernel refuses and for checks, not for speed)."""
    if block_sizes is None or block_sizes.decode != "relaid":
        return w
    return tuple(kernel_gpu.unrelay(v) for v in w) if isinstance(w, (tuple, list)) else kernel_gpu.unrelay(w)


def _each(fn, w, s, *args):
    """fn(w, s, *args) per weight of a tuple (a tuple of results), or once."""
    if _many(w, s):
        return tuple(fn(wi, si, *args) for wi, si in zip(w, s))
    return fn(w, s, *args)


def gather_matmul(x: jax.Array, w: jax.Array, s: jax.Array, expert: jax.Array, *,
                  implementation: Implementation = "auto", interpret: bool = False,
                  block_sizes: BlockSizes | None = None) -> jax.Array:
    """x bf16 [R, K] (act-quantised rows), w int8 [E, N, K/2], s e8m0 [E, N, K/32], expert int [R]
    -> bf16 [R, N] = x[r] @ dequant(w[expert[r]])^T, fp32 accumulation (w, s tuples: a tuple)."""
    _validate(x, w, s, "gather_matmul")
    r = x.shape[0]
    if expert.shape != (r,):
        raise ValueError(f"gather_matmul: expert must be [R={r}], got {expert.shape=}")
    if r == 0 or not gpu_kernel(implementation, interpret, "expert_matmul"):
        return _each(lambda w, s: _ref.gather_matmul(x, w, s, expert), _released(w, block_sizes), s)

    one_row = (block_sizes or BlockSizes()).one_row

    def local(x, expert):  # per data shard on a mesh (split_batch): pairs are token-major
        r = x.shape[0]
        # a tile is one pair: one row without tensor cores, or a 16-row tensor-core tile whose
        # other 15 rows are padding (masked at the store)
        rows = 1 if one_row else 16
        xp = x.astype(jnp.bfloat16) if rows == 1 else jnp.pad(x.astype(jnp.bfloat16), ((0, rows - 1), (0, 0)))
        # tile t is row t: numpy constants, which XLA keeps as literals (jnp.arange became an iota
        # kernel before each launch on GPUs, 12 a six-layer decode step)
        ar, ones = np.arange(r, dtype=np.int32), np.ones((r,), np.int32)
        out = _kernel_or_none(xp, w, s, expert.astype(jnp.int32), ar, ones, rows, interpret, block_sizes)
        if out is None:
            return _each(lambda w, s: _ref.gather_matmul(x, w, s, expert), _released(w, block_sizes), s)
        return tuple(o[:r] for o in out) if isinstance(out, tuple) else out[:r]

    return split_batch(local, (x, expert), (True, True), "gather_matmul")


def tile_rows_for(pairs: int, n_experts: int) -> int:
    """Rows per tile for `grouped_matmul` on the kernel path: R = `pairs` (token, expert) pairs
    over `n_experts` experts (never more than the next power of 2 >= R, at least 16).

    Every live tile reads and decodes its expert's whole matrix, so small tiles repeat that work
    and large ones pay MMA work on padding rows (an expert's last tile is partly empty; with
    `halvings_for`'s lower loops a 128-row tile holding few rows runs a shorter K loop). By the
    average pairs an expert p: 16 rows while p <= 14 (decode batches and prefills up to 896 tokens
    on the released 384 experts); 128 rows for 14 < p <= 24; 64 rows for 24 < p <= 32; 128 beyond.
    Measured on an H100 (`benchmarks.expert_launches`, one launch, uniform random routing;
    benchmarks/README.md, forty-second to forty-fourth sessions): w1 at 512 tokens 16-row tiles
    1404 µs against 128-row ones 1631, at 896 tokens 1760 against 1758, at 1024 1901 against 1795
    (w2 1962 against 1786; 64-row tiles 1851 / 1840), at 1536 64-row tiles 1960 against 128-row
    ones 1945, at 2048 2059 against 2093, at 4096 128-row tiles 1.07x faster than 64-row ones and
    at 16384 1.2x."""
    p = pairs / n_experts
    if p <= 14:
        c = 16
    elif p <= 24:
        c = 128
    elif p <= 32:
        c = 64
    else:
        c = 128
    return max(16, min(c, pl.next_power_of_2(pairs)))


def halvings_for(pairs: int, n_experts: int) -> int:
    """`BlockSizes.half_tiles` for `grouped_matmul` on the kernel path, beside `tile_rows_for`:
    3 (K loops of 128, 64, 32 or 16 rows, the fewest holding a tile's rows) while 128-row tiles
    hold at most 64 pairs an expert on average (prefills of 897-1536 and 2049-4096 tokens on the
    released 384 experts: many of an expert's tiles at most half full), else 0. Measured on an
    H100 at 4096 tokens (in the model 1.8% faster a prefill), at 1024 and 1536 (the launches with
    128-row tiles and these loops the fastest, above) and at 16384 (the launch 1.3% slower)
    (benchmarks/README.md, forty-third and forty-fourth sessions)."""
    return 3 if tile_rows_for(pairs, n_experts) == 128 and pairs <= 64 * n_experts else 0


def grouped_tiles(indices: jax.Array, n_experts: int, tile_rows: int):
    """Pairs -> expert-sorted rows cut into tiles of one expert each.

    indices int [R] (the expert of each pair). Returns (order int [R]: sorted row i is pair
    order[i], stable so pairs keep their order within an expert; tile_expert, tile_row0,
    tile_valid int32 [T]) with T = min(R, (R + E * (c - 1)) // c) static, c = tile_rows: each
    expert wastes less than one tile and every live tile holds >= 1 row; dead tiles have valid 0
    and row0 R (pointing at the c rows of padding the caller appends)."""
    r = indices.shape[0]
    c = tile_rows
    order = jnp.argsort(indices, stable=True)
    counts = jnp.zeros((n_experts,), jnp.int32).at[indices].add(1)
    starts = jnp.cumsum(counts) - counts
    n_tiles = (counts + c - 1) // c
    tile_end = jnp.cumsum(n_tiles)
    max_tiles = min(r, (r + n_experts * (c - 1)) // c)
    t = jnp.arange(max_tiles, dtype=jnp.int32)
    # the count of tile ends <= t, by one comparison table ([T, E] booleans: 147k at a 64-token
    # decode): the default binary search is a loop of small kernels on GPUs (108 launches a
    # six-layer decode step at batch 64)
    tile_expert = jnp.searchsorted(tile_end, t, side="right", method="compare_all").astype(jnp.int32)
    live = tile_expert < n_experts
    e = jnp.minimum(tile_expert, n_experts - 1)
    j = t - (tile_end[e] - n_tiles[e])
    row0 = jnp.where(live, starts[e] + j * c, r).astype(jnp.int32)
    valid = jnp.where(live, jnp.clip(counts[e] - j * c, 0, c), 0).astype(jnp.int32)
    return order, e, row0, valid


def grouped_matmul(x: jax.Array, w: jax.Array, s: jax.Array, tile_expert: jax.Array, tile_row0: jax.Array,
                   tile_valid: jax.Array, rows_per_tile: int, *, implementation: Implementation = "auto",
                   interpret: bool = False, block_sizes: BlockSizes | None = None) -> jax.Array:
    """x bf16 [M, K] sorted by expert with M >= max(tile_row0) + rows_per_tile (pad with zero
    rows); tiles from `grouped_tiles` -> bf16 [M, N]: row i of tile t is x[i] @ dequant(w[e_t])^T
    (w, s tuples: a tuple). Rows no live tile covers are 0 on the reference path and undefined on
    the kernel path."""
    _validate(x, w, s, "grouped_matmul")
    out = None
    if gpu_kernel(implementation, interpret, "expert_matmul"):
        out = _kernel_or_none(x, w, s, tile_expert, tile_row0, tile_valid, rows_per_tile, interpret, block_sizes)
    if out is None:
        return _each(lambda w, s: _ref.grouped_matmul(x, w, s, tile_expert, tile_row0, tile_valid, rows_per_tile),
                     _released(w, block_sizes), s)
    return out
