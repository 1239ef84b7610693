"""TMA probe: how fast a bulk-asynchronous-copy (TMA) pipeline streams the dense fp8 projections
on one GPU, against the Triton kernel the model runs (pallas_kernels/fp8_matmul) and against an
XLA copy of the same size. No product path uses this kernel; it measures whether moving the fp8
matmul to Mosaic GPU (TMA into shared memory, wgmma) lifts the 45-57% of copy bandwidth the
Triton kernel reaches at one row (benchmarks/README.md, thirteenth run).

    python -m benchmarks.tma_probe [--rows 1,16] [--only LABEL] [--stream-shapes 65536x8192] [--json PATH]

The probe kernel (`fp8_matmul_tma`, Mosaic GPU, Hopper): one program per (64 output columns,
K split); `plgpu.emit_pipeline` brings each K step's e4m3 weight tile [64, block_k] and bf16 row
tile [rows (padded to 8), block_k] into shared memory with TMA, `stages` steps in flight. The
weight tile is the wgmma's register operand: per 32-column scale group it is widened to fp32,
multiplied by its two e8m0 scales (rows 0-31 and 32-63 of the tile, read from HBM as scalars)
and rounded to bf16 (exact), then multiplied with the matching x^T columns into one fp32
accumulator. The same exact products as the Triton kernel, summed in another order. With
`scaled=False` the scales are skipped (wrong values; the pipeline's own speed). The result is
transposed ([N, rows] per K split), so XLA adds the splits, transposes and rounds afterwards.

`fp8_matmul_tma_persistent`: the same products with at most one program per SM, each streaming
several (column block, K split) items through one pipeline, and the scale bytes staged through
TMA with the weights; `products=False` streams the tiles without computing (the pipeline's own
rate), `--stream-shapes` runs one row through large matrices (the steady-state rate). Timed in
the twenty-first run: slower than the Triton kernel at the model's sizes.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from benchmarks.fp8_linear import SHAPES, weights
from benchmarks.kernels import Row, _best, _fmt, _time, start_run, write_json
from pallas_kernels._triton import e8m0_f32

BLOCK_N = 64  # wgmma rows: one tile of output columns
GROUP = 32  # weight scale block
SCALE_ROW = 128  # bytes of staged scales a K step (TMA shared-memory destinations: 128-byte aligned)


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu
    try:  # jax 0.11 registers the Mosaic GPU lowering only when this module is imported
        from jax._src.pallas.mosaic_gpu import pallas_call_registration  # noqa: F401
    except ImportError:
        pass
    return plgpu


def _tile_transforms(plgpu):
    """(e4m3 tile, bf16 rows): 32- and 64-byte swizzles, one tile column per scale group, so a
    group's slice of either is whole tiles."""
    return ((plgpu.TilingTransform((8, GROUP)), plgpu.SwizzleTransform(32)),
            (plgpu.TilingTransform((8, GROUP)), plgpu.SwizzleTransform(64)))


def _step_products(acc_ref, w_tile, x_tile, groups: int, scale_bytes) -> None:
    """acc_ref [64, rows] += w_tile [64, 32 * groups] e4m3 (widened, scaled per 32-column group,
    rounded to bf16: exact) times x_tile [rows, 32 * groups]^T, one wgmma per group.
    scale_bytes(g) -> the e8m0 bytes of rows 0-31 and 32-63 for group g, or None (unscaled)."""
    plgpu = _plgpu()
    top = jax.lax.broadcasted_iota(jnp.int32, (BLOCK_N, GROUP), 0) < GROUP
    for g in range(groups):
        a = w_tile[:, pl.ds(g * GROUP, GROUP)].astype(jnp.float32)
        if scale_bytes is not None:
            b0, b1 = (b.astype(jnp.int32) for b in scale_bytes(g))
            a = a * e8m0_f32(jnp.where(top, b0, b1))
        xt = plgpu.transpose_ref(x_tile.at[:, pl.ds(g * GROUP, GROUP)], (1, 0))
        plgpu.wgmma(acc_ref, a.astype(jnp.bfloat16), xt)
    plgpu.wgmma_wait(0)


def _prepare(x, w, s, block_k: int, k_splits: int, what: str):
    """Shape checks and the operands both kernels share: (plgpu, x padded to `rows` rows, rows,
    uint8 scales, K steps per split, scale groups per step, (weight, row) tile transforms)."""
    m, k = x.shape
    if m > 64 or w.shape[0] % BLOCK_N or block_k % GROUP or k % (block_k * k_splits):
        raise ValueError(f"{what}: unsupported shape {x.shape=} {w.shape=} {block_k=} {k_splits=}")
    plgpu = _plgpu()
    rows = max(8, -(-m // 8) * 8)
    x = jnp.pad(x.astype(jnp.bfloat16), ((0, rows - m), (0, 0)))
    s = s if s.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(s, jnp.uint8)
    return plgpu, x, rows, s, k // block_k // k_splits, block_k // GROUP, _tile_transforms(plgpu)


def fp8_matmul_tma(x: jax.Array, w: jax.Array, s: jax.Array, *, block_k: int = 256, stages: int = 4,
                   k_splits: int = 1, scaled: bool = True) -> jax.Array:
    """x bf16 [M, K] (M <= 64), w e4m3 [N, K], s e8m0 [N/32, K/32] -> bf16 [M, N] (module
    docstring). N must divide by 64, K by block_k * k_splits (block_k a multiple of 32)."""
    m, n = x.shape[0], w.shape[0]
    plgpu, x, rows, s, steps, groups, (w_tf, x_tf) = _prepare(x, w, s, block_k, k_splits, "fp8_matmul_tma")

    def body(w_hbm, x_hbm, s_hbm, o_hbm):
        nb, sp = jax.lax.axis_index("n"), jax.lax.axis_index("k")

        def accumulate(acc_ref):
            def step(idx, w_tile, x_tile):
                g0 = (sp * steps + idx[0]) * groups
                _step_products(acc_ref, w_tile, x_tile, groups, (lambda g: (
                    s_hbm[2 * nb, g0 + g], s_hbm[2 * nb + 1, g0 + g])) if scaled else None)

            plgpu.emit_pipeline(
                step, grid=(steps,), max_concurrent_steps=stages,
                in_specs=[plgpu.BlockSpec((BLOCK_N, block_k), lambda j: (nb, sp * steps + j), transforms=w_tf),
                          plgpu.BlockSpec((rows, block_k), lambda j: (0, sp * steps + j), transforms=x_tf)],
            )(w_hbm, x_hbm)
            return acc_ref[...]

        acc = pl.run_scoped(accumulate, plgpu.ACC((BLOCK_N, rows), jnp.float32))

        def store(o_smem):
            o_smem[...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_hbm.at[sp, pl.ds(nb * BLOCK_N, BLOCK_N)])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(store, plgpu.SMEM((BLOCK_N, rows), jnp.float32))

    out = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((k_splits, n, rows), jnp.float32), grid=(n // BLOCK_N, k_splits),
        grid_names=("n", "k"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))(w, x, s)
    return jnp.sum(out, axis=0).T[:m].astype(jnp.bfloat16)


def fp8_matmul_tma_persistent(x: jax.Array, w: jax.Array, s: jax.Array, *, block_k: int = 256, stages: int = 4,
                              k_splits: int = 1, programs: int = 132, products: bool = True,
                              swizzle: int = GROUP) -> jax.Array:
    """`fp8_matmul_tma` with the two costs the thirteenth run found removed: at most `programs`
    programs (the largest divisor of the work items not above it), each streaming its share of
    the (64 output columns, K split) items through one pipeline (no fill and drain per block;
    the accumulator is stored and cleared at each item's last step), and the scale bytes staged
    with the weight tiles (re-laid out by XLA to [N/64, K/block_k, SCALE_ROW] bytes, 2 * groups
    of them used, read from shared memory). Same results as `fp8_matmul_tma`. products=False:
    the pipeline streams the same tiles and the step does nothing with them (zeros out; the
    streaming floor of this pipeline). swizzle: bytes a row of the weight's shared-memory tiles
    (its TMA box's inner extent): 32, one scale group, or 64 / 128 (streaming only: the products
    slice whole 32-byte tiles)."""
    (m, k), n = x.shape, w.shape[0]
    if block_k % 256 or 2 * block_k // GROUP > SCALE_ROW:
        raise ValueError(f"fp8_matmul_tma_persistent: unsupported shape: {block_k=} (a step's 2 * block_k / 32 "
                         f"staged scale bytes must fill 16-byte rows within {SCALE_ROW})")
    if swizzle not in (32, 64, 128) or (products and swizzle != GROUP):
        raise ValueError(f"fp8_matmul_tma_persistent: unsupported shape: {swizzle=} ({GROUP} with products; "
                         "32, 64 or 128 streaming only)")
    plgpu, x, rows, s, steps, groups, (w_tf, x_tf) = _prepare(x, w, s, block_k, k_splits,
                                                             "fp8_matmul_tma_persistent")
    if swizzle != GROUP:
        w_tf = (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))
    blocks = n // BLOCK_N
    work = blocks * k_splits
    p = max(d for d in range(1, min(programs, work) + 1) if work % d == 0)
    per = work // p
    staged = s.reshape(blocks, 2, k // block_k, groups).transpose(0, 2, 1, 3).reshape(blocks, k // block_k, 2 * groups)
    # a TMA copy's shared-memory destination must be 128-byte aligned: a 16-byte row per stage
    # put every other stage's scales off that alignment (the fourteenth run's misaligned address)
    staged = jnp.pad(staged, ((0, 0), (0, 0), (0, SCALE_ROW - 2 * groups)))

    def body(w_hbm, x_hbm, s_hbm, o_hbm, o_smem):
        pid = jax.lax.axis_index("p")

        def item(j):  # this program's work item j -> (column block, K split)
            t = pid * per + j
            return t // k_splits, t % k_splits

        def accumulate(acc_ref):
            def step(idx, w_tile, x_tile, s_tile):
                j, kk = idx

                @pl.when(kk == 0)
                def _():
                    acc_ref[...] = jnp.zeros((BLOCK_N, rows), jnp.float32)

                if products:
                    _step_products(acc_ref, w_tile, x_tile, groups,
                                   lambda g: (s_tile[0, 0, g], s_tile[0, 0, groups + g]))

                @pl.when(kk == steps - 1)
                def _():
                    nb, sp = item(j)
                    plgpu.wait_smem_to_gmem(0)  # the previous item's store has read o_smem
                    o_smem[...] = acc_ref[...]
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_smem, o_hbm.at[sp, pl.ds(nb * BLOCK_N, BLOCK_N)])

            def at(j, kk):
                nb, sp = item(j)
                return nb, sp * steps + kk

            plgpu.emit_pipeline(
                step, grid=(per, steps), max_concurrent_steps=stages,
                in_specs=[plgpu.BlockSpec((BLOCK_N, block_k), at, transforms=w_tf),
                          plgpu.BlockSpec((rows, block_k), lambda j, kk: (0, at(j, kk)[1]), transforms=x_tf),
                          plgpu.BlockSpec((1, 1, SCALE_ROW), lambda j, kk: (*at(j, kk), 0))],
            )(w_hbm, x_hbm, s_hbm)

        pl.run_scoped(accumulate, plgpu.ACC((BLOCK_N, rows), jnp.float32))
        plgpu.wait_smem_to_gmem(0)

    out = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((k_splits, n, rows), jnp.float32), grid=(p,), grid_names=("p",),
        scratch_types=[plgpu.SMEM((BLOCK_N, rows), jnp.float32)],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))(w, x, staged)
    return jnp.sum(out, axis=0).T[:m].astype(jnp.bfloat16)


VARIANTS = (  # (label, kernel, kwargs): the thirteenth run's fastest and neighbours, then the persistent kernel
    ("tma bk=256 st=4", fp8_matmul_tma, {"block_k": 256, "stages": 4}),
    ("tma bk=512 st=2", fp8_matmul_tma, {"block_k": 512, "stages": 2}),
    ("tma bk=256 st=2 ks=4", fp8_matmul_tma, {"block_k": 256, "stages": 2, "k_splits": 4}),
    ("tma no scales bk=512 st=2", fp8_matmul_tma, {"block_k": 512, "stages": 2, "scaled": False}),
    ("tma no scales bk=256 st=2 ks=4", fp8_matmul_tma, {"block_k": 256, "stages": 2, "k_splits": 4, "scaled": False}),
    ("tma persistent bk=256 st=4", fp8_matmul_tma_persistent, {"block_k": 256, "stages": 4}),
    ("tma persistent bk=256 st=6 ks=2", fp8_matmul_tma_persistent, {"block_k": 256, "stages": 6, "k_splits": 2}),
    ("tma persistent bk=256 st=8", fp8_matmul_tma_persistent, {"block_k": 256, "stages": 8}),
    ("tma persistent bk=512 st=4", fp8_matmul_tma_persistent, {"block_k": 512, "stages": 4}),
    ("tma persistent streaming only bk=256 st=4", fp8_matmul_tma_persistent,
     {"block_k": 256, "stages": 4, "products": False}),
    ("tma persistent streaming only bk=256 st=8", fp8_matmul_tma_persistent,
     {"block_k": 256, "stages": 8, "products": False}),
    ("tma persistent streaming only bk=256 st=4 p=264", fp8_matmul_tma_persistent,
     {"block_k": 256, "stages": 4, "products": False, "programs": 264}),
    ("tma persistent streaming only bk=256 st=4 swizzle 128", fp8_matmul_tma_persistent,
     {"block_k": 256, "stages": 4, "products": False, "swizzle": 128}),
    ("tma persistent streaming only bk=512 st=4 swizzle 128", fp8_matmul_tma_persistent,
     {"block_k": 512, "stages": 4, "products": False, "swizzle": 128}),
    ("tma persistent streaming only bk=256 st=4 swizzle 64", fp8_matmul_tma_persistent,
     {"block_k": 256, "stages": 4, "products": False, "swizzle": 64}),
)


def same_size_copy_bw(nbytes: float, inner: int = 8) -> float:
    """Bytes/s of XLA's x + 1 over a uint32 buffer of `nbytes` (read + write), the ceiling a
    kernel of that size meets on this device (launch and ramp included)."""
    n = max(1024, int(nbytes / 4) // 1024 * 1024)
    xs = [jax.random.bits(jax.random.key(i), (n,), jnp.uint32) for i in range(inner)]
    sec, dev = _time(lambda x: x + 1, lambda i: (xs[i],), inner=inner, reps=5)
    return 8 * n / _best(sec, dev)


def rows_for(m: int, copy_bw: float, shapes=("attn.wq_b", "attn.wo_b", "shared.w1 (= w3)"), only: str = "") -> list[Row]:
    from pallas_kernels.fp8_matmul import api
    from pallas_kernels.fp8_matmul import reference as ref

    out = []
    for name in shapes:
        k, n = SHAPES[name]
        ws = [weights(k, n, 7 + i) for i in range(8)]
        x = (jax.random.normal(jax.random.key(m), (m, k)) * 3).astype(jnp.bfloat16)
        want = np.asarray(ref.fp8_matmul(x, *ws[0])).view(np.uint16)
        nbytes = n * k
        same_bw = same_size_copy_bw(nbytes)
        impls = [("triton kernel", lambda x, w, s: api.fp8_matmul(x, w, s, implementation="pallas"))]
        impls += [(label, functools.partial(kernel, **kw)) for label, kernel, kw in VARIANTS if only in label]
        for label, fn in impls:
            fn = jax.jit(fn)
            try:
                fn.eval_shape(x, *ws[0])
            except ValueError as e:
                if "unsupported shape" in str(e):  # the kernel's own check: this variant does not tile it
                    print(f"# {name}: {label}: {e}", flush=True)
                    continue
            try:
                sec, dev = _time(fn, lambda i, x=x, ws=ws: (x, *ws[i]), inner=8, reps=10)
                same = float(np.mean(np.asarray(fn(x, *ws[0])).view(np.uint16) == want))
                t = _best(sec, dev)
                out.append(Row("fp8 projection " + name, f"M={m} K={k} N={n}", label, sec * 1e6, dev * 1e6, nbytes,
                               nbytes / t / copy_bw, f"{same:.4f} bit-identical to xla",
                               f"{nbytes / t / same_bw:.1%} of a same-size copy ({same_bw / 1e12:.2f} TB/s)"))
            except Exception as e:  # noqa: BLE001 (a failing variant is a result)
                out.append(Row("fp8 projection " + name, f"M={m}", label, float("nan"), float("nan"), nbytes, 0,
                               note=f"FAILED {type(e).__name__}: {str(e)[:200]}"))
            print(_fmt(out[-1]), flush=True)
    return out


STREAM_VARIANTS = (  # (label, kernel or None for the Triton kernel, kwargs) for `stream_rows`
    ("triton one-row", None, {}),
    ("tma stream sw32 st4", fp8_matmul_tma_persistent, {"products": False}),
    ("tma stream sw128 st4", fp8_matmul_tma_persistent, {"products": False, "swizzle": 128}),
    ("tma stream sw128 bk512 st4", fp8_matmul_tma_persistent, {"products": False, "swizzle": 128, "block_k": 512}),
    ("tma products sw32 st4", fp8_matmul_tma_persistent, {}),
    ("tma products sw32 st6", fp8_matmul_tma_persistent, {"stages": 6}),
)


def stream_rows(n: int, k: int, copy_bw: float) -> list[Row]:
    """One row times a large random e4m3 [n, k] matrix: the Triton one-row kernel and the
    persistent TMA pipeline (streaming only and with products), device time a call: the
    steady-state streaming rate, without the launch and ramp costs that weigh on the model's
    2.6-42 MB projections."""
    from pallas_kernels.fp8_matmul import api

    w, s = weights(k, n, 0)
    x = jax.random.normal(jax.random.key(2), (1, k)).astype(jnp.bfloat16)
    out = []
    for label, kernel, kw in STREAM_VARIANTS:
        fn = jax.jit((lambda x, w, s: api.fp8_matmul(x, w, s, implementation="pallas")) if kernel is None
                     else functools.partial(kernel, **kw))
        try:  # distinct rows per call (identical calls would be merged); the matrix is read each time
            sec, dev = _time(fn, lambda i: ((x + i).astype(jnp.bfloat16), w, s), inner=4, reps=5)
            t = _best(sec, dev)
            out.append(Row("fp8 one-row stream", f"M=1 K={k} N={n}", label, sec * 1e6, dev * 1e6, n * k,
                           n * k / t / copy_bw))
        except Exception as e:  # noqa: BLE001 (a failing variant is a result)
            out.append(Row("fp8 one-row stream", f"M=1 K={k} N={n}", label, float("nan"), float("nan"), n * k, 0,
                           note=f"FAILED {type(e).__name__}: {str(e)[:200]}"))
        print(_fmt(out[-1]), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,16", help="activation rows M (comma list, <= 64)")
    p.add_argument("--only", default="", help="time only the variants whose label contains this")
    p.add_argument("--stream-shapes", default="",
                   help="NxK list: also stream one row through these large e4m3 matrices (`stream_rows`)")
    p.add_argument("--json", default=None, help="write the rows here")
    a = p.parse_args(argv)
    shapes = []
    for shape in filter(None, a.stream_shapes.split(",")):
        try:
            n, k = (int(v) for v in shape.split("x"))
        except ValueError:
            p.error(f"--stream-shapes takes NxK matrix shapes (e.g. 65536x8192), got {shape!r}")
        shapes.append((n, k))
    dev, copy_bw = start_run()
    rows = [r for m in a.rows.split(",") if m for r in rows_for(int(m), copy_bw, only=a.only)]
    for n, k in shapes:
        rows += stream_rows(n, k, copy_bw)
    if a.json:
        write_json(a.json, dev.device_kind, copy_bw, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
