"""Kernel benchmark: the Sinkhorn site, sparse attention, the gate's one-row logits and the indexer's
scores, Pallas kernel vs the XLA reference.

    python -m benchmarks.kernels [--sweep] [--json PATH] [--budget-s 420]

One run on one GPU prints a markdown table: median µs per call, the bytes each call must move
(each input read once, each output written once), achieved bandwidth as a fraction of the
device-to-device copy bandwidth measured in the same run, and the max error vs the float64
reference in bf16 ulps (attention) or f32 ulps (Sinkhorn). --sweep first times a few tile choices.

Timing: each measured call is unrolled `inner` times inside one jitted program over rotating input
copies (so repeated calls do not hit L2 on inputs that fit in it and dispatch cost is amortised),
warmed up, then timed with block_until_ready; the median of `reps` runs divided by `inner`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.index_scores import api as index_api
from pallas_kernels.sinkhorn import api as sinkhorn_api
from pallas_kernels.sparse_attention import api as attn_api
from pallas_kernels.topk import api as topk_api
from pallas_kernels.topk import kernel_gpu as topk_gpu

H, D, WINDOW, TOPK = 64, 512, 128, 512  # released attention: 64 heads, 512 latent, 128 + 512 rows
HC, DIM, ITERS = 4, 5120, 20
EXPERTS = 384  # released routed experts


def _time(fn, make_args, *, inner: int, reps: int) -> tuple[float, float]:
    """(wall, device) seconds per call of fn(*args): wall = median host time of the unrolled
    program / inner; device = summed GPU kernel time per call from a profiler trace (no launch
    gaps; NaN where the trace has no device plane)."""
    # one input set per call: identical calls on identical operands would be merged by XLA's CSE,
    # and distinct inputs keep repeated calls from hitting L2 (make_args may share a huge operand)
    sets = [make_args(i) for i in range(inner)]
    multi = jax.jit(lambda sets: [fn(*a) for a in sets])
    for _ in range(3):
        jax.block_until_ready(multi(sets))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(multi(sets))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / inner, _device_time(multi, sets, inner)


def _device_time(multi, sets, inner, reps=3) -> float:
    import glob
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        for _ in range(reps):
            jax.block_until_ready(multi(sets))
        jax.profiler.stop_trace()
        files = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        if not files:
            return float("nan")
        data = jax.profiler.ProfileData.from_file(files[0])
        per_line = {}
        for plane in data.planes:
            if "gpu" not in plane.name.lower() and "device" not in plane.name.lower():
                continue
            for line in plane.lines:
                per_line[(plane.name, line.name)] = sum(ev.duration_ns for ev in line.events)
    global _LINES_SHOWN
    if not _LINES_SHOWN:
        _LINES_SHOWN = True
        print("# profiler lines:", {k: round(v / 1e3, 1) for k, v in per_line.items()}, flush=True)
    streams = [v for (pl_, ln), v in per_line.items() if ln.lower().startswith("stream")]
    if not streams:
        streams = [v for (pl_, ln), v in per_line.items() if ln == "XLA Ops"]
    if not streams:
        return float("nan")
    return sum(streams) * 1e-9 / (reps * inner)


_LINES_SHOWN = False


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy: read + write of a 2 GiB f32 buffer (x + 1)."""
    n = 2**29
    x = jax.random.uniform(jax.random.key(0), (n,), jnp.float32)
    sec, dev = _time(lambda x: x + 1.0, lambda i: (x,), inner=1, reps=20)
    return 2 * 4 * n / _best(sec, dev)


@dataclasses.dataclass
class Row:
    site: str
    shape: str
    impl: str
    us: float
    dev_us: float
    bytes: float
    bw_frac: float
    err: str = ""
    note: str = ""


def _ulps_bf16(got, want):
    """(max error in bf16 ulps, where the ulp is taken at max(|want|, rms(want)) so that outputs
    near zero do not blow the count up; fraction of bf16 outputs that differ from the oracle's)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    rms = float(np.sqrt(np.mean(np.square(want))))
    spacing = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), max(rms, 2.0**-126)))) - 7)
    u = np.abs(got - want) / spacing
    return float(u.max()), float((got != want).mean())


# ------------------------------------------------------------------------------------ Sinkhorn


def sinkhorn_rows(copy_bw: float, tokens=(1, 64, 4096)) -> list[Row]:
    rows = []
    scale = jnp.asarray([0.9, 1.1, 1.7], jnp.float32)
    base = jax.random.normal(jax.random.key(1), (24,), jnp.float32)
    kw = {"norm_eps": 1e-6, "iters": ITERS, "hc_eps": 1e-6}
    for t in tokens:
        def make_x(i, t=t):  # a fresh projection per set too: each layer's weights come from HBM
            return (jax.random.normal(jax.random.key(100 + i), (1, t, HC, DIM), jnp.bfloat16),
                    jax.random.normal(jax.random.key(300 + i), (24, HC * DIM), jnp.float32) * 0.02, scale, base)
        site_bytes = t * HC * DIM * 2 + 24 * HC * DIM * 4 + 27 * 4 + t * 24 * 4
        inner = 50 if t <= 64 else 10
        for impl in ("reference", "pallas"):
            f = lambda x, fn_, s, b, impl=impl: sinkhorn_api.hc_mixes(x, fn_, s, b, **kw, implementation=impl)
            sec, dev = _time(f, make_x, inner=inner, reps=30)
            rows.append(Row("sinkhorn site (hc_mixes)", f"t={t}", impl, sec * 1e6, dev * 1e6, site_bytes,
                            site_bytes / _best(sec, dev) / copy_bw))

        def make_m(i, t=t):
            return (jax.random.normal(jax.random.key(200 + i), (t, 24), jnp.float32) * 2, scale, base)
        split_bytes = t * 24 * 4 * 2 + 27 * 4
        for impl, bs in (("reference", None), ("pallas", None),
                         ("pallas", sinkhorn_api.BlockSizes(division="rcp_fma")),
                         ("pallas", sinkhorn_api.BlockSizes(lanes=False)),
                         ("pallas", sinkhorn_api.BlockSizes(lane_tokens=2)),
                         ("pallas", sinkhorn_api.BlockSizes(lane_tokens=32))):
            f = lambda m, s, b, impl=impl, bs=bs: sinkhorn_api.hc_split_sinkhorn(
                m, s, b, hc=HC, iters=ITERS, eps=1e-6, implementation=impl, block_sizes=bs)
            sec, dev = _time(f, make_m, inner=inner, reps=30)
            err = ""
            m, s, b = make_m(0)
            got = [np.asarray(v) for v in jax.jit(f)(m, s, b)]
            if impl == "pallas" and bs is None:
                first = got
            elif impl == "pallas":  # every kernel variant computes the same bits
                same = all(np.array_equal(g.view(np.uint32), w.view(np.uint32)) for g, w in zip(got, first))
                err = "bit-identical to the default" if same else "DIFFERS from the default"
            if t == 4096:
                want = _sinkhorn_f64(np.asarray(m), np.asarray(s), np.asarray(b))
                ulps = [float(np.max(np.abs(np.asarray(g, np.float64) - w)
                                     / np.spacing(np.abs(w).astype(np.float32)))) for g, w in zip(got, want)]
                err = ("; ".join(v for v in (err, "pre/post/comb max f32 ulps vs f64: ") if v)
                       + "/".join(f"{u:.0f}" for u in ulps))
            label = impl if bs is None else f"{impl} ({_sinkhorn_variant(bs)})"
            rows.append(Row("sinkhorn split only", f"t={t}", label,
                            sec * 1e6, dev * 1e6, split_bytes,
                            split_bytes / _best(sec, dev) / copy_bw, err))
    return rows


def _sinkhorn_variant(bs) -> str:
    """The BlockSizes fields that differ from the defaults ("default" if none)."""
    d = sinkhorn_api.BlockSizes()
    return ", ".join(f"{f}={getattr(bs, f)}" for f in ("division", "lanes", "lane_tokens")
                     if getattr(bs, f) != getattr(d, f)) or "default"


def _sinkhorn_f64(m, s, b, eps=1e-6):
    m, s, b = m.astype(np.float64), s.astype(np.float64), b.astype(np.float64)
    pre = 1 / (1 + np.exp(-(m[:, :4] * s[0] + b[:4]))) + eps
    post = 2 / (1 + np.exp(-(m[:, 4:8] * s[1] + b[4:8])))
    c = (m[:, 8:] * s[2] + b[8:]).reshape(-1, 4, 4)
    c = np.exp(c - c.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + eps
    c = c / (c.sum(-2, keepdims=True) + eps)
    for _ in range(ITERS - 1):
        c = c / (c.sum(-1, keepdims=True) + eps)
        c = c / (c.sum(-2, keepdims=True) + eps)
    return pre, post, c


# --------------------------------------------------------------------------- gate (one row)


def router_rows(copy_bw: float) -> list[Row]:
    """The gate of one decode row at the released width: the FFN RMSNorm, the experts' activation
    quantiser and the logits (bf16 [1, 5120] x [384, 5120]). XLA's reference (its launches) against
    `kernel_gpu.router_logits` (one launch) at its default tiles and at the tiles it had before
    (block_e 4, block_k 512, 4 warps: its first version's tiles). Each set
    has its own weight (from HBM, as each layer's is)."""
    def make(i):
        k = jax.random.key(400 + i)
        return (jax.random.normal(k, (1, DIM), jnp.bfloat16),
                (jax.random.normal(jax.random.fold_in(k, 1), (EXPERTS, DIM), jnp.float32) * 0.02).astype(jnp.bfloat16),
                (1 + 0.1 * jax.random.normal(jax.random.fold_in(k, 2), (DIM,), jnp.float32)).astype(jnp.bfloat16))

    nbytes = EXPERTS * DIM * 2 + 2 * DIM * 2 + EXPERTS * 4 + 2 * DIM * 2
    eps = 1e-20
    variants = {"reference": lambda x, w, nw: topk_api.router_logits(x, w, norm_weight=nw, norm_eps=eps, quantise=True,
                                                                     implementation="reference"),
                "pallas": lambda x, w, nw: topk_gpu.router_logits(x, w, nw, eps, interpret=False),
                "pallas (block_e 4, block_k 512, 4 warps)": lambda x, w, nw: topk_gpu.router_logits(
                    x, w, nw, eps, block_e=4, block_k=512, num_warps=4, interpret=False)}
    want = [np.asarray(v, np.float32) for v in jax.jit(variants["reference"])(*make(0))]
    rows = []
    for label, f in variants.items():
        try:
            sec, dev = _time(f, make, inner=50, reps=30)
            got = [np.asarray(v, np.float32) for v in jax.jit(f)(*make(0))]
        except Exception as e:  # noqa: BLE001 (a failing row is a result)
            rows.append(Row("gate logits, norm + quantiser", "1 x 5120 x 384", label, float("nan"), float("nan"),
                            nbytes, 0.0, note=f"FAILED {type(e).__name__}: {str(e)[:200]}"))
            continue
        rows_same = all(np.array_equal(g, w) for g, w in zip(got[1:], want[1:]))
        err = (f"rows {'bit-identical' if rows_same else 'DIFFER'}; "
               f"logits max abs diff {float(np.max(np.abs(got[0] - want[0]))):.2g} vs reference")
        rows.append(Row("gate logits, norm + quantiser", "1 x 5120 x 384", label, sec * 1e6, dev * 1e6, nbytes,
                        nbytes / _best(sec, dev) / copy_bw, err))
    return rows


# ---------------------------------------------------------------------------- indexer scores

IH, IHD = 32, 128  # released index heads and head dim
# (site, batch rows, query rows each, keys): a 4096-token prefill's ratio-1 and ratio-2 index
# layers, and a batch-64 decode step at 64k context on a ratio-1 layer (the whole index cache)
INDEX_SITES = (("prefill r1", 1, 4096, 4096), ("prefill r2", 1, 4096, 2048), ("decode r1 64k", 64, 1, 65536))


def index_rows(copy_bw: float, sites=INDEX_SITES) -> list[Row]:
    """`index_scores` at the released index width: XLA's reference (its per-head f32 dots written
    to memory, then the head sum) against the GPU kernel (`pallas_kernels.index_scores`). Bytes:
    q, k and w read once, the bf16 scores written once. Each set has its own inputs; the error
    column gives the fraction of scores that differ from the reference's."""
    rows = []
    for site, b, s, t in sites:
        def make(i, b=b, s=s, t=t):
            k = jax.random.key(500 + i)
            return (jax.random.normal(k, (b, s, IH, IHD), jnp.float32).astype(jnp.bfloat16),
                    jax.random.normal(jax.random.fold_in(k, 1), (b, t, IHD), jnp.float32).astype(jnp.bfloat16),
                    (0.1 * jax.random.normal(jax.random.fold_in(k, 2), (b, s, IH), jnp.float32)).astype(jnp.bfloat16))

        nbytes = 2 * (b * s * IH * IHD + b * t * IHD + b * s * IH + b * s * t)
        shape = f"{b} x {s} x {IH} x {IHD}, {t} keys"
        want = None
        for label in ("reference", "pallas"):
            f = lambda q, k, w, label=label: index_api.index_scores(q, k, w, implementation=label)
            try:
                inner = 4 if b * s * t > 1 << 24 else 20
                sec, dev = _time(f, make, inner=inner, reps=10)
                got = np.asarray(jax.jit(f)(*make(0)), np.float32)
            except Exception as e:  # noqa: BLE001 (a failing row is a result)
                rows.append(Row("index scores", shape, f"{site} {label}", float("nan"), float("nan"), nbytes, 0.0,
                                note=f"FAILED {type(e).__name__}: {str(e)[:200]}"))
                continue
            want = got if want is None else want
            err = f"{float(np.mean(got != want)):.2g} of scores differ from the reference's"
            rows.append(Row("index scores", shape, f"{site} {label}", sec * 1e6, dev * 1e6, nbytes,
                            nbytes / _best(sec, dev) / copy_bw, err))
    return rows


# ---------------------------------------------------------------------------- sparse attention


_SHARED_KV = {}


def decode_inputs(b: int, ctx: int, seed: int):
    """One query per row; 128 window rows (the newest positions) + 512 distinct older rows.
    A cache over 1 GB is shared between input sets (the rows a set touches are random in it)."""
    key = jax.random.key(seed)
    kq, kk, ki = jax.random.split(key, 3)
    q = jax.random.normal(kq, (b, 1, H, D), jnp.bfloat16)
    if b * ctx * D * 2 > 2**30:
        if (b, ctx) not in _SHARED_KV:
            _SHARED_KV.clear()
            _SHARED_KV[(b, ctx)] = jax.random.normal(kk, (b, ctx, D), jnp.bfloat16)
        kv = _SHARED_KV[(b, ctx)]
    else:
        kv = jax.random.normal(kk, (b, ctx, D), jnp.bfloat16)
    win = jnp.broadcast_to(ctx - WINDOW + jnp.arange(WINDOW, dtype=jnp.int32), (b, WINDOW))
    older = jax.vmap(lambda k: jax.random.choice(k, ctx - WINDOW, (TOPK,), replace=False))(jax.random.split(ki, b))
    idx = jnp.concatenate([win, older.astype(jnp.int32)], axis=-1)[:, None, :]
    sink = jax.random.uniform(jax.random.key(seed + 7), (H,), jnp.float32, -1.0, 3.0)
    return q, kv, sink, idx


def prefill_inputs(m: int, seed: int):
    """Causal prefill of m tokens: window rows 0..m-1, then m/4 compressed rows; query i lists its
    last <= 128 positions and up to 512 compressed rows it may see (i // 4 of them)."""
    n = m + m // 4
    key = jax.random.key(seed)
    kq, kk, ki = jax.random.split(key, 3)
    q = jax.random.normal(kq, (1, m, H, D), jnp.bfloat16)
    kv = jax.random.normal(kk, (1, n, D), jnp.bfloat16)
    i = jnp.arange(m, dtype=jnp.int32)[:, None]
    w = i - WINDOW + 1 + jnp.arange(WINDOW, dtype=jnp.int32)[None]
    win = jnp.where(w >= 0, w, -1)
    r = jax.random.uniform(ki, (m, m // 4))
    visible = jnp.arange(m // 4)[None] < (i // 4)
    top = jax.lax.top_k(jnp.where(visible, r, -1.0), TOPK)[1].astype(jnp.int32)
    top_ok = jnp.take_along_axis(visible, top, axis=1)
    comp = jnp.where(top_ok, m + top, -1)
    idx = jnp.concatenate([win, comp], axis=-1)[None]
    sink = jax.random.uniform(jax.random.key(seed + 7), (H,), jnp.float32, -1.0, 3.0)
    return q, kv, sink, idx


def attn_bytes(q, kv, idx) -> float:
    """Bytes a call must move: q, idx, sink, every valid listed kv row once, the bf16 output."""
    valid = int(jnp.sum(idx >= 0))
    return q.size * 2 * 2 + idx.size * 4 + H * 4 + valid * kv.shape[-1] * 2


def attn_flops(idx) -> float:
    return 4.0 * H * D * int(jnp.sum(idx >= 0))


def _attn_fn(impl, bs=None, acc="f32"):
    scale = D ** -0.5
    return lambda q, kv, s, i: attn_api.sparse_attn(q, kv, s, i, scale, implementation=impl, accumulate=acc,
                                                    block_sizes=bs)


def attention_row(site, shape, impl, make, copy_bw, *, bs=None, acc="f32", inner=10, reps=15, check_err=False,
                  note=""):
    args0 = make(0)
    nbytes = attn_bytes(args0[0], args0[1], args0[3])
    fn = _attn_fn(impl, bs, acc)
    sec, dev = _time(fn, make, inner=inner, reps=reps)
    err = ""
    if check_err:
        q, kv, s, i = args0
        if q.shape[1] > 256:  # prefill: check the first 256 queries (the f64 oracle gathers every row)
            q, i = q[:, :256], i[:, :256]
        got = jax.jit(fn)(q, kv, s, i)
        want = jax.jit(lambda q, kv, s, i: attn_api.sparse_attn(q, kv, s, i, D ** -0.5, implementation="reference",
                                                                accumulate="f64"))(q, kv, s, i)
        mx, frac = _ulps_bf16(got, want)
        err = f"max {mx:.2f} ulp, {100 * frac:.2f}% differ"
    tflops = attn_flops(args0[3]) / _best(sec, dev) / 1e12
    label = f"{impl} {acc}" if bs is None else f"{impl} {acc} {_short(bs)}"
    return Row(site, shape, label, sec * 1e6, dev * 1e6, nbytes, nbytes / _best(sec, dev) / copy_bw, err,
               note or f"{tflops:.0f} TFLOP/s")


def _best(wall, dev):
    """Device time where the trace gave one, else wall."""
    return dev if not math.isnan(dev) and dev > 0 else wall


def _short(bs) -> str:
    fields = [f"{f.name}={getattr(bs, f.name)}" for f in dataclasses.fields(bs)
              if getattr(bs, f.name) != getattr(attn_api.BlockSizes(), f.name)]
    return "(" + ", ".join(fields) + ")" if fields else "(default)"


def floor_rows(copy_bw) -> list[Row]:
    """What one tiny XLA op and one tiny Pallas kernel cost in this harness (launch floor)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    def tiny_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    def tiny_pallas(x):
        return pl.pallas_call(tiny_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))(x)

    rows = []
    for name, f in (("xla x+1", lambda x: x + 1.0), ("pallas x+1", tiny_pallas)):
        try:
            sec, dev = _time(f, lambda i: (jnp.full((128,), float(i), jnp.float32),), inner=50, reps=30)
        except Exception as e:  # noqa: BLE001 (no GPU: the Pallas row cannot compile)
            rows.append(Row("launch floor", "128 f32", name, float("nan"), float("nan"), 1024, 0.0,
                            note=f"FAILED {type(e).__name__}"))
            continue
        rows.append(Row("launch floor", "128 f32", name, sec * 1e6, dev * 1e6, 1024, 0.0))
    return rows


def sweep(copy_bw, deadline):
    """Tile variants of the f32 kernel around the defaults: decode B=64 (4k context) and prefill."""
    rows = []
    B = attn_api.BlockSizes

    def add(site, shape, bs, acc, make, **kw):
        try:
            rows.append(attention_row(site, shape, "pallas", make, copy_bw, bs=bs, acc=acc, **kw))
        except Exception as e:  # noqa: BLE001 (a tile choice that does not compile is a result of the sweep)
            rows.append(Row(site, shape, f"pallas {acc} {_short(bs)}", float("nan"), float("nan"), 0, 0,
                            note=f"FAILED {type(e).__name__}: {str(e)[:160]}"))
        print(_fmt(rows[-1]), flush=True)

    decode = [("f32", B(block_h=16, block_k=64)), ("f32", B(block_h=32, num_warps=4)),
              ("f32", B(block_h=16, num_stages=3)), ("f32", B(block_h=64, block_d=512))]
    for acc, bs in decode:
        if time.time() > deadline:
            return rows
        add("sweep decode", "B=64 ctx=4k", bs, acc, lambda i: decode_inputs(64, 4096, 10 + i))
    for acc, bs in (("f32", B(block_h=16, num_warps=4)), ("f32", B(block_h=32, num_warps=4)),
                    ("f32", B(block_h=32, block_k=64))):
        if time.time() > deadline:
            return rows
        add("sweep prefill", "M=4096", bs, acc, lambda i: prefill_inputs(4096, 50 + i), inner=2, reps=3)
    return rows


def attention_rows(copy_bw, deadline, configs, batches=(1, 8, 64), contexts=(4096, 65536)):
    """configs: list of (impl, BlockSizes | None) timed on every shape."""
    rows = []

    def add(site, shape, impl, acc, bs, make, **kw):
        try:
            rows.append(attention_row(site, shape, impl, make, copy_bw, bs=bs, acc=acc, **kw))
        except Exception as e:  # noqa: BLE001 (a failing row is a result)
            rows.append(Row(site, shape, f"{impl} {acc}" if bs is None else f"{impl} {acc} {_short(bs)}",
                            float("nan"), float("nan"), 0, 0, note=f"FAILED {type(e).__name__}: {str(e)[:200]}"))
        print(_fmt(rows[-1]), flush=True)

    for ctx in contexts:
        for b in batches:
            for impl, acc, bs in configs:
                if time.time() > deadline:
                    return rows
                add("sparse attn decode", f"B={b} ctx={ctx // 1024}k", impl, acc, bs,
                    lambda i, b=b, ctx=ctx: decode_inputs(b, ctx, 20 + i), check_err=ctx == 4096 and b == 64)
    for impl, acc, bs in configs:
        if time.time() > deadline:
            return rows
        add("sparse attn prefill", "M=4096", impl, acc, bs, lambda i: prefill_inputs(4096, 60 + i), inner=2,
            reps=3, check_err=True)
    return rows


def write_json(path: str, device: str, copy_bw: float, rows: list[Row]) -> None:
    with open(path, "w") as f:
        json.dump({"device": device, "copy_bw": copy_bw, "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)


def _fmt(r: Row) -> str:
    return (f"| {r.site} | {r.shape} | {r.impl} | {r.us:.1f} | {r.dev_us:.1f} | {r.bytes / 1e6:.3f} "
            f"| {100 * r.bw_frac:.1f}% | {r.err} | {r.note} |")


HEADER = ("| site | shape | impl | wall µs | device µs | MB moved | of copy BW | error vs f64 | note |\n"
          "|---|---|---|---|---|---|---|---|---|")


def start_run():
    """Prints the device and the copy bandwidth measured now, then the table header; returns
    (device, copy bytes/s) for the rows' fractions."""
    dev = jax.devices()[0]
    print(f"# device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}", flush=True)
    copy_bw = copy_bandwidth()
    print(f"# copy bandwidth (read + write of 2 GiB): {copy_bw / 1e12:.2f} TB/s", flush=True)
    print(HEADER, flush=True)
    return dev, copy_bw


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true", help="time tile variants of the attention kernel first")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting new rows after this long")
    p.add_argument("--skip", default="", help="comma list of sections to skip: sinkhorn,router,index,attention")
    p.add_argument("--tokens", default="1,64,4096", help="Sinkhorn token counts (comma list)")
    p.add_argument("--batches", default="1,8,64", help="decode batch sizes (comma list)")
    p.add_argument("--contexts", default="4096,65536", help="decode context lengths (comma list)")
    p.add_argument("--sweep-s", type=float, default=None, help="time for the sweep (default: half the budget)")
    a = p.parse_args(argv)
    deadline = time.time() + a.budget_s
    dev, copy_bw = start_run()
    rows = floor_rows(copy_bw)
    for r in rows:
        print(_fmt(r), flush=True)
    if a.sweep:
        rows += sweep(copy_bw, time.time() + (a.sweep_s if a.sweep_s is not None else 0.5 * a.budget_s))
    if "sinkhorn" not in a.skip:
        for t in (int(x) for x in a.tokens.split(",")):
            try:
                new = sinkhorn_rows(copy_bw, tokens=(t,))
            except Exception as e:  # noqa: BLE001 (a failing row is a result)
                new = [Row("sinkhorn", f"t={t}", "?", float("nan"), float("nan"), 0, 0,
                           note=f"FAILED {type(e).__name__}: {str(e)[:300]}")]
            for r in new:
                rows.append(r)
                print(_fmt(r), flush=True)
    if "router" not in a.skip:
        for r in router_rows(copy_bw):
            rows.append(r)
            print(_fmt(r), flush=True)
    if "index" not in a.skip:
        for r in index_rows(copy_bw):
            rows.append(r)
            print(_fmt(r), flush=True)
    if "attention" not in a.skip:
        # the f32 kernel (default tiles, and with p rounded to bf16 once), the XLA reference in
        # float64 (what the model runs: its call asks for the oracle's rounding) and in f32
        configs = [("pallas", "f32", None), ("pallas", "f32", attn_api.BlockSizes(split_probs=False)),
                   ("reference", "f64", None), ("reference", "f32", None)]
        rows += attention_rows(copy_bw, deadline, configs, batches=[int(x) for x in a.batches.split(",")],
                               contexts=[int(x) for x in a.contexts.split(",")])
    print("\n## summary", flush=True)
    print(HEADER)
    for r in rows:
        if not r.site.startswith("sweep"):
            print(_fmt(r))
    if a.json:
        write_json(a.json, dev.device_kind, copy_bw, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
