"""Mixture of experts (SPEC §6): `Gate`, `Expert` (the shared expert), `Experts` (the routed
experts, stacked along a leading expert axis) and `MoE`.

Numerics follow the reference exactly where it has rounding points:
  * router logits in fp32 from the bf16 gate weight; the selection bias only picks experts and
    never enters the routing weights; normaliser `sum + 1e-20`; times `route_scale`;
  * every expert projection is the reference `linear()` dispatch: fp4 / fp8 weights take an
    activation quantised to e4m3 per 32 along K (`quant.act_quant`), bf16 output;
  * SwiGLU in fp32 with the asymmetric clamp, the routing weight applied BEFORE w2, the w2 input
    cast to bf16;
  * each routed expert's bf16 output is added into an fp32 sum per token in ascending expert
    order, then the shared expert's bf16 output, then one cast to bf16.

Routed-expert GEMMs use the scheme of `quant.linear_fp4`: activation and weight dequantised to
bf16 (exact: e4m3 / e2m1 values times powers of two), one dot with fp32 accumulation. The two
execution paths below therefore share every rounding point; they can differ from each other (and
from the reference's block-ordered GEMM) only in the order XLA adds the exact fp32 products.

The bf16 casts between fp32 steps are rounding points, not storage choices. XLA's GPU backend
by default (`--xla_allow_excess_precision=true`) deletes an fp32 -> bf16 -> fp32 convert pair and
keeps the fp32 value; on an H200 that moved 60% of this module's outputs off the reference. Run
with XLA_FLAGS=--xla_allow_excess_precision=false (then the tests pass there bit for bit).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax import expert_parallel, quant
from dsv41_jax.config import ModelArgs
from dsv41_jax.layers import Linear, WeightDtype, apply_linear, apply_linears, linear_kernels
from dsv41_jax.numerics import cast, exact_div, in_float64
from pallas_kernels._dispatch import resolve as _resolve_kernel
from pallas_kernels.expert_matmul import api as expert_matmul
from pallas_kernels.expert_matmul import kernel_gpu as expert_kernel
from pallas_kernels.topk.api import BlockSizes as TopkBlockSizes
from pallas_kernels.topk.api import router_logits, router_topk_scored

_F32 = jnp.float32
_BF16 = jnp.bfloat16
_HIGHEST = jax.lax.Precision.HIGHEST

# The reference's top-k normaliser (not norm_eps, although both are 1e-20 in the release).
ROUTE_NORM_EPS = 1e-20

MoEPath = Literal["auto", "gather", "grouped"]


# ------------------------------------------------------------------------------------- router


class Gate(nnx.Module):
    """Router (SPEC §6.1). Params: weight bf16 [E, dim], bias f32 [E], bias_vl f32 [E] (only when
    the config has a vision tower; it replaces `bias` for image-span tokens).

    `norm_logits` (off; set on the module to try it): a single row handed over with the FFN's
    RMSNorm (`logits(x, norm)`) is normalised inside the logits' launch on the kernel path
    (`pallas_kernels.topk.router_logits`, `BlockSizes.norm_logits`)."""

    def __init__(self, layer_id: int, args: ModelArgs):
        n_experts, topk = args.moe_experts(layer_id)
        self.topk = topk
        self.score_func = args.score_func
        self.gate_temp = args.gate_temp
        self.norm_topk_prob = args.norm_topk_prob
        self.route_scale = args.route_scale
        self.kernels, self.kernels_interpret = args.kernels, args.kernels_interpret  # the top-k's (pallas_kernels/topk)
        self.weight = nnx.Param(jnp.zeros((n_experts, args.dim), _BF16))
        self.bias = nnx.Param(jnp.zeros((n_experts,), _F32))
        self.bias_vl = nnx.Param(jnp.zeros((n_experts,), _F32)) if args.vision_enabled else None
        self.norm_logits = False

    def __call__(self, x: jax.Array, image_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """x [N, dim] (bf16), image_mask [N] bool or None -> (weights f32 [N, k], indices int32 [N, k]).

        Indices are in top-k order (descending biased score; ties -> lower expert id)."""
        return self.route(self.logits(x)[0], image_mask)

    def logits(self, x: jax.Array, norm=None, quantise: bool = False) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """x [N, dim] (bf16), norm: an RMSNorm to apply to x first, or None -> (logits f32 [N, E],
        the row the gate read: x or norm(x), with `quantise` that row's `quant.act_quant_bf16`
        values, else None). Exact bf16 products summed in f32."""
        nw, eps = (None, None) if norm is None else (norm.weight[...], norm.eps)
        return router_logits(x, self.weight[...], norm_weight=nw, norm_eps=eps, quantise=quantise,
                             implementation=self.kernels, interpret=self.kernels_interpret,
                             block_sizes=TopkBlockSizes(norm_logits=self.norm_logits))

    def route(self, logits: jax.Array, image_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """The gate from its logits f32 [N, E] -> (weights f32 [N, k], indices int32 [N, k])."""
        if self.gate_temp != 1.0:  # torch divides (XLA would multiply by the rounded reciprocal)
            logits = exact_div(logits, _F32(self.gate_temp))
        bias = self.bias[...]
        if image_mask is not None and self.bias_vl is not None:
            bias = jnp.where(image_mask[:, None], self.bias_vl[...], bias)
        # the bias steers which experts are picked; the weights come from the unbiased scores
        # (softmax / sigmoid / sqrt(softplus) of the logits, as torch rounds them)
        weights, indices = router_topk_scored(logits, bias, self.topk, self.score_func,
                                              implementation=self.kernels, interpret=self.kernels_interpret)
        if self.norm_topk_prob and self.topk > 1:
            # added left to right so every backend forms the same fp32 sum
            total = weights[:, 0]
            for j in range(1, self.topk):
                total = total + weights[:, j]
            weights = exact_div(weights, (total + _F32(ROUTE_NORM_EPS))[:, None])
        weights = weights * _F32(self.route_scale)
        return weights, indices.astype(jnp.int32)


# ------------------------------------------------------------------------------------ experts


def swiglu(gate: jax.Array, up: jax.Array, limit: float, weights: jax.Array | None = None,
           out_dtype=_BF16) -> jax.Array:
    """The Expert's hidden activation (SPEC §6.2): w1 / w3 outputs (bf16) -> w2 input (`out_dtype`).

    In fp32: up clamped to [-limit, limit], gate only from above (a large negative gate is kept:
    silu drives it to 0 on its own); h = silu(gate) * up; the routing weight (f32, broadcast
    against h) multiplies h here, before w2, so it is rounded into the bf16 w2 input."""
    g = gate.astype(_F32)
    u = up.astype(_F32)
    if limit > 0:
        u = jnp.clip(u, -limit, limit)
        g = jnp.minimum(g, _F32(limit))
    h = in_float64(jax.nn.silu, g) * u
    if weights is not None:
        h = weights.astype(_F32) * h
    return cast(h, out_dtype)


class Expert(nnx.Module):
    """One SwiGLU FFN (SPEC §6.2) -- the shared expert. w1, w3: [inter, dim]; w2: [dim, inter];
    each a `Linear` of `dtype` (fp8 in the release)."""

    def __init__(self, dim: int, inter_dim: int, dtype: WeightDtype = "fp8", swiglu_limit: float = 0.0, *,
                 kernels: str = "reference", kernels_interpret: bool = False):
        self.swiglu_limit = swiglu_limit
        kern = {"kernels": kernels, "kernels_interpret": kernels_interpret}  # the fp8 matmul's (layers.Linear)
        self.w1 = Linear(dim, inter_dim, dtype, **kern)
        self.w2 = Linear(inter_dim, dim, dtype, **kern)
        self.w3 = Linear(dim, inter_dim, dtype, **kern)

    def __call__(self, x: jax.Array, weights: jax.Array | None = None) -> jax.Array:
        """x [..., dim] bf16, weights [..., 1] f32 or None -> bf16 [..., dim]. w1 and w3 read the
        same x: one fp8 kernel launch (`layers.apply_linears`)."""
        h1, h3 = apply_linears(x, (self.w1, self.w3))
        h = swiglu(h1, h3, self.swiglu_limit, weights, out_dtype=x.dtype)
        return self.w2(h)


def _quantise_input(x: jax.Array, dtype: WeightDtype) -> jax.Array:
    """The activation a `linear()` of this weight dtype really multiplies, as exact bf16: e4m3 q
    times its power-of-two scale for fp8 / fp4 weights (quant.act_quant per 32), x itself for
    bf16 weights."""
    if dtype in ("fp8", "fp4"):
        return quant.act_quant_dequant(x).astype(_BF16)
    return x.astype(_BF16)


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [R, K] bf16 with w [N, K] (shared) or [R, N, K] (one matrix per row) -> bf16 [R, N],
    fp32 accumulation."""
    batch = ((0,), (0,)) if w.ndim == 3 else ((), ())
    y = jax.lax.dot_general(x, w, (((1,), (w.ndim - 1,)), batch), precision=_HIGHEST, preferred_element_type=_F32)
    return cast(y, _BF16)


def _packed(lins) -> tuple[tuple, tuple]:
    """Linears -> (their packed weights, their scales), as the expert_matmul tuples."""
    return tuple(m.weight[...] for m in lins), tuple(m.scale[...] for m in lins)


def unsort_rows(y: jax.Array, order: jax.Array) -> jax.Array:
    """Rows back from expert-sorted order: y [R, ...] with row i belonging to pair order[i] ->
    [R, ...] in pair order. A gather through the inverse permutation (a scatter of R ints),
    not a scatter of the rows (measured on an H200: 17 us a layer for 384 x 5120 bf16 rows)."""
    r = order.shape[0]
    inverse = jnp.zeros((r,), jnp.int32).at[order].set(jnp.arange(r, dtype=jnp.int32))
    return jnp.take(y, inverse, axis=0)


def _sorted_rows(x, src, weights, order, c):
    """The pairs' rows x[src] and routing weights in `order` (expert-sorted), plus c zero rows for
    the last tile to read past: (bf16 [R + c, dim], f32 [R + c])."""
    xs = jnp.concatenate([jnp.take(x, jnp.take(src, order), axis=0), jnp.zeros((c, x.shape[-1]), x.dtype)])
    return xs, jnp.concatenate([jnp.take(weights, order), jnp.zeros((c,), _F32)])


class Experts(nnx.Module):
    """The routed experts, stacked: w1 / w3 weight [E, inter, dim(/2)], w2 [E, dim, inter(/2)].

    With fp4 (the release): weight packed e2m1 int8 [E, out, in/2], scale e8m0 [E, out, in/32],
    laid out like the hub's `experts.{e}.wN` tensors stacked on axis 0. A checkpoint without fp4
    experts (expert_dtype null) uses the plain Linear dtype instead, as the reference does.

    `kernels` / `kernels_interpret` (ModelArgs fields) pick the fp4 matmul: with the Pallas
    kernel (pallas_kernels/expert_matmul, "auto" on a GPU) the packed bytes are widened inside the
    kernel and never reach HBM as bf16; otherwise the jnp paths below widen after the gather.
    `scale_fold` (ModelArgs.fp4_scale_fold "on", or "auto" resolved by a loader): every scale
    byte is <= 128, so the kernel may fold its decode's x 2^126 into the scales
    (`expert_matmul.BlockSizes.scale_fold`); `loading.resolve_fp4_scale_fold` checks and sets it.
    `one_row` (off; set on the module to try it): the gather path's pairs run as one-row programs
    without tensor cores (`expert_matmul.BlockSizes.one_row`; on an H100 a decode step 11% slower
    at batch 1 and 25% at batch 8, benchmarks/README.md).
    `stream_k` (off; set on the module to try it): the kernel's launches of under two waves (the
    one-token decode's) split their block steps evenly over `expert_matmul.TARGET_PROGRAMS` programs
    (`expert_matmul.BlockSizes.stream_k`; fp32 sums in another order; on an H100 no faster for
    w1 + w3 and 13% slower for w2).
    `one_dot` (off; set on the module to try it): the kernel's tensor-core tiles run one dot a K
    step on the 8 decoded code positions (`expert_matmul.BlockSizes.one_dot`; fp32 sums in another
    order): 41% fewer K-loop instructions at prefill tiles, no faster at decode (H200, twenty-third
    run); `model_speed --ab-on prefill` times it in prefill.
    `swap_ab` (off; set on the module to try it): the kernel's dots take the decoded weight tile
    as their first operand (`expert_matmul.BlockSizes.swap_ab`: on sm_90 wgmma with the decoded
    registers as its A operand; fp32 sums in another order); on an H100 with `one_dot` w2 11%
    faster and the fused w1 + w3 14% slower (benchmarks/README.md, thirty-eighth session).
    `swap_ab_single` (on; clear it on the module for the fused launch's tiles everywhere): the
    kernel's launches of one weight matrix (w2; w1 and w3 where prefill launches them apart) take
    `swap_ab` and `one_dot`, the fused w1 + w3 keeps the defaults
    (`expert_matmul.BlockSizes.swap_ab_single`; on an H100 w2 11% faster at one token, prefill's
    w1 6% and w2 4%, outputs bit-identical there; in the model the decode step 0.9% faster at
    batch 1, 0.3% at batch 64 and a 4096-token prefill 2.4%, benchmarks/README.md, fortieth
    session).
    `half_tiles` (None: `expert_matmul.halvings_for` each grouped call; an int sets it for all):
    the kernel's prefill tiles whose rows fit half the tile (an expert's last tile) run a K loop
    of half the rows, up to this many halvings (`expert_matmul.BlockSizes.half_tiles`; the same
    sums, less MMA work on padding rows; a 4096-token prefill 1.8% faster on an H100,
    benchmarks/README.md, forty-third session).
    `relaid` (ModelArgs.fp4_relaid "on", or "auto" resolved by a loader where the compiled GPU
    kernel runs: `loading.resolve_fp4_relaid`; setting it re-lays the fp4 weights in place,
    clearing it puts them back): the packed words held in the layout of the kernel's "relaid"
    decode (`expert_matmul.kernel_gpu.relay`, a bit permutation within each int32 word, same
    bytes), which takes fewer integer steps than "pairs" for bit-identical outputs; the jnp paths
    (`dense`, `apply_one`) and any reference fallback put the gathered weights back first.
    """

    def __init__(self, n_experts: int, dim: int, inter_dim: int, swiglu_limit: float = 0.0,
                 dtype: WeightDtype = "fp4", *, kernels: str = "auto", kernels_interpret: bool = False,
                 scale_fold: bool = False):
        self.n_experts, self.dim, self.inter_dim = n_experts, dim, inter_dim
        self.swiglu_limit = swiglu_limit
        self.dtype = dtype
        self.kernels, self.kernels_interpret = kernels, kernels_interpret
        self.scale_fold = scale_fold
        self.one_row = False
        self.stream_k = False
        self.one_dot = False
        self.swap_ab = False
        self.swap_ab_single = True
        self.half_tiles = None
        self._relaid = False
        self.w1 = Linear(dim, inter_dim, dtype, stack=(n_experts,))
        self.w2 = Linear(inter_dim, dim, dtype, stack=(n_experts,))
        self.w3 = Linear(dim, inter_dim, dtype, stack=(n_experts,))

    @property
    def relaid(self) -> bool:
        """Whether the fp4 weights are held re-laid for the kernel's "relaid" decode (class docstring)."""
        return self._relaid

    @relaid.setter
    def relaid(self, on: bool) -> None:
        self.set_relaid(on)

    def set_relaid(self, on: bool, donate: bool = False) -> None:
        """Sets `relaid`, moving the three stacks' bits in place when it changes; `donate` hands the
        old arrays to the move (no second copy of the stacks; nothing else may still hold them)."""
        on = bool(on)
        if on and self.dtype != "fp4":
            raise ValueError(f"Experts.relaid: only fp4 experts have a re-laid layout, these are {self.dtype}")
        if on != self._relaid:
            move = jax.jit(expert_kernel.relay if on else expert_kernel.unrelay, donate_argnums=0 if donate else ())
            for lin in (self.w1, self.w2, self.w3):
                lin.weight.value = move(lin.weight[...])
            self._relaid = on

    def _released(self, w: jax.Array) -> jax.Array:
        """Packed weights read from this module, in the released layout."""
        return expert_kernel.unrelay(w) if self._relaid else w

    def dense(self, e: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Expert ids e int [...] -> (w1, w3, w2) bf16 [..., out, in] of those experts, dequantised
        after the gather, so only the selected experts' packed bytes are read (exact in bf16)."""

        def one(lin: Linear) -> jax.Array:
            w = self._released(jnp.take(lin.weight[...], e, axis=0))
            if self.dtype == "fp4":
                return quant.dequant_fp4_weight(w, jnp.take(lin.scale[...], e, axis=0), _BF16)
            if self.dtype == "fp8":
                return quant.dequant_fp8_weight(w, jnp.take(lin.scale[...], e, axis=0), _BF16)
            return w.astype(_BF16)

        return one(self.w1), one(self.w3), one(self.w2)

    def ffn(self, xq: jax.Array, w1: jax.Array, w3: jax.Array, w2: jax.Array, weights: jax.Array) -> jax.Array:
        """The per-expert math on dequantised weights, shared by both MoE paths.

        xq [R, dim] bf16 (already `_quantise_input`-ed); w1/w3 [inter, dim] and w2 [dim, inter]
        (one expert for all rows) or [R, ...] (one per row); weights [R] f32 -> bf16 [R, dim]."""
        h = swiglu(_dot(xq, w1), _dot(xq, w3), self.swiglu_limit, weights[:, None])
        return _dot(_quantise_input(h, self.dtype), w2)

    def grouped(self, x: jax.Array, src: jax.Array, weights: jax.Array, e: jax.Array, n_e: int,
                tile_rows: int) -> jax.Array:
        """(token, expert) pairs through their experts, in tiles of one expert each (the grouped
        path). Pair p takes row x[src[p]] (x bf16 [*, dim], already `_quantise_input`-ed),
        routing weight weights[p] (f32 [R]) and expert e[p] in [0, n_e) of this module's stack
        (n_e: the stacked experts, local ones under expert parallelism), or e[p] = n_e for a pair
        computed elsewhere, whose output is 0. Returns bf16 [R, dim] in pair order.

        Pairs are sorted by expert (tokens ascending within) and cut into tiles of one expert
        (`expert_matmul.grouped_tiles`). With the fp4 kernel (`use_kernel`) every projection is one
        `expert_matmul.grouped_matmul` over all tiles (16-row tiles while experts get few pairs
        each, as in decode batches: each live tile reads a whole expert, so small tiles waste no
        rows; 64 or 128 rows for prefill-sized batches: `expert_matmul.tile_rows_for`). Otherwise
        tiles of min(tile_rows, R) rows and a `lax.scan` that dequantises one expert's three
        matrices per tile (`dense`) and runs `ffn` on its rows. Either way tiles no pair filled are
        skipped, so an expert's packed bytes are read once per tile it fills and never when no
        pair picked it."""
        if self.use_kernel():
            return self._grouped_kernel(x, src, weights, e, n_e)
        r, dim = src.shape[0], x.shape[-1]
        c = min(tile_rows, r)
        order, ex, row0, valid = expert_matmul.grouped_tiles(e, n_e, c)
        x_sorted, w_sorted = _sorted_rows(x, src, weights, order, c)

        def run(out, e_t, row0_t, valid_t):
            w1, w3, w2 = self.dense(e_t)
            x_t = jax.lax.dynamic_slice_in_dim(x_sorted, row0_t, c)
            w_t = jax.lax.dynamic_slice_in_dim(w_sorted, row0_t, c)
            y = self.ffn(x_t, w1, w3, w2, w_t)
            old = jax.lax.dynamic_slice_in_dim(out, row0_t, c)
            keep = (jnp.arange(c) < valid_t)[:, None]  # rows past the tile's end belong to the next expert
            return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, y, old), row0_t, 0)

        def step(out, tile):
            e_t, row0_t, valid_t = tile
            return jax.lax.cond(valid_t > 0, lambda o: run(o, e_t, row0_t, valid_t), lambda o: o, out), None

        out_sorted, _ = jax.lax.scan(step, jnp.zeros((r + c, dim), _BF16), (ex, row0, valid))
        return unsort_rows(out_sorted[:r], order)

    def _grouped_kernel(self, x, src, weights, e, n_e):
        """`grouped` through the fp4 kernel (same arguments and result)."""
        r = src.shape[0]
        c = expert_matmul.tile_rows_for(r, n_e)
        order, te, row0, valid = expert_matmul.grouped_tiles(e, n_e, c)
        x_sorted, w_sorted = _sorted_rows(x, src, weights, order, c)
        bs = self.block_sizes(expert_matmul.halvings_for(r, n_e))

        def matmul(rows, lins):
            return expert_matmul.grouped_matmul(rows, *_packed(lins), te, row0, valid, c,
                                                implementation=self.kernels, interpret=self.kernels_interpret,
                                                block_sizes=bs)

        y = self.kernel_ffn(x_sorted, w_sorted, matmul)[:r]
        # rows no live tile covers (pairs of another device's experts) are undefined on the kernel path
        y = jnp.where((jnp.take(e, order) < n_e)[:, None], y, jnp.zeros_like(y))
        return unsort_rows(y, order)

    def apply_one(self, e: int, x: jax.Array, weights: jax.Array | None = None) -> jax.Array:
        """Expert e alone, through the plain `linear()` dispatch (layers.apply_linear), exactly as
        the reference's `Expert.forward`: x [..., dim] bf16, weights [..., 1] or None -> bf16."""

        def lin(m: Linear, h):
            s = None if m.scale is None else m.scale[...][e]
            return apply_linear(h, self._released(m.weight[...][e]), s, self.dtype)

        h = swiglu(lin(self.w1, x), lin(self.w3, x), self.swiglu_limit, weights, out_dtype=x.dtype)
        return lin(self.w2, h)

    def block_sizes(self, half_tiles: int = 0) -> expert_matmul.BlockSizes:
        """The fp4 kernel's options: its defaults, with `scale_fold` when the scales allow it,
        `one_row`, `stream_k`, `one_dot` and `swap_ab` when set, `swap_ab_single` unless cleared, and
        `half_tiles` (`self.half_tiles` where set)."""
        half_tiles = half_tiles if self.half_tiles is None else self.half_tiles
        return expert_matmul.BlockSizes(scale_fold=self.scale_fold, one_row=self.one_row, one_dot=self.one_dot,
                                        swap_ab=self.swap_ab, swap_ab_single=self.swap_ab_single,
                                        half_tiles=half_tiles,
                                        decode="relaid" if self._relaid else None,
                                        stream_k=expert_matmul.TARGET_PROGRAMS if self.stream_k else 0)

    def use_kernel(self) -> bool:
        """Whether the routed GEMMs go through the fp4 Pallas kernel (fp4 experts, kernels
        resolved to Pallas on a GPU or in interpret mode)."""
        if self.dtype != "fp4":
            return False
        use, target = _resolve_kernel(self.kernels, None, self.kernels_interpret)
        return use and target == "gpu"

    def kernel_ffn(self, xq: jax.Array, weights: jax.Array, matmul) -> jax.Array:
        """`ffn` with the projections as `matmul(x, linears) -> one bf16 result per linear` (an
        expert_matmul call on the packed weights; w1 and w3 in one call): xq [M, dim] bf16,
        weights [M] f32 -> bf16 [M, dim]."""
        gate, up = matmul(xq, (self.w1, self.w3))
        (y,) = matmul(_quantise_input(swiglu(gate, up, self.swiglu_limit, weights[:, None]), self.dtype), (self.w2,))
        return y


# ----------------------------------------------------------------------------------------- MoE


class MoE(nnx.Module):
    """Routed experts plus one shared expert (SPEC §6).

    Attributes: `gate` (Gate), `experts` (Experts, stacked fp4), `shared_experts` (Expert, fp8).

    Two routed-expert paths with the same rounding points, picked statically from the number of
    (token, expert) pairs R = N * k:
      * gather (R <= gather_max_pairs; decode): each pair's packed expert weights are gathered
        and dequantised to bf16 inside the computation, then one batched matmul per projection.
        Transient memory R * 3 * inter * dim * 2 bytes (71 MB per pair at the released size),
        and only the selected experts' bytes are read.
      * grouped (prefill): pairs are sorted by expert and cut into tiles of `tile_rows` rows that
        each belong to one expert (at most ceil(R / tile_rows) + E tiles); a `lax.scan` over the
        tiles dequantises one expert's three matrices and runs them on its rows. Transient
        memory: one expert's bf16 weights plus one tile of activations; weight traffic is one
        dequantisation per tile, so at most E tiles are partly empty. A multi-device run should
        replace this with expert parallelism (experts sharded over devices, pairs dispatched with
        an all-to-all) and a grouped GEMM that widens fp4 inside the kernel.
    """

    def __init__(self, layer_id: int, args: ModelArgs, *, gather_max_pairs: int = 64, tile_rows: int = 128):
        n_experts, topk = args.moe_experts(layer_id)
        self.layer_id = layer_id
        self.dim = args.dim
        self.n_experts, self.topk = n_experts, topk
        self.gather_max_pairs = gather_max_pairs
        self.tile_rows = tile_rows
        plain: WeightDtype = "fp8" if args.dtype == "fp8" else "bf16"
        expert_dtype: WeightDtype = "fp4" if args.expert_dtype == "fp4" else plain
        self.gate = Gate(layer_id, args)
        self.experts = Experts(n_experts, args.dim, args.moe_inter_dim, args.swiglu_limit, expert_dtype,
                               **linear_kernels(args), scale_fold=args.fp4_scale_fold == "on")
        self.shared_experts = Expert(args.dim, args.moe_inter_dim, plain, args.swiglu_limit, **linear_kernels(args))

    def __call__(self, x: jax.Array, image_mask: jax.Array | None = None, *, path: MoEPath = "auto",
                 norm=None):
        """x [b, s, dim] bf16, image_mask [b, s] bool or None; norm: the RMSNorm the MoE input
        still needs (the block's `ffn_norm`: the MoE runs on norm(x)), or None (x is its input).
        A single row's norm can then run inside the gate's logits launch (`Gate.norm_logits`).

        Returns (y [b, s, dim] bf16, {"route_idx": int32 [b*s, k], "route_w": f32 [b*s, k]}).

        Traced under an active mesh (`jax.set_mesh`) whose `expert` or `data` axis is > 1, the
        MoE runs as one shard_map (`dsv41_jax.expert_parallel.moe_forward`), with the same values; there
        `path` picks the communication pattern: "gather" -> "replicated", "grouped" ->
        "all_to_all", "auto" by token count."""
        if path not in ("auto", "gather", "grouped"):
            raise ValueError(f"MoE path must be 'auto', 'gather' or 'grouped', got {path!r}")
        ep_mesh = expert_parallel.active_expert_mesh()
        if ep_mesh is not None:
            x = x if norm is None else norm(x)
            y, weights, indices = expert_parallel.moe_forward(
                self, x.reshape(-1, self.dim), None if image_mask is None else image_mask.reshape(-1), mesh=ep_mesh,
                pattern={"auto": "auto", "gather": "replicated", "grouped": "all_to_all"}[path])
            return y.reshape(x.shape), {"route_idx": indices, "route_w": weights}
        shape = x.shape
        x = x.reshape(-1, self.dim)
        n, k = x.shape[0], self.topk
        quantised = self.experts.dtype in ("fp8", "fp4")
        logits, x, xq = self.gate.logits(x, norm, quantise=quantised)
        weights, indices = self.gate.route(logits, None if image_mask is None else image_mask.reshape(-1))
        if path == "auto":
            path = "gather" if n * k <= self.gather_max_pairs else "grouped"
        # act_quant works per token, so each token is quantised once for all of its experts
        xq = _quantise_input(x, self.experts.dtype) if xq is None else xq
        route = self._routed_gather if path == "gather" else self._routed_grouped
        pair_out = route(xq, weights, indices)
        y = combine(pair_out.reshape(n, k, self.dim), indices, self.shared_experts(x))
        return y.reshape(shape), {"route_idx": indices, "route_w": weights}

    def _routed_gather(self, xq, weights, indices):
        """-> bf16 [N*k, dim], pair p = token * k + slot."""
        n, k = indices.shape
        ex = self.experts
        if ex.use_kernel():
            e = indices.reshape(-1)
            interp = ex.kernels_interpret

            def matmul(x, lins):
                return expert_matmul.gather_matmul(x, *_packed(lins), e, implementation=ex.kernels, interpret=interp,
                                                   block_sizes=ex.block_sizes())

            return ex.kernel_ffn(jnp.repeat(xq, k, axis=0), weights.reshape(-1), matmul)
        w1, w3, w2 = ex.dense(indices.reshape(-1))
        return ex.ffn(jnp.repeat(xq, k, axis=0), w1, w3, w2, weights.reshape(-1))

    def _routed_grouped(self, xq, weights, indices):
        """-> bf16 [N*k, dim], pair p = token * k + slot."""
        n, k = indices.shape
        r, n_exp = n * k, self.n_experts
        return self.experts.grouped(xq, jnp.arange(r, dtype=jnp.int32) // k, weights.reshape(-1),
                                    indices.reshape(-1), n_exp, self.tile_rows)


def combine(pair_out: jax.Array, indices: jax.Array, shared: jax.Array) -> jax.Array:
    """The reference's accumulation (SPEC §6.3): pair_out bf16 [N, k, dim] (slot order of
    `indices` [N, k]), shared bf16 [N, dim] -> bf16 [N, dim].

    fp32 sum starting from 0, adding each token's expert outputs in ascending expert id (the
    reference loops over experts in that order), then the shared expert, then one bf16 cast."""
    perm = jnp.argsort(indices, axis=-1)
    ordered = jnp.take_along_axis(pair_out, perm[:, :, None], axis=1)
    y = jnp.zeros(shared.shape, _F32)
    for j in range(pair_out.shape[1]):
        y = y + ordered[:, j].astype(_F32)
    y = y + shared.astype(_F32)
    return cast(y, _BF16)
