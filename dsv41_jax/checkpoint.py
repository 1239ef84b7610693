"""Hub checkpoint reader (sharded safetensors, no torch) and the tensor inventory a config implies.

`HubCheckpoint(directory)` maps a directory holding `model.safetensors.index.json` and its shards.
Opening it reads only the index. A shard's header is parsed the first time one of its tensors is
asked for, and tensor data is never copied: `get` returns a read-only view into a memory map of
the shard, so a converter can walk a ~500 GB checkpoint tensor by tensor (or shard by shard with
`iter_shard_groups`) without it ever landing in RAM.

`hub_tensor_inventory(args)` lists every tensor the hub checkpoint of a config holds (SPEC §14.1)
with its dtype tag and shape; `check_against_inventory` compares a checkpoint with that list and
`inventory_totals` sums it.

Hub storage (SPEC §13, §14.1): fp8 Linear -> F8_E4M3 [out, in] + `.scale` F8_E8M0 [ceil(out/32),
ceil(in/32)]; routed experts -> I8 [out, in/2] (two e2m1 codes per byte, element 2k in the low
nibble) + `.scale` F8_E8M0 [out, in/32]; Engram tables -> F8_E4M3 [rows, head_dim] + `.scale`
F8_E8M0 [rows, head_dim/32]; hc_*, attn_sink, gate.bias(_vl) F32; everything else BF16.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import ml_dtypes
import numpy as np

from dsv41_jax.config import QUANT_BLOCK, ModelArgs, ceil_div

__all__ = [
    "INDEX_FILE",
    "CheckpointError",
    "TensorInfo",
    "HubCheckpoint",
    "hub_tensor_inventory",
    "inventory_totals",
    "check_against_inventory",
]

INDEX_FILE = "model.safetensors.index.json"

# Why tensors are not read through `safetensors.safe_open(..., framework="numpy")`: in safetensors
# 0.8.0 it raises AttributeError on F8_E4M3 / F8_E8M0 (it looks the float8 types up on numpy, which
# has none), i.e. on most tensors of this checkpoint, and for the dtypes it does read it copies the
# bytes onto the heap (a 98 GB Engram table would land in RAM). The file format is small enough to
# read directly: an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
# data_offsets}}, then the data section; each tensor is a slice of a read-only np.memmap viewed as
# its dtype. (tests/test_checkpoint.py checks these views against safetensors' own reads.)
_DTYPES: dict[str, np.dtype] = {
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "I8": np.dtype(np.int8),  # packed fp4 experts: two e2m1 codes per byte
    "I16": np.dtype("<i2"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "U8": np.dtype(np.uint8),
    "U16": np.dtype("<u2"),
    "U32": np.dtype("<u4"),
    "U64": np.dtype("<u8"),
    "BOOL": np.dtype(np.bool_),
}

_MAX_LISTED = 20  # entries per category in a check_against_inventory message


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as the hub format, or that does not match the config."""


class TensorInfo(NamedTuple):
    """Header facts of one tensor; `shard` is the shard file name relative to the directory."""

    name: str
    dtype_tag: str
    shape: tuple[int, ...]
    shard: str

    @property
    def dtype(self) -> np.dtype:
        return _DTYPES[self.dtype_tag]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _DTYPES[self.dtype_tag].itemsize


class _Shard:
    """One shard file: header parsed on first use, file memory-mapped on the first data read."""

    def __init__(self, directory: Path, shard: str, index_path: Path):
        self.shard = shard  # as the index names it
        self.path = directory / shard
        self.index_path = index_path
        self._entries: dict | None = None
        self._data_start = 0
        self._file_size = 0
        self._mm: np.memmap | None = None

    def _fail(self, name: str | None, what: str) -> CheckpointError:
        where = f"shard {self.path}" if name is None else f"shard {self.path}, tensor {name!r}"
        return CheckpointError(f"{where}: {what}")

    def entries(self, name: str | None) -> dict:
        """The parsed header (without `__metadata__`); `name` is the tensor being looked up, if any."""
        if self._entries is not None:
            return self._entries
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise self._fail(name, f"file is {size} bytes, too short for the 8-byte header length (truncated?)")
                (n,) = struct.unpack("<Q", head)
                if n > size - 8:
                    raise self._fail(
                        name, f"header length field says {n} bytes but only {size - 8} follow (truncated, or not "
                        "a safetensors file)"
                    )
                raw = f.read(n)
        except FileNotFoundError:
            raise self._fail(name, f"shard file does not exist (named by {self.index_path})") from None
        except OSError as e:
            raise self._fail(name, f"cannot read the shard file ({e})") from None
        try:
            header = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise self._fail(
                name, f"header is not valid JSON ({e}); expected {{name: {{dtype, shape, data_offsets}}}}"
            ) from None
        if not isinstance(header, dict):
            raise self._fail(name, f"header is a JSON {type(header).__name__}, expected an object of tensor entries")
        header.pop("__metadata__", None)
        self._entries, self._data_start, self._file_size = header, 8 + n, size
        return header

    def locate(self, name: str) -> tuple[TensorInfo, int, int]:
        """(info, begin, end): validated absolute byte range of `name` in the file."""
        entries = self.entries(name)
        entry = entries.get(name)
        if entry is None:
            raise self._fail(
                name, f"{self.index_path} maps this tensor to this shard, but its header has no such tensor "
                f"({len(entries)} tensors in it)"
            )
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise self._fail(name, f"malformed header entry {entry!r}; expected keys dtype, shape, data_offsets")
        tag, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if tag not in _DTYPES:
            raise self._fail(name, f"unknown dtype tag {tag!r}; expected one of {sorted(_DTYPES)}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise self._fail(name, f"shape {shape!r} is not a list of non-negative integers")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise self._fail(name, f"data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end")
        begin, end = offsets
        numel, itemsize = math.prod(shape), _DTYPES[tag].itemsize
        if numel * itemsize != end - begin:
            raise self._fail(
                name, f"{tag} {shape} needs numel * itemsize = {numel} * {itemsize} = {numel * itemsize} bytes, "
                f"but data_offsets [{begin}, {end}] span {end - begin} bytes"
            )
        if self._data_start + end > self._file_size:
            raise self._fail(
                name, f"truncated: data_offsets [{begin}, {end}] end at byte {self._data_start + end} of the file, "
                f"but the file has only {self._file_size} bytes"
            )
        info = TensorInfo(name, tag, tuple(shape), self.shard)
        return info, self._data_start + begin, self._data_start + end

    def view(self, name: str) -> np.ndarray:
        info, begin, end = self.locate(name)
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mm[begin:end].view(info.dtype).reshape(info.shape)

    def release(self) -> None:
        # Arrays already returned keep their own reference to the map, so this never invalidates them.
        self._mm = None
        self._entries = None


class HubCheckpoint:
    """Lazy, memory-mapped reader of a sharded hub checkpoint directory.

    Only the index is read on construction. Returned arrays are read-only `np.memmap` views with the
    checkpoint's dtype (F8_E4M3 -> float8_e4m3fn, F8_E8M0 -> float8_e8m0fnu, I8 packed fp4 -> int8,
    BF16 -> bfloat16, ...); copy them (`np.array(a)`) to own the data. Every error is a
    `CheckpointError` naming the shard file, the tensor and what was expected.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.index_path = self.directory / INDEX_FILE
        try:
            text = self.index_path.read_text()
        except FileNotFoundError:
            raise CheckpointError(
                f"checkpoint index {self.index_path} does not exist; expected {INDEX_FILE} "
                "with a weight_map (tensor name -> shard file) in that directory"
            ) from None
        try:
            index = json.loads(text)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"checkpoint index {self.index_path} is not valid JSON ({e})") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(
                f"checkpoint index {self.index_path}: expected an object with a 'weight_map' "
                "of tensor name -> shard file"
            )
        self.metadata: dict = index.get("metadata") or {}
        self._weight_map: dict[str, str] = weight_map
        self._shards: dict[str, _Shard] = {}
        self._closed = False

    # ------------------------------------------------------------------ index (no shard access)

    def names(self) -> list[str]:
        """All tensor names in the index, sorted."""
        return sorted(self._weight_map)

    def __contains__(self, name: object) -> bool:
        return name in self._weight_map

    def __len__(self) -> int:
        return len(self._weight_map)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def shards(self) -> list[str]:
        """Shard file names the index refers to, sorted."""
        return sorted(set(self._weight_map.values()))

    def shard_of(self, name: str) -> str:
        """The shard file (relative to the directory) the index assigns `name` to."""
        try:
            return self._weight_map[name]
        except KeyError:
            close = difflib.get_close_matches(name, self._weight_map, n=3)
            hint = f"; similar names: {close}" if close else ""
            raise CheckpointError(
                f"tensor {name!r} is not in {self.index_path} ({len(self)} tensors){hint}"
            ) from None

    def iter_shard_groups(self) -> Iterator[tuple[str, list[str]]]:
        """Yields (shard file, sorted tensor names) per shard in file order, to stream a conversion."""
        groups: dict[str, list[str]] = {}
        for name in self.names():
            groups.setdefault(self._weight_map[name], []).append(name)
        for shard in sorted(groups):
            yield shard, groups[shard]

    # ------------------------------------------------------------------ shard access

    def _shard(self, shard: str) -> _Shard:
        if self._closed:
            raise CheckpointError(f"checkpoint {self.directory} is closed")
        s = self._shards.get(shard)
        if s is None:
            s = self._shards[shard] = _Shard(self.directory, shard, self.index_path)
        return s

    def info(self, name: str) -> TensorInfo:
        """dtype tag, shape and shard of `name` (parses that shard's header; reads no data)."""
        return self._shard(self.shard_of(name)).locate(name)[0]

    def get(self, name: str) -> np.ndarray:
        """`name` as a read-only memmap view with the checkpoint dtype and shape."""
        return self._shard(self.shard_of(name)).view(name)

    def get_many(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        """{name: get(name)} in the given order."""
        return {name: self.get(name) for name in names}

    def shard_tensor_names(self, shard: str) -> list[str]:
        """Every tensor a shard's header holds (index or not), sorted."""
        return sorted(self._shard(shard).entries(None))

    def close(self) -> None:
        """Drops the maps and parsed headers; arrays already returned stay valid."""
        for s in self._shards.values():
            s.release()
        self._shards.clear()
        self._closed = True

    def __enter__(self) -> HubCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HubCheckpoint({str(self.directory)!r}, {len(self)} tensors in {len(self.shards())} shards)"


# ---------------------------------------------------------------------------------------------
# Inventory: what the hub checkpoint of a config holds


def hub_tensor_inventory(args: ModelArgs) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor name of the hub checkpoint for `args` -> (dtype tag, shape), SPEC §14.1.

    Derived from the config alone. Raises CheckpointError for storage dtypes other than the
    released fp8 / fp4 (the hub layout of other settings is not defined).
    """
    if args.dtype != "fp8" or args.expert_dtype != "fp4":
        raise CheckpointError(
            f"hub_tensor_inventory describes the released storage (dtype 'fp8', expert_dtype 'fp4'); "
            f"got dtype={args.dtype!r}, expert_dtype={args.expert_dtype!r}"
        )
    inv: dict[str, tuple[str, tuple[int, ...]]] = {}
    B = QUANT_BLOCK
    D, hc = args.dim, args.hc_mult

    def put(name: str, tag: str, *shape: int) -> None:
        assert name not in inv, name
        inv[name] = (tag, tuple(shape))

    def fp8(prefix: str, out: int, inp: int) -> None:
        put(f"{prefix}.weight", "F8_E4M3", out, inp)
        put(f"{prefix}.scale", "F8_E8M0", ceil_div(out, B), ceil_div(inp, B))

    def fp4(prefix: str, out: int, inp: int) -> None:
        put(f"{prefix}.weight", "I8", out, inp // 2)
        put(f"{prefix}.scale", "F8_E8M0", out, ceil_div(inp, B))

    def block(p: str, layer: int) -> None:
        put(f"{p}attn_norm.weight", "BF16", D)
        put(f"{p}ffn_norm.weight", "BF16", D)
        mix = (2 + hc) * hc  # pre (hc) + post (hc) + comb (hc x hc)
        for site in ("attn", "ffn"):
            put(f"{p}hc_{site}_fn", "F32", mix, hc * D)
            put(f"{p}hc_{site}_base", "F32", mix)
            put(f"{p}hc_{site}_scale", "F32", 3)
        a = f"{p}attn."
        put(f"{a}attn_sink", "F32", args.n_heads)
        put(f"{a}q_norm.weight", "BF16", args.q_lora_rank)
        put(f"{a}kv_norm.weight", "BF16", args.head_dim)
        fp8(f"{a}wq_a", args.q_lora_rank, D)
        fp8(f"{a}wq_b", args.n_heads * args.head_dim, args.q_lora_rank)
        fp8(f"{a}wkv", args.head_dim, D)
        # stored fp8 on the hub although model.py holds it in bf16 (convert.py dequantizes it)
        fp8(f"{a}wo_a", args.o_groups * args.o_lora_rank, args.n_heads * args.head_dim // args.o_groups)
        fp8(f"{a}wo_b", D, args.o_groups * args.o_lora_rank)
        if args.is_kv_source(layer):
            put(f"{a}compressor.wkv.weight", "BF16", args.head_dim, D)
            if args.compress_ratio(layer) > 1:  # the ratio-1 compressor has no gate
                put(f"{a}compressor.wgate.weight", "BF16", args.head_dim, D)
            put(f"{a}compressor.norm.weight", "BF16", args.head_dim)
            put(f"{a}indexer.wk.weight", "BF16", args.index_head_dim, args.head_dim)
            put(f"{a}indexer.k_norm.weight", "BF16", args.index_head_dim)
        if args.is_index_source(layer):
            fp8(f"{a}indexer.wq_b", args.index_n_heads * args.index_head_dim, args.q_lora_rank)
            put(f"{a}indexer.weights_proj.weight", "BF16", args.index_n_heads, D)
        f = f"{p}ffn."
        n_routed, _ = args.moe_experts(layer)
        put(f"{f}gate.weight", "BF16", n_routed, D)
        put(f"{f}gate.bias", "F32", n_routed)
        if args.vision_enabled:
            put(f"{f}gate.bias_vl", "F32", n_routed)
        shared_inter = args.moe_inter_dim * args.n_shared_experts
        fp8(f"{f}shared_experts.w1", shared_inter, D)
        fp8(f"{f}shared_experts.w2", D, shared_inter)
        fp8(f"{f}shared_experts.w3", shared_inter, D)
        for e in range(n_routed):
            fp4(f"{f}experts.{e}.w1", args.moe_inter_dim, D)
            fp4(f"{f}experts.{e}.w2", D, args.moe_inter_dim)
            fp4(f"{f}experts.{e}.w3", args.moe_inter_dim, D)
        table = args.engram_table_index(layer)
        if table is not None:
            g = f"{p}engram."
            rows, width = args.engram_num_embeddings[table], args.engram_head_dim
            put(f"{g}q_weight", "BF16", hc, D)
            put(f"{g}k_weight", "BF16", hc, D)
            fp8(f"{g}wkv", (hc + 1) * D, args.n_hash_cols * width)  # hc keys + one shared value
            put(f"{g}embed.weight", "F8_E4M3", rows, width)
            put(f"{g}embed.scale", "F8_E8M0", rows, ceil_div(width, B))  # per row per 32 columns

    put("embed.weight", "BF16", args.vocab_size, D)
    for i in range(args.n_layers):
        block(f"layers.{i}.", i)
    put("norm.weight", "BF16", D)
    put("head.weight", "BF16", args.vocab_size, D)

    if args.dspark_enabled:
        last = args.n_mtp_layers - 1
        for s in range(args.n_mtp_layers):
            p = f"mtp.{s}."
            block(p, args.n_layers + s)
            if s == 0:
                put(f"{p}main_norm.weight", "BF16", D)
                fp8(f"{p}main_proj", D, D * len(args.dspark_target_layer_ids))
            if s == last:
                r = args.dspark_markov_rank
                put(f"{p}norm.weight", "BF16", D)
                put(f"{p}markov_head.embed.weight", "BF16", args.vocab_size, r)
                put(f"{p}markov_head.head.weight", "BF16", args.vocab_size, r)
                put(f"{p}confidence_head.proj.weight", "BF16", 1, D + r)

    if args.vision_enabled:
        vd, vi = args.vision_dim, args.vision_inter_dim
        for tok in ("image_start", "image_end", "image_newline"):
            put(tok, "BF16", D)
        put("vision.patch_embed.proj.weight", "BF16", vd, 3 * args.vision_patch_size**2)
        put("vision.patch_embed.proj.bias", "BF16", vd)
        for n in range(args.vision_n_layers):
            v = f"vision.blocks.{n}."
            put(f"{v}norm1.weight", "BF16", vd)
            put(f"{v}norm2.weight", "BF16", vd)
            put(f"{v}attn.wqkv.weight", "BF16", 3 * vd, vd)
            put(f"{v}attn.wqkv.bias", "BF16", 3 * vd)
            put(f"{v}attn.wo.weight", "BF16", vd, vd)
            put(f"{v}attn.wo.bias", "BF16", vd)
            put(f"{v}mlp.w1.weight", "BF16", 2 * vi, vd)  # gate and up, fused
            put(f"{v}mlp.w2.weight", "BF16", vd, vi)
        put("vision.norm.weight", "BF16", vd)
        put("aligner.w1.weight", "BF16", D, vd * args.vision_downsample_ratio**2)
        put("aligner.w1.bias", "BF16", D)
        put("aligner.w2.weight", "BF16", D, D)
        put("aligner.w2.bias", "BF16", D)
    return inv


def inventory_totals(args: ModelArgs) -> tuple[int, int]:
    """(number of tensors, bytes of tensor data) of the hub checkpoint for `args`."""
    inv = hub_tensor_inventory(args)
    n_bytes = sum(math.prod(shape) * _DTYPES[tag].itemsize for tag, shape in inv.values())
    return len(inv), n_bytes


def _listing(title: str, items: list[str]) -> str:
    shown = items[:_MAX_LISTED]
    more = f"\n    ... and {len(items) - len(shown)} more" if len(items) > len(shown) else ""
    return f"  {len(items)} {title}:\n" + "".join(f"    {s}\n" for s in shown) + more


def check_against_inventory(ckpt: HubCheckpoint | str | os.PathLike, args: ModelArgs) -> None:
    """Returns if `ckpt` holds exactly the inventory of `args`; otherwise raises CheckpointError listing
    missing names, unexpected names, dtype/shape mismatches (expected vs found), unreadable entries
    and tensors present in a shard header but absent from the index."""
    if not isinstance(ckpt, HubCheckpoint):
        with HubCheckpoint(ckpt) as opened:
            return check_against_inventory(opened, args)
    expected = hub_tensor_inventory(args)
    indexed = set(ckpt.names())
    missing = sorted(expected.keys() - indexed)
    unexpected = sorted(indexed - expected.keys())
    mismatched, unreadable, failed_shards = [], [], set()
    for name in sorted(indexed & expected.keys()):
        try:
            info = ckpt.info(name)
        except CheckpointError as e:
            unreadable.append(str(e))
            failed_shards.add(ckpt.shard_of(name))
            continue
        tag, shape = expected[name]
        if (info.dtype_tag, info.shape) != (tag, shape):
            mismatched.append(
                f"{name}: expected {tag} {list(shape)}, found {info.dtype_tag} {list(info.shape)} (shard {info.shard})"
            )
    unindexed = []
    for shard in ckpt.shards():
        try:
            in_header = ckpt.shard_tensor_names(shard)
        except CheckpointError as e:
            if shard not in failed_shards:  # otherwise already reported through its tensors
                unreadable.append(str(e))
            continue
        unindexed += [f"{n} (shard {shard})" for n in in_header if n not in ckpt or ckpt.shard_of(n) != shard]
    if not (missing or unexpected or mismatched or unreadable or unindexed):
        return None
    parts = [
        _listing("missing (expected by the config, not in the index)", missing) if missing else "",
        _listing("unexpected (in the index, not expected by the config)", unexpected) if unexpected else "",
        _listing("dtype/shape mismatches", mismatched) if mismatched else "",
        _listing("unreadable", unreadable) if unreadable else "",
        _listing("in a shard header but not mapped to that shard by the index", unindexed) if unindexed else "",
    ]
    raise CheckpointError(
        f"checkpoint {ckpt.directory} does not match the hub inventory of its config "
        f"({len(expected)} tensors expected, {len(indexed)} in the index):\n" + "".join(parts)
    )
