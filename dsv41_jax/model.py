"""The V4.1 text model: `Block` and `Transformer` (SPEC §2, §4.6), mirroring the reference tree.

Tree paths equal the reference parameter names: `embed.weight`, `layers.{i}.attn.wq_a.weight`,
`layers.{i}.hc_attn_fn`, `layers.{i}.engram.embed.weight`, `norm.weight`, `head.weight`, ...;
routed experts are stacked (`layers.{i}.ffn.experts.w1.weight[e]`, see `dsv41_jax.loading`).

Cross-layer sharing (compressed KV, index keys, top-k, candidates) is a plain dict handed up the
stack; which layer reads or writes what is decided by static per-layer facts of `ModelArgs`, so
the whole forward traces once under `jax.jit`.

Generation: `Transformer.prefill(ids, lengths, cache)` runs right-padded prompts and seeds the
caches of `dsv41_jax.cache`; `Transformer.prefill_chunk(ids, start, lengths, cache)` adds a chunk
of tokens per row onto a cache (chunked prefill, equal to one prefill of all the tokens);
`Transformer.decode_step(ids, pos, cache)` adds one token per row, each row at its own position.
All are pure functions of (model, arrays), one trace per shape. Prefill runs the layers above the
last kv source only on the dependency cone of what decode needs (SPEC §19.1, `replay_width`);
`replay=False` runs them everywhere, with the same results.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.attention import Attention, previous_call_index_k_owner, rows_at
from dsv41_jax.cache import cache_max_seq_len
from dsv41_jax.config import ModelArgs
from dsv41_jax.engram import Engram, EngramLayout, engram_hash
from dsv41_jax.layers import Embedding, Linear, RMSNorm
from dsv41_jax.mhc import hc_mixes, hc_post_pre, hc_pre, identity_pre_mix
from dsv41_jax.moe import MoE


class TokenMap(nnx.Variable):
    """A non-trainable input artifact carried with the model (the Engram compressed-token map)."""


class Block(nnx.Module):
    """One layer: hyper-connected attention then MoE, with the delayed pre-mix hand-off (§4.6).

    Params: attn, ffn, attn_norm, ffn_norm, hc_{attn,ffn}_{fn [24, hc*dim], base [24], scale [3]}
    (f32), and `engram` on Engram layers (applied by the Transformer before the block).
    """

    def __init__(self, layer_id: int, args: ModelArgs):
        self.layer_id = layer_id
        self.args = args
        hc, dim = args.hc_mult, args.dim
        mix = (2 + hc) * hc
        self.attn = Attention(layer_id, args)
        self.ffn = MoE(layer_id, args)
        self.engram = Engram(layer_id, args) if args.engram_table_index(layer_id) is not None else None
        self.attn_norm = RMSNorm(dim, args.norm_eps)
        self.ffn_norm = RMSNorm(dim, args.norm_eps)
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nnx.Param(jnp.zeros((mix, hc * dim), jnp.float32)))
            setattr(self, f"hc_{site}_base", nnx.Param(jnp.zeros((mix,), jnp.float32)))
            setattr(self, f"hc_{site}_scale", nnx.Param(jnp.zeros((3,), jnp.float32)))

    def _mixes(self, x, site: str):
        a = self.args
        return hc_mixes(
            x, getattr(self, f"hc_{site}_fn")[...], getattr(self, f"hc_{site}_scale")[...],
            getattr(self, f"hc_{site}_base")[...], norm_eps=a.norm_eps, iters=a.hc_sinkhorn_iters, hc_eps=a.hc_eps,
            implementation=a.kernels, interpret=a.kernels_interpret,
        )

    def _forward(self, x: jax.Array, pre_mix: jax.Array, image_mask: jax.Array | None, attend,
                 collapsed: jax.Array | None):
        """The block around an attention call `attend(attn_norm(h), h) -> (out, extra)` (h: the
        collapsed input before its norm); returns (x, this block's FFN pre-mix, hc_pre(x, that
        pre-mix), extra, MoE aux). `collapsed`, when given, is hc_pre(x, pre_mix) (the previous
        block's third result; `mhc.hc_post_pre`)."""
        residual = x
        attn_pre, attn_post, attn_comb = self._mixes(x, "attn")
        h = hc_pre(x, pre_mix) if collapsed is None else collapsed
        h, extra = attend(self.attn_norm(h), h)
        x, h = hc_post_pre(h, residual, attn_post, attn_comb, attn_pre)

        residual = x
        ffn_pre, ffn_post, ffn_comb = self._mixes(x, "ffn")
        h, moe_aux = self.ffn(h, image_mask, norm=self.ffn_norm)
        x, collapsed = hc_post_pre(h, residual, ffn_post, ffn_comb, ffn_pre)
        return x, ffn_pre, collapsed, extra, moe_aux

    def __call__(self, x: jax.Array, pre_mix: jax.Array, shared: dict, image_mask: jax.Array | None, *,
                 collapsed: jax.Array | None = None):
        """Prefill without caches. x [b, s, hc, d] bf16, pre_mix [b, s, hc] f32 (from the previous
        block's FFN mixes); collapsed: hc_pre(x, pre_mix) [b, s, d] bf16 when the caller has it
        (the previous block's last result), else formed here.

        Returns (x [b, s, hc, d] bf16, this block's FFN `pre` [b, s, hc] f32, shared, aux,
        hc_pre(x, pre) [b, s, d] bf16: the next block's `collapsed`).
        """
        def attend(h, _):
            out, new_shared, aux = self.attn(h, shared)
            return out, (new_shared, aux)

        x, pre, nxt, (shared, aux), moe_aux = self._forward(x, pre_mix, image_mask, attend, collapsed)
        return x, pre, shared, {**aux, **moe_aux}, nxt

    def prefill(self, x: jax.Array, pre_mix: jax.Array, shared: dict, image_mask: jax.Array | None,
                cache: dict, lengths: jax.Array, *, collapsed: jax.Array | None = None):
        """`__call__` that also seeds this layer's cache (see `Attention.prefill`); lengths int32
        [b]. Returns (x, pre, shared, cache, aux, next collapsed)."""
        def attend(h, _):
            out, new_shared, new_cache, aux = self.attn.prefill(h, shared, cache, lengths)
            return out, (new_shared, new_cache, aux)

        x, pre, nxt, (shared, cache, aux), moe_aux = self._forward(x, pre_mix, image_mask, attend, collapsed)
        return x, pre, shared, cache, {**aux, **moe_aux}, nxt

    def chunk(self, x: jax.Array, pre_mix: jax.Array, shared: dict, image_mask: jax.Array | None,
              cache: dict | None, start: jax.Array, lengths: jax.Array, *, collapsed: jax.Array | None = None):
        """A span of positions start[b] .. start[b]+c-1 per row (see `Attention.chunk`): x
        [b, c, hc, d], pre_mix [b, c, hc], image_mask [b, c] or None, cache = this layer's entry
        (None: decoder-half replay). Returns (x, pre, shared, cache, aux, next collapsed)."""
        def attend(h, _):
            out, new_shared, new_cache, aux = self.attn.chunk(h, shared, cache, start, lengths)
            return out, (new_shared, new_cache, aux)

        x, pre, nxt, (shared, cache, aux), moe_aux = self._forward(x, pre_mix, image_mask, attend, collapsed)
        return x, pre, shared, cache, {**aux, **moe_aux}, nxt

    def decode(self, x: jax.Array, pre_mix: jax.Array, shared: dict, cache: dict, pos: jax.Array,
               reference_compat: bool | jax.Array = False, context_bound: int | None = None, *,
               collapsed: jax.Array | None = None):
        """One token per row: x [b, 1, hc, d], pre_mix [b, 1, hc], pos int32 [b], cache = this
        layer's entry. Returns (x, pre, shared, cache, aux, next collapsed); see `Attention.decode`."""
        def attend(h, raw):  # the fp8 projections of a single row apply attn_norm themselves
            out, new_shared, new_cache, aux = self.attn.decode(h, shared, cache, pos, reference_compat, context_bound,
                                                               pre_norm=(raw, self.attn_norm))
            return out, (new_shared, new_cache, aux)

        x, pre, nxt, (shared, cache, aux), moe_aux = self._forward(x, pre_mix, None, attend, collapsed)
        return x, pre, shared, cache, {**aux, **moe_aux}, nxt


# aux names that differ from the golden arrays' names
_GOLDEN_NAMES = {"kv_state": "compressor_kv_state", "score_state": "compressor_score_state"}


def head_logits(h: jax.Array, w: jax.Array) -> jax.Array:
    """h bf16 [..., dim], w bf16 [V, dim] -> logits f32 [..., V] (SPEC §8).

    The reference widens both to fp32 (its head parameter is fp32 holding the hub's bf16 values)
    and multiplies in fp32: every product of two bf16 values is exact in fp32, so one bf16 dot
    with fp32 accumulation forms the same sum, while reading half the bytes of an fp32 weight
    and running at the bf16 matmul rate."""
    if h.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise TypeError(f"head_logits takes bf16 operands, got h {h.dtype} and head.weight {w.dtype}")
    return jax.lax.dot_general(h, w, (((h.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


class Transformer(nnx.Module):
    """embed -> hc copies -> (Engram) + blocks -> collapse with the last FFN pre-mix -> norm -> head."""

    def __init__(self, args: ModelArgs):
        self.args = args
        self.embed = Embedding(args.vocab_size, args.dim)
        self.layers = nnx.List([Block(i, args) for i in range(args.n_layers)])
        self.norm = RMSNorm(args.dim, args.norm_eps)
        # bf16 in the checkpoint and kept so (the reference widens it to fp32: see `head_logits`)
        self.head = Linear(args.dim, args.vocab_size, dtype="bf16")
        self.engram_layout = EngramLayout.from_args(args) if args.engram_layer_ids else None
        self.token_map = TokenMap(jnp.arange(args.vocab_size, dtype=jnp.int32)) if args.engram_layer_ids else None

    def __call__(self, ids: jax.Array, token_types: jax.Array | None = None, embeds: jax.Array | None = None,
                 *, all_logits: bool = False, collect: bool = False):
        """Prefill of whole prompts (start_pos 0), without caches.

        ids [b, s] int; token_types [b, s] int (-1 text, >= 0 image span) or None; embeds [b, s, d]
        bf16 replaces the embedding rows (image spans carry the vision tower's features).
        Returns logits f32 [b, V] (last position) or [b, s, V] with all_logits; with collect,
        also a dict of per-layer intermediates keyed like the golden arrays.
        """
        b = ids.shape[0]
        image_mask, engram_mask = _masks(token_types)
        hashes = None
        if self.engram_layout is not None:
            history = jnp.zeros((b, self.args.max_seq_len), jnp.int32)
            hashes, _ = engram_hash(ids, 0, history, engram_mask, self.engram_layout, self.token_map[...])
        shared: dict = {}

        def step(layer, x, pre_mix, collapsed):
            nonlocal shared
            x, pre_mix, shared, aux, collapsed = layer(x, pre_mix, shared, image_mask, collapsed=collapsed)
            return x, pre_mix, collapsed, aux

        record = {}
        x, pre_mix = self._stack(self._embed(ids, embeds), hashes, engram_mask, step, record if collect else None)
        logits = self.logits(x, pre_mix, all_logits=all_logits)
        return (logits, record) if collect else logits

    def prefill(self, ids: jax.Array, lengths: jax.Array | None, cache: dict, token_types: jax.Array | None = None,
                embeds: jax.Array | None = None, *, collect: bool = False, replay: bool = True):
        """Prefill of right-padded prompts, seeding `cache` (`dsv41_jax.cache.init_cache`).

        ids int [b, S] (row b real in [0, lengths[b]), anything after), lengths int32 [b] with
        1 <= L <= S (None: all S), token_types / embeds as `__call__`. Positions past a row's
        length never reach its real positions (every path is causal) and what they leave in the
        cache is overwritten before a decode step can see it.

        replay (default True; exact, SPEC §19.1): the layers above the last kv source own only
        window KV, so they run only on each row's last min(L, `replay_width`) positions, the
        dependency cone of the last position's logits and of the window rings decode reads.
        False runs every layer on all S positions. Both compute the same operations per position:
        bit-identical logits and caches on the golden configs (tests/test_replay.py); a reduced-width
        40-layer run at S = 4096 on CPU differed by 8.4e-5 in the logits (1.3% of RMS): the
        hyper-connection mixes round by 1 ulp differently depending on the row count there
        (benchmarks/README.md).
        Returns (logits f32 [b, V] at each row's last real position, cache with seq_len =
        lengths), plus the golden-keyed intermediates with collect (with replay, the arrays of
        the replayed layers cover their suffix only: [b, width, ...]).
        """
        a = self.args
        b, s = ids.shape
        t = cache_max_seq_len(cache)
        if t is not None and s > t:
            raise ValueError(f"prefill of {s} positions does not fit a cache of max_seq_len {t}")
        lengths = jnp.full((b,), s, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
        _check_lengths(lengths, s)
        image_mask, engram_mask = _masks(token_types)
        cache = dict(cache)
        hashes = None
        if self.engram_layout is not None:
            hashes, cache["engram_history"] = engram_hash(
                ids, 0, cache["engram_history"], engram_mask, self.engram_layout, self.token_map[...])
        shared: dict = {}
        layers = list(cache["layers"])
        first_replayed = replay_start(a) if replay else a.n_layers
        span_start = jnp.zeros((b,), jnp.int32)  # position of the stream's row 0, per row

        def narrow(i, x, pre_mix, hashes, emask):
            """Before a replayed layer: keep each row's suffix of that layer's width."""
            nonlocal shared, span_start, image_mask
            if i < first_replayed:
                return x, pre_mix, hashes, emask
            if i == first_replayed:
                shared = _span_shared(shared, s)
            width = replay_width(a, i, s)
            st = jnp.maximum(lengths - width, 0)

            def take(v):
                return None if v is None else rows_at(v, span_start, st, width)

            x, pre_mix, hashes, emask, image_mask = take(x), take(pre_mix), take(hashes), take(emask), take(image_mask)
            span_start = st
            return x, pre_mix, hashes, emask

        def step(layer, x, pre_mix, collapsed):
            nonlocal shared
            i = layer.layer_id
            if i >= first_replayed:
                x, pre_mix, shared, ring, aux, collapsed = layer.chunk(
                    x, pre_mix, shared, image_mask, None, span_start, lengths - span_start, collapsed=collapsed)
                layers[i] = {**layers[i], "window_kv": ring["window_kv"].astype(layers[i]["window_kv"].dtype)}
                return x, pre_mix, collapsed, aux
            x, pre_mix, shared, layers[i], aux, collapsed = layer.prefill(x, pre_mix, shared, image_mask, layers[i],
                                                                          lengths, collapsed=collapsed)
            if self.args.is_index_source(i):
                aux["index_k_owner"] = jnp.asarray(self.args.kv_source_of(i), jnp.int32)  # every owner publishes
            return x, pre_mix, collapsed, aux

        record = {} if collect else None
        if collect and hashes is not None:
            record["engram_hashes"] = hashes
        x, pre_mix = self._stack(self._embed(ids, embeds), hashes, engram_mask, step, record, narrow)
        rows = jnp.arange(b)
        last = lengths - 1 - span_start
        logits = self.logits(x[rows, last][:, None], pre_mix[rows, last][:, None])
        cache["layers"], cache["seq_len"] = layers, lengths
        return (logits, cache, record) if collect else (logits, cache)

    def prefill_chunk(self, ids: jax.Array, start: jax.Array, lengths: jax.Array | None, cache: dict,
                      token_types: jax.Array | None = None, embeds: jax.Array | None = None, *,
                      collect: bool = False):
        """One chunk of a chunked prefill: row b adds its tokens ids[b, :lengths[b]] at positions
        start[b] .. onto a cache holding its first start[b] positions (`prefill`, or earlier
        chunks; start 0 on a fresh cache is a prefill). Chunks of any sizes, boundaries anywhere
        (inside compressor groups too), compute what one prefill of all the tokens computes: the
        queries attend over the window ring plus the chunk and over the cached compressed rows,
        and source layers carry their compressor's open group over.

        ids int [b, c] (right-padded), start int32 [b] (each row's cache["seq_len"]), lengths
        int32 [b] with 0 <= L <= c (None: all c; 0 leaves the row unchanged), start + L <=
        max_seq_len; token_types / embeds [b, c(, d)] as `prefill`.
        Returns (logits f32 [b, V] at each row's last real position of the chunk (rows with L = 0:
        meaningless), cache with seq_len = start + lengths), plus per-layer intermediates with
        collect (aux arrays at the chunk's shapes: topk holds compressed rows, not offsets).
        """
        b, c = ids.shape
        start = jnp.asarray(start, jnp.int32)
        lengths = jnp.full((b,), c, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
        _check_chunk(start, lengths, c, cache_max_seq_len(cache))
        image_mask, engram_mask = _masks(token_types)
        cache = dict(cache)
        hashes = None
        if self.engram_layout is not None:
            hashes, cache["engram_history"] = self.chunk_hashes(ids, start, cache["engram_history"], engram_mask)
        shared: dict = {}
        layers = list(cache["layers"])

        def step(layer, x, pre_mix, collapsed):
            nonlocal shared
            i = layer.layer_id
            x, pre_mix, shared, layers[i], aux, collapsed = layer.chunk(x, pre_mix, shared, image_mask, layers[i],
                                                                        start, lengths, collapsed=collapsed)
            return x, pre_mix, collapsed, aux

        record = {} if collect else None
        if collect and hashes is not None:
            record["engram_hashes"] = hashes
        x, pre_mix = self._stack(self._embed(ids, embeds), hashes, engram_mask, step, record)
        rows, last = jnp.arange(b), jnp.maximum(lengths - 1, 0)
        logits = self.logits(x[rows, last][:, None], pre_mix[rows, last][:, None])
        cache["layers"], cache["seq_len"] = layers, start + lengths
        return (logits, cache, record) if collect else (logits, cache)

    def chunk_hashes(self, ids: jax.Array, start: jax.Array, history: jax.Array, mask: jax.Array | None):
        """Engram hashes of a chunk per row at its own start: int32 [b, c, n_tables, cols], and the
        history with positions start[b] .. start[b]+c-1 written (those past max_seq_len, only ever
        padding, are dropped)."""
        b, c = ids.shape
        t = history.shape[1]
        # c spare columns, so that a padded chunk ending past max_seq_len still writes in place
        padded = jnp.concatenate([history, jnp.full((b, c), -1, history.dtype)], axis=1)
        m = jnp.ones((b, c), bool) if mask is None else mask

        def one(i, p, h, mk):
            rows, h = engram_hash(i[None], p, h[None], None if mask is None else mk[None], self.engram_layout,
                                  self.token_map[...])
            return rows[0], h[0]

        hashes, padded = jax.vmap(one)(ids, start, padded, m)
        return hashes, padded[:, :t]

    def decode_step(self, ids: jax.Array, pos: jax.Array, cache: dict, *, reference_compat: bool = False,
                    collect: bool = False, context_bound: int | None = None):
        """One new token per row. ids int [b], pos int32 [b] (its position: row b holds pos[b]
        tokens, e.g. cache["seq_len"]; pos < max_seq_len), cache from `prefill` or a previous step.

        reference_compat=False (default): every index-key owner scores its own keys, so a decode
        step computes what a prefill of the whole sequence computes. True: reproduce the official
        decode's index-key hand-off (SPEC §21), where a ratio-r owner whose group is still open
        scores the keys the previous call published last; raises NotImplementedError for configs
        where that is not a fixed layer (`previous_call_index_k_owner`).
        context_bound (static int or None): a promise that every pos < context_bound. The indexers
        then score only the cached rows such positions can see instead of all max_seq_len // r
        (same results; one compiled step per bound, see `Generator`). A broken promise gives
        wrong results, not an error.
        Returns (logits f32 [b, V], cache with seq_len = pos + 1), plus intermediates with collect.
        """
        a = self.args
        (b,) = ids.shape
        pos = jnp.asarray(pos, jnp.int32)
        cache = dict(cache)
        hashes = None
        if self.engram_layout is not None:
            hashes, cache["engram_history"] = self.decode_hashes(ids, pos, cache["engram_history"])
        shared: dict = {}
        if reference_compat:
            owner = previous_call_index_k_owner(a)
            shared["index_k"] = cache["layers"][owner]["index_k"]
            shared["index_k_owner"] = jnp.full((b,), owner, jnp.int32)
        layers = list(cache["layers"])

        def step(layer, x, pre_mix, collapsed):
            nonlocal shared
            i = layer.layer_id
            x, pre_mix, shared, layers[i], aux, collapsed = layer.decode(
                x, pre_mix, shared, layers[i], pos, reference_compat, context_bound, collapsed=collapsed)
            return x, pre_mix, collapsed, aux

        record = {} if collect else None
        if collect and hashes is not None:
            record["engram_hashes"] = hashes
        x, pre_mix = self._stack(self._embed(ids[:, None], None), hashes, None, step, record)
        logits = self.logits(x, pre_mix)
        cache["layers"], cache["seq_len"] = layers, pos + 1
        return (logits, cache, record) if collect else (logits, cache)

    def decode_hashes(self, ids: jax.Array, pos: jax.Array, history: jax.Array):
        """Engram hashes of one token per row at per-row positions: int32 [b, 1, n_tables, cols]
        and the history with position pos[b] of row b written."""
        def one(i, p, h):
            rows, h = engram_hash(i[None, None], p, h[None], None, self.engram_layout, self.token_map[...])
            return rows[0], h[0]

        return jax.vmap(one)(ids, pos, history)

    def _embed(self, ids: jax.Array, embeds: jax.Array | None) -> jax.Array:
        """Token embeddings (or the given rows) as the hc copies of the stream, [b, s, hc, d]."""
        a = self.args
        h = self.embed(ids) if embeds is None else embeds.astype(jnp.bfloat16)
        return jnp.broadcast_to(h[:, :, None, :], (*h.shape[:2], a.hc_mult, a.dim))

    def _stack(self, x: jax.Array, hashes: jax.Array | None, engram_mask: jax.Array | None, step,
               record: dict | None, narrow=None) -> tuple[jax.Array, jax.Array]:
        """Engram + blocks over the stream x [b, s, hc, d], starting from the identity pre-mix;
        `step(layer, x, pre_mix, collapsed) -> (x, pre_mix, collapsed, aux)` runs one block, where
        `collapsed` is hc_pre(x, pre_mix) as the previous block formed it, or None where x has
        changed since (an Engram, `narrow`); `narrow(i, x, pre_mix, hashes, engram_mask)`, when
        given, may replace those four before block i (replay). Returns the final (x, pre_mix);
        fills `record` (golden key names) when given."""
        a = self.args
        b, s = x.shape[:2]
        pre_mix = identity_pre_mix(b, s, a.hc_mult)
        collapsed = None
        for i, layer in enumerate(self.layers):
            tag = f"L{i:02d}"
            if narrow is not None:
                narrowed = narrow(i, x, pre_mix, hashes, engram_mask)
                if narrowed[0] is not x or narrowed[1] is not pre_mix:
                    collapsed = None
                x, pre_mix, hashes, engram_mask = narrowed
            with jax.named_scope(f"layer_{i}"):
                if layer.engram is not None:
                    x, collapsed = layer.engram(x, hashes[:, :, a.engram_table_index(i), :], engram_mask), None
                    if record is not None:
                        record[f"engram_out.{tag}"] = x
                x, pre_mix, collapsed, aux = step(layer, x, pre_mix, collapsed)
            if record is not None:
                record[f"block_out.{tag}"] = x
                record[f"block_premix.{tag}"] = pre_mix
                record.update({f"{_GOLDEN_NAMES.get(k, k)}.{tag}": v for k, v in aux.items()})
        return x, pre_mix

    def logits(self, x: jax.Array, pre_mix: jax.Array, *, all_logits: bool = False) -> jax.Array:
        """Final collapse (last block's FFN pre-mix), norm, head (bf16 weights, fp32 logits). x [b, s, hc, d]."""
        if not all_logits:  # per token: collapse and norm the last position only
            x, pre_mix = x[:, -1], pre_mix[:, -1]
        return head_logits(self.norm(hc_pre(x, pre_mix)), self.head.weight[...])


def replay_start(args: ModelArgs) -> int:
    """The first layer the decoder-half replay runs on a suffix: the one above the last kv source
    (every layer from there on owns only window KV)."""
    return args.kv_source_layers[-1] + 1 if args.kv_source_layers else 0


def replay_width(args: ModelArgs, layer: int, s: int) -> int:
    """Positions (per row, ending at its last real one) that layer `layer` must run on in a
    prefill of S positions (SPEC §19.1): the top layer needs its input at the last window
    positions (its ring for decode, and the last position's attention), and each layer below
    needs window - 1 more, so that the next layer's window is complete: window + k (window - 1)
    for the layer k below the top, capped at S."""
    w = args.window_size
    return min(s, w + (args.n_layers - 1 - layer) * (w - 1))


def _span_shared(shared: dict, s: int) -> dict:
    """`shared` of a prefill of S positions in the span conventions (`Attention.chunk`): top-k
    as compressed rows (the prefill's offset S removed) and the query-row starts (0)."""
    shared = dict(shared)
    b = next(iter(shared.values())).shape[0] if shared else 0
    if "topk" in shared:
        shared["topk"] = jnp.where(shared["topk"] >= 0, shared["topk"] - s, -1)
        shared["topk_start"] = jnp.zeros((b,), jnp.int32)
    if "candidates" in shared:
        shared["candidates_start"] = jnp.zeros((b,), jnp.int32)
    return shared


def _masks(token_types: jax.Array | None) -> tuple[jax.Array | None, jax.Array | None]:
    """(image_mask, engram_mask) from token_types (-1 text, >= 0 image span), or (None, None)."""
    if token_types is None:
        return None, None
    image_mask = token_types >= 0
    return image_mask, ~image_mask


def _check_chunk(start: jax.Array, lengths: jax.Array, c: int, max_seq_len: int | None) -> None:
    """0 <= L <= c, start >= 0 and start + L <= max_seq_len, checked when the values are concrete."""
    try:
        st, lens = np.asarray(start), np.asarray(lengths)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    if lens.min() < 0 or lens.max() > c:
        raise ValueError(f"prefill_chunk lengths must be in [0, {c}] (the chunk width), got {lens.tolist()}")
    if st.min() < 0 or (max_seq_len is not None and (st + lens).max() > max_seq_len):
        raise ValueError(f"prefill_chunk: positions start .. start + length - 1 (start {st.tolist()}, lengths "
                         f"{lens.tolist()}) must lie in [0, {max_seq_len}) (the cache's max_seq_len)")


def _check_lengths(lengths: jax.Array, s: int) -> None:
    """1 <= L <= S, checked when the lengths are concrete (under jit they are not)."""
    try:
        lens = np.asarray(lengths)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    if lens.min() < 1 or lens.max() > s:
        raise ValueError(f"prefill lengths must be in [1, {s}] (the padded prompt length), got {lens.tolist()}")
