"""Synthetic hub checkpoints: the real tensor names, dtypes and shapes of a config, random values.

`write_synthetic_checkpoint(directory, args)` writes `model-0000i-of-0000n.safetensors` shards of
about `shard_bytes` each plus `model.safetensors.index.json`, `config.json` and, for configs with
Engram layers, an `engram_map.npy`. It streams: each tensor is generated and written in chunks of
`chunk_bytes`, so a full-size layer (or a 98 GB Engram table) is written in O(chunk) RAM.

Values are random but keep a forward pass finite:
  * fp8 (F8_E4M3) and packed fp4 (I8) codes are random bits (the two e4m3 NaN codes excluded);
  * their F8_E8M0 scales are powers of two chosen so a weight's RMS is about 1/sqrt(fan-in);
  * BF16 / F32 values are about 1/sqrt(last dim) in magnitude with random signs; norm weights and
    hc scales lie in [1, 2), router biases, attention sinks and hc bases are about 0.1 (BF16 values
    are built from random bits, for speed on the 1.3 GB embedding and head).
Each tensor's values depend only on (seed, name), not on the sharding or the write order.

`layer_subset(args, n_layers)` derives the config of the first n layers of a model (for
full-size tensors with few layers).
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from dsv41_jax.checkpoint import INDEX_FILE, hub_tensor_inventory
from dsv41_jax.config import ModelArgs

__all__ = ["engram_rows_for", "layer_subset", "synthetic_token_map", "write_synthetic_checkpoint"]

_ITEMSIZE = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4}
_E8M0_ONE = 127  # e8m0 byte of 2^0


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def _prime_sums(start: int, n_tables: int, n_cols: int) -> tuple[int, ...]:
    current, rows = start - 1, []
    for _ in range(n_tables):
        total = 0
        for _ in range(n_cols):
            current += 1
            while not _is_prime(current):
                current += 1
            total += current
        rows.append(total)
    return tuple(rows)


def engram_rows_for(args: ModelArgs) -> tuple[int, ...]:
    """Table rows per Engram layer implied by engram_vocab_size (SPEC §9.2): the bucket moduli are
    the consecutive primes from engram_vocab_size upward, n_hash_cols per layer, summed per layer."""
    return _prime_sums(args.engram_vocab_size, len(args.engram_layer_ids), args.n_hash_cols)


def layer_subset(args: ModelArgs, n_layers: int, *, engram_vocab_size: int | None = None) -> ModelArgs:
    """The config of the first `n_layers` backbone layers of `args` (no DSpark stages): layer-id
    lists are cut to the kept layers, a candidate source beyond them is dropped, and the Engram
    table rows are recomputed (from `engram_vocab_size` when given, to shrink the tables)."""
    if not 0 < n_layers <= args.n_layers:
        raise ValueError(f"n_layers must be in 1..{args.n_layers}, got {n_layers}")

    def keep(ids):
        return tuple(i for i in ids if i < n_layers)

    engram_ids = keep(args.engram_layer_ids)
    vocab = args.engram_vocab_size if engram_vocab_size is None else engram_vocab_size
    return args.replace(
        n_layers=n_layers,
        n_mtp_layers=0,
        dspark_block_size=0,
        dspark_target_layer_ids=(),
        compress_ratios=tuple(args.compress_ratios[:n_layers]),
        kv_source_layers=keep(args.kv_source_layers),
        index_source_layers=keep(args.index_source_layers),
        candidate_source_layer=args.candidate_source_layer if args.candidate_source_layer < n_layers else -1,
        engram_layer_ids=engram_ids,
        engram_vocab_size=vocab,
        engram_num_embeddings=_prime_sums(vocab, len(engram_ids), args.n_hash_cols),
    )


def synthetic_token_map(args: ModelArgs, seed: int = 0) -> np.ndarray:
    """A random raw -> compressed id map int32 [vocab_size] with exactly
    engram_compressed_vocab_size distinct ids (what `prepare_token_map` requires)."""
    n, vocab = args.engram_compressed_vocab_size, args.vocab_size
    if n > vocab:
        raise ValueError(f"engram_compressed_vocab_size {n} exceeds vocab_size {vocab}: no such token map exists")
    rng = np.random.default_rng([seed, 0xE6])
    m = np.concatenate([rng.permutation(n), rng.integers(0, n, vocab - n)]).astype(np.int32)
    return m[rng.permutation(vocab)]


# ----------------------------------------------------------------------------------- values


def _fan_in(shape: tuple[int, ...], packed: bool) -> int:
    return max(1, shape[-1] * (2 if packed else 1))


def _chunks(name: str, tag: str, shape: tuple[int, ...], rng: np.random.Generator, chunk_bytes: int,
            scale_exponent: int) -> Iterator[bytes]:
    """Raw little-endian bytes of one tensor, `chunk_bytes` (rounded to the item size) at a time."""
    itemsize = _ITEMSIZE[tag]
    total = math.prod(shape)
    step = max(1, chunk_bytes // itemsize)
    last = shape[-1] if shape else 1
    for start in range(0, total, step):
        n = min(step, total - start)
        if tag == "I8":
            yield rng.bytes(n)
        elif tag == "F8_E4M3":
            b = np.frombuffer(rng.bytes(n), np.uint8)
            yield (b - ((b & 0x7F) == 0x7F)).astype(np.uint8).tobytes()  # 0x7f/0xff are NaN
        elif tag == "F8_E8M0":
            yield (scale_exponent + rng.integers(0, 2, n, dtype=np.uint8)).astype(np.uint8).tobytes()
        else:
            yield _floats(name, tag, n, last, rng)


def _floats(name: str, tag: str, n: int, last: int, rng: np.random.Generator) -> bytes:
    """n random BF16 / F32 values of the tensor's scale: norm weights and hc scales in [1, 2),
    biases / sinks / hc bases about 0.1, others about 1/sqrt(last dim); random sign otherwise."""
    if name.endswith(("norm.weight", "_scale")):
        signed, log2_scale = False, 0
    elif name.endswith((".bias", ".bias_vl", "attn_sink", "_base")):
        signed, log2_scale = True, -4
    else:
        signed, log2_scale = True, -math.ceil(math.log2(math.sqrt(last)))
    if tag == "F32":
        g = np.abs(rng.standard_normal(n, dtype=np.float32)) if not signed else rng.standard_normal(n, dtype=np.float32)
        if log2_scale == 0 and not signed:
            g = 1.0 + 0.1 * g
        return (g * np.float32(2.0**log2_scale) if log2_scale else g).astype(np.float32).tobytes()
    # BF16 straight from bits (an fp32 normal + cast costs ~10x more for the 1.3 GB embed / head):
    # exponent log2_scale - {0, 1, 2}, random 7-bit mantissa, random sign when signed
    bits = np.frombuffer(rng.bytes(2 * n), np.uint16)
    exponent = (127 + log2_scale - (bits >> 8) % 3 * (1 if signed else 0)).astype(np.uint16)
    sign = (bits & 0x8000) if signed else np.uint16(0)
    return (sign | (exponent << 7) | (bits & 0x7F)).astype(np.uint16).tobytes()


def _scale_exponent(name: str, inventory: Mapping[str, tuple[str, tuple[int, ...]]]) -> int:
    """e8m0 byte for a `.scale`: weight RMS ~ 1/sqrt(fan-in) given the code RMS of its weight."""
    weight = inventory.get(name[: -len("scale")] + "weight")
    if weight is None:
        return _E8M0_ONE - 4
    tag, shape = weight
    packed = tag == "I8"
    code_rms_log2 = 1 if packed else 7  # e2m1 codes: RMS ~ 3; random e4m3 codes: RMS ~ 130
    return _E8M0_ONE - code_rms_log2 - math.ceil(math.log2(math.sqrt(_fan_in(shape, packed))))


# ---------------------------------------------------------------------------------- writer


def _plan_shards(inventory: Mapping[str, tuple[str, tuple[int, ...]]], shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, (tag, shape) in inventory.items():
        nbytes = math.prod(shape) * _ITEMSIZE[tag]
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_synthetic_checkpoint(directory: str | os.PathLike, args: ModelArgs, *, shard_bytes: int = 4 << 30,
                               chunk_bytes: int = 64 << 20, seed: int = 0,
                               inventory: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
                               token_map: bool = True, progress: bool = False) -> dict:
    """Writes a hub-format checkpoint of `args` with random values into `directory` (created).

    inventory: name -> (dtype tag, shape) to write instead of `hub_tensor_inventory(args)` (tests
      use it to produce checkpoints that deviate from their config).
    token_map: also write `engram_map.npy` (`synthetic_token_map`) when the config has Engram layers.
    Returns {"tensors", "bytes", "shards"}.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    inv = dict(hub_tensor_inventory(args) if inventory is None else inventory)
    unknown_tags = sorted({tag for tag, _ in inv.values()} - _ITEMSIZE.keys())
    if unknown_tags:
        raise ValueError(f"synthetic checkpoint: cannot generate dtype tags {unknown_tags}; known {sorted(_ITEMSIZE)}")
    shards = _plan_shards(inv, shard_bytes)
    bar = None
    if progress:
        from tqdm import tqdm

        total = sum(math.prod(s) * _ITEMSIZE[t] for t, s in inv.values())
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="synthetic checkpoint")
    weight_map, total_bytes = {}, 0
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name in names:
            tag, shape = inv[name]
            nbytes = math.prod(shape) * _ITEMSIZE[tag]
            header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format allows space padding; keeps the data 8-aligned
        with open(out / fname, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for name in names:
                tag, shape = inv[name]
                rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
                exp = _scale_exponent(name, inv) if tag == "F8_E8M0" else 0
                for chunk in _chunks(name, tag, shape, rng, chunk_bytes, exp):
                    f.write(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
                weight_map[name] = fname
        total_bytes += offset
    if bar is not None:
        bar.close()
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=1))
    (out / "config.json").write_text(json.dumps(args.to_dict(), indent=1))
    if token_map and args.engram_layer_ids:
        np.save(out / "engram_map.npy", synthetic_token_map(args, seed))
    return {"tensors": len(inv), "bytes": total_bytes, "shards": len(shards)}
