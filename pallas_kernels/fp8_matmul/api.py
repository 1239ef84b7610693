"""Dispatch for the dense fp8 matmul (SPEC §3, §13: the reference's `linear()` with an e4m3 weight
and e8m0 scales per 32 x 32 block).

`fp8_matmul(x [M, K], w, s)` multiplies act-quantised bf16 rows by the block-scaled matrix;
`linear(x [..., K], w, s)` is the whole `linear()` (activation quantiser, then the matmul);
`linear_many(x, ws, ss)` is `linear` for several matrices of one input, in one kernel launch.
`grouped(x [..., G, K], w [G*R, K], s)` is the attention's block-diagonal `wo_a` (bf16 inputs,
not quantised; group g of x times the g-th R rows of the matrix).
`implementation`: "reference" (jnp: widen the weight to bf16, then dot; reference.py), "pallas"
(kernel_gpu: read e4m3 + scales, widen inside the kernel), "auto" (the kernel on a GPU, the
reference on CPU; pallas_kernels/_dispatch.py). The kernel serves few rows (decode), where the
matmul streams the weight and XLA's widened copy would triple the bytes; above
`BlockSizes.max_rows` rows (prefill) the weight is reused across rows and XLA's GEMM runs.
A shape the kernel does not handle falls back to the reference with a logged warning; a TPU
falls back the same way (no TPU kernel yet). Both give the same exact products with fp32
accumulation and one bf16 rounding; they may differ only in the order the products are summed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Literal

import jax
import jax.numpy as jnp

from dsv41_jax import quant
from dsv41_jax.numerics import rms_norm, to_bf16
from pallas_kernels._dispatch import gpu_kernel, split_batch
from pallas_kernels._triton import fit_block
from pallas_kernels.fp8_matmul import kernel_gpu
from pallas_kernels.fp8_matmul import reference as _ref

logger = logging.getLogger(__name__)

Implementation = Literal["auto", "reference", "pallas"]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles of the GPU kernel; None picks a default from the row count.

    block_m: rows per program (power of 2 >= 16, or 1: one row without tensor cores, kernel_gpu's
    docstring). block_n: output columns per program (power of 2 >= 32 dividing N). block_k:
    reduction step (power of 2 >= 32 dividing K).
    one_row: a single row (M = 1) takes block_m 1 when block_m is not given.
    quantise_one_row: with block_m 1, `linear` leaves the activation quantiser to the kernel (it
      quantises each x tile it loads, kernel_gpu's docstring) instead of a launch of its own
      (same values; on the H200 a layer's eight projections 72.1 against 89.0 µs of device
      time, benchmarks/README.md, sixteenth run).
    norm_one_row: with block_m 1 and the activation quantiser in the kernel, `linear_many`'s
      RMSNorm (`norm_weight`) is applied in the kernel too (kernel_gpu's docstring) instead of
      its two launches (the mean of squares, then its application).
    chain_one_row: `grouped_linear` of a single row hands the first launch's K-split partial
      sums to the second, which adds them itself (instead of a launch adding them in between).
    one_row_group_sums: with block_m 1, each 32-long run of a column's unscaled products is summed
      and then multiplied by its block's scale (kernel_gpu's docstring) instead of scaling every
      weight element before the sum (on the H200 a layer's eight projections 67.7 against 71.1 µs
      of device time, `wq_b` 14.2 against 15.5; benchmarks/README.md, twentieth run).
    k_splits: programs sharing one output block's K range (their fp32 partials are then added);
      None picks the fewest that give `target_programs` programs, and for one row (block_m 1)
      the fewest whose programs also fill at least `min_wave_fill` of their waves of
      `target_programs` (else the split that fills them best): a launch of 1.2 waves runs nearly
      as long as one of 2. On the H200 at one row `wo_b` (80 column blocks) took 18.3 µs with 4
      splits (320 programs, 61% of 2 waves) and 15.3 with 8 (640, 81% of 3), shared `w1` + `w3`
      13.8 against 11.9 µs; a layer's eight projections 67.8 against 63.8 µs, the six-layer
      decode step at batch 1 1502 against 1444 µs (benchmarks/README.md, twenty-first run).
      Tensor-core tiles keep the fewest (in the step at batch 8 / 64 the rule measured 4271 /
      15656 against 4222 / 15738 µs: no gain).
    swap_ab: tensor-core tiles (block_m >= 16) take the decoded weight tile as each dot's first
      operand, so on sm_90 it can reach the MMA from registers instead of through shared memory
      (kernel_gpu's docstring; the expert kernel's `swap_ab`). Same products and K steps. One-row
      launches ignore it. Off: not yet timed (benchmarks.fp8_linear --variants swap=1 ...);
      the 64-row launches run at about 31% of the copy rate (benchmarks/README.md, forty-eighth
      session), bound by the weight tile's widening and layout change, not by HBM.
    num_warps, num_stages: Triton launch parameters. decode: "native" | "bits" (kernel_gpu).
    max_rows: above this many rows `linear` uses XLA's GEMM instead of the kernel (64: on the H200
      the kernel is 1.7x faster at 64 rows and 1.45x slower at 256, benchmarks/README.md).
    """
    block_m: int | None = None
    block_n: int | None = None
    block_k: int | None = None
    k_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 3
    decode: str = "native"
    swap_ab: bool = False
    max_rows: int = 64
    target_programs: int = 264  # two per SM of an H100/H200
    min_wave_fill: float = 0.7
    one_row: bool = True
    quantise_one_row: bool = True
    norm_one_row: bool = True
    chain_one_row: bool = True
    one_row_group_sums: bool = True

    def resolved(self, m: int, n: int | tuple[int, ...], k: int) -> BlockSizes:
        """Tiles for m rows times [n, k] (n a tuple: several matrices in one launch, block_n
        dividing each)."""
        ns = (n,) if isinstance(n, int) else tuple(n)
        tensor_core_rows = min(max(16, 1 << max(m - 1, 0).bit_length()), 64)
        block_m = self.block_m or (1 if m == 1 and self.one_row else tensor_core_rows)
        block_n = self.block_n or fit_block(64, math.gcd(*ns), kernel_gpu.QBLOCK)
        block_k = self.block_k or fit_block(256 if block_m <= 64 else 128, k, kernel_gpu.QBLOCK)
        k_splits = self.k_splits
        if k_splits is None:
            programs = -(-m // block_m) * max(sum(n_t // block_n for n_t in ns), 1)
            k_blocks = max(k // block_k, 1)
            k_splits = split_for_waves(programs, k_blocks, self.target_programs,
                                       self.min_wave_fill if block_m == 1 else 0.0)
        return dataclasses.replace(self, block_m=block_m, block_n=block_n, block_k=block_k, k_splits=k_splits)

    def kernel_args(self) -> dict:
        """`kernel_gpu.fp8_matmul_many`'s tile keywords for resolved tiles (`resolved`): the
        one-row option (`one_row_group_sums`) where block_m is 1, `swap_ab` on tensor-core tiles."""
        one_row = self.block_m == 1
        return {"block_m": self.block_m, "block_n": self.block_n, "block_k": self.block_k, "k_splits": self.k_splits,
                "num_warps": self.num_warps, "num_stages": self.num_stages, "decode": self.decode,
                "group_sums": self.one_row_group_sums and one_row, "swap_ab": self.swap_ab and not one_row}


def split_for_waves(programs: int, k_blocks: int, target: int, min_fill: float) -> int:
    """K splits (a divisor of k_blocks) for a launch of `programs` output blocks: the fewest
    giving >= `target` programs whose waves of `target` are at least `min_fill` full, else among
    those giving >= `target` the one filling its waves best (the fewest on a tie), else all."""
    divisors = [d for d in range(1, k_blocks + 1) if k_blocks % d == 0]
    enough = [d for d in divisors if programs * d >= target]
    if not enough:
        return divisors[-1]

    def fill(d):
        p = programs * d
        return p / (-(-p // target) * target)

    return next((d for d in enough if fill(d) >= min_fill), max(enough, key=lambda d: (fill(d), -d)))


def _validate(x, w, s):
    if x.ndim != 2:
        raise ValueError(f"fp8_matmul: x must be [rows, K], got {x.shape=}")
    if w.ndim != 2 or w.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"fp8_matmul: w must be e4m3 [N, K], got {w.shape=} {w.dtype=}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"fp8_matmul: x has K={x.shape[1]}, w has K={w.shape[1]}")
    _validate_scale("fp8_matmul", w, s)


def _validate_scale(name, w, s):
    n, k = w.shape
    want = (-(-n // kernel_gpu.QBLOCK), -(-k // kernel_gpu.QBLOCK))
    if s.shape != want:
        raise ValueError(f"{name}: s must be e8m0 [ceil(N/32), ceil(K/32)] = {want}, got {s.shape=}")


def _kernel_or_none(x, ws, ss, interpret, block_sizes, groups=1, quantise=False, norm=None, keep_splits=False):
    """The kernel's outputs (a tuple, one per weight), or None when the reference must run (a
    shape the kernel refuses); callers check `gpu_kernel` first. `groups`, `quantise`, `norm`:
    kernel_gpu's (with `quantise` x is the row before the activation quantiser, with `norm` the
    row before the RMSNorm, passed as it is; x [S, 1, K]: one row's partial sums). With
    `keep_splits` the K-split partials [S, M, N] are returned unsummed (bf16 [M, N] at 1 split)."""
    m, k = x.shape[-2], ws[0].shape[1]
    ns = tuple(w.shape[0] // groups for w in ws) * groups  # block_n must divide each group's rows
    bs = (block_sizes or BlockSizes()).resolved(m, ns, k)
    try:
        outs = kernel_gpu.fp8_matmul_many(x if quantise else x.astype(jnp.bfloat16), tuple(ws), tuple(ss),
                                          interpret=interpret, groups=groups, quantise=quantise, norm=norm,
                                          **bs.kernel_args())
    except NotImplementedError as e:
        logger.warning("fp8_matmul: kernel does not handle x %s w %s (%s); using the reference", x.shape,
                       [w.shape for w in ws], e)
        return None
    return tuple(to_bf16(jnp.sum(o, axis=0)) for o in outs) if bs.k_splits > 1 and not keep_splits else outs


@functools.partial(jax.jit, static_argnames=("implementation", "interpret", "block_sizes"))
def fp8_matmul(x: jax.Array, w: jax.Array, s: jax.Array, *, implementation: Implementation = "auto",
               interpret: bool = False, block_sizes: BlockSizes | None = None) -> jax.Array:
    """x bf16 [M, K] (act-quantised rows: `quant.act_quant_bf16`), w e4m3 [N, K],
    s e8m0 [ceil(N/32), ceil(K/32)] -> bf16 [M, N] = x @ dequant(w)^T, fp32 accumulation, one
    bf16 rounding."""
    _validate(x, w, s)
    out = _kernel_or_none(x, (w,), (s,), interpret, block_sizes) \
        if gpu_kernel(implementation, interpret, "fp8_matmul") else None
    return _ref.fp8_matmul(x, w, s) if out is None else out[0]


@functools.partial(jax.jit, static_argnames=("implementation", "interpret", "block_sizes"))
def linear(x: jax.Array, w: jax.Array, s: jax.Array, *, implementation: Implementation = "auto",
           interpret: bool = False, block_sizes: BlockSizes | None = None) -> jax.Array:
    """The fp8 `linear()`: x [..., K] (bf16/fp32), w e4m3 [N, K], s e8m0 -> bf16 [..., N].

    act_quant(x) (e4m3 per 32, power-of-two scales; exact in bf16), then the kernel for up to
    `max_rows` rows, else (or on the reference path) `quant.linear_fp8` (XLA). On a mesh that
    splits `data` the leading dim is split (`_dispatch.split_batch`) and `max_rows` applies to
    each shard's rows."""
    return linear_many(x, (w,), (s,), implementation=implementation, interpret=interpret,
                       block_sizes=block_sizes)[0]


@functools.partial(jax.jit, static_argnames=("implementation", "interpret", "block_sizes", "norm_eps"))
def linear_many(x: jax.Array, ws: tuple[jax.Array, ...], ss: tuple[jax.Array, ...], *,
                implementation: Implementation = "auto", interpret: bool = False,
                block_sizes: BlockSizes | None = None, norm_weight: jax.Array | None = None,
                norm_eps: float | None = None) -> tuple[jax.Array, ...]:
    """`linear(x, w, s)` for each (w, s) of ws / ss (all [N_t, K] for x's K) -> a tuple of bf16
    [..., N_t]. On the kernel path the rows are quantised once (a single row inside the kernel,
    `BlockSizes.quantise_one_row`) and every matrix streams in one launch
    (`kernel_gpu.fp8_matmul_many`); the tiles (K splits included) are picked for the
    combined grid, so a result may differ from its own `linear` call only in the order of its
    fp32 sums.

    With `norm_weight` (bf16 [K]) and `norm_eps` x is the input of an RMSNorm and the matrices
    multiply `numerics.rms_norm(x, norm_weight, norm_eps)`: a single row quantised in the kernel
    is normalised there too (`BlockSizes.norm_one_row`; only the order of the norm's sum of
    squares differs), other rows go through `rms_norm` first."""
    bs = block_sizes or BlockSizes()
    ws, ss = tuple(ws), tuple(ss)
    if len(ws) != len(ss) or not ws:
        raise ValueError(f"linear_many: one scale per weight, got {len(ws)} weights and {len(ss)} scales")
    if (norm_weight is None) != (norm_eps is None) or (norm_weight is not None and norm_weight.shape != x.shape[-1:]):
        raise ValueError(f"linear_many: norm_weight [{x.shape[-1]}] and norm_eps go together, got "
                         f"{None if norm_weight is None else norm_weight.shape} and {norm_eps}")
    if x.size == 0 or not gpu_kernel(implementation, interpret, "fp8_matmul"):
        x = x if norm_weight is None else rms_norm(x, norm_weight, norm_eps)
        return tuple(quant.linear_fp8(x, w, s) for w, s in zip(ws, ss))
    n_w = len(ws)

    def local(x, *wss):  # per data shard on a mesh (split_batch): the row count is the shard's
        ws, ss, nw = wss[:n_w], wss[n_w:2 * n_w], wss[2 * n_w:]
        normed = (lambda x: x) if not nw else (lambda x: rms_norm(x, nw[0], norm_eps))
        rows = math.prod(x.shape[:-1])
        if rows > bs.max_rows:
            return tuple(quant.linear_fp8(normed(x), w, s) for w, s in zip(ws, ss))
        in_kernel = (bs.quantise_one_row and x.dtype in (jnp.bfloat16, jnp.float32)
                     and bs.resolved(rows, tuple(w.shape[0] for w in ws), x.shape[-1]).block_m == 1)
        norm = None
        if in_kernel and nw and bs.norm_one_row:
            norm = (nw[0], norm_eps)
        else:
            x = normed(x)
        xq = x.reshape(rows, x.shape[-1]) if in_kernel else quant.act_quant_bf16(x).reshape(rows, x.shape[-1])
        for w, s in zip(ws, ss):
            _validate(xq, w, s)
        outs = _kernel_or_none(xq, ws, ss, interpret, bs, quantise=in_kernel, norm=norm)
        if outs is None:
            return tuple(quant.linear_fp8(x if norm is None else normed(x), w, s) for w, s in zip(ws, ss))
        return tuple(o.reshape(*x.shape[:-1], w.shape[0]) for o, w in zip(outs, ws))

    args = (x, *ws, *ss) + (() if norm_weight is None else (norm_weight,))
    if x.ndim > 1:
        return split_batch(local, args, (True,) + (False,) * (len(args) - 1), "fp8 linear")
    return local(*args)


@functools.partial(jax.jit, static_argnames=("implementation", "interpret", "block_sizes"))
def grouped_linear(x: jax.Array, wa: jax.Array, sa: jax.Array, wb: jax.Array, sb: jax.Array, *,
                   implementation: Implementation = "auto", interpret: bool = False,
                   block_sizes: BlockSizes | None = None) -> jax.Array:
    """`linear(grouped(x, wa, sa), wb, sb)` (the attention's `wo_a`, then `wo_b`): x bf16
    [..., G, K] -> bf16 [..., N_b]. A single row on the kernel path (`BlockSizes.chain_one_row`)
    hands wo_a's K-split partial sums straight to wo_b's launch, which adds them in split order
    and rounds to bf16 as it loads each x tile (kernel_gpu's docstring): the launch that adds
    them in between is saved. Only the order of those fp32 sums can differ from the two calls."""
    bs = block_sizes or BlockSizes()
    lead = x.shape[:-2]
    chained = (x.ndim >= 2 and math.prod(lead) == 1 and bs.chain_one_row and bs.quantise_one_row
               and gpu_kernel(implementation, interpret, "fp8_matmul"))
    if chained and wa.ndim == 2 and wb.ndim == 2 and wb.shape[1] == wa.shape[0] \
            and bs.resolved(1, wb.shape[0], wb.shape[1]).block_m == 1:
        g, k = x.shape[-2:]
        n_a = wa.shape[0]
        for name, w, s, kw in (("wa", wa, sa, k), ("wb", wb, sb, n_a)):
            if w.dtype != jnp.float8_e4m3fn or w.shape[1] != kw:
                raise ValueError(f"fp8_matmul.grouped_linear: {name} must be e4m3 [N, {kw}], got {w.shape=} {w.dtype=}")
            _validate_scale(f"fp8_matmul.grouped_linear ({name})", w, s)
        parts = None
        if n_a % g == 0:
            parts = _kernel_or_none(x.reshape(1, g * k), (wa,), (sa,), interpret, bs, groups=g, keep_splits=True)
        if parts is not None:
            pa = parts[0]  # fp32 partial sums [S, 1, n_a], or bf16 [1, n_a] from one split
            out = _kernel_or_none(pa, (wb,), (sb,), interpret, bs, quantise=True)
            if out is not None:
                return out[0].reshape(*lead, wb.shape[0])
    y = grouped(x, wa, sa, implementation=implementation, interpret=interpret, block_sizes=block_sizes)
    return linear(y.reshape(*lead, -1), wb, sb, implementation=implementation, interpret=interpret,
                  block_sizes=block_sizes)


@functools.partial(jax.jit, static_argnames=("implementation", "interpret", "block_sizes"))
def grouped(x: jax.Array, w: jax.Array, s: jax.Array, *, implementation: Implementation = "auto",
            interpret: bool = False, block_sizes: BlockSizes | None = None) -> jax.Array:
    """Block-diagonal matmul (the attention's `wo_a`, SPEC §5.11): x bf16 [..., G, K], w e4m3
    [G*R, K], s e8m0 [G*R/32, ceil(K/32)] -> bf16 [..., G, R], out[..., g, :] = x[..., g, :] @
    dequant(w)[g*R:(g+1)*R]^T with fp32 accumulation and one bf16 rounding. x is used as given
    (no activation quantiser). The kernel (one launch, `groups`=G) for up to `max_rows` rows,
    else the reference (`reference.grouped`: XLA widens the matrix, then one einsum)."""
    bs = block_sizes or BlockSizes()
    if x.ndim < 2 or w.ndim != 2 or w.dtype != jnp.float8_e4m3fn or w.shape[1] != x.shape[-1] \
            or w.shape[0] % x.shape[-2]:
        raise ValueError(f"fp8_matmul.grouped: x [..., G, K] and e4m3 w [G*R, K], got {x.shape=} {w.shape=} "
                         f"{w.dtype=}")
    _validate_scale("fp8_matmul.grouped", w, s)
    g, k = x.shape[-2:]
    n = w.shape[0]
    if x.size == 0 or not gpu_kernel(implementation, interpret, "fp8_matmul"):
        return _ref.grouped(x, w, s)

    def local(x, w, s):  # per data shard on a mesh (split_batch)
        rows = math.prod(x.shape[:-2])
        tiles = bs
        if bs.k_splits is None and rows > 16:
            # measured on the H200 at 64 rows (benchmarks/README.md, fourteenth run): one K split
            # 27.5 µs, the 264-program default (4 splits) 35.3
            tiles = dataclasses.replace(bs, k_splits=1)
        out = None
        if rows <= bs.max_rows:
            out = _kernel_or_none(x.reshape(rows, g * k), (w,), (s,), interpret, tiles, groups=g)
        if out is None:
            return _ref.grouped(x, w, s)
        return out[0].reshape(*x.shape[:-2], g, n // g)

    if x.ndim > 2:
        return split_batch(local, (x, w, s), (True, False, False), "fp8 grouped")
    return local(x, w, s)
