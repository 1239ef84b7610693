"""fp8 linear benchmark: the dense fp8 matmul kernel (pallas_kernels/fp8_matmul) against XLA's
path (widen the weight to bf16, then dot) at the released layer's fp8 projections.

    python -m benchmarks.fp8_linear [--rows 1,8,64,256,1024] [--json PATH]

Each row times the whole `linear()` (activation quantiser + matmul) on bf16 activations, with a
fresh weight per unrolled call (so the weight comes from HBM, as in a decode step), and reports
the bytes it must move (e4m3 weight + scales + activations in + bf16 out) as a fraction of the
copy bandwidth measured in the same run, plus the fraction of outputs bit-identical to XLA's
(the two differ only in fp32 summation order). "layer" rows add the seven projections of one
decoder layer; "one launch" rows time the projections of one input that the model computes in
one launch (`api.linear_many`) against a launch each. "attn.wo_a" rows time the attention's
block-diagonal projection (`api.grouped`, bf16 inputs): the kernel, XLA on the fp8 matrix
(widened inside the jit) and XLA on a bf16 copy of the matrix (a bf16 checkpoint's layout).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels import Row, _best, _fmt, _time, start_run, write_json
from dsv41_jax import quant
from pallas_kernels.fp8_matmul import api

# name -> (K, N): the fp8 projections of one released decoder layer (SPEC §5, §6)
SHAPES = {
    "attn.wq_a": (5120, 1280),
    "attn.wq_b": (1280, 32768),
    "attn.wkv": (5120, 512),
    "attn.wo_b": (8192, 5120),
    "indexer.wq_b": (1280, 4096),
    "shared.w1 (= w3)": (5120, 2304),
    "shared.w2": (2304, 5120),
}
COUNT = {"shared.w1 (= w3)": 2}  # w1 and w3 have the same shape
# projections of one input that the model runs in one launch (`fp8_matmul.linear_many`)
FUSED = {"attn.wq_a + attn.wkv": ("attn.wq_a", "attn.wkv"), "shared.w1 + w3": ("shared.w1 (= w3)",) * 2,
         "attn.wq_b + indexer.wq_b": ("attn.wq_b", "indexer.wq_b")}
# the grouped wo_a: (groups, K per group, N = groups x o_lora_rank)
WO_A = (8, 4096, 8192)


def weights(k: int, n: int, seed: int):
    """Random e4m3 bytes (NaN codes cleared) and e8m0 scale bytes 112..135, on the device."""
    key = jax.random.key(seed)
    b = jax.random.bits(key, (n, k), jnp.uint8)
    b = jnp.where((b & 0x7F) == 0x7F, b ^ 0x40, b)
    s = 112 + jax.random.randint(jax.random.fold_in(key, 1), (n // 32, k // 32), 0, 24).astype(jnp.uint8)
    return (jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn), jax.lax.bitcast_convert_type(s, jnp.float8_e8m0fnu))


def linear_bytes(m: int, k: int, n: int) -> float:
    return n * k + (n // 32) * (k // 32) + 2 * m * k + 2 * m * n


def parse_variant(text: str) -> api.BlockSizes:
    """"bn=64/bk=256/w=4/st=3/ks=2/q=0/gs=1/tp=528/swap=1" -> BlockSizes (unnamed fields keep their
    defaults; swap: `BlockSizes.swap_ab`)."""
    names = {"bm": "block_m", "bn": "block_n", "bk": "block_k", "ks": "k_splits", "w": "num_warps",
             "st": "num_stages", "q": "quantise_one_row", "gs": "one_row_group_sums", "tp": "target_programs",
             "swap": "swap_ab"}
    flags = ("q", "gs", "swap")
    kw = {}
    for part in (p for p in text.split("/") if p):
        key, _, value = part.partition("=")
        if key not in names or not value.lstrip("-").isdigit():
            raise ValueError(f"--variants: {part!r} in {text!r} is not NAME=INTEGER with NAME one of {sorted(names)}")
        kw[names[key]] = bool(int(value)) if key in flags else int(value)
    return api.BlockSizes(**kw)


def rows_for(m: int, copy_bw: float, decodes=("native",), variants=(), inner: int = 8, reps: int = 10,
             only: str = "") -> list[Row]:
    """Every projection of `SHAPES`, the `FUSED` pairs and the grouped wo_a at m rows; `only`: a
    substring the timed names must contain (then no "layer" total)."""
    out = []
    totals: dict[str, float] = {}
    total_bytes = 0.0
    for name, (k, n) in SHAPES.items():
        if only not in name:
            continue
        x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16) * 3
        ws = [weights(k, n, 100 * i + 7) for i in range(inner)]
        nbytes = linear_bytes(m, k, n)
        total_bytes += COUNT.get(name, 1) * nbytes
        want = quant.linear_fp8(x, *ws[0])
        impls = [("xla", None)] + [(f"pallas ({d})", api.BlockSizes(decode=d, max_rows=1 << 30)) for d in decodes]
        impls += [(f"pallas {v}", dataclasses.replace(parse_variant(v), max_rows=1 << 30)) for v in variants]
        for label, bs in impls:
            if bs is None:
                fn = quant.linear_fp8
            else:
                def fn(x, w, s, bs=bs):
                    return api.linear(x, w, s, implementation="pallas", block_sizes=bs)
            try:
                sec, dev = _time(fn, lambda i, x=x, ws=ws: (x, *ws[i % inner]), inner=inner, reps=reps)
                got = fn(x, *ws[0])
                same = float(np.mean(np.asarray(got).view(np.uint16) == np.asarray(want).view(np.uint16)))
                t = _best(sec, dev)
                r = None if bs is None else bs.resolved(m, n, k)
                note = "" if r is None else f"tiles m{r.block_m} n{r.block_n} k{r.block_k}, {r.k_splits} K splits"
                out.append(Row("fp8 linear " + name, f"M={m} K={k} N={n}", label, sec * 1e6, dev * 1e6, nbytes,
                               nbytes / t / copy_bw, f"{same:.4f} bit-identical to xla", note))
                totals[label] = totals.get(label, 0.0) + COUNT.get(name, 1) * t
            except Exception as e:  # noqa: BLE001 (a failing row is a result)
                out.append(Row("fp8 linear " + name, f"M={m}", label, float("nan"), float("nan"), nbytes, 0,
                               note=f"FAILED {type(e).__name__}: {str(e)[:200]}"))
            print(_fmt(out[-1]), flush=True)
    for label, t in totals.items() if not only else ():
        out.append(Row("fp8 linear layer (8 projections)", f"M={m}", label, t * 1e6, t * 1e6, total_bytes,
                       total_bytes / t / copy_bw))
        print(_fmt(out[-1]), flush=True)
    out += fused_rows(m, copy_bw, inner=inner, reps=reps, only=only)
    if only in "attn.wo_a (grouped)":
        out += grouped_rows(m, copy_bw, variants=variants, inner=inner, reps=reps)
    return out


def grouped_rows(m: int, copy_bw: float, variants=(), inner: int = 8, reps: int = 10) -> list[Row]:
    """wo_a: x bf16 [m, G, K] times the block-diagonal [N, K] matrix, three ways (module doc), and
    the kernel with each of `variants`' tiles."""
    from pallas_kernels.fp8_matmul import reference as ref

    g, k, n = WO_A
    out = []
    x = jax.random.normal(jax.random.key(m), (m, g, k), jnp.float32).astype(jnp.bfloat16)
    ws = [weights(k, n, 300 * i + 11) for i in range(inner)]
    wide = [quant.dequant_fp8_weight(w, s, jnp.bfloat16).reshape(g, n // g, k) for w, s in ws]
    want = ref.grouped(x, *ws[0])
    bs = api.BlockSizes(max_rows=1 << 30)
    io = 2 * m * g * k + 2 * m * n  # x [m, G*K] in, [m, N] out
    fp8_bytes, bf16_bytes = n * k + (n // 32) * (k // 32) + io, 2 * n * k + io

    def bf16_einsum(x, wd):
        return jnp.einsum("mgd,grd->mgr", x, wd, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    impls = (("pallas", lambda x, w, s: api.grouped(x, w, s, implementation="pallas", block_sizes=bs),
              lambda i: (x, *ws[i % inner]), fp8_bytes),
             ("xla, fp8 matrix", ref.grouped, lambda i: (x, *ws[i % inner]), fp8_bytes),
             ("xla, bf16 matrix", bf16_einsum, lambda i: (x, wide[i % inner]), bf16_bytes))
    for v in variants:
        vbs = dataclasses.replace(parse_variant(v), max_rows=1 << 30)
        impls += ((f"pallas {v}", lambda x, w, s, vbs=vbs: api.grouped(x, w, s, implementation="pallas",
                                                                       block_sizes=vbs),
                   lambda i: (x, *ws[i % inner]), fp8_bytes),)
    for label, fn, args, nbytes in impls:
        sec, dev = _time(fn, args, inner=inner, reps=reps)
        got = fn(*args(0))
        same = float(np.mean(np.asarray(got).view(np.uint16) == np.asarray(want).view(np.uint16)))
        t = _best(sec, dev)
        out.append(Row("fp8 linear attn.wo_a (grouped)", f"M={m} G={g} K={k} N={n}", label, sec * 1e6, dev * 1e6,
                       nbytes, nbytes / t / copy_bw, f"{same:.4f} bit-identical to xla on fp8"))
        print(_fmt(out[-1]), flush=True)
    return out


def fused_rows(m: int, copy_bw: float, inner: int = 8, reps: int = 10, only: str = "") -> list[Row]:
    """`FUSED` pairs in one launch (`api.linear_many`, default tiles) against one launch each."""
    out = []
    bs = api.BlockSizes(max_rows=1 << 30)
    for name, members in FUSED.items():
        if only not in name:
            continue
        k = SHAPES[members[0]][0]
        x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16) * 3
        mats = [[weights(k, SHAPES[p][1], 100 * i + 7 + j) for j, p in enumerate(members)] for i in range(inner)]
        nbytes = sum(linear_bytes(m, k, SHAPES[p][1]) for p in members)

        def many(x, *wss):
            return api.linear_many(x, wss[0::2], wss[1::2], implementation="pallas", block_sizes=bs)

        def each(x, *wss):
            return tuple(api.linear(x, w, s, implementation="pallas", block_sizes=bs)
                         for w, s in zip(wss[0::2], wss[1::2]))

        for label, fn in (("pallas, one launch", many), ("pallas, one launch each", each)):
            sec, dev = _time(fn, lambda i, x=x, mats=mats: (x, *(a for ws in mats[i % inner] for a in ws)),
                             inner=inner, reps=reps)
            t = _best(sec, dev)
            out.append(Row("fp8 linear " + name, f"M={m} K={k}", label, sec * 1e6, dev * 1e6, nbytes,
                           nbytes / t / copy_bw))
            print(_fmt(out[-1]), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8,64,256,1024", help="activation rows M (comma list)")
    p.add_argument("--decodes", default="native,bits", help="kernel decodes timed (comma list)")
    p.add_argument("--variants", default="", help="kernel tiles also timed, comma list of bn=64/bk=256/w=4/st=3/swap=1")
    p.add_argument("--only", default="", help="time only the projections whose name contains this")
    p.add_argument("--json", default=None, help="write the rows here")
    a = p.parse_args(argv)
    dev, copy_bw = start_run()
    rows = []
    for m in (int(v) for v in a.rows.split(",")):
        rows += rows_for(m, copy_bw, decodes=tuple(d for d in a.decodes.split(",") if d),
                         variants=tuple(v for v in a.variants.split(",") if v), only=a.only)
    if a.json:
        write_json(a.json, dev.device_kind, copy_bw, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
