"""The routed-expert fp4 launches alone at the released shapes: kernel variants timed side by side,
or each launch run once for a hardware-counter profiler.

    PYTHONPATH=. python -m benchmarks.expert_launches [--variants '[{}, {"decode": "relaid"}]']
        [--sites "b1 w1+w3,b1 w2,b8 w1+w3,b64 w1+w3,b64 w2,p4096 w1,p4096 w2"] [--rounds 2] [--json out.json]
    ncu --clock-control none -k regex:expert_matmul --section WarpStateStats ... \\
        python -m benchmarks.expert_launches --once --variants '[{}, {"num_warps": 8}]'

A site is "b<tokens> <weights>": the MoE's routed launches for that many tokens (6 experts a
token, drawn at random; one token takes the gather path, more the grouped path with
`tile_rows_for`'s tiles), weights "w1+w3" (one fused launch at decode tiles), "w1" or "w2";
"p<tokens>" is the same for a prefill. Random packed weights for all 384 experts, scale bytes
118..128 (so the scale fold is on, as for the released checkpoint). A variant is a dict of
`expert_matmul.BlockSizes` fields over the model's defaults, and `"rows"` the grouped path's
rows a tile; `{"decode": "relaid"}` runs on copies of the weights re-laid by `kernel_gpu.relay`.

Timing: every call reads other random experts (distinct inputs per call, so L2 holds none of
them), `benchmarks.kernels._time`'s device time a call from a profiler trace; the variants run
in alternating order for `rounds` rounds and the median is kept. Each row's bytes are the
distinct experts' packed weights and scales; the ceiling is the copy bandwidth measured in the
same run. Also reports whether each variant's outputs equal the first variant's bit for bit (the
rows that tiles cover; the grouped path leaves padding rows undefined).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels import _time, copy_bandwidth
from pallas_kernels.expert_matmul import api, kernel_gpu

ROUTED, TOP_K = 384, 6
SITES = "b1 w1+w3,b1 w2,b8 w1+w3,b64 w1+w3,b64 w2,p4096 w1,p4096 w2"


def stacks(key, n_exp: int, dim: int, inter: int):
    """Random packed w1, w3 [E, inter, dim/2], w2 [E, dim, inter/2] int8 and their e8m0 bytes."""
    def one(i, n, k):
        w = jax.random.randint(jax.random.fold_in(key, i), (n_exp, n, k // 2), -128, 128, jnp.int32).astype(jnp.int8)
        s = jax.random.randint(jax.random.fold_in(key, 10 + i), (n_exp, n, k // 32), 118, 129, jnp.int32)
        return w, s.astype(jnp.uint8)
    return {"w1": one(1, inter, dim), "w3": one(3, inter, dim), "w2": one(2, dim, inter)}


def parse_site(site: str) -> tuple[int, str]:
    """"b64 w1+w3" -> (64, "w1+w3")."""
    head, weights = site.split()
    if head[0] not in "bp" or not head[1:].isdigit() or weights not in ("w1+w3", "w1", "w2"):
        raise ValueError(f"site {site!r}: expected 'b<tokens>' or 'p<tokens>' then w1+w3, w1 or w2")
    return int(head[1:]), weights


def launch(tokens: int, n_exp: int, interpret: bool, bs: api.BlockSizes, rows: int | None = None):
    """f(x [P, K], ids [P], w, s) -> the site's routed launch(es) for P = 6 * tokens pairs; rows:
    the grouped path's rows a tile (default `api.tile_rows_for`)."""
    pairs = tokens * TOP_K
    c = rows or api.tile_rows_for(pairs, n_exp)

    def f(x, ids, w, s):
        if tokens == 1:
            return api.gather_matmul(x, w, s, ids, implementation="pallas", interpret=interpret, block_sizes=bs)
        order, te, row0, valid = api.grouped_tiles(ids, n_exp, c)
        xs = jnp.pad(jnp.take(x, order, axis=0), ((0, c), (0, 0)))
        out = api.grouped_matmul(xs, w, s, te, row0, valid, c, implementation="pallas", interpret=interpret,
                                 block_sizes=bs)
        inverse = jnp.argsort(order)  # pair order; the padding rows dropped
        return jax.tree.map(lambda o: jnp.take(o[:pairs], inverse, axis=0), out)
    return f


def run(sites, variants, rounds: int, once: bool, dims=(5120, 2304), n_exp: int = ROUTED, calls: int = 0,
        interpret: bool = False, seed: int = 0) -> list[dict]:
    """The rows (module docstring); with `once` each (site, variant) launch runs once, untimed."""
    dim, inter = dims
    key = jax.random.PRNGKey(seed)
    w = stacks(key, n_exp, dim, inter)
    relaid = {}
    if any(v.get("decode") == "relaid" for v in variants):
        relaid = {name: (jax.jit(kernel_gpu.relay)(ws), s) for name, (ws, s) in w.items()}
    bw = float("nan") if once or interpret else copy_bandwidth()
    rng = np.random.default_rng(seed)
    rows = []
    for site in sites:
        tokens, weights = parse_site(site)
        names = ("w1", "w3") if weights == "w1+w3" else (weights,)
        k = inter if weights == "w2" else dim
        n = dim if weights == "w2" else inter
        inner = calls or max(2, min(12, 2400 // tokens))
        sets = []
        for i in range(1 if once else inner):
            ids = rng.integers(0, n_exp, tokens * TOP_K).astype(np.int32)
            x = jax.random.normal(jax.random.fold_in(key, 1000 + i), (tokens * TOP_K, k), jnp.float32)
            sets.append((x.astype(jnp.bfloat16), jnp.asarray(ids)))
        distinct = float(np.mean([len(np.unique(np.asarray(ids))) for _, ids in sets]))
        by = distinct * len(names) * n * (k // 2 + k // 32)
        fl = 2.0 * tokens * TOP_K * n * k * len(names)
        times = {i: [] for i in range(len(variants))}
        first = {}
        for r in range(1 if once else rounds):
            order = range(len(variants)) if r % 2 == 0 else reversed(range(len(variants)))
            for i in order:
                variant = dict(variants[i])
                tile_rows = variant.pop("rows", None)
                src = relaid if variant.get("decode") == "relaid" else w
                ws = tuple(src[nm][0] for nm in names)
                ss = tuple(src[nm][1] for nm in names)
                f = launch(tokens, n_exp, interpret, api.BlockSizes(scale_fold=True, **variant), tile_rows)
                if r == 0:
                    first[i] = jax.block_until_ready(jax.jit(f)(*sets[0], ws, ss))
                if not once:
                    times[i].append(_time(f, lambda j, ws=ws, ss=ss, sets=sets: (*sets[j], ws, ss), inner=inner, reps=8)[1])
        for i, variant in enumerate(variants):
            same = all(np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
                       for a, b in zip(first[i], first[0]))
            row = {"name": f"kernel routed {site} {json.dumps(variant, sort_keys=True)}", "batch": tokens,
                   "context": 0, "bytes": by, "flops": fl, "ceiling": "hbm", "same_as_first": same}
            if not once:
                t = statistics.median(times[i])
                row |= {"seconds": t, "rounds_s": times[i], "fraction_of_ceiling": by / t / bw}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sites", default=SITES, help=f"comma-separated sites (default {SITES!r})")
    p.add_argument("--variants", default='[{}, {"decode": "relaid"}]', help="JSON list of BlockSizes field dicts")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--once", action="store_true", help="run each launch once, untimed (for a profiler)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--tiny", action="store_true", help="small shapes, kernels in interpret mode (CPU check)")
    ns = p.parse_args(argv)
    variants = json.loads(ns.variants)
    if not isinstance(variants, list) or not all(isinstance(v, dict) for v in variants) or not variants:
        p.error("--variants must be a JSON list of dicts of expert_matmul.BlockSizes fields")
    for v in variants:
        r = v.get("rows")
        if r is not None and (not isinstance(r, int) or r < 16 or r % 16):
            p.error(f"--variants: \"rows\" must be a multiple of 16 (rows a grouped tile), got {r!r}")
    sites = [s.strip() for s in ns.sites.split(",") if s.strip()]
    try:
        for s in sites:
            parse_site(s)
    except ValueError as e:
        p.error(str(e))
    extra = {"dims": (256, 128), "n_exp": 8, "calls": 2, "interpret": True} if ns.tiny else {}
    rows = run(sites, variants, ns.rounds, ns.once, **extra)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"meta": {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__}, "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
