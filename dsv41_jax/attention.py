"""Attention of DeepSeek V4.1 (SPEC §5): sliding-window KV plus a compressed, indexer-selected KV
stream, one `sparse_attn` over both, grouped low-rank output.

Every layer's role (window / source / reindex / reuse, SPEC §1.3) is a static Python fact of the
config, so each layer traces only its own branch. Cross-layer state travels up the stack in a
plain dict `shared` (missing key = not published yet):

  "compress_kv" bf16 [b, S//r, hd]   compressed KV of the latest kv source (RoPE'd, FP4-QDQ'd)
  "index_k"     bf16 [b, S//r, ihd]  index keys of the latest kv source (RoPE'd, FP4-QDQ'd)
  "topk"        int32 [b, S, k]      compressed indices of the latest index source, offset included
  "candidates"  bool [b, S, S//r]    candidate mask of the candidate source

A decode step (one token per row, per-row positions `pos` [b]) reads and writes the layer's
cache (`dsv41_jax.cache`) and publishes the same keys, with the caches' static widths
(N = max_seq_len // r rows, rows >= (pos + 1) // r not yet visible) plus
  "index_k_owner" int32 [b]         which layer's index keys "index_k" holds, per row.

The reference's decode has an index-key hand-off inconsistency (SPEC §21): a ratio-r owner whose
group is still open publishes no index keys, so its indexer scores against whatever the last
publisher left. `reference_compat` reproduces that; by default every owner scores its own keys.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax import quant
from dsv41_jax.cache import seed_group_state, seed_rows, seed_window, update_window, write_row, write_rows
from dsv41_jax.config import COMPRESSED_KV_BLOCK, QUANT_BLOCK, ModelArgs
from dsv41_jax.layers import Linear, RMSNorm, apply_linears, apply_rope, linear_kernels, rope_angles, rope_freqs
from dsv41_jax.numerics import exact_div, round_bf16, to_bf16
from pallas_kernels._dispatch import platform
from pallas_kernels.fp8_matmul import api as fp8_matmul
from pallas_kernels.fp8_matmul import reference as fp8_reference
from pallas_kernels.index_scores.api import index_scores
from pallas_kernels.sparse_attention.api import BlockSizes as SparseAttnBlockSizes
from pallas_kernels.sparse_attention.api import sparse_attn
from pallas_kernels.topk.api import topk_positions
from pallas_kernels.window_kv.api import write_window_row

_F32 = jnp.float32
_BF16 = jnp.bfloat16
_HIGHEST = jax.lax.Precision.HIGHEST


# ------------------------------------------------------------------------------------ helpers


@functools.cache
def _layer_freqs(rd: int, original_seq_len: int, base: float, factor: float, beta_fast: int, beta_slow: int):
    return rope_freqs(rd, original_seq_len, base, factor, beta_fast, beta_slow)


def layer_freqs(args: ModelArgs, layer_id: int) -> np.ndarray:
    """RoPE frequencies f32 [rd/2] of a layer: compress layers use compress_rope_theta + YaRN,
    window-only layers rope_theta without YaRN. The layer's Indexer uses the same table."""
    return _layer_freqs(args.rope_head_dim, args.rope_original_seq_len(layer_id), float(args.rope_base(layer_id)),
                        float(args.rope_factor), args.beta_fast, args.beta_slow)


def _rope_at(freqs: np.ndarray, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin f32 [1, len(positions), rd/2] for `apply_rope`."""
    cos, sin = rope_angles(freqs, positions)
    return cos[None], sin[None]


def _linear_dtype(args: ModelArgs) -> str:
    """Storage of the projections that the reference creates with its default dtype."""
    return "fp8" if args.dtype == "fp8" else "bf16"


def _require(shared: dict, key: str, layer_id: int) -> jax.Array:
    if key not in shared:
        raise KeyError(
            f"layer {layer_id} reads shared[{key!r}], which no lower layer has published; run the layers "
            f"in order, starting from the source layer (published so far: {sorted(shared)})"
        )
    return shared[key]


# ------------------------------------------------------------------------------ window indices


def window_topk_idxs(window: int, seqlen: int, start_pos) -> jax.Array:
    """Window-KV slots each query attends to (SPEC §5.4), int32, -1 = nothing there.

    Prefill (start_pos == 0, a Python int): [seqlen, min(seqlen, window)]; row t lists positions
    max(0, t-window+1) .. that + width-1, entries beyond t set to -1.
    Decode (seqlen == 1; start_pos may be traced): [1, window], the ring slots oldest first,
    (P%window)+1 .. window-1, 0 .. P%window, slots > P (ring still filling) set to -1.
    """
    if isinstance(start_pos, (int, np.integer)) and start_pos == 0:
        t = np.arange(seqlen)[:, None]
        idx = np.maximum(t - window + 1, 0) + np.arange(min(seqlen, window))[None, :]
        return jnp.asarray(np.where(idx > t, -1, idx), jnp.int32)
    if seqlen != 1:
        raise ValueError(f"a decode step (start_pos > 0) takes exactly one token, got seqlen={seqlen}")
    p = jnp.asarray(start_pos, jnp.int32)
    slots = (jnp.arange(window, dtype=jnp.int32) + p % window + 1) % window
    return jnp.where(slots > p, -1, slots)[None, :]


def span_window_idxs(window: int, c: int, start: jax.Array, history: bool) -> jax.Array:
    """Window-KV indices of a span of c queries at positions start[b] .. start[b]+c-1, int32
    [b, c, window] (-1 = nothing there).

    Query P lists positions max(0, P-window+1) .. that + window-1 in ascending order, entries
    beyond P set to -1: the order of a prefill (`window_topk_idxs`), so `sparse_attn` sees the
    same vectors in the same order. Positions inside the span index the span's own KV, which
    follows the ring in the KV concat (index window + P - start); earlier positions index their
    ring slot (P % window) with `history`, or are -1 without (the caller needs only the queries
    whose window lies inside the span).
    """
    p = start[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]  # [b, c]
    q = jnp.maximum(p - window + 1, 0)[..., None] + jnp.arange(window, dtype=jnp.int32)  # [b, c, window]
    st = start[:, None, None]
    before = jnp.mod(q, window) if history else jnp.full_like(q, -1)
    idx = jnp.where(q >= st, (window if history else 0) + q - st, before)
    return jnp.where(q > p[..., None], -1, idx)


@functools.partial(jax.jit, static_argnames="window")
def window_ring(kv: jax.Array, window: int) -> jax.Array:
    """The window cache after a prefill: kv [b, S, hd] -> [b, window, hd] with position p in slot
    p % window for the last min(S, window) positions, zeros in the never-written slots."""
    b, s, _ = kv.shape
    return seed_window(kv, jnp.full((b,), s, jnp.int32), window)


# ----------------------------------------------------------------------------- candidate blocks


@functools.partial(jax.jit, static_argnames=("topk_blocks", "block_size"))
def select_candidate_blocks(scores: jax.Array, compress_lens, topk_blocks: int, block_size: int):
    """Level one of the two-level top-k (SPEC §5.8).

    scores [..., W] (causally masked with -inf); compress_lens int or int array broadcasting
    against scores[..., :1] (each query's number of visible positions).
    Returns (mask bool [..., W], block_scores [..., ceil(W/block_size)] in scores.dtype): block
    score = max of its positions (W padded with -inf), the block holding the newest visible position
    pinned to +inf; the top min(topk_blocks, n_blocks) blocks (ties -> lower block) that are > -inf
    are kept and expanded back to positions.
    """
    w = scores.shape[-1]
    pad = -w % block_size
    padded = jnp.pad(scores, [(0, 0)] * (scores.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
    n_blocks = padded.shape[-1] // block_size
    blocks = jnp.max(padded.reshape(*scores.shape[:-1], n_blocks, block_size), axis=-1)
    # floor division: a query that sees nothing has last = -1 and pins no block
    last = (jnp.asarray(compress_lens) - 1) // block_size
    blocks = jnp.where(jnp.arange(n_blocks) == last, jnp.asarray(jnp.inf, blocks.dtype), blocks)
    vals, idx = jax.lax.top_k(blocks, min(topk_blocks, n_blocks))
    keep = jnp.put_along_axis(jnp.zeros(blocks.shape, bool), idx, vals > -jnp.inf, axis=-1, inplace=False)
    return jnp.repeat(keep, block_size, axis=-1)[..., :w], blocks


def pad_index_outputs(out: dict, n: int, k: int, block_size: int) -> dict:
    """An indexer's decode outputs over the first w < n rows, padded to the arrays of all n rows:
    index_score [b, 1, w] -> [b, 1, n] with -inf, topk [b, 1, min(k, w)] -> [b, 1, k] with -1
    (the picks are ascending with -1 last, so the hidden picks of a full-width top-k are -1s
    after them), candidates with False, cand_block_score [b, 1, ceil(w / block)] ->
    [b, 1, ceil(n / block)] with -inf (w is a whole number of blocks)."""
    def pad(a, width, value):
        return jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, width - a.shape[-1])], constant_values=value)

    res = dict(out)
    res["index_score"] = pad(out["index_score"], n, -jnp.inf)
    res["topk"] = pad(out["topk"], k, -1)
    if "candidates" in out:
        res["candidates"] = pad(out["candidates"], n, False)
        res["cand_block_score"] = pad(out["cand_block_score"], -(-n // block_size), -jnp.inf)
    return res


# --------------------------------------------------------------------------------- compressor


class Compressor(nnx.Module):
    """Pools `ratio` consecutive tokens into one KV latent (SPEC §5.6); kv-source layers only.

    wkv [hd, dim]: bf16 for ratio 1, f32 (holding bf16 values) for ratio > 1; wgate [hd, dim] f32
    (ratio > 1); norm RMSNorm(hd). The latent is returned BEFORE RoPE: the indexer needs it so.
    """

    def __init__(self, layer_id: int, args: ModelArgs):
        self.ratio = args.compress_ratios[layer_id]
        if self.ratio <= 0:
            raise ValueError(f"layer {layer_id} has compress ratio {self.ratio}: it has no Compressor")
        self.head_dim = args.head_dim
        self.norm = RMSNorm(args.head_dim, args.norm_eps)
        self.wkv = Linear(args.dim, args.head_dim, "fp32" if self.ratio > 1 else "bf16")
        if self.ratio > 1:
            self.wgate = Linear(args.dim, args.head_dim, "fp32")

    def __call__(self, x: jax.Array, lengths: jax.Array | None = None):
        """Prefill. x bf16 [b, S, dim], lengths int [b] (real tokens per row; None: all S) ->
        (latent bf16 [b, S//r, hd], kv_state, score_state).

        States are f32 [b, r, hd] (None for ratio 1): zeros / -inf, with the trailing L % r tokens
        of each row that form no complete group parked in slots 0..L%r-1 for the decode steps to
        finish. Latents of groups reaching past a row's length are computed from padding.
        """
        if self.ratio == 1:
            return self.norm(self.wkv(x)), None, None
        b, s, _ = x.shape
        r, n, hd = self.ratio, s // self.ratio, self.head_dim
        xf = round_bf16(x)  # x is bf16: the exact values, even if an upstream rounding was fused away
        kv, score = self.wkv(xf), self.wgate(xf)  # f32 [b, S, hd]
        lens = jnp.full((b,), s, jnp.int32) if lengths is None else lengths
        kv_state, score_state = seed_group_state(kv, lens, r, 0.0), seed_group_state(score, lens, r, -jnp.inf)
        cut = n * r
        pooled = pool_groups(kv[:, :cut].reshape(b, n, r, hd), score[:, :cut].reshape(b, n, r, hd))
        # the reference casts the f32 pool to bf16 BEFORE the norm
        return self.norm(to_bf16(pooled)), kv_state, score_state

    def decode(self, x: jax.Array, kv_state: jax.Array | None, score_state: jax.Array | None, pos: jax.Array):
        """One token per row. x bf16 [b, 1, dim], states f32 [b, r, hd] (None for ratio 1), pos
        int32 [b] -> (latent bf16 [b, 1, hd], (kv_state, score_state) or None, closes bool [b] or
        None).

        Ratio 1: every token is a group (closes None = always). Ratio r: the token goes into state
        slot pos % r; the latent pools the r slots and is meaningful only where the token closes
        its group, (pos + 1) % r == 0. It is computed for every row (static shapes); the caller
        writes it only where `closes` holds.
        """
        if self.ratio == 1:
            return self.norm(self.wkv(x)), None, None
        xf = round_bf16(x)
        kv, score = self.wkv(xf)[:, 0], self.wgate(xf)[:, 0]  # f32 [b, hd]
        slot = pos % self.ratio
        kv_state, score_state = write_row(kv_state, slot, kv), write_row(score_state, slot, score)
        latent = self.norm(to_bf16(pool_groups(kv_state, score_state)))[:, None]
        return latent, (kv_state, score_state), (pos + 1) % self.ratio == 0

    def chunk(self, x: jax.Array, kv_state: jax.Array | None, score_state: jax.Array | None, start: jax.Array,
              lengths: jax.Array):
        """A span of tokens per row onto the open group. x bf16 [b, c, dim] at positions start[b] ..
        start[b]+c-1, the first lengths[b] of them real; states f32 [b, r, hd] holding the
        start % r tokens of the group start is in (None for ratio 1).

        Returns (latents bf16 [b, G, hd] of groups start // r + g, g < G, complete bool [b, G],
        (kv_state, score_state) or None). G = c for ratio 1, else the most groups a span of c can
        touch, (c + r - 2) // r + 1; a group is complete where its last token is real. The new
        states park the tokens of the group still open after the span, as a prefill of all
        positions would (`seed_group_state`): slot j < (start + L) % r, fills elsewhere.
        """
        if self.ratio == 1:
            complete = jnp.arange(x.shape[1])[None, :] < lengths[:, None]
            return self.norm(self.wkv(x)), complete, None
        b, c, _ = x.shape
        r, hd = self.ratio, self.head_dim
        g = (c + r - 2) // r + 1
        xf = round_bf16(x)
        kv, score = self.wkv(xf), self.wgate(xf)  # f32 [b, c, hd]
        rem = (start % r)[:, None]  # parked tokens: state slots 0 .. rem-1
        # token i of the groups touched (positions start - rem + i): state slot i, then the span
        i = jnp.arange(g * r, dtype=jnp.int32)[None, :]
        src = jnp.clip(jnp.where(i < rem, i, r + i - rem), 0, r + c - 1)
        ext_kv = jnp.take_along_axis(jnp.concatenate([kv_state, kv], 1), src[:, :, None], axis=1)
        ext_score = jnp.take_along_axis(jnp.concatenate([score_state, score], 1), src[:, :, None], axis=1)
        pooled = pool_groups(ext_kv.reshape(b, g, r, hd), ext_score.reshape(b, g, r, hd))
        filled = rem + lengths[:, None]  # tokens of the touched groups that are real
        complete = (jnp.arange(g)[None, :] + 1) * r <= filled
        # the group left open: its first (filled % r) tokens
        j = jnp.arange(r, dtype=jnp.int32)[None, :]
        slot = jnp.clip((filled // r) * r + j, 0, g * r - 1)
        keep = (j < filled % r)[:, :, None]
        new_kv = jnp.where(keep, jnp.take_along_axis(ext_kv, slot[:, :, None], axis=1), 0.0)
        new_score = jnp.where(keep, jnp.take_along_axis(ext_score, slot[:, :, None], axis=1), -jnp.inf)
        return self.norm(to_bf16(pooled)), complete, (new_kv, new_score)


@jax.jit
def pool_groups(kv: jax.Array, score: jax.Array) -> jax.Array:
    """f32 [..., r, hd] x2 -> f32 [..., hd]: per channel, softmax of score over the r tokens of a
    group (max-subtracted, divided by the sum), weighted sum of kv."""
    e = jnp.exp(score - jnp.max(score, axis=-2, keepdims=True))
    return jnp.sum(kv * exact_div(e, jnp.sum(e, axis=-2, keepdims=True)), axis=-2)


# ------------------------------------------------------------------------------------ indexer


def causal_compress_lens(seqlen: int, ratio: int) -> jax.Array:
    """Prefill: compressed positions visible to each query, (t+1)//ratio, int32 [seqlen, 1]."""
    return jnp.asarray((np.arange(1, seqlen + 1) // ratio)[:, None], jnp.int32)


@functools.partial(jax.jit, static_argnames=("k", "offset", "implementation", "interpret"))
def select_topk(scores: jax.Array, compress_lens, k: int, offset: int, implementation: str = "reference",
                interpret: bool = False) -> jax.Array:
    """Top-k positions of scores [..., W] (ties -> lower index), sorted ascending; positions at or
    beyond the query's compress_len become -1, the rest are shifted by `offset` -> int32 [..., k].
    implementation: `pallas_kernels.topk` ("auto": its GPU kernel on a GPU, no sort)."""
    idx = topk_positions(scores, k, implementation=implementation, interpret=interpret)
    return jnp.where(idx < compress_lens, idx + offset, -1).astype(jnp.int32)


class Indexer(nnx.Module):
    """Chooses the compressed positions each query attends to (SPEC §5.7); index-source layers.

    wq_b [ih*ihd, q_lora_rank] fp8; weights_proj [ih, dim] bf16; on kv sources (key owners) also
    wk [ihd, hd] bf16 and k_norm RMSNorm(ihd).
    """

    def __init__(self, layer_id: int, args: ModelArgs):
        self.layer_id = layer_id
        self.ratio = args.compress_ratios[layer_id]
        self.n_heads, self.head_dim, self.rope_dim = args.index_n_heads, args.index_head_dim, args.rope_head_dim
        self.index_topk = args.index_topk
        self.owns_k = args.is_kv_source(layer_id)
        self.is_candidate_source = args.is_candidate_source(layer_id)
        self.uses_candidates = args.uses_candidates(layer_id)
        self.candidate_topk_blocks, self.candidate_block_size = args.candidate_topk_blocks, args.candidate_block_size
        self.kernels, self.kernels_interpret = args.kernels, args.kernels_interpret
        # the scores on the GPU kernel (`pallas_kernels.index_scores`, where `kernels` picks it)
        # rather than XLA's per-head f32 dots in memory, for prefills and decode steps alike
        # (benchmarks/README.md, forty-fifth and forty-sixth sessions)
        self.score_kernel = True
        # computed in double, then applied as an f32 scalar, as the reference's bf16 * python float
        self.weight_scale = self.head_dim**-0.5 * self.n_heads**-0.5
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim, _linear_dtype(args), **linear_kernels(args))
        self.weights_proj = Linear(args.dim, self.n_heads, "bf16")
        if self.owns_k:
            self.wk = Linear(args.head_dim, self.head_dim, "bf16")
            self.k_norm = RMSNorm(self.head_dim, args.norm_eps)

    def keys(self, latent: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """Index keys from the pre-RoPE latent bf16 [b, n, hd] -> bf16 [b, n, ihd]: k_norm(wk(.)),
        RoPE at the group-start positions (cos/sin [1, n, rd/2]), FP4 QDQ (UE8M0, 32)."""
        if not self.owns_k:
            raise ValueError(f"layer {self.layer_id}'s indexer owns no index keys")
        k = apply_rope(self.k_norm(self.wk(latent)), cos, sin, self.rope_dim)
        return quant.fp4_quant_dequant_ue8m0(k, QUANT_BLOCK)

    def queries(self, qi: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """qi = wq_b(qr) bf16 [b, s, ih*ihd] (`Attention.query_kv` projects it beside the
        attention's own wq_b, which reads the same qr) -> q bf16 [b, s, ih, ihd]: RoPE at the
        query positions, FP4 QDQ (UE8M0, 32)."""
        b, s, _ = qi.shape
        q = qi.reshape(b, s, self.n_heads, self.head_dim)
        q = apply_rope(q, cos, sin, self.rope_dim)
        return quant.fp4_quant_dequant_ue8m0(q, QUANT_BLOCK)

    def scores(self, q: jax.Array, k: jax.Array, w: jax.Array) -> jax.Array:
        """`index_scores` (q bf16 [b, s, ih, ihd], k bf16 [b, t, ihd], w bf16 [b, s, ih] -> bf16
        [b, s, t]) on the GPU kernel with `score_kernel`, else the jnp reference."""
        return index_scores(q, k, w, implementation=self.kernels if self.score_kernel else "reference",
                            interpret=self.kernels_interpret)

    def head_weights(self, x: jax.Array) -> jax.Array:
        """x bf16 [b, s, dim] -> bf16 [b, s, ih] = weights_proj(x) * ihd^-0.5 * ih^-0.5 (f32 product)."""
        return to_bf16(round_bf16(self.weights_proj(x)) * _F32(self.weight_scale))

    def prefill(self, x: jax.Array, qi: jax.Array, index_k: jax.Array, cos: jax.Array, sin: jax.Array,
                offset: int, candidates: jax.Array | None = None) -> dict:
        """Scores and top-k for a prefill. x [b, S, dim], qi [b, S, ih*ihd] (`queries`), index_k bf16
        [b, S//r, ihd], cos/sin at positions 0..S-1, offset = window-KV length (S), candidates
        bool [b, S, S//r] (layers that use them).

        Returns {"topk" int32 [b, S, k], "index_score" bf16 [b, S, S//r]} plus, on the candidate
        source, {"candidates" bool [b, S, S//r], "cand_block_score" bf16 [b, S, n_blocks]}.
        """
        s = x.shape[1]
        width = index_k.shape[1]
        if width != s // self.ratio:
            raise ValueError(f"index_k has {width} rows, expected S//ratio = {s // self.ratio}")
        scores = self.scores(self.queries(qi, cos, sin), index_k, self.head_weights(x))
        return self._select(scores, causal_compress_lens(s, self.ratio), offset, candidates)

    def decode(self, x: jax.Array, qi: jax.Array, index_k: jax.Array, cos: jax.Array, sin: jax.Array,
               pos: jax.Array, offset: int, candidates: jax.Array | None = None,
               context_bound: int | None = None) -> dict:
        """Scores and top-k for one token per row. x [b, 1, dim], qi [b, 1, ih*ihd], index_k
        bf16 [b, N, ihd] (a whole cache: N = max_seq_len // r), cos/sin at `pos` int32 [b],
        offset = window length (the ring comes first in the KV concat), candidates bool [b, 1, N].
        context_bound (static int or None): a promise that every pos < context_bound; then only
        the first `decode_index_width` rows are scored and the results are padded back to width
        N (-inf scores, False candidates, -1 indices), which gives the same arrays (see below).

        Row b sees the first (pos[b] + 1) // r compressed positions; the other columns are -inf.
        Returns the keys of `prefill` with width N (candidates False beyond the visible columns).

        k = min(index_topk, N) is static, the reference's k' = min(index_topk, n) with n the
        visible width. Both take the top entries in the order (score descending, column
        ascending), where every visible column (a candidate-masked one scores -inf but stays
        visible) precedes every hidden one (-inf, larger column). So the reference's k' picks are
        exactly our first k' picks; when k > k' (n < index_topk) the reference takes all n
        visible columns and our extra picks are hidden columns, which `select_topk` turns into -1.
        Sorted ascending, a row is the reference's row followed by -1s. Likewise for the
        candidate blocks: blocks past the visible width score -inf and are never kept, and the
        visible ones are ranked in the same order, so the kept blocks are the reference's.
        """
        n = index_k.shape[1]
        w = self.decode_index_width(n, context_bound)
        if w < n:  # every hidden column is -inf and never chosen: score the visible prefix only
            out = self.decode(x, qi, index_k[:, :w], cos, sin, pos, offset,
                              None if candidates is None else candidates[..., :w])
            return pad_index_outputs(out, n, min(self.index_topk, n), self.candidate_block_size)
        scores = self.scores(self.queries(qi, cos, sin), index_k, self.head_weights(x))
        lens = ((pos + 1) // self.ratio).astype(jnp.int32)[:, None, None]  # [b, 1, 1]
        out = self._select(scores, lens, offset, candidates)
        if "candidates" in out:
            # the reference's mask is only n columns wide; the pinned last block may reach past n
            out["candidates"] = out["candidates"] & (jnp.arange(index_k.shape[1]) < lens)
        return out

    def decode_index_width(self, n: int, context_bound: int | None) -> int:
        """Index-key rows a decode step must score when every position is < context_bound: the
        rows those positions can see, ceil(bound / r), rounded up to whole candidate blocks on
        layers that select or use them (so the blocks are the same as over all n rows)."""
        if context_bound is None:
            return n
        rows = -(-context_bound // self.ratio)
        if self.is_candidate_source or self.uses_candidates:
            rows = -(-rows // self.candidate_block_size) * self.candidate_block_size
        return max(1, min(n, rows))

    def chunk(self, x: jax.Array, qi: jax.Array, index_k: jax.Array, cos: jax.Array, sin: jax.Array,
              pos: jax.Array, candidates: jax.Array | None = None) -> dict:
        """Scores and top-k for a span of queries. x [b, c, dim], qi [b, c, ih*ihd], index_k
        bf16 [b, N, ihd] (rows = groups 0..N-1: a cache, or a prefill's keys), cos/sin [b, c, rd/2]
        at pos int32 [b, c], candidates bool [b, c, N] (layers that use them).

        Query P sees the first (P + 1) // r rows. Returns the keys of `prefill` with width N and
        "topk" holding the chosen rows themselves (no offset, -1 = none): the reference's rows
        followed by -1s (see `decode`: the same static-k argument holds per query).
        """
        scores = self.scores(self.queries(qi, cos, sin), index_k, self.head_weights(x))
        return self._select(scores, ((pos + 1) // self.ratio)[..., None], 0, candidates)

    def _select(self, scores: jax.Array, lens: jax.Array, offset: int, candidates: jax.Array | None) -> dict:
        """Causal mask (columns >= lens -> -inf), candidate blocks (source) or the candidate mask
        (layers above it), then the ascending top-k. scores bf16 [b, s, W]; lens int broadcasting
        against scores[..., :1]."""
        width = scores.shape[-1]
        neg_inf = jnp.asarray(-jnp.inf, scores.dtype)
        scores = jnp.where(jnp.arange(width) >= lens, neg_inf, scores)
        out = {}
        if self.is_candidate_source:
            out["candidates"], out["cand_block_score"] = select_candidate_blocks(
                scores, lens, self.candidate_topk_blocks, self.candidate_block_size)
        elif self.uses_candidates:
            if candidates is None:
                raise ValueError(f"layer {self.layer_id} masks to the candidate blocks, but none were given")
            scores = jnp.where(candidates, scores, neg_inf)
        out["index_score"] = scores
        out["topk"] = select_topk(scores, lens, min(self.index_topk, width), offset, self.kernels,
                                  self.kernels_interpret)
        return out


# ---------------------------------------------------------------------------------- attention


def resolve_attn_accumulate(choice: str) -> str:
    """`ModelArgs.attn_accumulate` -> `sparse_attn`'s `accumulate`: "auto" is "f64" (the golden
    oracle's rounding) except on TPU, which has no float64 ("f32"); "f64" / "f32" pass through."""
    tpu = platform() == "tpu"
    if choice == "auto":
        return "f32" if tpu else "f64"
    if choice not in ("f64", "f32"):
        raise ValueError(f"attn_accumulate must be 'auto', 'f64' or 'f32', got {choice!r}")
    if choice == "f64" and tpu:
        raise ValueError("attn_accumulate='f64' needs float64, which TPUs do not have: use 'f32' or 'auto'")
    return choice


class Attention(nnx.Module):
    """One layer's attention (SPEC §5). Parameters as the reference names them:
    wq_a [q_lora_rank, dim] fp8, q_norm, wq_b [H*hd, q_lora_rank] fp8, wkv [hd, dim] fp8, kv_norm,
    wo_a [g*o_lora_rank, H*hd/g] fp8 (kept as shipped; the reference's convert.py widens it to
    bf16, the same values), wo_b [dim, g*o_lora_rank] fp8, attn_sink f32 [H];
    compressor (kv sources) and indexer (index sources).
    `f64_kernel` (off; set on the module to try it): float64 requests run the GPU kernel's
    float64 program instead of the jnp reference (`sparse_attention.BlockSizes.f64_kernel`).
    `kv_row_kernel` (off; set on the module to try it): a one-row decode step's window-KV row
    (kv_norm, RoPE, FP8 QDQ, the ring write) runs as one kernel launch
    (`pallas_kernels.window_kv`) instead of XLA's three.
    """

    def __init__(self, layer_id: int, args: ModelArgs):
        self.layer_id = layer_id
        self.role = args.attn_role(layer_id)
        self.ratio = args.compress_ratios[layer_id] if self.role != "window" else 0
        self.n_heads, self.head_dim, self.rope_dim = args.n_heads, args.head_dim, args.rope_head_dim
        self.window = args.window_size
        self.n_groups, self.o_lora_rank = args.o_groups, args.o_lora_rank
        self.softmax_scale = args.softmax_scale
        # sparse_attn's choices: implementation and precision
        self.kernels, self.kernels_interpret = args.kernels, args.kernels_interpret
        self.accumulate = resolve_attn_accumulate(args.attn_accumulate)
        self.f64_kernel = False  # set on the module to try the GPU kernel's float64 program
        self.kv_row_kernel = False  # set on the module to try the one-launch window-KV row
        self.is_index_source = args.is_index_source(layer_id)
        self.uses_candidates = args.uses_candidates(layer_id)
        self.is_candidate_source = args.is_candidate_source(layer_id)
        self.freqs = tuple(float(f) for f in layer_freqs(args, layer_id))
        lin = _linear_dtype(args)
        eps = args.norm_eps
        hd_all = self.n_heads * self.head_dim

        self.attn_sink = nnx.Param(jnp.zeros((self.n_heads,), _F32))
        kern = linear_kernels(args)
        self.wq_a = Linear(args.dim, args.q_lora_rank, lin, **kern)
        self.q_norm = RMSNorm(args.q_lora_rank, eps)
        self.wq_b = Linear(args.q_lora_rank, hd_all, lin, **kern)
        self.wkv = Linear(args.dim, self.head_dim, lin, **kern)
        self.kv_norm = RMSNorm(self.head_dim, eps)
        self.wo_a = Linear(hd_all // self.n_groups, self.n_groups * self.o_lora_rank, lin, **kern)
        self.wo_b = Linear(self.n_groups * self.o_lora_rank, args.dim, lin, **kern)
        # shared keys this layer reads (published by lower layers)
        self.reads = tuple(
            ([] if self.role in ("window", "source") else ["compress_kv"])
            + (["index_k"] if self.role == "reindex" else [])
            + (["topk"] if self.role == "reuse" else [])
            + (["candidates"] if self.uses_candidates else [])
        )
        self.compressor = Compressor(layer_id, args) if self.role == "source" else None
        self.indexer = Indexer(layer_id, args) if self.is_index_source else None

    def attn_block_sizes(self) -> SparseAttnBlockSizes | None:
        """`sparse_attn`'s options: its defaults, with `f64_kernel` when set (float64 requests
        then run the GPU kernel's float64 program instead of the jnp reference)."""
        return SparseAttnBlockSizes(f64_kernel=True) if self.f64_kernel else None

    # ------------------------------------------------------------------ stages

    def rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """cos, sin f32 [1, len, rd/2] of this layer's table at `positions` int [len]."""
        return _rope_at(np.asarray(self.freqs, np.float32), positions)

    def rope_rows(self, pos: jax.Array) -> tuple[jax.Array, jax.Array]:
        """cos, sin f32 [b, 1, rd/2] at one position per batch row, pos int [b]; pos int [b, c]
        (a span per row) gives [b, c, rd/2]."""
        pos = jnp.asarray(pos)
        return rope_angles(np.asarray(self.freqs, np.float32), pos[:, None] if pos.ndim == 1 else pos)

    def query_kv(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
                 pre_norm: tuple[jax.Array, RMSNorm] | None = None,
                 finish_kv: bool = True) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """x bf16 [b, s, dim] -> (q bf16 [b, s, H, hd] RoPE'd, qi bf16 [b, s, ih*ihd] or None,
        kv bf16 [b, s, hd]). qr = q_norm(wq_a(x)), q = wq_b(qr), qi = indexer.wq_b(qr) on index
        sources (both projections of qr in one kernel launch where the fp8 kernel runs, which
        applies q_norm to a single row itself: `apply_linears`); kv = kv_norm(wkv(x)), RoPE, then
        FP8 QDQ (32, UE8M0) over the whole vector, RoPE tail included. wq_a and wkv read the same
        x: one fp8 kernel launch (`layers.apply_linears`). pre_norm: (x before its norm, the norm)
        with x = norm(that): the launch then takes the row before the norm (and applies the norm
        itself to a single row). finish_kv False: kv is wkv's output, before kv_norm."""
        b, s, _ = x.shape
        if pre_norm is None:
            qa, kv = apply_linears(x, (self.wq_a, self.wkv))
        else:
            qa, kv = apply_linears(pre_norm[0], (self.wq_a, self.wkv), norm=pre_norm[1])
        if self.indexer is not None:
            q, qi = apply_linears(qa, (self.wq_b, self.indexer.wq_b), norm=self.q_norm)
        else:
            (q,), qi = apply_linears(qa, (self.wq_b,), norm=self.q_norm), None
        q = q.reshape(b, s, self.n_heads, self.head_dim)
        if not finish_kv:
            return apply_rope(q, cos, sin, self.rope_dim), qi, kv
        kv = apply_rope(self.kv_norm(kv), cos, sin, self.rope_dim)
        return apply_rope(q, cos, sin, self.rope_dim), qi, quant.act_quant_dequant(kv, QUANT_BLOCK)

    def compress_latent(self, latent: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """Pre-RoPE latent bf16 [b, n, hd] -> cached compressed KV: RoPE at the group starts
        (cos/sin [1, n, rd/2]), FP4 QDQ with E4M3 scales per 16."""
        return quant.fp4_quant_dequant_e4m3(apply_rope(latent, cos, sin, self.rope_dim), COMPRESSED_KV_BLOCK)

    def output(self, o: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """o bf16 [b, s, H, hd] -> bf16 [b, s, dim]: de-rotate, grouped low-rank wo_a, then wo_b."""
        b, s = o.shape[:2]
        o = apply_rope(o, cos, sin, self.rope_dim, inverse=True)
        o = to_bf16(o).reshape(b, s, self.n_groups, -1)
        # block-diagonal over groups: group g only sees its own heads. fp32 accumulation of exact
        # bf16 x bf16 products (an e4m3 weight times its power-of-two scale is exact in bf16, so
        # the fp8 matrix gives the reference's bf16 values), one rounding
        if self.wo_a.dtype == "fp8" and self.wo_b.dtype == "fp8" and self.wo_b.weight.ndim == 2:
            # (a single row: wo_b's launch adds wo_a's split partial sums itself)
            return fp8_matmul.grouped_linear(o, self.wo_a.weight[...], self.wo_a.scale[...], self.wo_b.weight[...],
                                             self.wo_b.scale[...], implementation=self.wo_a.kernels,
                                             interpret=self.wo_a.kernels_interpret)
        if self.wo_a.dtype == "fp8":
            y = fp8_matmul.grouped(o, self.wo_a.weight[...], self.wo_a.scale[...],
                                   implementation=self.wo_a.kernels, interpret=self.wo_a.kernels_interpret)
        else:  # a dtype="bf16" model
            y = fp8_reference.grouped_dense(o, self.wo_a.weight[...])
        return self.wo_b(y.reshape(b, s, self.n_groups * self.o_lora_rank))

    def compressed_prefill(self, x: jax.Array, qi: jax.Array | None, cos: jax.Array, sin: jax.Array,
                           shared: dict, aux: dict, lengths: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """The compressed branch of a prefill (SPEC §5.5-5.9). Updates `shared` / `aux` in place.
        Returns (compressed KV bf16 [b, S//r, hd], indices int32 [b, S, k], offset by S)."""
        b, s, _ = x.shape
        r = self.ratio
        n = s // r
        if self.role == "source":
            latent, kv_state, score_state = self.compressor(x, lengths)
            if kv_state is not None:
                aux["kv_state"], aux["score_state"] = kv_state, score_state
            gcos, gsin = self.rope(jnp.arange(n) * r)  # a latent sits at its group's first token
            # index keys come from the latent BEFORE it is rotated and quantised for the cache
            shared["index_k"] = aux["index_k"] = self.indexer.keys(latent, gcos, gsin)
            shared["compress_kv"] = aux["compress_kv"] = self.compress_latent(latent, gcos, gsin)
        compress_kv = _require(shared, "compress_kv", self.layer_id)
        if compress_kv.shape[1] != n:
            raise ValueError(f"layer {self.layer_id}: shared compress_kv has {compress_kv.shape[1]} rows, expected {n}")
        if self.is_index_source:
            if n == 0:
                topk = jnp.zeros((b, s, 0), jnp.int32)
            else:
                cand = _require(shared, "candidates", self.layer_id) if self.uses_candidates else None
                res = self.indexer.prefill(x, qi, _require(shared, "index_k", self.layer_id), cos, sin,
                                           offset=s, candidates=cand)
                topk = res["topk"]
                aux.update(res)
                if self.is_candidate_source:
                    shared["candidates"] = res["candidates"]
            shared["topk"] = aux["topk"] = topk
        topk = _require(shared, "topk", self.layer_id)
        return compress_kv, topk

    # ------------------------------------------------------------------ prefill

    def prefill_operands(self, x: jax.Array, shared: dict, lengths: jax.Array | None = None):
        """Everything `sparse_attn` takes for a prefill of positions 0..S-1.

        x bf16 [b, S, dim], lengths int [b] (real tokens per row, right padding; None: all S) ->
        (q bf16 [b, S, H, hd], kv bf16 [b, S + S//r, hd] (window KV then the compressed KV), idx
        int32 [b, S, min(S, window) + k] (window slots then compressed rows, already offset by S),
        shared (a new dict with this layer's publications), aux). Padding only ever feeds later
        positions (causality), so `lengths` changes just what is seeded for decode in aux.
        """
        b, s, _ = x.shape
        shared, aux = dict(shared), {}
        for key in self.reads:
            _require(shared, key, self.layer_id)
        cos, sin = self.rope(jnp.arange(s))
        q, qi, kv = self.query_kv(x, cos, sin)
        lens = jnp.full((b,), s, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
        aux["window_kv"] = seed_window(kv, lens, self.window)
        idx = jnp.broadcast_to(window_topk_idxs(self.window, s, 0)[None], (b, s, min(s, self.window)))
        if self.ratio:
            compress_kv, topk = self.compressed_prefill(x, qi, cos, sin, shared, aux, lengths)
            kv = jnp.concatenate([kv, compress_kv.astype(kv.dtype)], axis=1)
            idx = jnp.concatenate([idx, topk], axis=-1)
        return q, kv, idx, shared, aux

    def __call__(self, x: jax.Array, shared: dict, lengths: jax.Array | None = None) -> tuple[jax.Array, dict, dict]:
        """Prefill of positions 0..S-1. x bf16 [b, S, dim], shared (see module doc), lengths int
        [b] or None (see `prefill_operands`) -> (out bf16 [b, S, dim], shared updated with what
        this layer publishes, aux).

        aux: "window_kv" bf16 [b, window, hd] (the ring after prefill) and, where the layer has
        them, "compress_kv", "index_k", "kv_state", "score_state", "topk", "index_score",
        "candidates", "cand_block_score" (shapes as in the golden sets).
        """
        q, kv, idx, shared, aux = self.prefill_operands(x, shared, lengths)
        o = sparse_attn(q, kv, self.attn_sink[...], idx, self.softmax_scale, implementation=self.kernels,
                        accumulate=self.accumulate, interpret=self.kernels_interpret,
                        block_sizes=self.attn_block_sizes())
        cos, sin = self.rope(jnp.arange(x.shape[1]))
        return self.output(o, cos, sin), shared, aux

    def prefill(self, x: jax.Array, shared: dict, cache: dict, lengths: jax.Array):
        """A prefill that also seeds this layer's cache (`dsv41_jax.cache`) for decode.

        x bf16 [b, S, dim], lengths int32 [b] (1 <= L <= S) -> (out, shared, cache, aux) with
        out / shared / aux as `__call__`. Seeded: the ring from each row's last min(L, window)
        positions, compressed KV / index-key rows [0, S//r) (rows >= L//r are padding until the
        decode step that completes their group overwrites them), compressor states holding each
        row's L % r open-group tokens.
        """
        out, shared, aux = self(x, shared, lengths)
        cache = dict(cache)
        cache["window_kv"] = aux["window_kv"].astype(cache["window_kv"].dtype)
        if self.role == "source":
            cache["compress_kv"] = seed_rows(cache["compress_kv"], aux["compress_kv"])
            cache["index_k"] = seed_rows(cache["index_k"], aux["index_k"])
            if "kv_state" in aux:
                cache["kv_state"], cache["score_state"] = aux["kv_state"], aux["score_state"]
        return out, shared, cache, aux

    # ------------------------------------------------------------------ spans (chunked prefill)

    def chunk(self, x: jax.Array, shared: dict, cache: dict | None, start: jax.Array, lengths: jax.Array):
        """A span of queries per row at positions start[b] .. start[b]+c-1, the first lengths[b]
        real (0 <= L <= c), computing what a prefill of all positions computes there.

        x bf16 [b, c, dim]. With `cache` (this layer's entry of `dsv41_jax.cache`, holding each
        row's positions < start): a chunk of a chunked prefill. The queries attend over the ring
        plus the span's window KV and over the compressed rows of the kv source; a source layer
        first feeds the span to its compressor (carrying the open group over) and writes the
        completed groups' rows. Returns (out bf16 [b, c, dim], shared, cache, aux) with the ring,
        compressed rows and states of positions < start + L.

        cache None (decoder-half replay, SPEC §19.1): a layer that owns only window KV run on a
        suffix of a prefill; window positions before the span are not there, so only queries at
        P >= start + window - 1 (or all, where start = 0) are exact, and the returned cache entry
        holds the ring of positions < start + L.

        In `shared`, spans publish and read the cache's conventions ("compress_kv" / "index_k"
        whole row arrays, "index_k_owner") and per-query arrays of the span they were computed
        on: "topk" int32 [b, c', k] (compressed rows, no offset, -1 = none) with "topk_start"
        int32 [b] (the position of its first query row), "candidates" bool [b, c', N] with
        "candidates_start". A reader takes the rows of its own queries (`rows_at`).
        aux: "window_kv" (the ring) and, on index sources, the indexer's arrays at width N.
        """
        b, c, _ = x.shape
        history = cache is not None
        shared, cache, aux = dict(shared), dict(cache or {}), {}
        for key in self.reads:
            _require(shared, key, self.layer_id)
        start = jnp.asarray(start, jnp.int32)
        lengths = jnp.asarray(lengths, jnp.int32)
        pos = start[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]  # [b, c]
        cos, sin = self.rope_rows(pos)  # [b, c, rd/2]
        q, qi, kv = self.query_kv(x, cos, sin)
        ring = cache["window_kv"] if history else jnp.zeros((b, self.window, kv.shape[-1]), kv.dtype)
        cache["window_kv"] = aux["window_kv"] = update_window(ring, kv, start, start + lengths)
        keys = jnp.concatenate([ring.astype(kv.dtype), kv], axis=1) if history else kv
        idx = span_window_idxs(self.window, c, start, history)
        if self.ratio:
            rows, topk = self.compressed_chunk(x, qi, cos, sin, pos, start, lengths, shared, cache, aux)
            offset = keys.shape[1]
            keys = jnp.concatenate([keys, rows.astype(kv.dtype)], axis=1)
            idx = jnp.concatenate([idx, jnp.where(topk >= 0, topk + offset, -1)], axis=-1)
        o = sparse_attn(q, keys, self.attn_sink[...], idx, self.softmax_scale, implementation=self.kernels,
                        accumulate=self.accumulate, interpret=self.kernels_interpret,
                        block_sizes=self.attn_block_sizes())
        return self.output(o, cos, sin), shared, cache, aux

    def compressed_chunk(self, x, qi, cos, sin, pos, start, lengths, shared: dict, cache: dict, aux: dict):
        """The compressed branch of a span. Updates shared / cache / aux in place. Returns
        (compressed rows bf16 [b, N, hd] of the kv source, chosen rows int32 [b, c, k], -1 = none)."""
        c = x.shape[1]
        if self.role == "source":
            r = self.ratio
            latent, complete, states = self.compressor.chunk(x, cache.get("kv_state"), cache.get("score_state"),
                                                             start, lengths)
            if states is not None:
                cache["kv_state"], cache["score_state"] = states
            group = (start // r)[:, None] + jnp.arange(latent.shape[1], dtype=jnp.int32)[None, :]  # [b, G]
            gcos, gsin = self.rope_rows(group * r)  # a group's first token
            # index keys come from the latent BEFORE it is rotated and quantised for the cache
            cache["index_k"] = write_rows(cache["index_k"], group, self.indexer.keys(latent, gcos, gsin), complete)
            cache["compress_kv"] = write_rows(cache["compress_kv"], group, self.compress_latent(latent, gcos, gsin),
                                              complete)
            shared["compress_kv"], shared["index_k"] = cache["compress_kv"], cache["index_k"]
            shared["index_k_owner"] = jnp.full(start.shape, self.layer_id, jnp.int32)
        rows = _require(shared, "compress_kv", self.layer_id)
        if self.is_index_source:
            cand = None
            if self.uses_candidates:
                cand = rows_at(_require(shared, "candidates", self.layer_id), shared["candidates_start"], start, c)
            res = self.indexer.chunk(x, qi, _require(shared, "index_k", self.layer_id), cos, sin, pos, cand)
            aux.update(res)
            if self.is_candidate_source:
                shared["candidates"], shared["candidates_start"] = res["candidates"], start
            shared["topk"], shared["topk_start"] = res["topk"], start
        return rows, rows_at(_require(shared, "topk", self.layer_id), shared["topk_start"], start, c)

    # ------------------------------------------------------------------ decode

    def decode(self, x: jax.Array, shared: dict, cache: dict, pos: jax.Array,
               reference_compat: bool | jax.Array = False, context_bound: int | None = None,
               pre_norm: tuple[jax.Array, RMSNorm] | None = None):
        """One new token per row at its own position. x bf16 [b, 1, dim], pos int32 [b], cache =
        this layer's entry of `dsv41_jax.cache` -> (out bf16 [b, 1, dim], shared, cache, aux).
        context_bound: see `Indexer.decode` (same results; less index scoring when it is small).
        pre_norm: (the row before the block's attention norm, that norm), x being its output:
        wq_a and wkv then take the row before the norm (`query_kv`).

        The token's window KV goes into ring slot pos % window and the query attends over the
        whole ring (slots holding positions > pos are -1), then over the selected compressed rows
        (indices offset by the window length). `reference_compat` (Python bool, or a traced bool
        scalar): see `publish_index_k`.
        aux: "topk" int32 [b, 1, k], "index_score" bf16 [b, 1, N], "index_k_owner" int32 [b] on
        index sources; "candidates" bool [b, 1, N], "cand_block_score" on the candidate source.
        """
        shared, cache, aux = dict(shared), dict(cache), {}
        for key in self.reads:
            _require(shared, key, self.layer_id)
        pos = jnp.asarray(pos, jnp.int32)
        cos, sin = self.rope_rows(pos)
        q, qi, kv = self.query_kv(x, cos, sin, pre_norm, finish_kv=not self.kv_row_kernel)
        if self.kv_row_kernel:  # kv is wkv's row: kv_norm, RoPE, QDQ and the write in one launch
            ring = write_window_row(cache["window_kv"], pos % self.window, kv[:, 0], self.kv_norm.weight[...],
                                    self.kv_norm.eps, cos[:, 0], sin[:, 0], self.rope_dim,
                                    implementation=self.kernels, interpret=self.kernels_interpret)
        else:
            ring = write_row(cache["window_kv"], pos % self.window, kv[:, 0])
        cache["window_kv"] = ring
        kv = ring
        idx = jax.vmap(lambda p: window_topk_idxs(self.window, 1, p))(pos)  # [b, 1, window]
        if self.ratio:
            rows, topk = self.compressed_decode(x, qi, cos, sin, pos, shared, cache, aux, reference_compat,
                                                context_bound)
            # gather the chosen rows (ascending, -1 last) instead of concatenating the whole cache;
            # sparse_attn sees the same vectors in the same order
            k = topk.shape[-1]
            chosen = jnp.take_along_axis(rows, jnp.maximum(topk[:, 0] - self.window, 0)[:, :, None], axis=1)
            kv = jnp.concatenate([ring, chosen.astype(ring.dtype)], axis=1)
            local = jnp.where(topk >= 0, self.window + jnp.arange(k, dtype=jnp.int32), -1)
            idx = jnp.concatenate([idx, local], axis=-1)
        o = sparse_attn(q, kv, self.attn_sink[...], idx, self.softmax_scale, implementation=self.kernels,
                        accumulate=self.accumulate, interpret=self.kernels_interpret,
                        block_sizes=self.attn_block_sizes())
        return self.output(o, cos, sin), shared, cache, aux

    def compressed_decode(self, x: jax.Array, qi: jax.Array | None, cos: jax.Array, sin: jax.Array, pos: jax.Array,
                          shared: dict, cache: dict, aux: dict, reference_compat,
                          context_bound: int | None = None) -> tuple[jax.Array, jax.Array]:
        """The compressed branch of a decode step. Updates shared / cache / aux in place. Returns
        (compressed KV cache bf16 [b, N, hd] of the kv source, indices int32 [b, 1, k] offset by
        the window length)."""
        if self.role == "source":
            self._compress_token(x, pos, shared, cache, reference_compat)
        rows = _require(shared, "compress_kv", self.layer_id)
        if self.is_index_source:
            index_k, owner = read_index_k(shared, rows.shape[1], self.layer_id)
            cand = _require(shared, "candidates", self.layer_id) if self.uses_candidates else None
            res = self.indexer.decode(x, qi, index_k, cos, sin, pos, offset=self.window, candidates=cand,
                                      context_bound=context_bound)
            aux.update(res)
            aux["index_k_owner"] = owner
            if self.is_candidate_source:
                shared["candidates"] = res["candidates"]
            shared["topk"] = res["topk"]
        return rows, _require(shared, "topk", self.layer_id)

    def _compress_token(self, x: jax.Array, pos: jax.Array, shared: dict, cache: dict, reference_compat) -> None:
        """Source layers: feed the token to the compressor; where it closes a group, write the
        latent (RoPE'd at the group start pos + 1 - r) to compressed-KV row pos // r and its index
        key to the same index-key row; publish both caches."""
        r = self.ratio
        latent, states, closes = self.compressor.decode(x, cache.get("kv_state"), cache.get("score_state"), pos)
        if states is not None:
            cache["kv_state"], cache["score_state"] = states
        gcos, gsin = self.rope_rows(pos + 1 - r)
        row = pos // r
        # index keys come from the latent BEFORE it is rotated and quantised for the cache
        cache["index_k"] = write_row(cache["index_k"], row, self.indexer.keys(latent, gcos, gsin)[:, 0], closes)
        cache["compress_kv"] = write_row(cache["compress_kv"], row, self.compress_latent(latent, gcos, gsin)[:, 0], closes)
        shared["compress_kv"] = cache["compress_kv"]
        publish_index_k(shared, cache["index_k"], self.layer_id, closes, reference_compat)


def rows_at(arr: jax.Array, arr_start: jax.Array, start: jax.Array, c: int) -> jax.Array:
    """The query rows of positions start[b] .. start[b]+c-1 from a per-query array arr [b, c', ...]
    whose row 0 is position arr_start[b] (the span it was computed on contains this one)."""
    take = (start - arr_start)[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]
    take = take.reshape(take.shape + (1,) * (arr.ndim - 2))
    return jnp.take_along_axis(arr, jnp.clip(take, 0, arr.shape[1] - 1), axis=1)


# ------------------------------------------------------------------ index-key hand-off (decode)


def publish_index_k(shared: dict, own: jax.Array, layer_id: int, closes: jax.Array | None, reference_compat) -> None:
    """An index-key owner publishes its cache as shared["index_k"] (and its id, per row, as
    shared["index_k_owner"]).

    Default: always (every owner's indexer scores its own keys). reference_compat: only on rows
    where a latent was produced this step (`closes`; None = every step, ratio 1), as the reference
    does (SPEC §21); other rows keep the pointer already in `shared` - at the first owner of a
    call that is the previous call's last publisher (`previous_call_index_k_owner`), which the
    caller seeds. A traced `reference_compat` selects between the two per call.
    """
    b = own.shape[0]
    mine = jnp.full((b,), layer_id, jnp.int32)
    if closes is None or reference_compat is False:
        shared["index_k"], shared["index_k_owner"] = own, mine
        return
    if "index_k" not in shared:
        raise ValueError(
            f"layer {layer_id}: reference_compat needs shared['index_k'] / ['index_k_owner'] seeded with the index-key "
            "cache the previous call published last (see previous_call_index_k_owner)"
        )
    prev, prev_owner = shared["index_k"], shared["index_k_owner"]
    if prev.shape[1] < own.shape[1]:
        raise NotImplementedError(
            f"reference_compat: layer {layer_id} would fall back to an index-key cache of {prev.shape[1]} rows, fewer "
            f"than its own {own.shape[1]}; the reference's behaviour for this config is not defined"
        )
    keep = closes if reference_compat is True else closes | ~jnp.asarray(reference_compat, bool)
    shared["index_k"] = jnp.where(keep[:, None, None], own, prev[:, : own.shape[1]])
    shared["index_k_owner"] = jnp.where(keep, mine, prev_owner)


def read_index_k(shared: dict, width: int, layer_id: int) -> tuple[jax.Array, jax.Array]:
    """The first `width` rows of the published index keys, bf16 [b, width, ihd], and their owner
    int32 [b]. Only the first (pos + 1) // r of them are visible to row b."""
    keys = _require(shared, "index_k", layer_id)
    if keys.shape[1] < width:
        raise NotImplementedError(
            f"layer {layer_id} reads {width} index-key rows but the published cache has {keys.shape[1]} "
            "(reference_compat fallback to a coarser owner); the reference's behaviour for this config is not defined"
        )
    return keys[:, :width], _require(shared, "index_k_owner", layer_id)


def previous_call_index_k_owner(args: ModelArgs) -> int:
    """The layer whose index-key cache the reference's shared pointer holds when a decode call
    starts: the last index-key owner that published in the previous call.

    Well defined only when the last kv source has ratio 1: it produces a latent (and publishes)
    in every call, prefill or decode, so it is the previous call's last publisher whatever the
    positions. Otherwise it depends on the position history, and NotImplementedError is raised.
    """
    last = args.kv_source_layers[-1]
    if args.compress_ratios[last] != 1:
        raise NotImplementedError(
            f"reference_compat: the last kv source, layer {last}, has compress ratio {args.compress_ratios[last]}; "
            "which index-key cache the reference's decode falls back to then depends on the previous positions, "
            "which this port does not reproduce"
        )
    return last
