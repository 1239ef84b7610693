"""Decode caches (SPEC §5.12) as a plain pytree, and the per-row writes into them.

    cache = {
      "seq_len": int32 [B]                   tokens each row holds (prefill length, +1 per step)
      "layers": [one dict per backbone layer]:
          "window_kv"   bf16 [B, window, hd]        ring: position p in slot p % window
          kv sources only:
          "compress_kv" bf16 [B, T // r, hd]        compressed KV, row j = group j (RoPE'd, FP4-QDQ'd)
          "index_k"     bf16 [B, T // r, ihd]       index keys, same rows (RoPE'd, FP4-QDQ'd)
          ratio > 1 sources only:
          "kv_state"    f32 [B, r, hd]  zeros       the tokens of the group still filling up
          "score_state" f32 [B, r, hd]  -inf
      "engram_history": int32 [B, T]         compressed token ids (only with Engram layers)
    }

T is the cache's max_seq_len (positions must stay below it). Every shape is static in (B, T), so
one compiled decode step serves every position. Rows of a batch may be at different positions:
every write below takes a per-row position and touches only that row. The DSpark stages'
window rings are not part of this cache (no DSpark decode here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.config import ConfigError, ModelArgs

_BF16 = jnp.bfloat16
_F32 = jnp.float32


def _layer_cache(args: ModelArgs, layer: int, batch: int, max_seq_len: int) -> dict:
    c = {"window_kv": jnp.zeros((batch, args.window_size, args.head_dim), _BF16)}
    if args.is_kv_source(layer):
        r = args.compress_ratios[layer]
        c["compress_kv"] = jnp.zeros((batch, max_seq_len // r, args.head_dim), _BF16)
        c["index_k"] = jnp.zeros((batch, max_seq_len // r, args.index_head_dim), _BF16)
        if r > 1:
            c["kv_state"] = jnp.zeros((batch, r, args.head_dim), _F32)
            c["score_state"] = jnp.full((batch, r, args.head_dim), -jnp.inf, _F32)
    return c


def init_cache(args: ModelArgs, batch: int, max_seq_len: int | None = None) -> dict:
    """An empty cache for `batch` rows of up to `max_seq_len` positions (default args.max_seq_len)."""
    t = args.max_seq_len if max_seq_len is None else max_seq_len
    if batch <= 0 or t <= 0:
        raise ValueError(f"init_cache: batch ({batch}) and max_seq_len ({t}) must be positive")
    for i in args.kv_source_layers:
        if t < args.compress_ratios[i]:
            raise ConfigError(f"max_seq_len {t} holds no compressed row of layer {i} (ratio {args.compress_ratios[i]})")
    cache = {
        "seq_len": jnp.zeros((batch,), jnp.int32),
        "layers": [_layer_cache(args, i, batch, t) for i in range(args.n_layers)],
    }
    if args.engram_layer_ids:
        # every slot is written by engram_hash before a hash reads it
        cache["engram_history"] = jnp.full((batch, t), -1, jnp.int32)
    return cache


def cache_bytes(args: ModelArgs, batch: int, max_seq_len: int | None = None) -> int:
    """Bytes of `init_cache(args, batch, max_seq_len)`, from shapes only (nothing is allocated)."""
    shapes = jax.eval_shape(lambda: init_cache(args, batch, max_seq_len))
    return int(sum(np.prod(s.shape) * s.dtype.itemsize for s in jax.tree.leaves(shapes)))


def cache_max_seq_len(cache: dict) -> int | None:
    """Positions the cache can hold (static), or None when nothing in it depends on the length
    (a window-only model without Engram)."""
    if "engram_history" in cache:
        return cache["engram_history"].shape[1]
    for c in cache["layers"]:
        if "compress_kv" in c:
            return c["compress_kv"].shape[1] * (c["kv_state"].shape[1] if "kv_state" in c else 1)
    return None


# ------------------------------------------------------------------------------ per-row writes


def _rows(x: jax.Array) -> jax.Array:
    return jnp.arange(x.shape[0])


def write_row(buf: jax.Array, index: jax.Array, value: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """buf [B, N, ...] with buf[b, index[b]] = value[b] where mask[b] (None: every row).

    index int [B]; value [B, ...]. A masked-off row keeps its old entry, so a value computed
    speculatively (a group that is not complete yet) never reaches the cache.
    """
    value = value.astype(buf.dtype)
    if buf.shape[0] == 1:
        # one row: a dynamic_update_slice, which XLA fuses with the value's producer (its scatter
        # becomes one too, behind a bounds check that kept the producer a kernel of its own).
        # Indices as the scatter takes them: negative ones count from the end, and one outside
        # [-N, N) leaves the buffer as it is.
        n = buf.shape[1]
        i = jnp.asarray(index).reshape(()).astype(jnp.int32)
        i = jnp.where(i < 0, i + n, i)
        keep = (i >= 0) & (i < n) if mask is None else (i >= 0) & (i < n) & mask.reshape(())
        at = jnp.clip(i, 0, n - 1)
        start = (jnp.int32(0), at) + (jnp.int32(0),) * (buf.ndim - 2)
        old = jax.lax.dynamic_slice(buf, start, (1, 1) + buf.shape[2:])
        return jax.lax.dynamic_update_slice(buf, jnp.where(keep, value.reshape(old.shape), old), start)
    rows = _rows(buf)
    if mask is not None:
        old = buf[rows, index]
        value = jnp.where(mask.reshape(mask.shape + (1,) * (value.ndim - 1)), value, old)
    return buf.at[rows, index].set(value)


def seed_window(kv: jax.Array, lengths: jax.Array, window: int) -> jax.Array:
    """The ring after a prefill: kv [B, S, hd] of positions 0..S-1, lengths int [B] (real tokens
    per row) -> [B, window, hd] holding position p in slot p % window for each row's last
    min(L, window) real positions; slots no real position reached are zero.

    Slot j holds the newest real position congruent to j: p = L-1 - ((L-1-j) mod window)
    (`update_window` of an empty ring from position 0).
    """
    lengths = jnp.asarray(lengths, jnp.int32)
    b, _, hd = kv.shape
    empty = jnp.zeros((b, window, hd), kv.dtype)
    return update_window(empty, kv, jnp.zeros_like(lengths), lengths)


def seed_group_state(values: jax.Array, lengths: jax.Array, ratio: int, fill: float) -> jax.Array:
    """A compressor state after a prefill: values f32 [B, S, hd] per position, lengths int [B] ->
    [B, ratio, hd]. Slot j < L % ratio holds position L - L % ratio + j (the tokens of the group
    still open at the end of the prompt); the other slots hold `fill`."""
    lengths = jnp.asarray(lengths, jnp.int32)
    rem = lengths % ratio
    j = jnp.arange(ratio, dtype=jnp.int32)[None, :]
    p = (lengths - rem)[:, None] + j
    got = jnp.take_along_axis(values, jnp.clip(p, 0, values.shape[1] - 1)[:, :, None], axis=1)
    return jnp.where((j < rem[:, None])[:, :, None], got, jnp.asarray(fill, values.dtype))


def seed_rows(buf: jax.Array, rows: jax.Array) -> jax.Array:
    """buf [B, N, d] with rows [B, n, d] written at 0..n-1 (n <= N). In a right-padded batch the
    rows at or beyond a row's L // r come from padding: no query of that row sees them before the
    decode step that completes their group has overwritten them."""
    n = rows.shape[1]
    if n > buf.shape[1]:
        raise ValueError(f"{n} compressed rows do not fit a cache of {buf.shape[1]} rows (max_seq_len too small)")
    return buf.at[:, :n].set(rows.astype(buf.dtype))


def write_rows(buf: jax.Array, index: jax.Array, values: jax.Array, mask: jax.Array) -> jax.Array:
    """buf [B, N, d] with buf[b, index[b, g]] = values[b, g] where mask[b, g].

    index int [B, G] (distinct per row); values [B, G, d]; mask bool [B, G]. Entries with mask
    False keep the old row; indices >= N (positions past the cache, only ever padding) are dropped.
    """
    rows = _rows(buf)[:, None]
    old = jnp.take_along_axis(buf, jnp.clip(index, 0, buf.shape[1] - 1)[:, :, None], axis=1)
    values = jnp.where(mask[:, :, None], values.astype(buf.dtype), old)
    return buf.at[rows, index].set(values, mode="drop")


def update_window(ring: jax.Array, kv: jax.Array, start: jax.Array, end: jax.Array) -> jax.Array:
    """The ring after positions start .. end-1 of each row were added.

    ring [B, window, hd] holding each row's positions < start (slot p % window); kv [B, c, hd]
    the values of positions start .. start+c-1; start, end int32 [B] with start <= end <=
    start + c (positions >= end are padding). Slot j then holds the newest position p < end with
    p % window == j: from kv where p >= start, the old ring where 0 <= p < start, zero where no
    such position exists (`seed_window` is the case of an empty ring and start = 0).
    """
    window = ring.shape[1]
    last = end[:, None] - 1
    p = last - jnp.mod(last - jnp.arange(window, dtype=jnp.int32)[None, :], window)  # [B, window]
    got = jnp.take_along_axis(kv, jnp.clip(p - start[:, None], 0, kv.shape[1] - 1)[:, :, None], axis=1)
    old = jnp.where((p >= 0)[:, :, None], ring, jnp.zeros((), ring.dtype))
    return jnp.where((p >= start[:, None])[:, :, None], got.astype(ring.dtype), old)
