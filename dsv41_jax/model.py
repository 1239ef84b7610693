"""The V4.1 text model: `Block` and `Transformer` (SPEC §2, §4.6), mirroring the reference tree.

Tree paths equal the reference parameter names: `embed.weight`, `layers.{i}.attn.wq_a.weight`,
`layers.{i}.hc_attn_fn`, `layers.{i}.engram.embed.weight`, `norm.weight`, `head.weight`, ...;
routed experts are stacked (`layers.{i}.ffn.experts.w1.weight[e]`, see `dsv41_jax.loading`).

Cross-layer sharing (compressed KV, index keys, top-k, candidates) is a plain dict handed up the
stack; which layer reads or writes what is decided by static per-layer facts of `ModelArgs`, so
the whole forward traces once under `jax.jit`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.attention import Attention
from dsv41_jax.config import ModelArgs
from dsv41_jax.engram import Engram, EngramLayout, engram_hash
from dsv41_jax.layers import Embedding, Linear, RMSNorm
from dsv41_jax.mhc import hc_mixes, hc_post, hc_pre, identity_pre_mix
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
        )

    def __call__(self, x: jax.Array, pre_mix: jax.Array, shared: dict, image_mask: jax.Array | None):
        """x [b, s, hc, d] bf16, pre_mix [b, s, hc] f32 (from the previous block's FFN mixes).

        Returns (x [b, s, hc, d] bf16, this block's FFN `pre` [b, s, hc] f32, shared, aux).
        """
        residual = x
        attn_pre, attn_post, attn_comb = self._mixes(x, "attn")
        h = self.attn_norm(hc_pre(x, pre_mix))
        h, shared, aux = self.attn(h, shared)
        x = hc_post(h, residual, attn_post, attn_comb)

        residual = x
        ffn_pre, ffn_post, ffn_comb = self._mixes(x, "ffn")
        h = self.ffn_norm(hc_pre(x, attn_pre))
        h, moe_aux = self.ffn(h, image_mask)
        x = hc_post(h, residual, ffn_post, ffn_comb)
        return x, ffn_pre, shared, {**aux, **moe_aux}


class Transformer(nnx.Module):
    """embed -> hc copies -> (Engram) + blocks -> collapse with the last FFN pre-mix -> norm -> head."""

    def __init__(self, args: ModelArgs):
        self.args = args
        self.embed = Embedding(args.vocab_size, args.dim)
        self.layers = nnx.List([Block(i, args) for i in range(args.n_layers)])
        self.norm = RMSNorm(args.dim, args.norm_eps)
        # bf16 in the checkpoint, held in fp32 so the logits come out fp32 (SPEC §8)
        self.head = Linear(args.dim, args.vocab_size, dtype="fp32")
        self.engram_layout = EngramLayout.from_args(args) if args.engram_layer_ids else None
        self.token_map = TokenMap(jnp.arange(args.vocab_size, dtype=jnp.int32)) if args.engram_layer_ids else None

    def __call__(self, ids: jax.Array, token_types: jax.Array | None = None, embeds: jax.Array | None = None,
                 *, all_logits: bool = False, collect: bool = False):
        """Prefill of whole prompts (start_pos 0).

        ids [b, s] int; token_types [b, s] int (-1 text, >= 0 image span) or None; embeds [b, s, d]
        bf16 replaces the embedding rows (image spans carry the vision tower's features).
        Returns logits f32 [b, V] (last position) or [b, s, V] with all_logits; with collect,
        also a dict of per-layer intermediates keyed like the golden arrays.
        """
        a = self.args
        b, s = ids.shape
        image_mask = None if token_types is None else token_types >= 0
        engram_mask = None if image_mask is None else ~image_mask
        hashes = None
        if self.engram_layout is not None:
            history = jnp.zeros((b, a.max_seq_len), jnp.int32)
            hashes, _ = engram_hash(ids, 0, history, engram_mask, self.engram_layout, self.token_map[...])
        h = self.embed(ids) if embeds is None else embeds.astype(jnp.bfloat16)
        x = jnp.broadcast_to(h[:, :, None, :], (b, s, a.hc_mult, a.dim))
        pre_mix = identity_pre_mix(b, s, a.hc_mult)
        shared: dict = {}
        record = {}
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer_{i}"):
                if layer.engram is not None:
                    x = layer.engram(x, hashes[:, :, a.engram_table_index(i), :], engram_mask)
                    if collect:
                        record[f"engram_out.L{i:02d}"] = x
                x, pre_mix, shared, aux = layer(x, pre_mix, shared, image_mask)
                if collect:
                    record[f"block_out.L{i:02d}"] = x
                    record[f"block_premix.L{i:02d}"] = pre_mix
                    record.update({f"{k}.L{i:02d}": v for k, v in aux.items()})
        logits = self.logits(x, pre_mix, all_logits=all_logits)
        return (logits, record) if collect else logits

    def logits(self, x: jax.Array, pre_mix: jax.Array, *, all_logits: bool = False) -> jax.Array:
        """Final collapse (last block's FFN pre-mix), norm, fp32 head. x [b, s, hc, d]."""
        h = self.norm(hc_pre(x, pre_mix))
        if not all_logits:
            h = h[:, -1]
        return self.head(h.astype(jnp.float32))
