"""Full-width speed of a reduced-layer V4.1 stack on one GPU, against ceilings measured in the
same run.

    python -m benchmarks.model_speed --out DIR [--tiny] [--sections ...] [--paths fast,reference]

The stack: the released config (tests/data/released_config.json) at full width (dim 5120, 64
heads x 512, 384 routed experts top-6 + 1 shared, fp8 weights with e8m0 scales, packed fp4
experts) cut to six layers, one per attention role:

    0 window-only | 1 source ratio 2 | 2 reuse ratio 2 | 3 source ratio 1 (candidate source) |
    4 reindex ratio 1 (masked to the candidates) | 5 reuse ratio 1

Engram layers are omitted (engram_layer_ids = ()): their table lookups are a few KB per token
and the released tables (2 x 110 GB) do not fit one GPU. No DSpark stages, no vision tower.
Weights are random bits generated on the device by one jitted function per leaf shape, so
nothing model-sized crosses the host; caches are seeded directly at the measured context (random
KV and index keys, seq_len = context - 1) rather than by prefilling.

Sections (each row: name, batch, context, seconds, bytes, flops, fraction_of_ceiling):
  ceilings  HBM copy bandwidth (read + write of a multi-GB buffer), bf16 and fp8 GEMM FLOP/s
  experts   the routed-expert GEMMs alone (one layer's 384 experts): XLA widen-then-dot vs the
            Pallas fp4 kernel, with the fraction of bit-identical outputs and the max ulp
  decode    decode steps of the whole stack (embed, 6 layers, head) per (batch, context): one
            step per call, calls back to back ("decode <path>") or each waited for before the
            next ("decode <path> synced", a host loop reading every token), and --loop-steps
            greedy steps in one call of `Generator`'s decode program ("decode <path> loop", wall
            time per step: the host's dispatch paid once per call, as `Generator.generate` runs;
            with --host-loop also "... loop (host loop)": that program with the loop's condition
            tested by the host each step, as before it ran inside the CUDA graph); with
            --generate-steps N also `Generator.generate` itself, end to end as a user runs it
            ("decode <path> generate": prefill of random prompts making the first of N new tokens,
            the rest from its pipelined calls of --loop-steps steps; seconds per step over the
            calls after the first)
  layers    the same step as one jitted call per layer (per-layer time by role)
  --ab A,B  (beside the sections) two paths' decode loops in one process, on the same weights and
            cache, timed in --ab-rounds rounds of alternating order ("ab <path> loop": each
            round's seconds and, on B's row, B - A per round): the A/B of a module switch or of
            the experts' fp4 layout (fast-released,fast-relaid), whose gain can be smaller than
            the loop's 1-3% spread between processes (`ab_section`)
  prefill   prefill of one prompt of S tokens (cache of S positions); its FLOPs count each
            layer at the positions it runs on (`prefill_counts`: replayed layers on a suffix)
Bytes and FLOPs come from `count_layer` (derivation in its docstring) and the parameter shapes.
Rows are printed as they finish and the JSON is rewritten after every row, so a run stopped by
a time limit keeps what it measured. `--paths fast,reference` times the same rows with
kernels="auto" (Pallas kernels on a GPU) and kernels="reference" (plain jnp) and records the
speed-up; the path `fast-f32` is `fast` with `attn_accumulate="f32"` (the sparse attention in
f32, on the Pallas kernel, instead of the float64 reference) and `fast-nofold` is `fast` with
`fp4_scale_fold="off"` (the routed-expert kernel's x 2^126 not folded into the scales; every path
else resolves the default "auto" on the random weights as the loaders do: on); `fast-released`
and `fast-relaid` are `fast` with the routed experts' fp4 words as released ("pairs" decode) and
re-laid where the compiled GPU kernel runs ("relaid" decode; `fp4_relaid` "off" / "auto", which
`fast` takes by default; an A/B of the two moves one copy in place between rounds); `fast-onerow` is
`fast` with the routed experts' decode gather as one-row programs without tensor cores
(`Experts.one_row`, `expert_matmul.BlockSizes.one_row`); `fast-streamk` is `fast` with the routed
experts' launches of under two waves split evenly over the SMs (`Experts.stream_k`,
`expert_matmul.BlockSizes.stream_k`); `fast-onedot` is `fast` with the routed experts' tensor-core
tiles as one dot a K step (`Experts.one_dot`, `expert_matmul.BlockSizes.one_dot`); `fast-swapab`
is `fast-onedot` with the decoded weight tile as the dots' first operand (`Experts.swap_ab`,
`expert_matmul.BlockSizes.swap_ab`); `fast-noswapsingle` is `fast` with the launches of one weight
matrix back on the fused launch's tiles (`Experts.swap_ab_single` off: no `swap_ab`, no `one_dot`
there); `fast-f64k` is `fast` with the float64
attention on the GPU kernel's float64 program instead of the jnp reference (`Attention.f64_kernel`,
`sparse_attention.BlockSizes.f64_kernel`); `fast-gatenorm` is `fast` with a single row's FFN norm
inside the gate's logits launch (`Gate.norm_logits`, `topk.BlockSizes.norm_logits`); `fast-kvrow`
is `fast` with a single row's window-KV row (kv_norm, RoPE, QDQ, ring write) in one launch
(`Attention.kv_row_kernel`, `pallas_kernels.window_kv`); `fast-rows` is both; `fast-anyheight`
is `fast` with every prefill size's routed-expert tiles on K loops of the fewest of 128, 64, 32
or 16 rows that hold their rows (`Experts.half_tiles` 3, `expert_matmul.BlockSizes.half_tiles`;
`fast` does so at 2049-4096 tokens, `expert_matmul.halvings_for`), `fast-fullheight` with none
(0); `fast-indexref` runs the indexer's scores on XLA's reference instead of their GPU kernel
(`Indexer.score_kernel` off; `pallas_kernels.index_scores`). `--tiny` runs
the same script at tiny width on CPU (a bug check, not a measurement).
"""

from __future__ import annotations

import argparse
import functools
import gc
import gzip
import json
import os
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import critical_path as cp
from dsv41_jax.cache import init_cache
from dsv41_jax.config import ModelArgs
from dsv41_jax.generate import Generator, context_bucket, decode_compiler_options
from dsv41_jax.loading import resolve_fp4_options, resolve_fp4_relaid
from dsv41_jax.model import Transformer, replay_start, replay_width
from dsv41_jax.parity import set_switches
from dsv41_jax.sampling import SamplingParams

RELEASED = Path(__file__).resolve().parents[1] / "tests" / "data" / "released_config.json"

# one layer per attention role (see the module docstring)
ROLES = ("window", "source r2", "reuse r2", "source r1 + candidates", "reindex r1", "reuse r1")
_LAYOUT = dict(compress_ratios=(0, 2, 2, 1, 1, 1), kv_source_layers=(1, 3), index_source_layers=(1, 3, 4),
               candidate_source_layer=3)
_NO_EXTRAS = dict(n_mtp_layers=0, dspark_block_size=0, dspark_target_layer_ids=(), engram_layer_ids=(),
                  engram_num_embeddings=(), vision_n_layers=0)


# path -> (ModelArgs.kernels, ModelArgs.attn_accumulate, ModelArgs.fp4_scale_fold, ModelArgs.fp4_relaid);
# "auto" folds (the random scale bytes are <= 121) and re-lays where the compiled GPU kernel runs, as
# the loaders do ("fast" takes ModelArgs' defaults); "fast-nofold": "fast" without the fp4 kernel's
# fold; "fast-released" / "fast-relaid": "fast" with the routed experts' fp4 words as released (the
# kernel's "pairs" decode) / re-laid where the compiled GPU kernel runs (its "relaid" decode);
# "fast-onerow": "fast" with the routed experts' gather as one-row programs (`Experts.one_row`);
# "fast-streamk": "fast" with the routed experts' small launches split stream-K (`Experts.stream_k`);
# "fast-onedot": "fast" with the routed experts' tensor-core tiles as one dot a K step (`Experts.one_dot`);
# "fast-swapab": "fast-onedot" with the decoded weight tile as the dots' first operand (`Experts.swap_ab`);
# "fast-noswapsingle": "fast" with the launches of one weight matrix without "fast-swapab"'s options
# (`Experts.swap_ab_single` off);
# "fast-f64k": "fast" with the float64 attention on the GPU kernel (`Attention.f64_kernel`);
# "fast-gatenorm": "fast" with a single row's FFN norm inside the gate's logits launch (`Gate.norm_logits`);
# "fast-kvrow": "fast" with a single row's window-KV row in one launch (`Attention.kv_row_kernel`);
# "fast-rows": both;
# "fast-anyheight" / "fast-fullheight": every prefill size's expert tiles on the fewest of 128, 64, 32 or 16
# rows holding their rows / on the whole tile (`Experts.half_tiles` 3 / 0; "fast": `expert_matmul.halvings_for`);
# "fast-indexref": "fast" with the indexer's scores on XLA's reference (`Indexer.score_kernel` off; the
# forty-fourth session's "fast-indexk" is now "fast")
_RELAID = ModelArgs.fp4_relaid  # the default
_FAST = ("auto", "auto", "auto", _RELAID)
PATHS = {"fast": _FAST, "fast-f32": ("auto", "f32", "auto", _RELAID), "fast-nofold": ("auto", "auto", "off", _RELAID),
         "fast-released": ("auto", "auto", "auto", "off"), "fast-relaid": ("auto", "auto", "auto", "auto"),
         "fast-onerow": _FAST, "fast-streamk": _FAST, "fast-onedot": _FAST, "fast-swapab": _FAST,
         "fast-noswapsingle": _FAST, "fast-f64k": _FAST, "fast-gatenorm": _FAST, "fast-kvrow": _FAST, "fast-rows": _FAST,
         "fast-anyheight": _FAST, "fast-fullheight": _FAST, "fast-indexref": _FAST,
         "reference": ("reference", "auto", "auto", _RELAID)}
# path -> the `parity.MODULE_SWITCHES` it sets
PATH_FLAGS = {"fast-onerow": ("experts_one_row",), "fast-streamk": ("experts_stream_k",),
              "fast-onedot": ("experts_one_dot",), "fast-swapab": ("experts_one_dot", "experts_swap_ab"),
              "fast-noswapsingle": ("experts_no_swap_ab_single",),
              "fast-f64k": ("attn_f64_kernel",), "fast-gatenorm": ("gate_norm_logits",), "fast-kvrow": ("kv_row_kernel",),
              "fast-rows": ("gate_norm_logits", "kv_row_kernel"), "fast-anyheight": ("experts_any_height",),
              "fast-fullheight": ("experts_full_height",), "fast-indexref": ("index_score_reference",)}


def bench_args(tiny: bool, batch: int, context: int, kernels: str, attn_accumulate: str = "auto",
               fp4_scale_fold: str = "auto", fp4_relaid: str = _RELAID) -> ModelArgs:
    """The six-layer stack at full released width (or tiny width for --tiny)."""
    run = {"max_batch_size": batch, "max_seq_len": context, "kernels": kernels, "attn_accumulate": attn_accumulate,
           "fp4_scale_fold": fp4_scale_fold, "fp4_relaid": fp4_relaid}
    if tiny:
        return ModelArgs.tiny(**_NO_EXTRAS).replace(n_layers=6, **run, **_LAYOUT)
    return ModelArgs.from_json(RELEASED, n_layers=6, **run, **_LAYOUT, **_NO_EXTRAS)


# ----------------------------------------------------------------------------------- counting


def _nbytes(leaf) -> int:
    return int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize


def _flat(state):
    flat = nnx.to_flat_state(state) if hasattr(nnx, "to_flat_state") else state.flat_state()
    for path, var in flat:
        leaf = var.get_value() if hasattr(var, "get_value") else getattr(var, "value", var)
        if hasattr(leaf, "shape"):
            yield [str(k) for k in path], leaf


def param_bytes(args: ModelArgs) -> dict:
    """From the abstract parameter shapes (nothing allocated): per layer the bytes of the routed
    experts per expert, of everything else the layer reads each step ("dense": attention,
    compressor, indexer, router, shared expert, norms, hyper-connections), and the elements of
    the per-token linears outside the experts ("dense_elems"; packed fp4 bytes count twice);
    plus embedding and head bytes. "dense_fp8": the part of "dense" stored as fp8 (e4m3 weights
    and their e8m0 scales: the projections the dense fp8 kernel reads)."""
    abstract = nnx.eval_shape(lambda: Transformer(args))
    per_layer = [{"dense": 0, "experts": 0, "dense_elems": 0, "dense_fp8": 0} for _ in range(args.n_layers)]
    out = {"layers": [], "embed": 0, "head": 0}
    for keys, leaf in _flat(nnx.state(abstract)):
        b = _nbytes(leaf)
        if keys[0] != "layers":
            if keys[0] in out:
                out[keys[0]] += b
            continue
        d = per_layer[int(keys[1])]
        routed = keys[2:4] == ["ffn", "experts"]
        d["experts" if routed else "dense"] += b
        if not routed and leaf.dtype in (jnp.float8_e4m3fn, jnp.float8_e8m0fnu):
            d["dense_fp8"] += b
        shared_expert = keys[2:4] == ["ffn", "shared_experts"]
        matrix = len(leaf.shape) >= 2 and (keys[-1] == "weight" or keys[-1].endswith("_fn"))
        if not routed and not shared_expert and matrix:
            n = int(np.prod(leaf.shape))
            d["dense_elems"] += 2 * n if leaf.dtype == jnp.int8 else n
    for i, d in enumerate(per_layer):
        n_exp, _ = args.moe_experts(i)
        out["layers"].append({"dense": d["dense"], "per_expert": d["experts"] / n_exp, "dense_elems": d["dense_elems"],
                              "dense_fp8": d["dense_fp8"]})
    return out


def unique_experts(n_experts: int, k: int, tokens: int) -> float:
    """Expected distinct experts hit by `tokens` tokens routing to k of n uniformly at random
    (random weights route near-uniformly): n * (1 - (1 - k/n)^tokens)."""
    return n_experts * (1.0 - (1.0 - k / n_experts) ** tokens)


def count_layer(args: ModelArgs, layer: int, pb: dict, batch: int, context: int,
                tokens_per_row: int = 1, n_unique: float | None = None) -> tuple[float, float]:
    """(bytes, flops) of one layer for one decode step of `batch` rows at `context`
    (tokens_per_row=1), or a prefill of one row (batch=1) whose layer runs on the last
    `tokens_per_row` of `context` positions (all of them, or a replayed layer's suffix:
    `prefill_counts`).

    Bytes (decode; each operand read once, outputs written once, activations negligible):
      * the layer's dense weights once (attention / compressor / indexer projections in their
        stored dtypes, router, shared expert, norms, hyper-connection weights);
      * the routed experts hit: unique_experts(E, k, batch * tokens) x bytes of one expert
        (fp4 codes + e8m0 scales of w1, w2, w3); at batch 1, 6 experts; `n_unique` replaces the
        uniform-routing estimate by a count of the experts a step actually routed to;
      * the cache: the window ring (B x window x hd bf16); at a layer that scores indices (kv
        source or reindex) the index keys B x (T/r) x ihd bf16 (the decode scores the full
        width); at a compressed layer the gathered top-k latent rows B x topk x hd bf16.
    FLOPs: 2 x weight elements used per token (dense linears; k routed + the shared expert)
      + indexer 2 x ih x ihd x (T/r) per scoring token + attention 4 x heads x hd x (window +
      topk) per token. Prefill counts the compressed keys each position sees: on average
      (S - n/2) / r for the last n of S positions (S / 2r for all of them).
    At the released width and batch 1 this gives about 284 MB per layer (SPEC §19.3; wo_a fp8 as
    stored)."""
    a = args
    lp = pb["layers"][layer]
    n_exp, k = a.moe_experts(layer)
    tokens = batch * tokens_per_row
    r = a.compress_ratios[layer]
    role = a.attn_role(layer)
    scores = role in ("source", "reindex")
    hd, ihd = a.head_dim, a.index_head_dim
    # dense weight elements per token ~ bytes / bytes-per-element; routed: k experts of
    # 3 x inter x dim each (fp4 bytes hold 2 per byte, which the element count undoes)
    expert_elems = 3 * a.moe_inter_dim * a.dim
    if prefill := tokens_per_row > 1:
        keys = (context - tokens_per_row / 2) / r if r else 0  # causal, over the last n positions
        attn_pos = min(a.window_size, context) + (min(a.index_topk, context // r) if r else 0)
    else:
        keys = context / r if r else 0
        attn_pos = a.window_size + (a.index_topk if r else 0)
    hit = unique_experts(n_exp, k, tokens) if n_unique is None else n_unique
    by = lp["dense"] + hit * lp["per_expert"]
    if not prefill:
        by += batch * a.window_size * hd * 2
        if scores:
            by += batch * keys * ihd * 2
        if r:
            by += batch * a.index_topk * hd * 2
    else:
        by += tokens * a.dim * a.hc_mult * 2 * 2  # the hc stream in and out, bf16
    dense_elems = lp["dense_elems"]
    fl = tokens * (2 * dense_elems + 2 * (k + 1) * expert_elems + 4 * a.n_heads * hd * attn_pos)
    if scores:
        fl += tokens * 2 * a.index_n_heads * ihd * keys
    return float(by), float(fl)


def prefill_counts(args: ModelArgs, pb: dict, s: int) -> list[tuple[float, float]]:
    """Per-layer `count_layer` of one row's prefill of `s` tokens as `Transformer.prefill` runs it
    (replay on, SPEC §19.1): the layers from `replay_start` on only on their suffix of
    `replay_width` positions; the others on all s."""
    start = replay_start(args)
    return [count_layer(args, i, pb, 1, s, tokens_per_row=s if i < start else replay_width(args, i, s))
            for i in range(args.n_layers)]


def decode_bytes(args: ModelArgs, pb: dict, batch: int, context: int, hit: list | None = None):
    """(per-layer `count_layer` results, bytes of the whole decode step: the layers, the embedding
    rows and the bf16 head); `hit`: experts routed to per layer, else uniform routing."""
    counts = [count_layer(args, i, pb, batch, context, n_unique=None if hit is None else hit[i])
              for i in range(args.n_layers)]
    return counts, sum(c[0] for c in counts) + batch * args.dim * 2 + pb["head"]


def decode_kind_bytes(args: ModelArgs, pb: dict, batch: int, hit: list | None = None) -> dict:
    """Bytes a decode step reads for the parts of `KINDS` whose bytes are their weights: the routed
    experts (`hit`: experts routed to per layer, else `unique_experts` of uniform routing), the
    dense fp8 projections (e4m3 weights and e8m0 scales outside the routed experts) and the head
    (bf16 [vocab, dim])."""
    experts = 0.0
    for i, lp in enumerate(pb["layers"]):
        n_exp, k = args.moe_experts(i)
        experts += (unique_experts(n_exp, k, batch) if hit is None else hit[i]) * lp["per_expert"]
    return {"routed experts": experts, "dense fp8 kernel": float(sum(lp["dense_fp8"] for lp in pb["layers"])),
            "head": float(pb["head"])}


# ------------------------------------------------------------------------------- on-device init


def _random_leaf(key, shape, dtype):
    dtype = jnp.dtype(dtype)
    if dtype == jnp.int8:  # packed e2m1 codes: every bit pattern is a valid pair of codes
        return jax.random.bits(key, shape, jnp.uint8).view(jnp.int8)
    if dtype == jnp.float8_e8m0fnu:  # power-of-two scales 2^-9 .. 2^-6, typical of real weights
        return jax.lax.bitcast_convert_type(jax.random.randint(key, shape, 118, 122).astype(jnp.uint8), dtype)
    if dtype == jnp.float8_e4m3fn:
        return (jax.random.normal(key, shape, jnp.float32) * 64).astype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.zeros(shape, dtype)
    return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype)


_random_leaf_jit = jax.jit(_random_leaf, static_argnums=(1, 2))


def random_model(args: ModelArgs, seed: int = 0):
    """(graphdef, state) with random weights made on the default device, leaf by leaf.

    The routers' balancing biases are zero: random ones (N(0, 0.02)) outweigh the spread of the
    routing scores that random weights give (the normed activations are small), so every token
    would pick the experts with the largest biases (measured on the H200 at full width: 25-38
    distinct experts for 64 tokens instead of about 245), and a decode step would read far
    fewer expert bytes than the released model's routing does. `args.fp4_scale_fold` and
    `args.fp4_relaid` are resolved on the random weights as the loaders resolve them
    (`loading.resolve_fp4_options`)."""
    abstract = nnx.eval_shape(lambda: Transformer(args))
    graphdef, state = nnx.split(abstract)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    key = jax.random.key(seed)
    out = []
    for i, (path, leaf) in enumerate(flat):
        if "['gate']['bias']" in jax.tree_util.keystr(path):
            out.append(jnp.zeros(leaf.shape, leaf.dtype))
        else:
            out.append(_random_leaf_jit(jax.random.fold_in(key, i), tuple(leaf.shape), jnp.dtype(leaf.dtype)))
    return _with_resolved_fp4(graphdef, jax.tree.unflatten(treedef, out), args)


def with_path_flags(graphdef, state, path: str):
    """(graphdef, state) with the module switches of `PATH_FLAGS[path]` set ("fast-onerow":
    `Experts.one_row`, "fast-streamk": `Experts.stream_k`, "fast-onedot": `Experts.one_dot`, "fast-swapab":
    `Experts.one_dot` and `Experts.swap_ab`, "fast-noswapsingle": `Experts.swap_ab_single` off, "fast-f64k":
    `Attention.f64_kernel`, "fast-gatenorm": `Gate.norm_logits`, "fast-kvrow": `Attention.kv_row_kernel`,
    "fast-rows": both, "fast-anyheight" / "fast-fullheight": `Experts.half_tiles` 3 / 0, "fast-indexref":
    `Indexer.score_kernel` off); other paths unchanged."""
    if path not in PATH_FLAGS:
        return graphdef, state
    model = nnx.merge(graphdef, state)
    set_switches(model, PATH_FLAGS[path])
    return nnx.split(model)


def _experts_layout(graphdef, state, args: ModelArgs):
    """(graphdef, state) with the fp4 stacks in the layout `args.fp4_relaid` resolves to
    (`loading.resolve_fp4_relaid`), moved in place (their old arrays donated on accelerators), so a
    layout A/B holds one copy of the weights."""
    model = nnx.merge(graphdef, state)
    resolve_fp4_relaid(model, args)
    return nnx.split(model)


def _with_resolved_fp4(graphdef, state, args: ModelArgs):
    """(graphdef, state) with `args.fp4_scale_fold` and `args.fp4_relaid` resolved on the weights
    in `state`, as the loaders resolve them (`loading.resolve_fp4_options`)."""
    model = nnx.merge(graphdef, state)
    resolve_fp4_options(model, args, source="the random weights")
    return nnx.split(model)


@functools.partial(jax.jit, donate_argnums=0)
def _random_rows(x, key):
    """x's shape and dtype, values ~ +-[2^-2, 2^-1) with random bf16 mantissas, made from 16-bit
    random words (no f32 temporary as large as a 64k-context cache)."""
    bits = jax.random.bits(key, x.shape, jnp.uint16)
    bits = (bits & jnp.uint16(0x807F)) | jnp.uint16(0x3E80)  # sign, mantissa; exponent 2^-2
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(x.dtype)


def _fill_cache(cache, key):
    """Random KV / index-key rows, one leaf per call (the donated zeros are reused)."""
    def fill(path, x):
        name = str(path[-1])
        if "compress_kv" in name or "index_k" in name or "window_kv" in name:
            return _random_rows(x, jax.random.fold_in(key, hash(name) % 1000))
        return x
    return jax.tree_util.tree_map_with_path(fill, cache)


def seeded_cache(args: ModelArgs, batch: int, context: int):
    """A decode cache of args.max_seq_len positions with every row holding context - 1 tokens."""
    cache = init_cache(args, batch, args.max_seq_len)
    cache = _fill_cache(cache, jax.random.key(1))
    cache["seq_len"] = jnp.full((batch,), context - 1, jnp.int32)
    return cache


# ------------------------------------------------------------------------------------ timing


def timeit(fn, *, warmup: int = 2, iters: int = 10, repeats: int = 3, budget_s: float = 0.3) -> float:
    """Median over `repeats` of the mean time of `iters` back-to-back calls (one sync each);
    slow calls get fewer iterations so that each repeat stays near `budget_s`."""
    for _ in range(warmup):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        first = time.perf_counter() - t0
    iters = max(1, min(iters, int(budget_s / max(first, 1e-9))))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


class Report:
    def __init__(self, out: Path, meta: dict):
        self.out, self.rows, self.meta = out, [], meta
        out.mkdir(parents=True, exist_ok=True)

    def add(self, **row):
        self.rows.append(row)
        self._print(row)
        (self.out / "model_speed.json").write_text(json.dumps({"meta": self.meta, "rows": self.rows}, indent=1))

    @staticmethod
    def _print(r):
        sec = r.get("seconds")
        t = f"{sec * 1e6:10.1f} us" if isinstance(sec, float) else f"{'-':>13}"
        frac = r.get("fraction_of_ceiling")
        f = f"{frac:6.1%}" if isinstance(frac, float) else "     -"
        extra = " ".join(f"{k}={v}" for k, v in r.items()
                         if k not in ("name", "batch", "context", "seconds", "bytes", "flops", "fraction_of_ceiling"))
        print(f"{r['name']:<34} b={r.get('batch', '-'):<4} ctx={r.get('context', '-'):<6} {t} "
              f"{(r.get('bytes') or 0) / 1e6:10.1f} MB {(r.get('flops') or 0) / 1e9:10.2f} GF {f}  {extra}", flush=True)


# ----------------------------------------------------------------------------------- sections


def ceilings(rep: Report, tiny: bool) -> dict:
    n = (1 << 18) if tiny else (1 << 29)  # 2 GiB of f32 read and 2 GiB written (x + 1)
    x = jax.random.uniform(jax.random.key(0), (n,), jnp.float32)
    f = jax.jit(lambda v: v + 1.0)
    t = timeit(lambda: f(x), warmup=10, iters=20, repeats=5)
    bw = 2 * n * 4 / t
    rep.add(name="ceiling hbm copy", batch=1, context=0, seconds=t, bytes=2 * n * 4, flops=0,
            fraction_of_ceiling=1.0, bandwidth_GBps=round(bw / 1e9, 1))
    del x
    m = 512 if tiny else 8192
    kx, kw = jax.random.split(jax.random.key(0))
    a = jax.random.normal(kx, (m, m), jnp.bfloat16)
    b = jax.random.normal(kw, (m, m), jnp.bfloat16)
    g = jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    t = timeit(lambda: g(a, b))
    bf16 = 2 * m ** 3 / t
    rep.add(name="ceiling bf16 gemm", batch=m, context=m, seconds=t, bytes=3 * m * m * 2, flops=2 * m ** 3,
            fraction_of_ceiling=1.0, tflops=round(bf16 / 1e12, 1))
    fp8 = None
    try:
        a8, b8 = a.astype(jnp.float8_e4m3fn), b.T.astype(jnp.float8_e4m3fn)
        h = jax.jit(lambda p, q: jax.lax.dot_general(p, q, (((1,), (1,)), ((), ())),
                                                     preferred_element_type=jnp.float32).astype(jnp.bfloat16))
        t = timeit(lambda: h(a8, b8))
        fp8 = 2 * m ** 3 / t
        rep.add(name="ceiling fp8 gemm", batch=m, context=m, seconds=t, bytes=2 * m * m + m * m * 2,
                flops=2 * m ** 3, fraction_of_ceiling=1.0, tflops=round(fp8 / 1e12, 1))
    except Exception as e:  # noqa: BLE001 - a backend without fp8 GEMMs reports it and goes on
        rep.add(name="ceiling fp8 gemm", batch=m, context=m, seconds=None, bytes=0, flops=0,
                fraction_of_ceiling=None, error=f"{type(e).__name__}: {str(e)[:200]}")
    return {"hbm": bw, "bf16": bf16, "fp8": fp8}


# expert_matmul.BlockSizes fields tried on one projection ({}: the defaults)
KERNEL_VARIANTS = ({}, {"one_dot": True}, {"scale_fold": True}, {"one_dot": True, "scale_fold": True},
                   {"one_dot": True, "scale_fold": True, "num_warps": 8},
                   {"decode": "subnormal"}, {"decode": "select"}, {"block_k": 256}, {"block_n": 64}, {"num_warps": 8},
                   {"one_row": True}, {"one_row": True, "scale_fold": True},
                   {"one_row": True, "scale_fold": True, "block_k": 256},
                   {"one_row": True, "scale_fold": True, "num_warps": 8},
                   {"one_row": True, "scale_fold": True, "k_splits": 1},
                   {"one_row": True, "scale_fold": True, "k_splits": 5}, {"scale_fold": True, "k_splits": 2})


def experts_section(rep: Report, ceil: dict, args: ModelArgs, batches, seed: int = 0, variants=KERNEL_VARIANTS):
    """The routed-expert GEMMs of one MoE (w1, w3, SwiGLU, w2) at `batches` tokens: XLA path vs
    the Pallas kernel, same weights and routing; bit-identity of the two outputs."""
    from dsv41_jax.moe import MoE

    outs = {}
    moes = {}
    fast = "pallas" if jax.default_backend() == "gpu" else "reference"
    for path_name, kernels in (("reference", "reference"), ("fast", fast)):
        a = args.replace(kernels=kernels, kernels_interpret=False)
        abstract = nnx.eval_shape(lambda: MoE(0, a))
        gd, st = nnx.split(abstract)
        leaves, td = jax.tree.flatten(st)
        key = jax.random.key(seed)
        st = jax.tree.unflatten(td, [_random_leaf_jit(jax.random.fold_in(key, i), tuple(l.shape), jnp.dtype(l.dtype))
                                     for i, l in enumerate(leaves)])
        moes[path_name] = _with_resolved_fp4(gd, st, a)  # the fast row: the loaders' defaults
    per_expert = param_bytes(args)["layers"][0]["per_expert"]
    n_exp, k = args.moe_experts(0)
    for tokens in batches:
        rng = np.random.default_rng(tokens)
        idx = jnp.asarray(np.stack([rng.choice(n_exp, k, replace=False) for _ in range(tokens)]), jnp.int32)
        w = jnp.asarray(rng.uniform(0.1, 0.5, (tokens, k)), jnp.float32)
        x = jax.random.normal(jax.random.key(tokens), (tokens, args.dim), jnp.bfloat16)
        from dsv41_jax.moe import _quantise_input
        xq = jax.jit(lambda v: _quantise_input(v, "fp4"))(x)
        n_unique = len(np.unique(np.asarray(idx)))
        by = n_unique * per_expert
        fl = 2 * tokens * k * 3 * args.moe_inter_dim * args.dim
        path = "gather" if tokens * k <= 64 else "grouped"
        for name, (gd, st) in moes.items():
            def run(st, xq, w, idx, gd=gd):
                m = nnx.merge(gd, st)
                return (m._routed_gather if path == "gather" else m._routed_grouped)(xq, w, idx)
            f = jax.jit(run)
            try:
                t = timeit(lambda: f(st, xq, w, idx))
                outs[name] = np.asarray(f(st, xq, w, idx))
                rep.add(name=f"experts {path} {name}", batch=tokens, context=0, seconds=t, bytes=by, flops=fl,
                        fraction_of_ceiling=by / t / ceil["hbm"], unique_experts=n_unique)
            except Exception as e:  # noqa: BLE001
                rep.add(name=f"experts {path} {name}", batch=tokens, context=0, seconds=None, bytes=by, flops=fl,
                        fraction_of_ceiling=None, error=f"{type(e).__name__}: {str(e)[:300]}")
        if "reference" in outs and "fast" in outs:
            rep.add(name="experts out: fast vs reference", batch=tokens, context=0, seconds=None, bytes=0, flops=0,
                    fraction_of_ceiling=None, **_compare(outs["fast"], outs["reference"]))
        outs.clear()
        if jax.default_backend() == "gpu" and tokens in (1, 8, 64):
            _projection_rows(rep, ceil, moes["reference"], xq, idx, tokens, path, per_expert, n_unique, variants)


def _ordered(a) -> np.ndarray:
    i = np.asarray(a).view(np.uint16).astype(np.int32)
    return np.where(i & 0x8000, -(i & 0x7FFF), i)


def _compare(got, want) -> dict:
    """bf16 outputs: fraction bit-identical, max ulp distance (counted across zero), max |diff|
    over the RMS of `want`."""
    d = np.abs(_ordered(got) - _ordered(want))
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    rms = float(np.sqrt(np.mean(w * w))) or 1.0
    return {"bit_identical": round(float(np.mean(d == 0)), 6), "max_ulp": int(d.max()),
            "max_abs_over_rms": float(np.max(np.abs(g - w)) / rms)}


def _projection_rows(rep, ceil, moe, xq, idx, tokens, path, per_expert, n_unique, variants=KERNEL_VARIANTS):
    """w1 alone (the [inter, dim] fp4 projection): XLA widen-then-dot vs kernel variants; the
    kernel's products are exact, so outputs may differ from XLA only by fp32 summation order."""
    from pallas_kernels.expert_matmul import api as em

    gd, st = moe
    lin = nnx.merge(gd, st).experts.w1
    w, sc = lin.weight[...], lin.scale[...]
    k = idx.shape[1]
    by = n_unique * per_expert / 3
    fl = 2 * tokens * k * w.shape[1] * xq.shape[1]
    if path == "gather":
        operands = (jnp.repeat(xq, k, axis=0), w, sc, idx.reshape(-1))

        def make(impl, bs):
            return jax.jit(lambda xr, w, sc, ids: em.gather_matmul(xr, w, sc, ids, implementation=impl,
                                                                   block_sizes=bs))
    else:
        c, r = 16, idx.size
        order, te, row0, valid = em.grouped_tiles(idx.reshape(-1), w.shape[0], c)
        xs = jnp.concatenate([jnp.take(xq, order // k, axis=0), jnp.zeros((c, xq.shape[1]), xq.dtype)])
        operands = (xs, w, sc, te, row0, valid)

        def make(impl, bs):
            return jax.jit(lambda xs, w, sc, te, row0, valid: em.grouped_matmul(
                xs, w, sc, te, row0, valid, c, implementation=impl, block_sizes=bs)[:r])
    want = None
    for variant in (None, *variants):
        impl = "reference" if variant is None else "pallas"
        bs = None if variant is None else em.BlockSizes(**variant)
        label = "xla" if variant is None else "kernel " + (
            " ".join(f"{k}={v}" for k, v in variant.items()) or "default")
        try:
            f = make(impl, bs)
            t = timeit(lambda: f(*operands))
            out = np.asarray(f(*operands))
            extra = {} if want is None else _compare(out, want)
            want = out if want is None else want
            rep.add(name=f"w1 {path} {label}", batch=tokens, context=0, seconds=t, bytes=by, flops=fl,
                    fraction_of_ceiling=by / t / ceil["hbm"], **extra)
        except Exception as err:  # noqa: BLE001 - a variant Triton rejects is reported, not fatal
            rep.add(name=f"w1 {path} {label}", batch=tokens, context=0, seconds=None, bytes=by, flops=fl,
                    fraction_of_ceiling=None, error=f"{type(err).__name__}: {str(err)[:200]}")


def _decode_fn(graphdef, context_bound=None):
    def step(state, ids, pos, cache):
        return nnx.merge(graphdef, state).decode_step(ids, pos, cache, context_bound=context_bound)
    return jax.jit(step, donate_argnums=(3,))


def routed_experts(graphdef, state, ids, pos, cache, context_bound=None) -> tuple[list[int], dict]:
    """(distinct routed experts each layer's MoE picks in this decode step (its `route_idx`),
    the cache after the step). The cache is donated, as in the timed step: a copy of a batch-256,
    64k-row cache does not fit beside it on one H200."""
    def route(state, ids, pos, cache):
        _, cache, record = nnx.merge(graphdef, state).decode_step(ids, pos, cache, collect=True,
                                                                  context_bound=context_bound)
        return {k: v for k, v in record.items() if k.startswith("route_idx.")}, cache
    got, cache = jax.jit(route, donate_argnums=(3,))(state, ids, pos, cache)
    return [len(np.unique(np.asarray(got[k]))) for k in sorted(got)], cache


def ab_comparable(a: str, b: str) -> bool:
    """Whether `--ab a,b` may pair the two paths: the same `PATHS` entry (they differ in module
    switches), or entries that differ only in fp4_relaid and paths without switches (the layout
    is moved in place between rounds)."""
    return PATHS[a] == PATHS[b] or (PATHS[a][:3] == PATHS[b][:3] and a not in PATH_FLAGS and b not in PATH_FLAGS)


def _decode_setup(tiny, batch, context, path, cache_len, bound):
    """(args, cache length, context bound, parameter bytes, per-layer counts, bytes, FLOPs) of a
    decode row: caches of max(cache_len, context) positions, `Generator`'s context bound where
    `bound`, bytes from uniform routing (`decode_bytes`), FLOPs with the head's."""
    cache_len_row = max(cache_len or context, context)
    args = bench_args(tiny, batch, cache_len_row, *PATHS[path])
    context_bound = context_bucket(context, cache_len_row) if bound else None
    pb = param_bytes(args)
    counts, by = decode_bytes(args, pb, batch, context)
    fl = sum(c[1] for c in counts) + 2 * batch * args.vocab_size * args.dim
    return args, cache_len_row, context_bound, pb, counts, by, fl


def decode_section(rep, ceil, tiny, batches, contexts, paths, layers_for, profile_for=(), cache_len=None,
                   bound=True, measure_routing=False, loop_steps=0, host_loop=False, generate_steps=0,
                   generate_batches=(1, 8)):
    """Decode rows. cache_len: the caches hold this many positions (default: the context); with
    `bound` the step gets the Generator's context bound (`generate.context_bucket`), so the
    indexers score only the rows the context can see, else every cached row. Rows record both.
    measure_routing: the row's bytes count the experts the step routes to (`routed_experts`, one
    extra compiled step) instead of the uniform-routing estimate, which is recorded beside; where
    that pass fails (out of memory at batch 256 and 64k on one H200) the row keeps the uniform
    estimate and says so (`routing`, `routing_error`).
    loop_steps: also time `Generator`'s decode program running this many greedy steps in one
    call (positions context - 1 - loop_steps ... context - 2, so the same context bound); with
    `host_loop` against the same program with the loop driven by the host (`loop_row`).
    generate_steps: for batches in `generate_batches`, also `Generator.generate` making this many
    tokens (the prefill's, then calls of `loop_steps` (16 when 0) steps: `generate_row`)."""
    for context in contexts:
        for batch in batches:
            for path in paths:
                name = f"decode {path}"
                args, cache_len_row, context_bound, pb, counts, by, fl = _decode_setup(tiny, batch, context, path,
                                                                                      cache_len, bound)
                try:
                    graphdef, state = random_model(args)
                    graphdef, state = with_path_flags(graphdef, state, path)
                    cache = seeded_cache(args, batch, context)
                    # distinct random tokens: rows that all decode one token route alike, and
                    # then far fewer experts are read than `unique_experts` counts
                    ids = jax.random.randint(jax.random.key(3), (batch,), 0, args.vocab_size)
                    pos = cache["seq_len"]
                    extra = {}
                    if measure_routing:
                        try:
                            hit, cache = routed_experts(graphdef, state, ids, pos, cache, context_bound)
                        except Exception as e:  # noqa: BLE001 - e.g. out of memory at 256 x 64k
                            # the row is still timed, its bytes from uniform routing; the cache
                            # was donated to the failed pass, so it is seeded again
                            extra = {"routing": "uniform (the measured-routing pass failed)",
                                     "routing_error": f"{type(e).__name__}: {str(e)[:200]}"}
                            cache = seeded_cache(args, batch, context)
                        else:
                            extra = {"bytes_uniform_routing": by, "unique_experts_measured": hit}
                            counts, by = decode_bytes(args, pb, batch, context, hit)
                    t0 = time.perf_counter()
                    # compiled once: the timed calls and a profile's HLO text share the executable
                    f = _decode_fn(graphdef, context_bound).lower(state, ids, pos, cache).compile()
                    _, cache = f(state, ids, pos, cache)
                    jax.block_until_ready(cache)
                    compile_s = time.perf_counter() - t0
                    holder = {"cache": cache}

                    def call():
                        logits, holder["cache"] = f(state, ids, pos, holder["cache"])
                        return logits

                    t = timeit(call, iters=5 if not tiny else 2)
                    rep.add(name=name, batch=batch, context=context, seconds=t, bytes=by, flops=fl,
                            fraction_of_ceiling=by / t / ceil["hbm"], ceiling="hbm", compile_s=round(compile_s, 1),
                            tokens_per_s=round(batch / t, 1), cache_len=cache_len_row, context_bound=context_bound,
                            **extra)
                    # one step per call waiting for each (a host loop that reads every token)
                    ts = timeit(lambda: jax.block_until_ready(call()), iters=5 if not tiny else 2)
                    rep.add(name=f"{name} synced", batch=batch, context=context, seconds=ts, bytes=by, flops=fl,
                            fraction_of_ceiling=by / ts / ceil["hbm"], ceiling="hbm", tokens_per_s=round(batch / ts, 1))
                    if loop_steps and context > loop_steps + 1:
                        loop_row(rep, ceil, name, graphdef, state, holder, ids, pos - loop_steps, context_bound,
                                 loop_steps, batch, context, by, fl, tiny, host_loop)
                    if (batch, context, path) in profile_for:
                        hlo = f.as_text()
                        _save_hlo(rep, f"decode_{batch}x{context}{_path_suffix(name)}", hlo)
                        profile_rows(rep, call, name, batch, context, top=24, sources=hlo_sources(hlo), hlo_text=hlo,
                                     kind_bytes=decode_kind_bytes(args, pb, batch, extra.get("unique_experts_measured")),
                                     hbm=ceil.get("hbm"))
                    if (batch, context, path) in layers_for:
                        layers_section(rep, ceil, args, graphdef, state, holder["cache"], ids, pos, counts, path,
                                       loop_steps)
                    holder.clear()  # the closures above keep `holder`: let the next row reuse the cache's memory
                    del holder, cache
                    if generate_steps and batch in generate_batches:  # (the Generator allocates its own cache)
                        generate_row(rep, ceil, name, graphdef, state, batch, context, cache_len_row, generate_steps,
                                     loop_steps or 16, by, fl)
                    del state
                except Exception as e:  # noqa: BLE001 - e.g. out of memory at 256 x 64k: record, go on
                    rep.add(name=name, batch=batch, context=context, seconds=None, bytes=by, flops=fl,
                            fraction_of_ceiling=None, error=f"{type(e).__name__}: {str(e)[:300]}")
                    traceback.print_exc(limit=3)
                _speedup(rep, f"decode", batch, context)


def _loop_program(graphdef, state, holder, ids, pos, context_bound, steps, options=None, start=None, gens=None,
                  key=None):
    """(call, tokens of its first call, seconds of that first call (compile included)):
    `Generator`'s decode program (`Generator._decode`, compiled with `options`; None: its
    defaults) running `steps` greedy steps from positions `pos` in one call. Each call takes
    holder["cache"] (donated) and leaves the new cache there; with `start` the first call runs
    on a copy of that cache instead (so several programs can start from the same state). With
    `gens` the Generator is left at gens[key] (a caller may hand it other weight arrays)."""
    gen = Generator(nnx.merge(graphdef, state), decode_steps=steps, decode_options=options)
    if gens is not None:
        gens[key] = gen
    done = jnp.zeros(ids.shape, bool)

    def call(cache=None):
        toks, _, _, _, new, _ = gen._decode(gen.state, ids, pos, holder["cache"] if cache is None else cache, done,
                                            None, np.int32(0), np.int32(steps), None, SamplingParams(),
                                            context_bound, (), 0)
        holder["cache"] = new
        return toks

    t0 = time.perf_counter()
    if start is not None:
        holder["cache"] = None  # (the call donates its cache)
        first = np.asarray(call(cache=jax.tree.map(jnp.copy, start)))
    else:
        first = np.asarray(call())
    return call, first, time.perf_counter() - t0


def loop_row(rep, ceil, name, graphdef, state, holder, ids, pos, context_bound, steps, batch, context, by, fl,
             tiny, host_loop=False):
    """The row "<name> loop": `Generator`'s decode program (`Generator._decode`) running `steps`
    greedy steps from positions `pos` in one call; seconds are the call's wall time over `steps`.

    host_loop: also the row "<name> loop (host loop)", the same program compiled with XLA's
    default options (`Generator(decode_options={})`: the host tests the loop's condition each
    step, where the default runs the loop inside the CUDA graph on GPUs). The two are timed in
    three alternating rounds (each round's seconds kept as `rounds_s`, the row's the median), and
    `tokens_equal` records whether their first calls, each from the same copy of the cache, gave
    the same tokens. The loop program is not profiled: its CUDA graph's kernels do not appear one
    by one in a `jax.profiler` trace (on the H200: 25 kernels and 131 µs a step seen of a
    1506 µs step), so `profile_rows` traces the one-step program (its kernels in sequence)."""
    variants = [("loop", None)] + ([("loop (host loop)", {})] if host_loop else [])
    start = holder["cache"] if host_loop else None  # each variant's first call starts from a copy
    calls, compile_s, first = {}, {}, {}
    for label, options in variants:
        calls[label], first[label], compile_s[label] = _loop_program(graphdef, state, holder, ids, pos, context_bound,
                                                                     steps, options, start)
    del start
    times = {label: [] for label, _ in variants}
    for _ in range(3 if host_loop else 1):
        for label, _ in variants:
            times[label].append(timeit(calls[label], iters=3 if not tiny else 1) / steps)
    for label, _ in variants:
        t = statistics.median(times[label])
        extra = {}
        if host_loop:
            extra = {"rounds_s": times[label], "tokens_equal": bool(np.array_equal(first[label], first["loop"]))}
        rep.add(name=f"{name} {label}", batch=batch, context=context, seconds=t, bytes=by, flops=fl,
                fraction_of_ceiling=by / t / ceil["hbm"], ceiling="hbm", compile_s=round(compile_s[label], 1),
                tokens_per_s=round(batch / t, 1), steps_per_call=steps, context_bound=context_bound, **extra)


def ab_section(rep, ceil, tiny, pair, batches, contexts, rounds, steps, cache_len=None, bound=True,
               measure_routing=False):
    """Paired timing of two paths' decode loops in one process ("ab" rows): `Generator`'s program
    of `steps` greedy steps (as the "loop" rows), for paths that differ only in module switches
    (`PATH_FLAGS`) or in the experts' fp4 layout (`fp4_relaid`; one copy of the weights, moved in
    place between rounds: two do not fit an H100), so both programs run on the same random weights and
    start from copies of one seeded cache. They are timed in `rounds` rounds, A then B in even
    rounds and B then A in odd ones, so slow drift (clocks, heat, other tenants) weighs on both;
    between machines, and between processes on one machine, the loop's time moves by 1-3%, more
    than one launch taken off a layer's chain saves.
    Rows "ab <path> loop": the median over the rounds (`rounds_s` each round's seconds a step);
    the second path's row also `diff_s` (each round's B - A), `diff_median_s`, `b_faster_rounds`
    (rounds where B took less) and `tokens_equal` (whether both first calls gave the same
    tokens)."""
    a, b = pair
    if not ab_comparable(a, b):
        raise ValueError(f"--ab {a},{b}: the paths must differ only in module switches (PATH_FLAGS) or fp4_relaid; "
                         f"{a} runs (kernels, attn_accumulate, fp4_scale_fold, fp4_relaid) = {PATHS[a]}, "
                         f"{b} {PATHS[b]}")
    for context in contexts:
        for batch in batches:
            if context <= steps + 1:
                raise ValueError(f"--ab: context {context} must exceed the loop's {steps} steps + 1")
            args, _, context_bound, pb, _, by, fl = _decode_setup(tiny, batch, context, a, cache_len, bound)
            graphdef, state = random_model(args)
            # B only re-lays the experts' weights: one copy, moved in place between rounds (two may not fit)
            relays = PATHS[a] != PATHS[b]
            layout_args = {path: args.replace(fp4_relaid=PATHS[path][3]) for path in pair}
            programs = {path: (graphdef, state) if relays else with_path_flags(graphdef, state, path) for path in pair}
            cache = seeded_cache(args, batch, context)
            ids = jax.random.randint(jax.random.key(3), (batch,), 0, args.vocab_size)
            pos = cache["seq_len"]
            extra = {}
            if measure_routing:
                hit, cache = routed_experts(*programs[a], ids, pos, cache, context_bound)
                extra = {"bytes_uniform_routing": by, "unique_experts_measured": hit}
                _, by = decode_bytes(args, pb, batch, context, hit)
            holder = {}
            calls, first, compile_s, gens = {}, {}, {}, {}
            layout = {"path": a, "state": state}  # whose layout the arrays are in
            del state

            def use(path, layout=layout, gens=gens, programs=programs, relays=relays, layout_args=layout_args):
                # with `relays`: the weights moved to `path`'s layout and handed to the generators
                if relays and layout["path"] != path:
                    programs[path] = _experts_layout(programs[layout["path"]][0], layout["state"], layout_args[path])
                    layout["state"], layout["path"] = programs[path][1], path
                    for gen in gens.values():
                        gen.state = layout["state"]
                return programs[path]

            for path in pair:
                calls[path], first[path], compile_s[path] = _loop_program(
                    *use(path), holder, ids, pos - steps, context_bound, steps, start=cache, gens=gens, key=path)
            del cache, programs
            times = {path: [] for path in pair}
            for r in range(rounds):
                for path in (pair if r % 2 == 0 else pair[::-1]):
                    use(path)
                    times[path].append(timeit(calls[path], iters=3 if not tiny else 1) / steps)
            for path, t, row in _ab_rows(pair, times, first):
                rep.add(name=f"ab {path} loop", batch=batch, context=context, seconds=t, bytes=by, flops=fl,
                        fraction_of_ceiling=by / t / ceil["hbm"], ceiling="hbm", compile_s=round(compile_s[path], 1),
                        tokens_per_s=round(batch / t, 1), steps_per_call=steps, context_bound=context_bound,
                        **row, **extra)
            # free this pair's weights and caches before the next batch's are made (`use` holds them
            # through its defaults): on an H100 batch 1 after batch 8 at 64k ran out of memory
            holder.clear()
            del layout, gens, calls, use
            gc.collect()


def _ab_rows(pair, times, first):
    """(path, median seconds, row fields) of each path of an A/B: `rounds_s`, and for B `diff_s`
    (each round's B - A), `diff_median_s`, `b_faster_rounds` and `tokens_equal` (both paths' first
    outputs, `first[path]`, equal)."""
    a, b = pair
    diff = [tb - ta for ta, tb in zip(times[a], times[b])]
    for path in pair:
        row = {"rounds_s": times[path]}
        if path == b:
            row |= {"diff_s": diff, "diff_median_s": statistics.median(diff), "b_faster_rounds": sum(d < 0 for d in diff),
                    "tokens_equal": bool(np.array_equal(first[a], first[b]))}
        yield path, statistics.median(times[path]), row


def generate_row(rep, ceil, name, graphdef, state, batch, context, cache_len, new_tokens, steps_per_call, by, fl,
                 seed: int = 5, repeats: int = 2):
    """The row "<name> generate": `Generator.generate` end to end, as a user runs it (prefill,
    then its pipelined decode calls of `steps_per_call` greedy steps each), making `new_tokens`
    tokens for `batch` random prompts of context - new_tokens - 1 tokens, in a Generator with its
    own cache of `cache_len` positions. One untimed call compiles, then the fastest of `repeats`
    calls is kept. seconds: wall time per decode step over the calls after the first
    (`GenerateOutput.decode_tokens_per_second`: the first call's steps include waiting for the
    prefill); `prefill_s` is that call's prefill. Returns (prompts, the kept call's output), or
    None where the row is skipped (printed): a prompt of < 1 token, or no decode call after the
    first (new_tokens - 1 <= steps_per_call; the prefill makes the first token). An exception
    (e.g. out of memory) is recorded as the row's `error`."""
    row = f"{name} generate"
    prompt_len = context - new_tokens - 1
    if prompt_len < 1:
        print(f"{row}: skipped at batch {batch}, context {context}: prompts of context - {new_tokens} - 1 = "
              f"{prompt_len} tokens (--generate-steps too large for the context)", flush=True)
        return None
    if new_tokens - 1 <= steps_per_call:
        print(f"{row}: skipped: of {new_tokens} new tokens the prefill makes one and {new_tokens - 1} decode steps "
              f"the rest, all in the first call ({steps_per_call} steps), whose time is not counted; needs "
              f"--generate-steps > {steps_per_call + 1}", flush=True)
        return None
    try:
        gen = Generator(nnx.merge(graphdef, state), max_seq_len=cache_len, decode_steps=steps_per_call)
        vocab = gen.args.vocab_size
        prompts = np.random.default_rng(seed).integers(0, vocab, (batch, prompt_len)).tolist()
        t0 = time.perf_counter()
        gen.generate(prompts, new_tokens)
        compile_s = time.perf_counter() - t0
        best, t = None, float("inf")
        for _ in range(repeats):
            out = gen.generate(prompts, new_tokens)
            if batch / out.decode_tokens_per_second() < t:
                best, t = out, batch / out.decode_tokens_per_second()
        rep.add(name=row, batch=batch, context=context, seconds=t, bytes=by, flops=fl,
                fraction_of_ceiling=by / t / ceil["hbm"], ceiling="hbm", compile_s=round(compile_s, 1),
                tokens_per_s=round(batch / t, 1), steps_per_call=steps_per_call, new_tokens=new_tokens,
                prompt_len=prompt_len, prefill_s=best.prefill_seconds, cache_len=cache_len)
        return prompts, best
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: record, go on
        rep.add(name=row, batch=batch, context=context, seconds=None, bytes=by, flops=fl, fraction_of_ceiling=None,
                error=f"{type(e).__name__}: {str(e)[:300]}")
        traceback.print_exc(limit=3)
        return None


def hlo_sources(hlo_text: str) -> dict:
    """Optimized-HLO instruction name -> the project source line that emitted it ("attention.py:
    318 _index_scores_block"), from the instruction's metadata (the module's stack-frame tables;
    older XLA: source_file / source_line). A fusion without its own takes the line most of its
    fused instructions came from; with no project line at all, the op_name path without the
    jit and layer scopes ("sparse_attn/take_along_axis/gather"). Profiled kernels are named
    after these instructions ("." and "-" as "_"; Pallas kernels by their pallas_call name)."""
    tables: dict = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}
    section = None
    insts = []  # (name, metadata text, called computation or None, enclosing computation)
    comp = None
    inst = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$')
    for line in hlo_text.splitlines():
        head = line.strip()
        if head in tables:
            section = tables[head]
            continue
        if section is not None:
            m = re.match(r'^(\d+) (.*)$', head)
            if m:
                section[int(m.group(1))] = m.group(2)
                continue
            section = None
        if head.endswith("{") and not line.startswith(" "):
            comp = re.sub(r"^(ENTRY )?%?", "", head).split(" ")[0]
            continue
        m = inst.match(line)
        if m:
            meta = re.search(r"metadata=\{([^}]*)\}", m.group(2))
            calls = re.search(r"calls=%?([\w.\-]+)", m.group(2))
            insts.append((m.group(1), meta.group(1) if meta else "", calls.group(1) if calls else None, comp))

    def field(text, key):
        m = re.search(key + r'=("([^"]*)"|\d+)', text)
        return None if m is None else (m.group(2) if m.group(2) is not None else int(m.group(1)))

    ours = ("dsv41_jax", "pallas_kernels")
    quote = '"'  # the tables quote their file names

    def line_of(meta):
        if (f := field(meta, "source_file")) is not None and any(o in f for o in ours):
            return f"{Path(f).name}:{field(meta, 'source_line')}"
        row = tables["StackFrames"].get(field(meta, "stack_frame_id"))
        if row is None:
            return None
        loc = tables["FileLocations"].get(field(row, "file_location_id"), "")
        name = tables["FileNames"].get(field(loc, "file_name_id"), "")
        if not any(o in name for o in ours):
            return None
        fn = tables["FunctionNames"].get(field(loc, "function_name_id"), '""').strip('"')
        return f"{Path(name.strip(quote)).name}:{field(loc, 'line')} {fn}"

    def scope_of(meta):
        op = field(meta, "op_name")
        if not op:
            return None
        parts = [re.sub(r"^jit\((.*)\)$", r"\1", q) for q in op.split("/")]
        return "/".join(q for q in parts[1:] if not re.fullmatch(r"layer_\d+|main|run|step", q)) or None

    by_comp: dict = {}
    for name, meta, _, c in insts:
        by_comp.setdefault(c, []).append(meta)
    result = {}
    for name, meta, calls, _ in insts:
        src = line_of(meta)
        inner = by_comp.get(calls, [])
        if src is None and inner:
            lines = [v for v in map(line_of, inner) if v]
            src = max(set(lines), key=lines.count) if lines else None
        if src is None:
            scopes = [v for v in map(scope_of, [meta, *inner]) if v]
            src = max(set(scopes), key=scopes.count) if scopes else None
        if src:
            result[re.sub(r"[.\-]", "_", name)] = src
    return result


def _source_of(sources: dict, op: str) -> str | None:
    """`hlo_sources` entry of a profiled kernel name (a sort's kernels add a "_0" suffix)."""
    return sources.get(op) or sources.get(re.sub(r"_\d+$", "", op))


# the parts of a step a profile's kernels are summed into ("  kind ..." rows), in print order
KINDS = ("routed experts", "dense fp8 kernel", "attention", "head", "other")


def op_kind(op: str, source: str | None) -> str:
    """The part of the model a profiled kernel belongs to (one of `KINDS`), from its name and its
    emitting source line (`_source_of`, "file:line function"): the routed-expert and dense fp8
    Pallas kernels by name; the sparse attention (the float64 reference's gathers, dots and
    softmax, cuBLAS's float64 GEMMs, which carry no source line, or the attention kernel); the
    head's GEMM; everything else (norms, casts, quantisers, router, hyper-connections, indexer,
    cache writes)."""
    fn = (source or "").rsplit(" ", 1)[-1]
    if op.startswith("expert_matmul"):
        return "routed experts"
    if op.startswith("fp8_matmul"):
        return "dense fp8 kernel"
    if fn in ("_attend", "_sparse_attn") or op.startswith("sparse_attn") or "gemm_f64" in op:
        return "attention"
    if fn == "head_logits":
        return "head"
    return "other"


def kind_rows(rep, name, batch, context, per_op: dict, launches: dict, sources: dict, reps: int,
              stream_ns: float, kind_bytes: dict | None = None, hbm: float | None = None):
    """One "  kind <part>" row per `KINDS` entry with kernels: its kernel time a step, share of
    the step's kernel time and launches a step; with `kind_bytes` (bytes a step of a part, e.g.
    the routed experts the step's routing hit) and the copy bandwidth `hbm`, also the part's
    bytes and its fraction of that bandwidth."""
    ns_of: dict = {}
    n_of: dict = {}
    for op, ns in per_op.items():
        k = op_kind(op, _source_of(sources, op))
        ns_of[k] = ns_of.get(k, 0) + ns
        n_of[k] = n_of.get(k, 0) + launches[op]
    for k in KINDS:
        if k not in ns_of:
            continue
        t = ns_of[k] * 1e-9 / reps
        by = (kind_bytes or {}).get(k, 0)
        frac = by / t / hbm if by and hbm and t > 0 else None
        extra = {} if frac is None else {"ceiling": "hbm"}
        rep.add(name=f"  kind {k}", batch=batch, context=context, seconds=t, bytes=by, flops=0,
                fraction_of_ceiling=frac, share=round(ns_of[k] / max(stream_ns, 1), 3),
                launches_per_step=round(n_of[k] / reps), **extra)


def path_label(sources: dict, inst: cp.Inst) -> str:
    """A kernel-launching instruction's label in path rows: the project line that emitted it
    (`hlo_sources`), else its Pallas kernel's name or its own name without the number."""
    return _source_of(sources, re.sub(r"[.\-]", "_", inst.name)) or cp.kernel_label(inst)


def _save_hlo(rep, name: str, text: str):
    (rep.out / f"hlo_{name}.txt.gz").write_bytes(gzip.compress(text.encode()))


def kernel_totals(events) -> tuple[int, int, dict, dict]:
    """GPU kernel events (name, start_ns, duration_ns) -> (the sum of their durations, the time at
    least one of them runs: the union of their intervals, ns per op name, launches per op name).
    Kernels that overlap (a CUDA graph scheduled concurrently) count in full in the sum and once
    in the union."""
    per_op: dict = {}
    launches: dict = {}
    total = busy = 0
    end = None
    for op, start, dur in sorted(events, key=lambda e: e[1]):
        total += dur
        per_op[op] = per_op.get(op, 0) + dur
        launches[op] = launches.get(op, 0) + 1
        if end is None or start >= end:
            busy += dur
            end = start + dur
        elif start + dur > end:
            busy += start + dur - end
            end = start + dur
    return total, busy, per_op, launches


def kernel_alone(events) -> dict:
    """GPU kernel events (name, start_ns, duration_ns) -> ns per op name during which a kernel of
    that op is the only one running: the time nothing beside it hides (in a concurrently
    scheduled graph, the serial chain; where kernels run one after another, all of it)."""
    marks = sorted([(start, 1, i) for i, (_, start, _) in enumerate(events)]
                   + [(start + dur, 0, i) for i, (_, start, dur) in enumerate(events)])
    alone: dict = {}
    active: set = set()
    last = None
    for t, is_start, i in marks:  # ends sort before starts at one instant
        if len(active) == 1 and last is not None and t > last:
            op = events[next(iter(active))][0]
            alone[op] = alone.get(op, 0) + t - last
        if is_start:
            active.add(i)
        else:
            active.discard(i)
        last = t
    return alone


def profile_rows(rep, call, name, batch, context, reps: int = 3, top: int = 14, sources: dict | None = None,
                 hlo_text: str | None = None, kind_bytes: dict | None = None, hbm: float | None = None):
    """Device time of one call from a jax.profiler trace: the total over the GPU stream lines
    (`busy_s`: the time any kernel runs, which is less where kernels overlap; `kernel_totals`;
    `alone_s`: the time exactly one kernel runs, `kernel_alone`), and the ops taking the most
    time (XLA op names; Pallas kernels by their names). With `sources` (`hlo_sources`), also the
    time per emitting source line, and every op's time, launches and source in
    profile_<decode|prefill>_<batch>x<context>.json beside model_speed.json (and the optimized
    HLO, gzipped, beside it). With `hlo_text` (the profiled program's optimized HLO), also its
    critical path (`critical_path_rows`), and the traced kernel events in
    events_<decode|prefill>_<batch>x<context>.json.gz ([name, start_ns, duration_ns]). With
    `sources`, the kernel time by part of the model too (`kind_rows`; `kind_bytes`, `hbm`: bytes
    a step per part and the copy bandwidth, for a part's fraction of it)."""
    import glob
    import tempfile

    jax.block_until_ready(call())
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        for _ in range(reps):
            jax.block_until_ready(call())
        jax.profiler.stop_trace()
        files = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        if not files:
            return
        data = jax.profiler.ProfileData.from_file(files[0])
        events = [(ev.name, ev.start_ns, ev.duration_ns) for plane in data.planes if "gpu" in plane.name.lower()
                  for line in plane.lines if line.name.lower().startswith("stream") for ev in line.events]
    stream_ns, busy_ns, per_op, launches = kernel_totals(events)
    alone = kernel_alone(events)
    rep.add(name=f"{name} device time", batch=batch, context=context, seconds=stream_ns * 1e-9 / reps, bytes=0,
            flops=0, fraction_of_ceiling=None, kernels_per_step=round(sum(launches.values()) / reps),
            busy_s=busy_ns * 1e-9 / reps, alone_s=sum(alone.values()) * 1e-9 / reps)
    for op, ns in sorted(per_op.items(), key=lambda kv: -kv[1])[:top]:
        rep.add(name=f"  op {op[:60]}", batch=batch, context=context, seconds=ns * 1e-9 / reps, bytes=0, flops=0,
                fraction_of_ceiling=None, share=round(ns / max(stream_ns, 1), 3),
                alone_s=alone.get(op, 0) * 1e-9 / reps)
    if hlo_text is not None and events:  # (no device kernels traced on CPU)
        critical_path_rows(rep, name, batch, context, hlo_text, events, reps, sources or {}, top)
        # the raw trace, for `python -m benchmarks.critical_path HLO EVENTS --steps reps` offline
        (rep.out / f"events_{name.split()[0]}_{batch}x{context}{_path_suffix(name)}.json.gz").write_bytes(
            gzip.compress(json.dumps([[n, t, d] for n, t, d in events]).encode()))
    if sources is None:
        return
    kind_rows(rep, name, batch, context, per_op, launches, sources, reps, stream_ns, kind_bytes, hbm)
    by_src: dict = {}
    for op, ns in per_op.items():
        src = _source_of(sources, op) or "(no source: " + op.rstrip("_0123456789") + ")"
        t, n, a = by_src.get(src, (0, 0, 0))
        by_src[src] = (t + ns, n + launches[op], a + alone.get(op, 0))
    for src, (ns, n, a) in sorted(by_src.items(), key=lambda kv: -kv[1][0])[:top]:
        rep.add(name=f"  src {src[:58]}", batch=batch, context=context, seconds=ns * 1e-9 / reps, bytes=0,
                flops=0, fraction_of_ceiling=None, share=round(ns / max(stream_ns, 1), 3),
                launches_per_step=round(n / reps), alone_s=a * 1e-9 / reps)
    table = [{"op": op, "us_per_step": round(ns / reps / 1e3, 2), "launches_per_step": launches[op] / reps,
              "alone_us_per_step": round(alone.get(op, 0) / reps / 1e3, 2), "source": _source_of(sources, op)}
             for op, ns in sorted(per_op.items(), key=lambda kv: -kv[1])]
    tag = name.split()[0]  # "decode" / "prefill"
    (rep.out / f"profile_{tag}_{batch}x{context}{_path_suffix(name)}.json").write_text(json.dumps(table, indent=1))


def critical_path_rows(rep, name, batch, context, hlo_text: str, events, reps: int, sources: dict, top: int):
    """The longest chain of dependent kernels of the profiled program (benchmarks/critical_path.py):
    its kernel time a step ("<name> critical path": what a concurrently scheduled graph of the same
    kernels cannot hide) and that time per emitting source line ("  path src ..."). A trace that
    does not follow the HLO's schedule gives a row with the reason instead."""
    try:
        insts = cp.entry_instructions(hlo_text)
        secs = cp.mean_seconds(insts, cp.steps_of([(n, t * 1e-9, d * 1e-9) for n, t, d in events], reps))
    except ValueError as e:
        rep.add(name=f"{name} critical path", batch=batch, context=context, seconds=None, bytes=0, flops=0,
                fraction_of_ceiling=None, error=str(e)[:300])
        return
    total, path = cp.critical_path(insts, secs)
    rep.add(name=f"{name} critical path", batch=batch, context=context, seconds=total, bytes=0,
            flops=0, fraction_of_ceiling=None, kernels_on_path=len(path), kernels_per_step=len(secs),
            kernel_time_s=sum(secs.values()))

    for src, (t, n) in list(cp.path_by_source(path, insts, secs, lambda i: path_label(sources, i)).items())[:top]:
        rep.add(name=f"  path src {src[:53]}", batch=batch, context=context, seconds=t, bytes=0, flops=0,
                fraction_of_ceiling=None, launches_per_step=n)


def _path_suffix(name: str) -> str:
    """"" for a fast-path row ("decode fast"), else "_<path>", so profiles of two paths do not
    collide."""
    words = name.split()
    path = words[1] if len(words) > 1 else ""
    return "" if path == "fast" else f"_{path}"


def layers_section(rep, ceil, args, graphdef, state, cache, ids, pos, counts, path, loop_steps=0):
    """Each Block.decode as its own jitted call (inputs from a chained run), timed alone; with
    `loop_steps`, also "... loop": the layer run that many times in one call (a `fori_loop`
    carrying its cache, its input made to depend on the previous output as x + 0 * out so that
    nothing is hoisted out of the loop; compiled with `Generator`'s decode options), wall time per
    run: the layer without the host's dispatch."""
    from dsv41_jax.mhc import identity_pre_mix

    model = nnx.merge(graphdef, state)
    b = ids.shape[0]
    x = jax.jit(lambda st, i: nnx.merge(graphdef, st)._embed(i[:, None], None))(state, ids)
    pre = identity_pre_mix(b, 1, args.hc_mult)
    shared: dict = {}
    layers = list(cache["layers"])
    for i in range(args.n_layers):
        blk_gd, blk_st = nnx.split(model.layers[i])

        def run(st, x, pre, shared, c, pos, gd=blk_gd):
            return nnx.merge(gd, st).decode(x, pre, shared, c, pos)

        f = jax.jit(run, donate_argnums=(4,))
        x2, pre2, shared2, c2 = f(blk_st, x, pre, shared, layers[i], pos)[:4]
        holder = {"c": c2}

        def call():
            out = f(blk_st, x, pre, shared, holder["c"], pos)
            holder["c"] = out[3]
            return out[0]

        t = timeit(call, iters=10)
        by, fl = counts[i]
        rep.add(name=f"layer {path} {i} {ROLES[i]}", batch=b, context=int(pos[0]) + 1, seconds=t, bytes=by, flops=fl,
                fraction_of_ceiling=by / t / ceil["hbm"], ceiling="hbm")
        if loop_steps:
            def repeat(st, x, pre, shared, c, pos, gd=blk_gd):
                def body(_, carry):
                    x, c = carry
                    out = nnx.merge(gd, st).decode(x, pre, shared, c, pos)
                    return x + jnp.zeros((), x.dtype) * out[0], out[3]
                return jax.lax.fori_loop(0, loop_steps, body, (x, c))

            # compiled as Generator compiles its decode loop (the loop in the CUDA graph, kernels
            # scheduled concurrently on GPUs)
            g = jax.jit(repeat, donate_argnums=(4,), compiler_options=decode_compiler_options(jax.default_backend()))
            holder["c"] = g(blk_st, x, pre, shared, holder["c"], pos)[1]

            def call_loop(g=g, blk_st=blk_st, x=x, pre=pre, shared=shared, holder=holder):
                out = g(blk_st, x, pre, shared, holder["c"], pos)
                holder["c"] = out[1]
                return out[0]

            t = timeit(call_loop, iters=3) / loop_steps
            rep.add(name=f"layer {path} {i} {ROLES[i]} loop", batch=b, context=int(pos[0]) + 1, seconds=t, bytes=by,
                    flops=fl, fraction_of_ceiling=by / t / ceil["hbm"], ceiling="hbm", steps_per_call=loop_steps)
        x, pre, shared, layers[i] = x2, pre2, shared2, holder["c"]


def _prefill_setup(tiny: bool, s: int, path: str):
    """(args, bytes, FLOPs) of a prefill of one `s`-token prompt on `path`."""
    args = bench_args(tiny, 1, s, *PATHS[path])
    counts = prefill_counts(args, param_bytes(args), s)
    return args, sum(c[0] for c in counts), sum(c[1] for c in counts) + 2 * args.vocab_size * args.dim


def _prefill_program(args, graphdef, state, s: int):
    """(compiled prefill, call, compile seconds, first logits) of one `s`-token random prompt into
    a fresh cache; `call()` runs it again and returns its logits."""
    cache = jax.jit(lambda: init_cache(args, 1, s))()
    ids = jax.random.randint(jax.random.key(2), (1, s), 0, args.vocab_size)

    def run(state, ids, cache, gd=graphdef):
        return nnx.merge(gd, state).prefill(ids, None, cache)

    t0 = time.perf_counter()
    f = jax.jit(run).lower(state, ids, cache).compile()  # one executable: timing and HLO
    logits = jax.block_until_ready(f(state, ids, cache))[0]
    call = functools.partial(lambda f, *a: f(*a)[0], f, state, ids, cache)
    return f, call, time.perf_counter() - t0, logits


def prefill_section(rep, ceil, tiny, lengths, paths, profile_for=()):
    for s in lengths:
        for path in paths:
            args, by, fl = _prefill_setup(tiny, s, path)
            try:
                graphdef, state = with_path_flags(*random_model(args), path)
                f, call, compile_s, _ = _prefill_program(args, graphdef, state, s)
                t = timeit(call, warmup=1, iters=2 if not tiny else 1, repeats=2)
                rep.add(name=f"prefill {path}", batch=1, context=s, seconds=t, bytes=by, flops=fl,
                        fraction_of_ceiling=fl / t / ceil["bf16"], ceiling="bf16", compile_s=round(compile_s, 1),
                        tokens_per_s=round(s / t, 1))
                if (s, path) in profile_for:
                    hlo = f.as_text()
                    _save_hlo(rep, f"prefill_{s}", hlo)
                    profile_rows(rep, call, f"prefill {path}", 1, s, reps=1, top=24,
                                 sources=hlo_sources(hlo))
                del state, call
            except Exception as e:  # noqa: BLE001
                rep.add(name=f"prefill {path}", batch=1, context=s, seconds=None, bytes=by, flops=fl,
                        fraction_of_ceiling=None, error=f"{type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc(limit=3)
            _speedup(rep, "prefill", 1, s)


def ab_prefill_section(rep, ceil, tiny, pair, lengths, rounds):
    """Paired timing of two paths' prefills in one process ("ab <path> prefill" rows), for paths
    that differ only in module switches (`PATH_FLAGS`): both programs on one copy of the random
    weights, the same prompt, timed in `rounds` rounds (A then B in even rounds, B then A in odd
    ones), each round one warm-up call and the mean of 2 back-to-back calls; fields as `ab_section`'s
    rows, `tokens_equal` on the last position's greedy token and B's `logits_max_abs_diff` on that
    position's logits. Between processes the same prefill moved by up to 4% (107-112 ms at 4096
    tokens on the H200, runs 17-23)."""
    a, b = pair
    if PATHS[a] != PATHS[b]:
        raise ValueError(f"--ab {a},{b} --ab-on prefill: the paths must differ only in module switches (PATH_FLAGS); "
                         f"{a} runs {PATHS[a]}, {b} {PATHS[b]}")
    for s in lengths:
        args, by, fl = _prefill_setup(tiny, s, a)
        graphdef, state = random_model(args)
        calls, last, compile_s = {}, {}, {}
        for path in pair:
            _, calls[path], compile_s[path], logits = _prefill_program(args, *with_path_flags(graphdef, state, path), s)
            last[path] = np.asarray(logits)  # f32 [1, V]: the prompt's last position
        times = {path: [] for path in pair}
        for r in range(rounds):
            for path in (pair if r % 2 == 0 else pair[::-1]):
                times[path].append(timeit(calls[path], warmup=1, iters=1 if tiny else 2, repeats=1))
        for path, t, row in _ab_rows(pair, times, {p: v.argmax(-1) for p, v in last.items()}):
            if path == b:  # the last position's logits: 0 where B's program computes A's numbers
                row["logits_max_abs_diff"] = float(np.max(np.abs(last[a] - last[b])))
            rep.add(name=f"ab {path} prefill", batch=1, context=s, seconds=t, bytes=by, flops=fl,
                    fraction_of_ceiling=fl / t / ceil["bf16"], ceiling="bf16", compile_s=round(compile_s[path], 1),
                    tokens_per_s=round(s / t, 1), **row)
        del state, calls


def _speedup(rep: Report, kind: str, batch: int, context: int):
    """The "<kind> speed-up" row: reference over fast seconds, of the rows "<kind> fast" /
    "<kind> reference" (`speedup`) and of their " loop" rows where both exist (`speedup_loop`)."""
    def rows(suffix):
        names = {f"{kind} fast{suffix}": "fast", f"{kind} reference{suffix}": "reference"}
        got = {names[r["name"]]: r for r in rep.rows
               if r["name"] in names and r["batch"] == batch and r["context"] == context}
        return got if len(got) == 2 and got["fast"].get("seconds") and got["reference"].get("seconds") else None

    got, loop = rows(""), rows(" loop")
    if got and "speedup" not in got["fast"]:
        got["fast"]["speedup"] = round(got["reference"]["seconds"] / got["fast"]["seconds"], 2)
        extra = {}
        if loop:
            extra["speedup_loop"] = loop["fast"]["speedup"] = round(loop["reference"]["seconds"] / loop["fast"]["seconds"], 2)
        rep.add(name=f"{kind} speed-up", batch=batch, context=context, seconds=None, bytes=0, flops=0,
                fraction_of_ceiling=None, speedup=got["fast"]["speedup"], **extra)


def _shapes(s: str) -> set[tuple[int, int, str]]:
    """"BxT[:path],..." -> {(B, T, path)}, path "fast" where none is given."""
    out = set()
    for item in s.split(","):
        if item:
            shape, _, path = item.partition(":")
            bb, tt = shape.split("x")
            out.add((int(bb), int(tt), path or "fast"))
    return out


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for model_speed.json")
    p.add_argument("--tiny", action="store_true", help="tiny width on any backend (bug check)")
    p.add_argument("--sections", default="ceilings,experts,decode,prefill")
    p.add_argument("--paths", default="fast,reference",
                   help="fast (kernels=auto), fast-f32 (and attn_accumulate=f32), fast-nofold (fp4_scale_fold=off), "
                        "fast-released / fast-relaid (fp4_relaid off / auto), fast-onerow (one-row expert gather), "
                        "fast-streamk (stream-K expert launches), fast-onedot (one dot a K step in the expert tiles), "
                        "fast-swapab (and the weight tile as the dots' first operand), "
                        "fast-noswapsingle (the single-weight launches without them, as the fused one), "
                        "fast-f64k (float64 attention kernel), "
                        "fast-gatenorm, fast-kvrow, fast-rows, fast-anyheight, fast-fullheight, fast-indexref (module switches), "
                        "reference (plain jnp)")
    p.add_argument("--batches", default=None, help="decode batches (default 1,8,64,256; tiny 1,2)")
    p.add_argument("--contexts", default=None, help="decode contexts (default 4096,65536; tiny 64,128)")
    p.add_argument("--prefill", default=None, help="prefill lengths (default 4096,16384; tiny 32,64)")
    p.add_argument("--expert-batches", default="1,8,64,256")
    p.add_argument("--expert-variants", default=None,
                   help="JSON list of expert_matmul.BlockSizes fields tried on w1 (default KERNEL_VARIANTS)")
    p.add_argument("--layers-for", default="1x4096,64x4096",
                   help="BxT decode shapes that also get per-layer times (fast path; add :reference)")
    p.add_argument("--profile-for", default="1x4096,64x4096",
                   help="BxT decode shapes profiled, on the fast path or BxT:path")
    p.add_argument("--profile-prefill", default="", help="prefill lengths profiled (fast path)")
    p.add_argument("--reference-contexts", default=None, help="decode contexts timed on the reference path too")
    p.add_argument("--reference-prefill", default=None, help="prefill lengths timed on the reference path too")
    p.add_argument("--cache-len", type=int, default=None,
                   help="decode caches of this many positions (default: each row's context)")
    p.add_argument("--no-context-bound", action="store_true",
                   help="decode steps score every cached index key (no Generator context bound)")
    p.add_argument("--measure-routing", action="store_true",
                   help="decode bytes from the experts each step routes to (default: uniform routing)")
    p.add_argument("--loop-steps", type=int, default=16,
                   help="decode rows also time this many steps in one call (Generator's program); 0: off. "
                        "Also the steps per call of the generate rows (16 when 0)")
    p.add_argument("--host-loop", action="store_true",
                   help="loop rows also time the decode program with XLA's default options (the host tests the "
                        "loop's condition each step), in alternating rounds")
    p.add_argument("--generate-steps", type=int, default=0,
                   help="decode rows also time Generator.generate making this many tokens (prefill of random "
                        "prompts of context - N - 1 tokens, then its pipelined calls); seconds per step over the "
                        "calls after the first, so N must exceed the steps per call + 1; 0: off")
    p.add_argument("--generate-batches", default="1,8",
                   help="decode batches that get the generate row (its prefill of batch x context tokens must fit)")
    p.add_argument("--ab", default=None,
                   help="A,B: two paths that differ only in module switches, their decode loops (--loop-steps "
                        "steps a call) timed in --ab-rounds alternating rounds in one process, for each --batches "
                        "x --contexts ('ab' rows; runs beside --sections)")
    p.add_argument("--ab-rounds", type=int, default=6, help="rounds of the --ab timing (>= 2)")
    p.add_argument("--ab-on", default="decode",
                   help="what --ab times: decode (the loops), prefill (each --prefill length; paths that differ "
                        "only in module switches) or both, comma-separated")
    p.add_argument("--reference-batches", default=None,
                   help="decode batches timed on the reference path too (default: all)")
    ns = p.parse_args(argv)
    tiny = ns.tiny
    batches = _ints(ns.batches or ("1,2" if tiny else "1,8,64,256"))
    contexts = _ints(ns.contexts or ("64,128" if tiny else "4096,65536"))
    lengths = _ints(ns.prefill or ("32,64" if tiny else "4096,16384"))
    paths = [v for v in ns.paths.split(",") if v]
    for v in paths:
        if v not in PATHS:
            p.error(f"--paths: unknown path {v!r} ({', '.join(PATHS)})")
    if ns.loop_steps < 0:
        p.error(f"--loop-steps must be a number of steps >= 0 (0: off), got {ns.loop_steps}")
    if ns.generate_steps < 0:
        p.error(f"--generate-steps must be a number of tokens >= 0 (0: off), got {ns.generate_steps}")
    per_call = ns.loop_steps or 16  # decode steps a call of the generate rows
    if 0 < ns.generate_steps <= per_call + 1:
        p.error(f"--generate-steps {ns.generate_steps}: its {ns.generate_steps - 1} decode steps (the prefill makes "
                f"the first token) all run in the first call of {per_call} steps (--loop-steps), whose "
                f"time the row excludes; use more than {per_call + 1}, or 0 for off")
    ab = [v for v in (ns.ab or "").split(",") if v]
    if ns.ab is not None:
        if len(ab) != 2 or ab[0] == ab[1] or any(v not in PATHS for v in ab):
            p.error(f"--ab: expected two different paths A,B of {', '.join(PATHS)}, got {ns.ab!r}")
        if not ab_comparable(*ab):
            p.error(f"--ab {ns.ab}: the paths must differ only in module switches (PATH_FLAGS: "
                    f"{', '.join(PATH_FLAGS)}, against the path they extend) or in the experts' layout "
                    f"(fast-released against fast-relaid)")
        if ns.ab_rounds < 2:
            p.error(f"--ab-rounds must be at least 2, got {ns.ab_rounds}")
    ab_on = set(v for v in ns.ab_on.split(",") if v)
    if not ab_on or ab_on - {"decode", "prefill"}:
        p.error(f"--ab-on: expected decode, prefill or both, got {ns.ab_on!r}")
    if ab:
        if "decode" in ab_on and ns.loop_steps < 1:
            p.error("--ab times the decode loop: --loop-steps must be >= 1")
        if "prefill" in ab_on and PATHS[ab[0]] != PATHS[ab[1]]:
            p.error(f"--ab {ns.ab} --ab-on prefill: the paths must differ only in module switches (PATH_FLAGS: "
                    f"{', '.join(PATH_FLAGS)}, against the path they extend)")
    sections = set(ns.sections.split(","))
    layers_for, profile_for = _shapes(ns.layers_for), _shapes(ns.profile_for)
    dev = jax.devices()[0]
    meta = {"device": getattr(dev, "device_kind", str(dev)), "backend": jax.default_backend(), "jax": jax.__version__,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "tiny": tiny, "layers": list(ROLES),
            "describe_layers": bench_args(tiny, 1, contexts[0], "auto").describe_layers(),
            "engram": "omitted (engram_layer_ids = ())"}
    rep = Report(Path(ns.out), meta)
    for line in meta["describe_layers"]:
        print(line)
    ceil = ceilings(rep, tiny) if "ceilings" in sections else {"hbm": 4.3e12, "bf16": 7.9e14, "fp8": None}
    rep.meta["ceilings"] = ceil
    if "experts" in sections:
        experts_section(rep, ceil, bench_args(tiny, 1, contexts[0], "auto"),
                        _ints(ns.expert_batches if not tiny else "1,8,64"),
                        variants=tuple(json.loads(ns.expert_variants)) if ns.expert_variants else KERNEL_VARIANTS)
    ref_b = set(_ints(ns.reference_batches)) if ns.reference_batches else set(batches)
    ref_ctx = set(_ints(ns.reference_contexts)) if ns.reference_contexts else set(contexts)
    ref_pre = set(_ints(ns.reference_prefill)) if ns.reference_prefill else set(lengths)
    # the first context's decode rows, then prefill, then the longer contexts (a run cut short by
    # its time limit keeps one row of each kind)
    for n_ctx, context in enumerate(contexts):
        if "decode" in sections:
            for batch in batches:
                ps = [v for v in paths if v != "reference" or (batch in ref_b and context in ref_ctx)]
                decode_section(rep, ceil, tiny, [batch], [context], ps, layers_for, profile_for,
                               ns.cache_len, not ns.no_context_bound, ns.measure_routing, ns.loop_steps,
                               ns.host_loop, ns.generate_steps, set(_ints(ns.generate_batches)))
        if n_ctx == 0 and "prefill" in sections:
            for s_len in lengths:
                prefill_section(rep, ceil, tiny, [s_len], [v for v in paths if v != "reference" or s_len in ref_pre],
                                {(v, "fast") for v in _ints(ns.profile_prefill)})
    if ab and "decode" in ab_on:
        ab_section(rep, ceil, tiny, tuple(ab), batches, contexts, ns.ab_rounds, ns.loop_steps, ns.cache_len,
                   not ns.no_context_bound, ns.measure_routing)
    if ab and "prefill" in ab_on:
        ab_prefill_section(rep, ceil, tiny, tuple(ab), lengths, ns.ab_rounds)
    print(f"wrote {Path(ns.out) / 'model_speed.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
