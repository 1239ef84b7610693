"""Kernel launches of the six-layer decode step, compiled for an H100 / H200 this host need not have.

XLA compiles for a GPU from a description of the card (SM count, shared memory, caches, clock,
memory bandwidth: `CARDS`) through the CUDA PJRT plugin's topology, with no device present
(`jax.experimental.topologies`). The optimized program is the one the card runs: the same fusions
and the same Pallas launches (checked against a traced H200 step: 381 launching instructions
here, 383 kernels traced; 204 on the longest chain here, 200 on the timed path), but for GEMM
autotuning, which needs the device (XLA takes its default GEMM configurations; on the decode
step's path the matmuls are Pallas kernels and the float64 attention's dots).

At batch 1 a step is a chain of dependent launches, each costing its kernel's run time plus about
0.6 µs (benchmarks/README.md, twenty-second run), so a launch removed from that chain is time
saved; this counts them: every launching instruction, and the longest chain of dependent ones
(`critical_path` with every launch weighing one), per emitting source line
(`model_speed.hlo_sources`), and how many of each touch under 1 MiB (`launch_bytes`: operands and
result, whole): launches too small to stream anything, whose time is their fixed cost.

Needs jax's CUDA plugin at the installed jax's version V (pyproject's `aot` extra: `pip install
"jax-cuda12-plugin==V" "jax-cuda12-pjrt==V"`, about 0.5 GB; no CUDA toolkit or driver); runs on
CPU-only hosts, where `python -m` starts jax CPU-only (JAX_PLATFORMS=cpu) so that the plugin
registers without a device.
The platform-dependent choices (kernels, float64) are made for a GPU (`target_platform`).

  python -m benchmarks.launch_count [--batches 1,64] [--contexts 4096] [--card h100] [--paths fast]
                                    [--chain] [--hlo DIR] [--json FILE] [--prefill 4096 [--top 15]]

`--prefill` also compiles the prefill of one prompt per length and lists the source lines whose
launches touch the most bytes (`bytes_by_source`).
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    # the CUDA plugin registers its topology without a device only where jax starts CPU-only
    # (with a GPU backend requested and no driver, its start-up check fails first)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks import critical_path as cp
from benchmarks import model_speed as ms
from dsv41_jax.cache import init_cache
from dsv41_jax.generate import context_bucket
from dsv41_jax.loading import resolve_fp4_relaid
from dsv41_jax.model import Transformer
from pallas_kernels._dispatch import target_platform

# The cards' facts XLA's GPU compiler reads (GpuDeviceInfoProto fields; NVIDIA's published
# figures for the SXM parts: 132 SMs of 228 KiB shared memory (227 KiB a block opted in), 50 MiB
# L2, 1.98 GHz boost clock).
_HOPPER = {"threads_per_block_limit": 1024, "threads_per_warp": 32, "shared_memory_per_block": 48 * 1024,
           "shared_memory_per_block_optin": 227 * 1024, "shared_memory_per_core": 228 * 1024,
           "threads_per_core_limit": 2048, "core_count": 132, "fpus_per_core": 128, "block_dim_limit_x": 2**31 - 1,
           "block_dim_limit_y": 65535, "block_dim_limit_z": 65535, "l2_cache_size": 50 * 2**20,
           "clock_rate_ghz": 1.98, "registers_per_core_limit": 65536, "registers_per_block_limit": 65536}
CARDS = {
    "h100": dict(_HOPPER, name="NVIDIA H100 80GB HBM3", memory_bandwidth=3_352_320_000_000,
                 device_memory_size=80 * 2**30),
    "h200": dict(_HOPPER, name="NVIDIA H200", memory_bandwidth=4_800_000_000_000, device_memory_size=141 * 10**9),
}


def target_config(card: str) -> str:
    """The GpuTargetConfigProto text of `card` (a key of CARDS)."""
    if card not in CARDS:
        raise ValueError(f"--card must be one of {sorted(CARDS)}, got {card!r}")
    facts = dict(CARDS[card])
    name = facts.pop("name")
    fields = "\n".join(f"  {k}: {v}" for k, v in facts.items())
    return (f"gpu_device_info {{\n{fields}\n  cuda_compute_capability {{ major: 9 minor: 0 }}\n}}\n"
            f'platform_name: "CUDA"\ndevice_description_str: "{name}"\n')


def gpu_device(card: str):
    """A device of `card` for ahead-of-time compilation (no GPU needed): a CUDA topology device."""
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(card), topology="1x1x1")
    except (NotImplementedError, RuntimeError, ValueError) as e:
        raise RuntimeError(f"no CUDA topology for --card {card}: jax's CUDA plugin is needed (jax-cuda12-plugin "
                           f"and jax-cuda12-pjrt at jax's version {jax.__version__}), with JAX_PLATFORMS=cpu on a "
                           f"host without a GPU ({type(e).__name__}: {e})") from e
    return topo.devices[0]


LAYOUT_PATHS = ("fast-released", "fast-relaid")  # "fast" with the experts' fp4 words as released / re-laid


def _abstract_model(batch: int, cache_len: int, card: str, path: str):
    """(args, graphdef, state, cache, on_card) of `model_speed`'s six-layer full-width model at
    `batch` rows and a cache of `cache_len` positions, as shapes only; `on_card(tree)` places a
    tree of shapes on `card`, the routed experts' fp4 layout as the loaders resolve `fp4_relaid`.
    Call inside `target_platform("gpu")`. path: "fast" (kernels auto), "reference" (plain jnp),
    a `model_speed.PATH_FLAGS` path, or one of the layouts (`LAYOUT_PATHS`)."""
    known = ("fast", "reference", *LAYOUT_PATHS, *ms.PATH_FLAGS)
    if path not in known:
        raise ValueError(f"--paths: unknown path {path!r} ({', '.join(known)})")
    sharding = jax.sharding.SingleDeviceSharding(gpu_device(card))
    args = ms.bench_args(False, batch, cache_len, "reference" if path == "reference" else "auto",
                         fp4_scale_fold="on", fp4_relaid=ms.PATHS[path][3])

    def loaded():  # the fp4 layout as the loaders resolve it (re-laid where the compiled kernel runs)
        model = Transformer(args)
        resolve_fp4_relaid(model, args)
        return model

    graphdef, state = nnx.split(nnx.eval_shape(loaded))
    graphdef, state = ms.with_path_flags(graphdef, state, path)
    cache = jax.eval_shape(lambda: init_cache(args, batch, args.max_seq_len))
    on_card = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
    return args, graphdef, state, cache, on_card


def decode_hlo(batch: int, context: int, card: str = "h100", path: str = "fast") -> str:
    """The optimized HLO text of `model_speed`'s six-layer full-width decode step (`Generator`'s
    context bound, every row at position context - 1) at `batch` rows, compiled for `card`;
    `path` as `_abstract_model`."""
    with target_platform("gpu"):
        args, graphdef, state, cache, on_card = _abstract_model(batch, context, card, path)
        rows = on_card(jax.ShapeDtypeStruct((batch,), jnp.int32))
        fn = ms._decode_fn(graphdef, context_bucket(context, args.max_seq_len))
        return fn.lower(on_card(state), rows, rows, on_card(cache)).compile().as_text()


def prefill_hlo(length: int, card: str = "h100", path: str = "fast") -> str:
    """The optimized HLO text of `model_speed`'s six-layer full-width prefill of one prompt of
    `length` tokens (a cache of `length` positions), compiled for `card`; `path` as
    `_abstract_model`."""
    with target_platform("gpu"):
        _, graphdef, state, cache, on_card = _abstract_model(1, length, card, path)
        ids = on_card(jax.ShapeDtypeStruct((1, length), jnp.int32))

        def run(state, ids, cache):
            return nnx.merge(graphdef, state).prefill(ids, None, cache)

        return jax.jit(run).lower(on_card(state), ids, on_card(cache)).compile().as_text()


def bytes_by_source(hlo_text: str) -> dict[str, tuple[int, int]]:
    """Emitting source line (`model_speed.path_label`) -> (launches, bytes touched: `launch_bytes`,
    an upper bound), most bytes first, over the entry computation's launches (the kernels inside
    a while loop's body, as the chunked float64 attention's, are not counted)."""
    touched = launch_bytes(hlo_text)
    sources = ms.hlo_sources(hlo_text)
    out: dict[str, list[int]] = {}
    for inst in cp.entry_instructions(hlo_text):
        if inst.name in touched:
            entry = out.setdefault(ms.path_label(sources, inst), [0, 0])
            entry[0] += 1
            entry[1] += touched[inst.name]
    return {k: (v[0], v[1]) for k, v in sorted(out.items(), key=lambda kv: -kv[1][1])}


def chain(hlo_text: str) -> tuple[int, list[tuple[str, str, str]], dict[str, int]]:
    """(launching instructions of the entry computation, its longest chain of dependent launches
    in order as (instruction, layer scope or "", emitting source line), that chain's launches per
    source line, most first)."""
    insts = cp.entry_instructions(hlo_text)
    _, path = cp.critical_path(insts, {}, per_launch=1.0)
    sources = ms.hlo_sources(hlo_text)
    by_name = {i.name: i for i in insts}
    layers = dict(re.findall(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name="[^"]*?(layer_\d+)', hlo_text, re.MULTILINE))
    steps = [(name, layers.get(name, ""), ms.path_label(sources, by_name[name])) for name in path]
    counts: dict[str, int] = {}
    for _, _, key in steps:
        counts[key] = counts.get(key, 0) + 1
    return sum(i.launches for i in insts), steps, dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1, "s4": 0.5, "u4": 0.5,
                "f4e2m1fn": 0.5, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8,
                "s64": 8, "u64": 8, "c64": 8, "c128": 16}
SMALL = 2**20  # a launch touching less than this is latency-bound on an H100 / H200


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape text ("bf16[1,5120]{1,0}", or a tuple of such)."""
    total = 0.0
    for dtype, dims in re.findall(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]", shape):
        if dtype in _DTYPE_BYTES:
            n = 1
            for d in dims.split(","):
                n *= int(d) if d else 1
            total += n * _DTYPE_BYTES[dtype]
    return int(total)


def launch_bytes(hlo_text: str) -> dict[str, int]:
    """Each launching entry instruction -> the bytes of its result and of its operands' results,
    whole: an upper bound on what the launch touches (a fusion that gathers a row of a large
    table, or updates a slice of a cache in place, counts the whole buffer). Launches under
    `SMALL` by this count move too little to stream: their time is their fixed cost."""
    insts = cp.entry_instructions(hlo_text)
    shapes = {i.name: shape_bytes(i.shape) for i in insts}
    return {i.name: shapes[i.name] + sum(shapes.get(a, 0) for a in i.args) for i in insts if i.launches}


def _ints(s: str, flag: str) -> list[int]:
    try:
        out = ms._ints(s)
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise SystemExit(f"{flag}: expected a comma-separated list of positive integers, got {s!r}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,64")
    p.add_argument("--contexts", default="4096")
    p.add_argument("--card", default="h100", choices=sorted(CARDS))
    p.add_argument("--paths", default="fast", help="fast, reference, " + ", ".join((*LAYOUT_PATHS, *ms.PATH_FLAGS)))
    p.add_argument("--chain", action="store_true", help="also list the chain's launches in order")
    p.add_argument("--hlo", default=None, help="directory for the optimized HLO texts (.txt.gz)")
    p.add_argument("--json", default=None, help="write the counts to this JSON file")
    p.add_argument("--prefill", default="", help="also prefill lengths (comma list): launches and the source lines "
                                                 "touching the most bytes")
    p.add_argument("--top", type=int, default=15, help="source lines listed per prefill")
    ns = p.parse_args(argv)
    batches, contexts = _ints(ns.batches, "--batches"), _ints(ns.contexts, "--contexts")
    lengths = _ints(ns.prefill, "--prefill") if ns.prefill else []
    rows = []
    for path in [q for q in ns.paths.split(",") if q]:
        for context in contexts:
            for batch in batches:
                try:
                    text = decode_hlo(batch, context, ns.card, path)
                except (RuntimeError, ValueError) as e:
                    print(f"error: {e}", file=sys.stderr)
                    return 2
                n, path_names, counts = chain(text)
                touched = launch_bytes(text)
                small = [b for b in touched.values() if b < SMALL]
                chain_small = sum(touched.get(name, 0) < SMALL for name, _, _ in path_names)
                print(f"decode {path} batch {batch} context {context} ({CARDS[ns.card]['name']}, compiled without "
                      f"a device): {n} launches, {len(path_names)} on the longest dependent chain; "
                      f"{len(small)} launches ({chain_small} on the chain) touch under 1 MiB "
                      f"({sum(small) / 1e6:.1f} MB in all)")
                for label, c in counts.items():
                    print(f"  {c:4d}  {label}")
                if ns.chain:
                    for name, layer, label in path_names:
                        print(f"    {name:<40} {layer:<9} {label}")
                if ns.hlo:
                    Path(ns.hlo).mkdir(parents=True, exist_ok=True)
                    (Path(ns.hlo) / f"decode_{path}_{batch}x{context}_{ns.card}.txt.gz").write_bytes(
                        gzip.compress(text.encode()))
                rows.append({"path": path, "batch": batch, "context": context, "card": ns.card, "launches": n,
                             "on_chain": len(path_names), "launches_under_1mib": len(small),
                             "chain_under_1mib": chain_small, "chain_by_source": counts})
    for path, length in ((q, n) for q in ns.paths.split(",") if q for n in lengths):
        try:
            text = prefill_hlo(length, ns.card, path)
        except (RuntimeError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        by_source = bytes_by_source(text)
        total = sum(b for _, b in by_source.values())
        print(f"prefill {path} {length} tokens ({CARDS[ns.card]['name']}, compiled without a device): "
              f"{sum(n for n, _ in by_source.values())} launches touching {total / 1e9:.1f} GB (whole operands: "
              f"an upper bound); the source lines touching the most:")
        for label, (n, b) in list(by_source.items())[:ns.top]:
            print(f"  {b / 1e9:8.2f} GB {n:4d}  {label}")
        if ns.hlo:
            Path(ns.hlo).mkdir(parents=True, exist_ok=True)
            (Path(ns.hlo) / f"prefill_{path}_{length}_{ns.card}.txt.gz").write_bytes(gzip.compress(text.encode()))
        rows.append({"path": path, "prefill": length, "card": ns.card,
                     "bytes_by_source": {k: list(v) for k, v in by_source.items()}})
    if ns.json:
        Path(ns.json).write_text(json.dumps({"jax": jax.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
