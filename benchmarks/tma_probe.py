"""TMA probe: how fast a bulk-asynchronous-copy (TMA) pipeline streams the dense fp8 projections
on one GPU, against the Triton kernel the model runs (pallas_kernels/fp8_matmul) and against an
XLA copy of the same size. No product path uses this kernel; it measures whether moving the fp8
matmul to Mosaic GPU (TMA into shared memory, wgmma) lifts the 45-57% of copy bandwidth the
Triton kernel reaches at one row (benchmarks/README.md, thirteenth run).

    python -m benchmarks.tma_probe [--rows 1,16] [--json PATH]

The probe kernel (`fp8_matmul_tma`, Mosaic GPU, Hopper): one program per (64 output columns,
K split); `plgpu.emit_pipeline` brings each K step's e4m3 weight tile [64, block_k] and bf16 row
tile [rows (padded to 8), block_k] into shared memory with TMA, `stages` steps in flight. The
weight tile is the wgmma's register operand: per 32-column scale group it is widened to fp32,
multiplied by its two e8m0 scales (rows 0-31 and 32-63 of the tile, read from HBM as scalars)
and rounded to bf16 (exact), then multiplied with the matching x^T columns into one fp32
accumulator. The same exact products as the Triton kernel, summed in another order. With
`scaled=False` the scales are skipped (wrong values; the pipeline's own speed). The result is
transposed ([N, rows] per K split), so XLA adds the splits, transposes and rounds afterwards.
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

BLOCK_N = 64  # wgmma rows: one tile of output columns
GROUP = 32  # weight scale block


def _e8m0_f32(b: jax.Array) -> jax.Array:
    """int32 e8m0 bytes -> fp32 2^(b-127) (0 -> 2^-127, 255 -> NaN)."""
    bits = jnp.where(b == 0, jnp.int32(1 << 22), jnp.where(b == 255, jnp.int32(0x7FC00000), b << 23))
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def fp8_matmul_tma(x: jax.Array, w: jax.Array, s: jax.Array, *, block_k: int = 256, stages: int = 4,
                   k_splits: int = 1, scaled: bool = True) -> jax.Array:
    """x bf16 [M, K] (M <= 64), w e4m3 [N, K], s e8m0 [N/32, K/32] -> bf16 [M, N] (module
    docstring). N must divide by 64, K by block_k * k_splits (block_k a multiple of 32)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    try:  # jax 0.11 registers the Mosaic GPU lowering only when this module is imported
        from jax._src.pallas.mosaic_gpu import pallas_call_registration  # noqa: F401
    except ImportError:
        pass

    m, k = x.shape
    n = w.shape[0]
    if m > 64 or n % BLOCK_N or block_k % GROUP or k % (block_k * k_splits):
        raise ValueError(f"fp8_matmul_tma: unsupported shape {x.shape=} {w.shape=} {block_k=} {k_splits=}")
    rows = max(8, -(-m // 8) * 8)
    x = jnp.pad(x.astype(jnp.bfloat16), ((0, rows - m), (0, 0)))
    s = s if s.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(s, jnp.uint8)
    steps = k // block_k // k_splits
    groups = block_k // GROUP
    # 32-byte swizzle for the e4m3 tile and 64-byte for the bf16 rows: one tile column per
    # scale group, so a group's slice of either is whole tiles
    w_tf = (plgpu.TilingTransform((8, GROUP)), plgpu.SwizzleTransform(32))
    x_tf = (plgpu.TilingTransform((8, GROUP)), plgpu.SwizzleTransform(64))

    def body(w_hbm, x_hbm, s_hbm, o_hbm):
        nb, sp = jax.lax.axis_index("n"), jax.lax.axis_index("k")

        def accumulate(acc_ref):
            def step(idx, w_tile, x_tile):
                g0 = (sp * steps + idx[0]) * groups
                top = jax.lax.broadcasted_iota(jnp.int32, (BLOCK_N, GROUP), 0) < GROUP
                for g in range(groups):
                    a = w_tile[:, pl.ds(g * GROUP, GROUP)].astype(jnp.float32)
                    if scaled:
                        b0 = s_hbm[2 * nb, g0 + g].astype(jnp.int32)
                        b1 = s_hbm[2 * nb + 1, g0 + g].astype(jnp.int32)
                        a = a * _e8m0_f32(jnp.where(top, b0, b1))
                    xt = plgpu.transpose_ref(x_tile.at[:, pl.ds(g * GROUP, GROUP)], (1, 0))
                    plgpu.wgmma(acc_ref, a.astype(jnp.bfloat16), xt)
                plgpu.wgmma_wait(0)

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


VARIANTS = (  # (label, kwargs): the fastest of the thirteenth run's sweep and its neighbours
    ("tma bk=256 st=4", {"block_k": 256, "stages": 4}),
    ("tma bk=512 st=2", {"block_k": 512, "stages": 2}),
    ("tma bk=256 st=2 ks=4", {"block_k": 256, "stages": 2, "k_splits": 4}),
    ("tma no scales bk=512 st=2", {"block_k": 512, "stages": 2, "scaled": False}),
    ("tma no scales bk=256 st=2 ks=4", {"block_k": 256, "stages": 2, "k_splits": 4, "scaled": False}),
)


def same_size_copy_bw(nbytes: float, inner: int = 8) -> float:
    """Bytes/s of XLA's x + 1 over a uint32 buffer of `nbytes` (read + write), the ceiling a
    kernel of that size meets on this device (launch and ramp included)."""
    n = max(1024, int(nbytes / 4) // 1024 * 1024)
    xs = [jax.random.bits(jax.random.key(i), (n,), jnp.uint32) for i in range(inner)]
    sec, dev = _time(lambda x: x + 1, lambda i: (xs[i],), inner=inner, reps=5)
    return 8 * n / _best(sec, dev)


def rows_for(m: int, copy_bw: float, shapes=("attn.wq_b", "attn.wo_b", "shared.w1 (= w3)")) -> list[Row]:
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
        impls += [(label, functools.partial(fp8_matmul_tma, **kw)) for label, kw in VARIANTS]
        for label, fn in impls:
            kw = dict(VARIANTS).get(label, {})
            if k % (kw.get("block_k", 256) * kw.get("k_splits", 1)):
                print(f"# {name}: {label} does not tile K={k}", flush=True)
                continue
            fn = jax.jit(fn)
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,16", help="activation rows M (comma list, <= 64)")
    p.add_argument("--json", default=None, help="write the rows here")
    a = p.parse_args(argv)
    dev, copy_bw = start_run()
    rows = [r for m in a.rows.split(",") for r in rows_for(int(m), copy_bw)]
    if a.json:
        write_json(a.json, dev.device_kind, copy_bw, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
