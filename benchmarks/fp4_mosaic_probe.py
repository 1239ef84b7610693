"""Mosaic GPU probe: the routed experts' fp4 products with the weight tile decoded in registers as
the wgmma's A operand, against the Triton kernel the model runs (pallas_kernels/expert_matmul)
on the same work. No product path uses these kernels; they measure whether a Mosaic GPU kernel
(bulk asynchronous copies, a producer warpgroup beside the compute warpgroups) lifts the routed
experts above the Triton kernel's 55-83% of copy bandwidth at decode and ~170 TFLOP/s in a
prefill. Measured on an H100 (benchmarks/README.md, forty-first session): 1.5x slower than the
Triton kernel at decode, where the TMA pipeline alone is within 8% of the Triton kernel's time,
and at best equal on the prefill's 64-row tiles (three compute warpgroups a program).

    PYTHONPATH=. python -m benchmarks.fp4_mosaic_probe [--sites "6x1 w1,6x1 w2,64x64 w1"]
        [--variants '[{}, {"ws": 1, "wgs": 2}]'] [--json PATH]

A site "<E>x<M> <w1|w2>" is E experts, each multiplying its own M rows (the released w1 [2304,
5120] or w2 [5120, 2304] shapes): "6x1 w1" is one decode token's six experts, "64x64 w1" a
prefill's 64-row tiles. Both kernels compute out[e] = x[e] @ dequant(w[e])^T (fp32 out here).

The kernel (`fp4_matmul_mgpu`, Hopper): one program per (expert, 64 output rows), or with
`ws` per (expert, 64 * wgs rows) with a TMA producer warpgroup and `wgs` compute warpgroups
(`plgpu.emit_pipeline_warp_specialized`). Each K step brings the packed weight bytes [64, bk/2],
their e8m0 bytes and the step's x columns into shared memory. A byte holds elements 2j (low
nibble) and 2j+1 (high nibble), so x is split once into its even and odd columns and each byte
tile gives two bf16 operands, lo and hi, with no interleave: code c (s e1 e0 m) becomes the bf16
bits (s << 15) | (e1 e0 m << 6), which is the e2m1 value times 2^-126 (the "pairs" decode of the
Triton kernel: a bf16 subnormal for e = 0), then one multiply per element by 2^(b - 1) (the scale
2^(b - 127) with 2^126 folded in; exact, valid for scale bytes b <= 128, which
`ModelArgs.fp4_scale_fold` checks for the model). Per 32-column scale group one wgmma of lo
against x's even columns and one of hi against its odd columns, fp32 accumulation. The same
exact products as the Triton kernel, summed in another order.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from benchmarks.kernels import _time, copy_bandwidth
from benchmarks.tma_probe import _plgpu
from dsv41_jax import quant

TILE_N = 64  # wgmma rows: output rows a compute warpgroup holds
GROUP = 32  # elements a scale byte covers
SITES = "6x1 w1,6x1 w2,64x64 w1"
SHAPES = {"w1": (2304, 5120), "w2": (5120, 2304)}  # released [N, K]


def byte_order(hk: int) -> np.ndarray:
    """The byte columns a `bytes8` tile's wgmma operand holds, in operand order: a 32-bit shared
    memory load gives a thread 4 consecutive bytes of a 16-byte block (the 8-bit wgmma layout),
    which are read as its two register pairs of the 16-bit layout, columns 2q, 2q + 1 and
    2q + 8, 2q + 9 of the block (q = lane % 4)."""
    p = np.arange(16)
    block = np.where(p < 8, 4 * (p // 2) + p % 2, 4 * ((p - 8) // 2) + 2 + p % 2)
    return (np.arange(0, hk, 16)[:, None] + block[None]).reshape(-1)


def _prepare(x, w, s_t, block_k: int, cta_n: int, what: str, bytes8: bool = False):
    """Shape checks; (x's even and odd columns [E, rows, K/2] bf16 with rows padded to 8, in the
    order the weight operand holds them (`byte_order` with bytes8), rows)."""
    e, m, k = x.shape
    if (block_k not in (64, 128, 256) or k % block_k or w.shape != (e, w.shape[1], k // 2)
            or w.shape[1] % cta_n or s_t.shape != (e, k // GROUP, w.shape[1])):
        raise ValueError(f"{what}: unsupported shape {x.shape=} {w.shape=} {s_t.shape=} {block_k=} "
                         f"(expected w [E, N, K/2] with N a multiple of {cta_n}, s_t [E, K/32, N], "
                         "block_k 64, 128 or 256 dividing K)")
    rows = max(8, -(-m // 8) * 8)
    x = jnp.pad(x.astype(jnp.bfloat16), ((0, 0), (0, rows - m), (0, 0)))
    xe, xo = x[:, :, 0::2], x[:, :, 1::2]
    if bytes8:  # within each K step's bk/2 byte columns
        hk = block_k // 2
        order = (np.arange(0, k // 2, hk)[:, None] + byte_order(hk)[None]).reshape(-1)
        xe, xo = xe[:, :, order], xo[:, :, order]
    return xe, xo, rows


def _transforms(plgpu, block_k: int):
    """(weight bytes [., bk/2]: one swizzled row a tile row; x columns: 16-wide tiles, one wgmma's K)."""
    hk = block_k // 2
    return ((plgpu.TilingTransform((8, hk)), plgpu.SwizzleTransform(hk)),
            (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32)))


def decode_bits(b):
    """Packed bytes as int16 (any array type: Mosaic values, jnp, numpy) -> (lo, hi) int16: the
    bf16 bits of the low / high nibble's e2m1 value times 2^-126 (module docstring)."""
    return ((b & 0x08) << 12) | ((b & 0x07) << 6), ((b & 0x80) << 8) | ((b & 0x70) << 2)


def scale_bits(sb):
    """e8m0 bytes as int16 (<= 128) -> the bf16 bits of 2^(b - 1): the scale with 2^126 folded in."""
    return (sb + 126) << 7


def _load_bytes8(w_sub):
    """w_sub [64, hk] uint8 in shared memory -> the same registers as a 16-bit-layout operand:
    32-bit loads (8-bit wgmma layout), each thread's 4 bytes split into its two byte pairs
    (`byte_order` says which columns they become)."""
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    plgpu = _plgpu()
    shape = tuple(w_sub.shape)
    raw = plgpu.load(w_sub, (), layout=plgpu.Layout.WGMMA_8BIT)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_8BIT,),
                       return_type=plgpu.ShapeDtypeStruct(shape, jnp.uint8, layout=plgpu.Layout.WGMMA))
    def split(_, arr):
        regs = np.empty(mgpu.WGMMA_LAYOUT.registers_shape(shape), dtype=object)
        for idx, reg in np.ndenumerate(arr.registers):
            for h in range(2):
                regs[(idx[0], 2 * idx[1] + h, *idx[2:])] = mgpu_utils.vector_slice(reg, slice(2 * h, 2 * h + 2))
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=arr.is_signed)

    return split(raw)


def _products(acc_ref, w_sub, xe_tile, xo_tile, scale_row, groups: int, bytes8: bool = False) -> None:
    """acc_ref [64, rows] += decoded w_sub [64, 16 * groups] bytes (module docstring) times x's even
    (lo nibbles) and odd (hi nibbles) columns; scale_row(g) -> the 64 e8m0 bytes of group g.
    bytes8: the tile read with 32-bit loads (`_load_bytes8`; x's columns permuted to match)."""
    plgpu = _plgpu()
    wl, rl = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)
    cast = plgpu.layout_cast
    raw = _load_bytes8(w_sub) if bytes8 else plgpu.load(w_sub, (), layout=wl, optimized=False)
    lo, hi = (cast(v, wl) for v in decode_bits(cast(cast(raw, wl).astype(jnp.int16), wl)))
    for g in range(groups):
        sb = cast(plgpu.load(scale_row(g), (), layout=rl, optimized=False).astype(jnp.int16), rl)
        scale = cast(jax.lax.bitcast_convert_type(cast(scale_bits(sb), rl), jnp.bfloat16), rl)
        scale = cast(jax.lax.broadcast_in_dim(scale, (TILE_N, 16), (0,)), wl)
        for part, x_tile in ((lo, xe_tile), (hi, xo_tile)):
            a = cast(jax.lax.bitcast_convert_type(cast(part[:, g * 16:(g + 1) * 16], wl), jnp.bfloat16), wl)
            plgpu.wgmma(acc_ref, cast(a * scale, wl),
                        plgpu.transpose_ref(x_tile.at[0, :, pl.ds(g * 16, 16)], (1, 0)))


def fp4_matmul_mgpu(x: jax.Array, w: jax.Array, s_t: jax.Array, *, block_k: int = 128, stages: int = 4,
                    ws: bool = False, wgs: int = 2, bytes8: bool = False, inflight: int = 0,
                    products: bool = True, tiles: int = 1) -> jax.Array:
    """x bf16 [E, M, K], w packed e2m1 uint8 [E, N, K/2], s_t e8m0 bytes uint8 [E, K/32, N] (the
    scales transposed; bytes <= 128) -> fp32 [E, M, N] = x[e] @ dequant(w[e])^T (module docstring).
    ws: a producer warpgroup and `wgs` compute warpgroups a program. bytes8: 32-bit shared-memory
    loads of the weight bytes (`_load_bytes8`). inflight (one warpgroup only): wgmma groups left
    running at the end of a K step (the next step's decode overlaps them; x's tiles released a
    step late); 0 waits for all. products=False: the same tiles streamed and nothing computed
    (zeros out; the pipeline's own floor). tiles (with ws): 64-row tiles a compute warpgroup holds
    (one accumulator each), so a program covers 64 * wgs * tiles rows and reads x's tiles once
    for all of them."""
    plgpu = _plgpu()
    if tiles != 1 and not ws:
        raise ValueError(f"fp4_matmul_mgpu: {tiles=} needs ws=True")
    wg_n = TILE_N * tiles  # rows a compute warpgroup holds
    cta_n = wg_n * (wgs if ws else 1)
    xe, xo, rows = _prepare(x, w, s_t, block_k, cta_n, "fp4_matmul_mgpu", bytes8)
    e, m, k = x.shape
    n = w.shape[1]
    hk, groups, steps = block_k // 2, block_k // GROUP, k // block_k
    w_tf, x_tf = _transforms(plgpu, block_k)

    if inflight and (ws or stages < 2):
        raise ValueError(f"fp4_matmul_mgpu: {inflight=} needs one warpgroup (ws=False) and stages >= 2")
    late = {"delay_release": 1} if inflight else {}

    def specs(ei, nb):
        return [plgpu.BlockSpec((1, cta_n, hk), lambda j: (ei, nb, j), transforms=w_tf),
                plgpu.BlockSpec((1, rows, hk), lambda j: (ei, 0, j), transforms=x_tf, **late),
                plgpu.BlockSpec((1, rows, hk), lambda j: (ei, 0, j), transforms=x_tf, **late),
                plgpu.BlockSpec((1, groups, cta_n), lambda j: (ei, j, nb))]

    def store(acc, o_smem, o_dst):
        o_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_dst)
        plgpu.wait_smem_to_gmem(0)

    def body(w_hbm, xe_hbm, xo_hbm, s_hbm, o_hbm):
        ei, nb = jax.lax.axis_index("e"), jax.lax.axis_index("n")

        def accumulate(acc_ref):
            def step(_, w_tile, xe_tile, xo_tile, s_tile):
                if products:
                    _products(acc_ref, w_tile.at[0], xe_tile, xo_tile, lambda g: s_tile.at[0, g], groups, bytes8)
                    plgpu.wgmma_wait(inflight)

            plgpu.emit_pipeline(step, grid=(steps,), max_concurrent_steps=stages, in_specs=specs(ei, nb))(
                w_hbm, xe_hbm, xo_hbm, s_hbm)
            plgpu.wgmma_wait(0)
            return acc_ref[...]

        acc = pl.run_scoped(accumulate, plgpu.ACC((TILE_N, rows), jnp.float32))
        pl.run_scoped(lambda o_smem: store(acc, o_smem, o_hbm.at[ei, pl.ds(nb * TILE_N, TILE_N)]),
                      plgpu.SMEM((TILE_N, rows), jnp.float32))

    def body_ws(w_hbm, xe_hbm, xo_hbm, s_hbm, o_hbm, o_smem):
        ei, nb, wg = jax.lax.axis_index("e"), jax.lax.axis_index("n"), jax.lax.axis_index("wg")

        def compute_context(eval_pipeline):
            @functools.partial(pl.run_scoped, accs=[plgpu.ACC((TILE_N, rows), jnp.float32) for _ in range(tiles)])
            def _(accs):
                eval_pipeline(tuple(accs))
                for i, acc_ref in enumerate(accs):
                    row0 = nb * cta_n + wg * wg_n + i * TILE_N
                    store(acc_ref[...], o_smem.at[wg], o_hbm.at[ei, pl.ds(row0, TILE_N)])

        def step(_, w_tile, xe_tile, xo_tile, s_tile, accs):
            if products:
                for i, acc_ref in enumerate(accs):
                    r0 = wg * wg_n + i * TILE_N
                    _products(acc_ref, w_tile.at[0, pl.ds(r0, TILE_N)], xe_tile, xo_tile,
                              lambda g, r0=r0: s_tile.at[0, g, pl.ds(r0, TILE_N)], groups, bytes8)
                plgpu.wgmma_wait(0)
            return accs

        plgpu.emit_pipeline_warp_specialized(
            step, grid=(steps,), memory_registers=40, max_concurrent_steps=stages, wg_axis="wg",
            num_compute_wgs=wgs, compute_context=compute_context, in_specs=specs(ei, nb),
        )(w_hbm, xe_hbm, xo_hbm, s_hbm)

    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
    out_type = jax.ShapeDtypeStruct((e, n, rows), jnp.float32)
    if ws:
        kernel = plgpu.kernel(body_ws, out_type=out_type, grid=(e, n // cta_n), grid_names=("e", "n"),
                              num_threads=wgs + 1, thread_name="wg", compiler_params=params,
                              scratch_types={"o_smem": plgpu.SMEM((wgs, TILE_N, rows), jnp.float32)})
    else:
        kernel = plgpu.kernel(body, out_type=out_type, grid=(e, n // cta_n), grid_names=("e", "n"),
                              compiler_params=params)
    return jnp.swapaxes(kernel(w, xe, xo, s_t), 1, 2)[:, :m]


def reference(x: jax.Array, w: jax.Array, s: jax.Array) -> jax.Array:
    """The same products in jnp: x bf16 [E, M, K], w uint8 [E, N, K/2], s uint8 [E, N, K/32] -> fp32."""
    wd = quant.dequant_fp4_weight(w, s, jnp.float32)
    return jnp.einsum("emk,enk->emn", x.astype(jnp.float32), wd, precision=jax.lax.Precision.HIGHEST)


def parse_site(site: str) -> tuple[int, int, str]:
    """"64x64 w1" -> (64, 64, "w1")."""
    try:
        head, weights = site.split()
        e, m = (int(v) for v in head.split("x"))
    except ValueError:
        e = m = weights = None
    if e is None or e < 1 or m < 1 or weights not in SHAPES:
        raise ValueError(f"--sites: {site!r}: expected '<experts>x<rows> w1' or '... w2'")
    return e, m, weights


def operands(key, e: int, m: int, n: int, k: int):
    """Random x bf16 [E, M, K], packed w uint8 [E, N, K/2], scale bytes uint8 [E, N, K/32] in
    118..128 (the fold's range, as the released checkpoint's)."""
    k1, k2, k3 = jax.random.split(key, 3)
    w = jax.random.randint(k1, (e, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    s = jax.random.randint(k2, (e, n, k // GROUP), 118, 129, jnp.int32).astype(jnp.uint8)
    x = jax.random.normal(k3, (e, m, k), jnp.float32).astype(jnp.bfloat16)
    return x, w, s


def relaid(w):
    """Packed uint8 words -> the Triton kernel's re-laid int8 words (done once, as at load)."""
    from pallas_kernels.expert_matmul import kernel_gpu
    return jax.jit(kernel_gpu.relay)(jax.lax.bitcast_convert_type(w, jnp.int8))


def triton(x, w, s, decode: str):
    """The model's kernel on the same work: gather (one row an expert) or grouped 16..64-row tiles.
    w: uint8 words as released ("pairs"), or int8 words from `relaid` ("relaid")."""
    from pallas_kernels.expert_matmul import api
    e, m, k = x.shape
    wi = jax.lax.bitcast_convert_type(w, jnp.int8) if w.dtype == jnp.uint8 else w
    bs = api.BlockSizes(scale_fold=True, decode=decode)
    xs = x.reshape(e * m, k)
    if m == 1:
        out = api.gather_matmul(xs, wi, s, jnp.arange(e, dtype=jnp.int32), implementation="pallas", block_sizes=bs)
    else:
        c = min(api.tile_rows_for(e * m, e), m)
        if m % c:
            raise ValueError(f"triton: {m} rows an expert do not split into {c}-row tiles")
        starts = np.arange(0, e * m, c, dtype=np.int32)
        te, valid = jnp.asarray(starts // m), jnp.full(starts.shape, c, jnp.int32)
        out = api.grouped_matmul(jnp.pad(xs, ((0, c), (0, 0))), wi, s, te, jnp.asarray(starts), valid, c,
                                 implementation="pallas", block_sizes=bs)[:e * m]
    return out.reshape(e, m, -1)


def run(sites, variants, *, check: bool = True, seed: int = 0) -> list[dict]:
    """Timed rows: for each site the Triton kernel ("pairs" and "relaid" decodes) and each Mosaic
    variant, device time a call (`benchmarks.kernels._time`), fraction of the copy bandwidth
    measured here; with `check`, each Mosaic variant's outputs against `reference`."""
    bw = copy_bandwidth()
    rows = []
    for site in sites:
        e, m, weights = parse_site(site)
        n, k = SHAPES[weights]
        inner = 8 if e * m <= 64 else 3
        sets = [operands(jax.random.PRNGKey(seed + 100 + i), e, m, n, k) for i in range(inner)]
        by = e * n * (k // 2 + k // GROUP)
        fl = 2.0 * e * m * n * k
        want = np.asarray(reference(*sets[0])) if check else None
        sets_relaid = [(x, relaid(w), s) for x, w, s in sets]
        impls = [("triton pairs", lambda x, w, s: triton(x, w, s, "pairs"), sets),
                 ("triton relaid", lambda x, w, s: triton(x, w, s, "relaid"), sets_relaid)]
        impls += [(f"mosaic {json.dumps(v, sort_keys=True)}",
                   lambda x, w, s, v=v: fp4_matmul_mgpu(x, w, jnp.swapaxes(s, 1, 2), **v), sets) for v in variants]
        for name, fn, fn_sets in impls:
            row = {"name": f"fp4 probe {site} {name}", "bytes": by, "flops": fl, "ceiling": "hbm"}
            try:
                if check and name.startswith("mosaic"):
                    got = np.asarray(jax.jit(fn)(*sets[0]), np.float32)
                    row["max_abs_err"] = float(np.max(np.abs(got - want)))
                    row["max_ref"] = float(np.max(np.abs(want)))
                    row["bit_identical"] = float(np.mean(got.view(np.uint32) == want.view(np.uint32)))
                t = _time(fn, lambda j, fn_sets=fn_sets: fn_sets[j], inner=inner, reps=5)[1]
                row |= {"seconds": t, "fraction_of_ceiling": by / t / bw, "tflops": fl / t / 1e12}
            except Exception as exc:  # noqa: BLE001 (a variant that does not compile or fit is a result)
                row["error"] = repr(exc)[:500]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sites", default=SITES)
    p.add_argument("--variants", default="[{}]", help="JSON list of fp4_matmul_mgpu keyword dicts")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--json")
    a = p.parse_args(argv)
    try:
        sites = [s.strip() for s in a.sites.split(",") if s.strip()]
        for s in sites:
            parse_site(s)
        variants = json.loads(a.variants)
        if not isinstance(variants, list) or not all(isinstance(v, dict) for v in variants):
            raise ValueError("--variants: expected a JSON list of objects")
    except ValueError as exc:
        print(f"fp4_mosaic_probe: {exc}", file=sys.stderr)
        return 2
    rows = run(sites, variants, check=not a.no_check)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": str(jax.devices()[0].device_kind), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
