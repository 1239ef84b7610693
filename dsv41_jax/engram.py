"""Engram: an n-gram hash-table lookup gated into the residual stream (SPEC §9).

Three parts:
  * `EngramLayout.from_args(args)`: bucket primes, column offsets and hash multipliers, derived
    from the config alone in plain Python/numpy (static; hashable, so usable as a jit static).
  * `engram_hash(...)`: the n-gram hash ids of every position, functional and jit-able, with the
    compressed-id history of each batch row carried explicitly between prefill and decode calls.
  * `Engram(layer_id, args)`: the nnx module that looks the hashed rows up in the fp8 table and
    adds the gated value to each hc copy of the stream.

64-bit hashing without x64. The reference hashes in int64: product = token * multiplier
(multipliers reach ~2^55 for small compressed vocabularies), XOR of products, floor-mod by a
prime. JAX runs 32-bit unless `jax_enable_x64` is set globally, which this port does not do. So
an int64 is held as two uint32 halves (hi, lo) and the arithmetic is rebuilt from 32-bit ops, in
JAX, inside jit (usable from a jitted decode loop, no host round trip):
  * wrapping 64-bit multiply: 32x32->64 partial products from 16-bit limbs;
  * XOR: per half;
  * floor-mod by a prime p < 2^31: Horner over k-bit chunks of the 64-bit value, r = (r*2^k +
    chunk) mod p, with k = 32 - bitlen(max prime) so r*2^k never leaves uint32; a negative int64
    (top bit set) is corrected by subtracting 2^64 mod p, which gives torch's/numpy's floor-mod.
Row ids are returned as int32: every table has fewer than 2^31 rows (checked by the layout).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.numerics import cast, in_float64, mean, reciprocal_sqrt, sqrt
from dsv41_jax import quant
from dsv41_jax.config import QUANT_BLOCK, ConfigError, ModelArgs
from dsv41_jax.layers import Linear, linear_kernels

# Compressed id the history cache holds for tokens that take no part in n-grams (image spans).
DEAD = -1
# The gate's |dot| floor before the signed square root (the reference's clamp value).
GATE_CLAMP = 1e-6
# Multipliers come from this per-layer seed: numpy.random.default_rng(_SEED_STRIDE * layer_id).
_SEED_STRIDE = 10007
_INT32_LIMIT = 2**31
_U32 = jnp.uint32


# ------------------------------------------------------------------------------------ layout


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0 or n % 3 == 0:
        return n in (2, 3)
    f = 5
    while f * f <= n:
        if n % f == 0 or n % (f + 2) == 0:
            return False
        f += 6
    return True


def hash_multipliers(layer_id: int, max_ngram_size: int, compressed_vocab_size: int) -> tuple[int, ...]:
    """Odd int64 multipliers of one Engram layer, one per look-back shift (SPEC §9.3).

    Bounded so that compressed_id * multiplier cannot overflow int64."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rng = np.random.default_rng(_SEED_STRIDE * layer_id)
    values = rng.integers(low=0, high=bound, size=(max_ngram_size,), dtype=np.int64)
    return tuple(int(v) * 2 + 1 for v in values)


@dataclasses.dataclass(frozen=True)
class EngramLayout:
    """Bucket layout of the Engram tables (SPEC §9.2-9.3); everything is static Python.

    Column c of a layer (c = (n - 2) * n_heads + head, n = 2..max_ngram_size) hashes the n-gram
    ending at a position into its own prime-sized range of that layer's table, which starts at
    offsets[layer][c]. Indices `[layer]` follow `engram_layer_ids` (the table index).
    """

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    head_dim: int
    primes: tuple[tuple[int, ...], ...]  # [layer][column] bucket modulus
    offsets: tuple[tuple[int, ...], ...]  # [layer][column] first table row of the column's range
    multipliers: tuple[tuple[int, ...], ...]  # [layer][shift] odd int64 hash multiplier
    num_embeddings: tuple[int, ...]  # [layer] table rows = sum of that layer's primes
    compressed_vocab_size: int
    pad_raw_id: int  # raw token id whose compressed id fills missing history

    @classmethod
    def from_args(cls, args: ModelArgs) -> EngramLayout:
        """Primes searched upward from engram_vocab_size - 1, never reused across layers, n-gram
        sizes or heads (order: layer, n = 2..max, head). Raises ConfigError when a table's row
        count in `engram_num_embeddings` is not the sum of its primes, or when a bucket or table
        does not fit the int32 arithmetic of `engram_hash`."""
        if not args.engram_layer_ids:
            raise ConfigError("EngramLayout needs engram_layer_ids; this config has no Engram layers")
        n_cols = args.n_hash_cols
        current, primes = args.engram_vocab_size - 1, []
        for layer in args.engram_layer_ids:
            row = []
            for _ in range(n_cols):
                current += 1
                while not _is_prime(current):
                    current += 1
                if current >= _INT32_LIMIT:
                    raise ConfigError(
                        f"engram_vocab_size = {args.engram_vocab_size}: the bucket primes of Engram layer {layer} "
                        "reach 2^31; engram_hash's 32-bit arithmetic needs them below"
                    )
                row.append(current)
            primes.append(tuple(row))
        for i, (layer, row) in enumerate(zip(args.engram_layer_ids, primes)):
            if sum(row) != args.engram_num_embeddings[i]:
                raise ConfigError(
                    f"engram_num_embeddings[{i}] = {args.engram_num_embeddings[i]} (Engram layer {layer}), but its "
                    f"{n_cols} bucket primes {row[0]}..{row[-1]} sum to {sum(row)}: the table rows must equal that "
                    "sum (SPEC §9.2), otherwise hash ids would address the wrong rows"
                )
            if sum(row) >= _INT32_LIMIT:
                raise ConfigError(f"Engram layer {layer}: {sum(row)} table rows do not fit int32 row ids")
        return cls(
            layer_ids=tuple(args.engram_layer_ids),
            max_ngram_size=args.engram_max_ngram_size,
            n_heads=args.engram_n_heads,
            head_dim=args.engram_head_dim,
            primes=tuple(primes),
            offsets=tuple(tuple(int(o) for o in np.cumsum((0,) + row[:-1])) for row in primes),
            multipliers=tuple(
                hash_multipliers(layer, args.engram_max_ngram_size, args.engram_compressed_vocab_size)
                for layer in args.engram_layer_ids
            ),
            num_embeddings=tuple(args.engram_num_embeddings),
            compressed_vocab_size=args.engram_compressed_vocab_size,
            pad_raw_id=args.engram_pad_id,
        )

    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def n_cols(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads


def prepare_token_map(token_map, args: ModelArgs, *, source: str = "token map") -> np.ndarray:
    """Raw token id -> compressed id table (SPEC §9.1), checked and returned as int32 [n_raw].

    The reference asserts that the map has exactly engram_compressed_vocab_size distinct ids;
    a mismatch would silently rehash every n-gram, since the multipliers derive from that size."""
    m = np.asarray(token_map)
    if m.ndim != 1 or not np.issubdtype(m.dtype, np.integer):
        raise ValueError(f"{source}: expected a 1-D integer array, got {m.dtype} {m.shape}")
    n = args.engram_compressed_vocab_size
    if m.size and (m.min() < 0 or m.max() >= n):
        raise ValueError(f"{source}: compressed ids span [{m.min()}, {m.max()}], outside [0, {n})")
    distinct = len(np.unique(m))
    if distinct != n:
        raise ValueError(
            f"{source}: {distinct} distinct compressed ids, but engram_compressed_vocab_size = {n}; the hash "
            "multipliers derive from that size, so the map and the config must agree"
        )
    if not 0 <= args.engram_pad_id < m.size:
        raise ValueError(f"{source}: engram_pad_id {args.engram_pad_id} is not a raw id of the {m.size}-entry map")
    return m.astype(np.int32)


# --------------------------------------------------------------------- 64-bit integer arithmetic
# An int64 is a pair (hi, lo) of uint32 arrays: value = hi * 2^32 + lo, two's complement.


def _split_u64(values) -> tuple[np.ndarray, np.ndarray]:
    """Python/numpy int64 values -> (hi, lo) uint32 numpy constants."""
    u = np.asarray(values, dtype=np.int64).view(np.uint64)
    return (u >> np.uint64(32)).astype(np.uint32), (u & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def _from_i32(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """int32 -> sign-extended (hi, lo)."""
    lo = jax.lax.bitcast_convert_type(x.astype(jnp.int32), _U32)
    return jnp.where(x < 0, _U32(0xFFFFFFFF), _U32(0)), lo


def _mul_wide_u32(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Full 64-bit product of two uint32 arrays as (hi, lo), from 16-bit limbs (each partial
    product fits uint32)."""
    m16 = _U32(0xFFFF)
    a0, a1, b0, b1 = a & m16, a >> 16, b & m16, b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> 16) + (p01 & m16) + (p10 & m16)  # < 3 * 2^16: no overflow
    hi = p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16)
    lo = (mid << 16) | (p00 & m16)
    return hi, lo


def _mul_i64(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Wrapping int64 product (the low 64 bits, as numpy/torch int64 multiply)."""
    hi, lo = _mul_wide_u32(a[1], b[1])
    return hi + a[0] * b[1] + a[1] * b[0], lo  # uint32 products wrap mod 2^32, as they must


def _xor_i64(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    return a[0] ^ b[0], a[1] ^ b[1]


def _bits(x: tuple[jax.Array, jax.Array], start: int, width: int) -> jax.Array:
    """Bits [start, start + width) of the 64-bit value (static start/width, width <= 31) as uint32."""
    hi, lo = x
    mask = _U32((1 << width) - 1)
    if start >= 32:
        return (hi >> (start - 32)) & mask
    if start + width <= 32:
        return (lo >> start) & mask
    return ((lo >> start) | (hi << (32 - start))) & mask


def _floor_mod_i64(x: tuple[jax.Array, jax.Array], p: np.ndarray) -> jax.Array:
    """x mod p with the sign of p (floor-mod, as torch/numpy `%` on int64), p a uint32 numpy
    array of moduli in [2, 2^31) broadcast against x. Returns uint32 in [0, p)."""
    p = np.asarray(p, np.uint32)
    chunk = 32 - int(p.max()).bit_length()  # r < p, so r * 2^chunk + bits stays below 2^32
    pj = jnp.asarray(p)
    r = jnp.zeros(jnp.broadcast_shapes(x[0].shape, p.shape), _U32)
    top = 64
    while top > 0:
        width = min(chunk, top)
        top -= width
        r = jax.lax.rem((r << width) | _bits(x, top, width), jnp.broadcast_to(pj, r.shape))
    # A negative int64 is u - 2^64 for the unsigned value u just reduced.
    two64 = np.array([pow(2, 64, int(q)) for q in p.ravel()], np.uint32).reshape(p.shape)
    r_neg = jax.lax.rem(r + jnp.asarray(p - two64), jnp.broadcast_to(pj, r.shape))
    return jnp.where((x[0] >> 31) == 1, r_neg, r)


# ------------------------------------------------------------------------------------ hashing


def new_engram_history(batch: int, max_seq_len: int) -> jax.Array:
    """Empty compressed-id history cache, int32 [batch, max_seq_len]. Every slot is written by
    `engram_hash` before it is read, so the fill value never reaches a hash."""
    return jnp.full((batch, max_seq_len), DEAD, jnp.int32)


def engram_hash(ids: jax.Array, start_pos: int | jax.Array, history: jax.Array, token_mask: jax.Array | None,
                layout: EngramLayout, token_map: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Hash ids of the n-grams ending at each position (SPEC §9.4). Pure and jit-able (layout
    static; start_pos may be traced).

    Args:
      ids: int [b, s] raw token ids at positions start_pos .. start_pos + s - 1.
      start_pos: position of ids[:, 0].
      history: int32 [b, t] compressed ids of earlier positions (from `new_engram_history` or the
        previous call); t >= start_pos + s. Under jit an overrun is not detected (the write clamps).
      token_mask: bool [b, s], False for tokens that take no part in n-grams (image spans), or None.
      layout: `EngramLayout.from_args(args)`.
      token_map: int32 [n_raw] raw -> compressed id (`prepare_token_map`).
    Returns:
      hashes: int32 [b, s, n_engram_layers, n_cols], table row ids with column offsets included;
        columns ordered (n = 2 heads, n = 3 heads, ...).
      history: int32 [b, t] with positions start_pos .. start_pos + s - 1 written.
    """
    b, s = ids.shape
    if history.shape[0] != b:
        raise ValueError(f"engram_hash: history has {history.shape[0]} rows for a batch of {b}")
    if isinstance(start_pos, int) and not 0 <= start_pos <= history.shape[1] - s:
        raise ValueError(
            f"engram_hash: positions {start_pos}..{start_pos + s - 1} do not fit the history of length "
            f"{history.shape[1]} (max_seq_len)"
        )
    token_map = jnp.asarray(token_map, jnp.int32)
    compressed = token_map[ids]
    if token_mask is not None:
        compressed = jnp.where(token_mask, compressed, DEAD)
    start_pos = jnp.asarray(start_pos, jnp.int32)
    history = jax.lax.dynamic_update_slice(history, compressed.astype(history.dtype), (jnp.int32(0), start_pos))

    # Look back one shift at a time; once a shift reaches before position 0 or an image token,
    # it and every larger shift take the pad id, so an n-gram never spans a gap.
    pad = token_map[layout.pad_raw_id]
    positions = jnp.broadcast_to(start_pos + jnp.arange(s, dtype=jnp.int32), (b, s))
    blocked = jnp.zeros((b, s), bool)
    tokens = []
    for shift in range(layout.max_ngram_size):
        source = jnp.take_along_axis(history, jnp.maximum(positions - shift, 0), axis=1)
        blocked = blocked | (positions < shift) | (source == DEAD)
        tokens.append(jnp.where(blocked, pad, source))
    tok = _from_i32(jnp.stack(tokens, axis=-1)[:, :, None, :])  # [b, s, 1, shift]

    mult = tuple(jnp.asarray(h) for h in _split_u64(layout.multipliers))  # [layer, shift]
    products = _mul_i64(tok, mult)  # [b, s, layer, shift]
    primes = np.asarray(layout.primes, np.uint32).reshape(layout.n_layers, layout.max_ngram_size - 1, layout.n_heads)
    rolling = (products[0][..., 0], products[1][..., 0])
    hashes = []
    for n in range(2, layout.max_ngram_size + 1):
        rolling = _xor_i64(rolling, (products[0][..., n - 1], products[1][..., n - 1]))
        hashes.append(_floor_mod_i64((rolling[0][..., None], rolling[1][..., None]), primes[:, n - 2]))
    rows = jnp.concatenate(hashes, axis=-1).astype(jnp.int32) + jnp.asarray(layout.offsets, jnp.int32)
    return rows, history


# ------------------------------------------------------------------------------------ module


def stored_table_rows(rows: int, multiple: int) -> int:
    """Rows a table is stored with: `rows` rounded up to a multiple of `multiple`
    (`ModelArgs.engram_rows_multiple`). The rows past `rows` are padding: zero in a converted
    checkpoint, and never addressed, since `engram_hash` returns ids below the sum of the
    layer's primes, which is `rows` (`EngramLayout.from_args` checks that)."""
    if rows < 0 or multiple < 1:
        raise ValueError(f"stored_table_rows: rows {rows} must be >= 0 and multiple {multiple} >= 1")
    return -(-rows // multiple) * multiple


class EngramEmbedding(nnx.Module):
    """The n-gram table, kept fp8 as stored; rows are dequantised on lookup (SPEC §9.5).

    weight e4m3 [stored_rows, head_dim]; scale e8m0 [stored_rows, head_dim / 32] (one per row per
    32 columns). stored_rows >= rows: the rows from `rows` on are storage padding (so the table
    splits evenly over a mesh, see `stored_table_rows`) and read as zero, like any id outside the
    reference's table.
    """

    def __init__(self, rows: int, head_dim: int, stored_rows: int | None = None):
        if head_dim % QUANT_BLOCK:
            raise ValueError(f"EngramEmbedding: head_dim {head_dim} is not a multiple of {QUANT_BLOCK}")
        stored_rows = rows if stored_rows is None else stored_rows
        if stored_rows < rows:
            raise ValueError(f"EngramEmbedding: stored_rows {stored_rows} is fewer than the table's {rows} rows")
        self.rows, self.head_dim = rows, head_dim
        self.weight = nnx.Param(jnp.zeros((stored_rows, head_dim), jnp.float8_e4m3fn))
        self.scale = nnx.Param(jnp.ones((stored_rows, head_dim // QUANT_BLOCK), jnp.float8_e8m0fnu))

    def __call__(self, ids: jax.Array) -> jax.Array:
        """ids int [...] -> bf16 [..., head_dim]: value * scale in f32, then bf16. Ids outside the
        table's `rows` (padding rows included) give zero rows, as the reference's lookup does."""
        valid = (ids >= 0) & (ids < self.rows)
        safe = jnp.where(valid, ids, 0)
        w = jnp.take(self.weight[...], safe, axis=0).astype(jnp.float32)  # [..., hd]
        s = quant.e8m0_to_f32(jnp.take(self.scale[...], safe, axis=0))  # [..., hd / 32]
        v = (w.reshape(*w.shape[:-1], -1, QUANT_BLOCK) * s[..., None]).reshape(w.shape)
        return cast(jnp.where(valid[..., None], v, 0.0), jnp.bfloat16)


def engram_gate(h: jax.Array, key: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gate per (token, hc copy), f32 [b, s, hc] (SPEC §9.6).

    h, key f32 [b, s, hc, d]; weight f32 [hc, d] (= q_weight * k_weight). Both RMS statistics are
    taken per copy over d, not jointly over the copies; the dot is scaled by d^-0.5, then
    sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot)). copysign, not sign(): dot = 0 gives 0.5+.
    """
    d = h.shape[-1]
    # torch.rsqrt and the mean as the reference rounds them (dsv41_jax.numerics), never XLA's
    # approximate rsqrt or the mean's reciprocal multiply
    rstd = reciprocal_sqrt(mean(jnp.square(h), axis=-1) + jnp.float32(eps)) * reciprocal_sqrt(
        mean(jnp.square(key), axis=-1) + jnp.float32(eps)
    )
    dot = jnp.sum(h * weight * key, axis=-1) * rstd * jnp.float32(d**-0.5)
    return in_float64(jax.nn.sigmoid, jnp.copysign(sqrt(jnp.maximum(jnp.abs(dot), jnp.float32(GATE_CLAMP))), dot))


class Engram(nnx.Module):
    """Engram module of one layer (SPEC §9.5-9.6); parameter names equal the hub's
    (`layers.{L}.engram.` + embed.weight / embed.scale / wkv.weight / wkv.scale / q_weight / k_weight).

    embed: EngramEmbedding [stored rows, head_dim] (`stored_table_rows`); wkv: fp8 Linear
    n_cols*head_dim -> (hc + 1) * dim (hc keys, then one value shared by all copies); q_weight,
    k_weight bf16 [hc, dim], used only as their product.
    """

    def __init__(self, layer_id: int, args: ModelArgs):
        table = args.engram_table_index(layer_id)
        if table is None:
            raise ValueError(f"Engram: layer {layer_id} is not in engram_layer_ids {list(args.engram_layer_ids)}")
        self.layer_id, self.table = layer_id, table
        self.dim, self.hc, self.eps, self.n_cols = args.dim, args.hc_mult, args.norm_eps, args.n_hash_cols
        rows = args.engram_num_embeddings[table]
        self.embed = EngramEmbedding(rows, args.engram_head_dim, stored_table_rows(rows, args.engram_rows_multiple))
        self.wkv = Linear(args.n_hash_cols * args.engram_head_dim, (args.hc_mult + 1) * args.dim, "fp8",
                          **linear_kernels(args))
        self.q_weight = nnx.Param(jnp.ones((args.hc_mult, args.dim), jnp.bfloat16))
        self.k_weight = nnx.Param(jnp.ones((args.hc_mult, args.dim), jnp.bfloat16))

    def key_value(self, hash_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        """hash_ids int [b, s, n_cols] -> (key f32 [b, s, hc, dim], value bf16 [b, s, dim])."""
        b, s, n_cols = hash_ids.shape
        if n_cols != self.n_cols:
            raise ValueError(f"Engram layer {self.layer_id}: hash_ids has {n_cols} columns, expected {self.n_cols}")
        kv = self.wkv(self.embed(hash_ids).reshape(b, s, -1))  # bf16 [b, s, (hc + 1) * dim]
        key = kv[..., : self.hc * self.dim].astype(jnp.float32).reshape(b, s, self.hc, self.dim)
        return key, kv[..., self.hc * self.dim :]

    def __call__(self, x: jax.Array, hash_ids: jax.Array, token_mask: jax.Array | None = None) -> jax.Array:
        """x [b, s, hc, dim] (bf16 stream); hash_ids int [b, s, n_cols] (this layer's slice of
        `engram_hash`); token_mask bool [b, s] or None (False: gate 0, the position passes
        through unchanged). Returns x + gate * value per copy, computed in f32, in x.dtype."""
        key, value = self.key_value(hash_ids)
        weight = self.q_weight[...].astype(jnp.float32) * self.k_weight[...].astype(jnp.float32)
        h = x.astype(jnp.float32)
        gate = engram_gate(h, key, weight, self.eps)  # [b, s, hc]
        if token_mask is not None:
            gate = jnp.where(token_mask[..., None], gate, 0.0)
        return cast(h + gate[..., None] * value.astype(jnp.float32)[..., None, :], x.dtype)
