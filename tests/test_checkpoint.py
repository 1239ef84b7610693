"""Hub checkpoint reader and tensor inventory: golden checkpoints read back exactly, the reader is lazy
and memory-mapped, malformed checkpoints fail with messages naming shard and tensor, and the
inventory of the released config has the SPEC §14.1 / §15 totals."""

from __future__ import annotations

import json
import math
import resource
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dsv41_jax.checkpoint import (
    INDEX_FILE,
    CheckpointError,
    HubCheckpoint,
    check_against_inventory,
    hub_tensor_inventory,
    inventory_totals,
)
from dsv41_jax.config import ModelArgs

DATA = Path(__file__).parent / "data"
TINY_A = DATA / "golden" / "tiny-a"
SHARD_A = "model-00001-of-00001.safetensors"
RELEASED = DATA / "released_config.json"

# Written out here rather than imported, so a wrong table in the module cannot agree with itself.
EXPECTED_DTYPE = {
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I8": np.dtype(np.int8),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
}


# ------------------------------------------------------------------ helpers (independent of the reader)


def _read_shard(path: Path) -> tuple[dict, bytes]:
    """(header with __metadata__, data section) of a safetensors file."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_shard(path: Path, header: dict, data: bytes) -> None:
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def _write_index(directory: Path, weight_map: dict[str, str]) -> None:
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _golden_copy(tmp_path: Path, *, shard: bool = True) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copy(TINY_A / INDEX_FILE, d / INDEX_FILE)
    if shard:
        shutil.copy(TINY_A / SHARD_A, d / SHARD_A)
    return d


def _edit_header(shard: Path, edit) -> None:
    header, data = _read_shard(shard)
    edit(header)
    _write_shard(shard, header, data)


def _assert_names(err: pytest.ExceptionInfo, *parts: str) -> None:
    msg = str(err.value)
    for p in parts:
        assert p in msg, f"{p!r} not in error message: {msg}"


# ------------------------------------------------------------------ golden checkpoints


def test_golden_index_names_equal_the_config_inventory(golden):
    inv = hub_tensor_inventory(golden.args)
    with HubCheckpoint(golden.path) as ckpt:
        assert set(ckpt.names()) == set(inv)
        assert ckpt.names() == sorted(inv)
        assert len(ckpt) == len(inv)


def test_every_golden_tensor_reads_back_with_inventory_dtype_and_shape(golden):
    inv = hub_tensor_inventory(golden.args)
    with HubCheckpoint(golden.path) as ckpt:
        for name, (tag, shape) in inv.items():
            info = ckpt.info(name)
            assert (info.dtype_tag, info.shape) == (tag, shape), name
            arr = ckpt.get(name)
            assert arr.dtype == EXPECTED_DTYPE[tag], name
            assert arr.shape == shape, name


def test_check_against_inventory_passes_on_golden(golden):
    with HubCheckpoint(golden.path) as ckpt:
        assert check_against_inventory(ckpt, golden.args) is None
    assert check_against_inventory(golden.path, golden.args) is None  # a directory works too


def test_inventory_totals_equal_golden_index_total_size(golden):
    n, n_bytes = inventory_totals(golden.args)
    index = json.loads((golden.path / INDEX_FILE).read_text())
    assert n == len(index["weight_map"])
    assert n_bytes == index["metadata"]["total_size"]


def test_every_golden_tensor_is_the_raw_file_bytes_at_its_offsets(golden):
    header, data = _read_shard(golden.path / SHARD_A)
    with HubCheckpoint(golden.path) as ckpt:
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            b, e = entry["data_offsets"]
            assert ckpt.get(name).tobytes() == data[b:e], name


def test_non_float8_tensors_equal_what_safetensors_numpy_reads(golden):
    safetensors = pytest.importorskip("safetensors")
    checked = 0
    with HubCheckpoint(golden.path) as ckpt, safetensors.safe_open(golden.path / SHARD_A, framework="numpy") as f:
        for name in ckpt.names():
            if ckpt.info(name).dtype_tag.startswith("F8_"):
                continue
            ref = f.get_tensor(name)
            ours = ckpt.get(name)
            assert ours.dtype == ref.dtype and ours.shape == ref.shape, name
            assert ours.tobytes() == ref.tobytes(), name
            checked += 1
    assert checked > 100


def test_safetensors_numpy_cannot_read_float8_tensors_which_is_why_the_reader_views_bytes():
    safetensors = pytest.importorskip("safetensors")
    with safetensors.safe_open(TINY_A / SHARD_A, framework="numpy") as f:
        for name in ("layers.0.attn.wkv.weight", "layers.0.attn.wkv.scale"):
            with pytest.raises(AttributeError, match="float8"):
                f.get_tensor(name)


def test_e8m0_scales_decode_as_powers_of_two_from_the_exponent_byte():
    with HubCheckpoint(TINY_A) as ckpt:
        for name in ("layers.0.attn.wq_b.scale", "layers.0.ffn.experts.3.w2.scale", "layers.1.engram.embed.scale"):
            arr = ckpt.get(name)
            raw = np.asarray(arr).view(np.uint8).astype(np.int64)
            np.testing.assert_array_equal(arr.astype(np.float64), np.exp2(raw - 127.0), err_msg=name)


def test_bf16_tensor_values_are_the_high_half_of_float32_bits():
    header, data = _read_shard(TINY_A / SHARD_A)
    b, e = header["layers.0.attn_norm.weight"]["data_offsets"]
    bits = np.frombuffer(data[b:e], dtype="<u2").astype(np.uint32) << 16
    with HubCheckpoint(TINY_A) as ckpt:
        got = ckpt.get("layers.0.attn_norm.weight").astype(np.float32)
    np.testing.assert_array_equal(got, bits.view(np.float32))
    assert 0.5 < float(np.mean(got)) < 1.5  # RMSNorm weights are 1 + 0.1 N


# ------------------------------------------------------------------ laziness and memory mapping


def test_opening_reads_only_the_index_not_the_shards(tmp_path):
    d = _golden_copy(tmp_path, shard=False)
    ckpt = HubCheckpoint(d)  # the shard file does not exist: opening must not need it
    assert len(ckpt) == 891 and "embed.weight" in ckpt and "bogus" not in ckpt
    assert ckpt.shard_of("embed.weight") == SHARD_A
    assert [s for s, _ in ckpt.iter_shard_groups()] == [SHARD_A]
    with pytest.raises(CheckpointError) as err:
        ckpt.info("embed.weight")
    _assert_names(err, SHARD_A, "'embed.weight'", "does not exist")


def _split_into_two_shards(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    header, data = _read_shard(TINY_A / SHARD_A)
    header.pop("__metadata__", None)
    names = sorted(header)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    d = tmp_path / "two"
    d.mkdir()
    weight_map = {}
    for shard, group in shards.items():
        new_header, chunks, pos = {"__metadata__": {"format": "pt"}}, [], 0
        for n in group:
            b, e = header[n]["data_offsets"]
            new_header[n] = {**header[n], "data_offsets": [pos, pos + e - b]}
            chunks.append(data[b:e])
            pos += e - b
            weight_map[n] = shard
        _write_shard(d / shard, new_header, b"".join(chunks))
    _write_index(d, weight_map)
    return d, weight_map


def test_get_touches_only_the_shard_of_the_requested_tensor(tmp_path):
    d, weight_map = _split_into_two_shards(tmp_path)
    first, second = sorted(set(weight_map.values()))
    with HubCheckpoint(d) as ckpt, HubCheckpoint(TINY_A) as gold:
        name1 = next(n for n in ckpt.names() if ckpt.shard_of(n) == first)
        name2 = next(n for n in ckpt.names() if ckpt.shard_of(n) == second)
        (d / second).unlink()  # after opening: a later read from `first` must not look at it
        assert ckpt.get(name1).tobytes() == gold.get(name1).tobytes()
        with pytest.raises(CheckpointError) as err:
            ckpt.get(name2)
        _assert_names(err, second, repr(name2))


def test_iter_shard_groups_partitions_the_index_by_shard(tmp_path):
    d, weight_map = _split_into_two_shards(tmp_path)
    with HubCheckpoint(d) as ckpt:
        groups = list(ckpt.iter_shard_groups())
        assert [s for s, _ in groups] == sorted(set(weight_map.values()))
        assert sorted(n for _, names in groups for n in names) == ckpt.names()
        for shard, names in groups:
            assert names == sorted(names) and all(weight_map[n] == shard for n in names)
            many = ckpt.get_many(names)
            assert list(many) == names and all(isinstance(a, np.ndarray) for a in many.values())


def test_returned_arrays_are_readonly_memmap_views_of_the_shard():
    with HubCheckpoint(TINY_A) as ckpt:
        arr = ckpt.get("layers.3.ffn.experts.5.w1.weight")
        assert isinstance(arr, np.memmap)
        assert Path(arr.filename).resolve() == (TINY_A / SHARD_A).resolve()
        assert not arr.flags.writeable and not arr.flags.owndata
    assert arr.dtype == np.int8 and arr[0].size == arr.shape[1]  # still valid after close()


def test_a_4gib_tensor_is_mapped_not_read(tmp_path):
    rows, cols = 1 << 22, 1 << 10  # 4 GiB of F8_E4M3, stored as a sparse file
    d = tmp_path / "big"
    d.mkdir()
    header = {"big.weight": {"dtype": "F8_E4M3", "shape": [rows, cols], "data_offsets": [0, rows * cols]}}
    _write_shard(d / "s.safetensors", header, b"")
    with open(d / "s.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) + rows * cols)
    _write_index(d, {"big.weight": "s.safetensors"})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with HubCheckpoint(d) as ckpt:
        arr = ckpt.get("big.weight")
        assert arr.shape == (rows, cols) and arr.dtype == EXPECTED_DTYPE["F8_E4M3"]
        assert float(arr[-1, -4:].astype(np.float32).sum()) == 0.0
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 256, f"peak RSS grew by {grown_mib:.0f} MiB"


# ------------------------------------------------------------------ malformed checkpoints


def test_missing_index_names_the_index_file(tmp_path):
    with pytest.raises(CheckpointError) as err:
        HubCheckpoint(tmp_path)
    _assert_names(err, str(tmp_path / INDEX_FILE), "weight_map")


def test_index_without_weight_map_is_rejected(tmp_path):
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError) as err:
        HubCheckpoint(tmp_path)
    _assert_names(err, INDEX_FILE, "weight_map")


def test_missing_shard_names_shard_and_tensor(tmp_path):
    d = _golden_copy(tmp_path)
    (d / SHARD_A).unlink()
    with HubCheckpoint(d) as ckpt, pytest.raises(CheckpointError) as err:
        ckpt.get("layers.2.attn.compressor.wkv.weight")
    _assert_names(err, SHARD_A, "'layers.2.attn.compressor.wkv.weight'", "does not exist", INDEX_FILE)


def test_truncated_shard_names_shard_and_the_cut_tensor_while_earlier_tensors_still_read(tmp_path):
    d = _golden_copy(tmp_path)
    header, _ = _read_shard(d / SHARD_A)
    header.pop("__metadata__")
    last = max(header, key=lambda n: header[n]["data_offsets"][1])
    first = min(header, key=lambda n: header[n]["data_offsets"][0])
    with open(d / SHARD_A, "r+b") as f:
        f.truncate(f.seek(0, 2) - 3)
    with HubCheckpoint(d) as ckpt:
        assert ckpt.get(first).size > 0
        with pytest.raises(CheckpointError) as err:
            ckpt.get(last)
    _assert_names(err, SHARD_A, repr(last), "truncated")


def test_shard_shorter_than_its_header_length_field_is_reported_as_truncated(tmp_path):
    d = _golden_copy(tmp_path)
    with open(d / SHARD_A, "r+b") as f:
        f.truncate(200)
    with HubCheckpoint(d) as ckpt, pytest.raises(CheckpointError) as err:
        ckpt.get("norm.weight")
    _assert_names(err, SHARD_A, "'norm.weight'", "header length", "truncated")


def test_corrupt_header_json_names_shard_and_tensor(tmp_path):
    d = _golden_copy(tmp_path)
    raw = bytearray((d / SHARD_A).read_bytes())
    raw[8:40] = b"{not json at all, definitely!!!!"[:32]
    (d / SHARD_A).write_bytes(bytes(raw))
    with HubCheckpoint(d) as ckpt, pytest.raises(CheckpointError) as err:
        ckpt.info("head.weight")
    _assert_names(err, SHARD_A, "'head.weight'", "not valid JSON")


def test_shape_that_disagrees_with_the_byte_span_names_shard_tensor_and_sizes(tmp_path):
    d = _golden_copy(tmp_path)
    _edit_header(d / SHARD_A, lambda h: h["layers.0.attn.wkv.weight"].update(shape=[64, 63]))
    with HubCheckpoint(d) as ckpt, pytest.raises(CheckpointError) as err:
        ckpt.get("layers.0.attn.wkv.weight")
    _assert_names(err, SHARD_A, "'layers.0.attn.wkv.weight'", "4032 bytes", "span 4096 bytes")


def test_unknown_dtype_tag_names_shard_tensor_and_tag(tmp_path):
    d = _golden_copy(tmp_path)
    _edit_header(d / SHARD_A, lambda h: h["layers.0.attn.attn_sink"].update(dtype="F4_E2M1X2"))
    with HubCheckpoint(d) as ckpt:
        assert ckpt.get("layers.0.attn.wkv.weight").shape == (64, 64)  # other tensors unaffected
        with pytest.raises(CheckpointError) as err:
            ckpt.get("layers.0.attn.attn_sink")
    _assert_names(err, SHARD_A, "'layers.0.attn.attn_sink'", "'F4_E2M1X2'", "F8_E8M0")


def test_index_entry_for_a_tensor_the_shard_lacks_names_shard_and_tensor(tmp_path):
    d = _golden_copy(tmp_path)
    index = json.loads((d / INDEX_FILE).read_text())
    index["weight_map"]["layers.0.attn.ghost.weight"] = SHARD_A
    (d / INDEX_FILE).write_text(json.dumps(index))
    with HubCheckpoint(d) as ckpt, pytest.raises(CheckpointError) as err:
        ckpt.get("layers.0.attn.ghost.weight")
    _assert_names(err, SHARD_A, "'layers.0.attn.ghost.weight'", "no such tensor", INDEX_FILE)


def test_name_not_in_the_index_is_an_error_naming_it_and_suggesting_close_names():
    with HubCheckpoint(TINY_A) as ckpt, pytest.raises(CheckpointError) as err:
        ckpt.get("layers.0.attn.wkv.weigth")
    _assert_names(err, "'layers.0.attn.wkv.weigth'", INDEX_FILE, "layers.0.attn.wkv.weight")


def test_closed_checkpoint_refuses_reads():
    ckpt = HubCheckpoint(TINY_A)
    ckpt.close()
    with pytest.raises(CheckpointError, match="closed"):
        ckpt.get("embed.weight")


def test_check_against_inventory_lists_missing_unexpected_mismatched_and_unindexed(tmp_path):
    d = _golden_copy(tmp_path)
    index = json.loads((d / INDEX_FILE).read_text())
    del index["weight_map"]["layers.4.engram.embed.scale"]  # still in the header: unindexed too
    index["weight_map"]["layers.0.attn.wo_a.bias"] = SHARD_A
    (d / INDEX_FILE).write_text(json.dumps(index))

    def edit(h):
        h["layers.0.attn.wkv.weight"].update(shape=[32, 128])  # same byte count, wrong shape
        h["layers.0.ffn.experts.0.w1.weight"].update(dtype="U8")  # same itemsize, wrong dtype

    _edit_header(d / SHARD_A, edit)
    args = ModelArgs.from_json(TINY_A)
    with pytest.raises(CheckpointError) as err:
        check_against_inventory(d, args)
    _assert_names(
        err,
        "1 missing",
        "layers.4.engram.embed.scale",
        "1 unexpected",
        "layers.0.attn.wo_a.bias",
        "2 dtype/shape mismatches",
        "layers.0.attn.wkv.weight: expected F8_E4M3 [64, 64], found F8_E4M3 [32, 128]",
        "layers.0.ffn.experts.0.w1.weight: expected I8 [64, 32], found U8 [64, 32]",
        "layers.4.engram.embed.scale (shard " + SHARD_A,
    )


def test_check_against_inventory_fails_for_another_config(golden):
    other = golden.args.replace(vision_n_layers=0 if golden.args.vision_enabled else 1)
    with pytest.raises(CheckpointError, match="does not match"):
        check_against_inventory(golden.path, other)


# ------------------------------------------------------------------ inventory of the released config


@pytest.fixture(scope="module")
def released() -> ModelArgs:
    return ModelArgs.from_json(RELEASED)


def test_released_inventory_has_96085_tensors(released):
    n, n_bytes = inventory_totals(released)
    assert n == 96_085  # SPEC §14.1
    assert 500e9 < n_bytes < 520e9  # "~510 GB total"


def test_released_inventory_parameter_count_equals_spec_arithmetic(released):
    # SPEC §15: 763,205,315,794 stored parameters (fp4 bytes hold two, scales not counted)
    inv = hub_tensor_inventory(released)
    params = sum(
        math.prod(shape) * (2 if tag == "I8" else 1)
        for name, (tag, shape) in inv.items()
        if not name.endswith(".scale")
    )
    assert params == 763_205_315_794


@pytest.mark.parametrize(
    "name, tag, shape",
    [
        ("layers.0.attn.wq_a.scale", "F8_E8M0", (40, 160)),
        ("layers.7.attn.wq_b.weight", "F8_E4M3", (32768, 1280)),
        ("layers.2.attn.wo_a.weight", "F8_E4M3", (8192, 4096)),
        ("layers.2.attn.wo_a.scale", "F8_E8M0", (256, 128)),
        ("layers.39.attn.wo_b.scale", "F8_E8M0", (160, 256)),
        ("layers.5.hc_ffn_fn", "F32", (24, 20480)),
        ("layers.5.ffn.gate.bias_vl", "F32", (384,)),
        ("layers.0.ffn.experts.383.w1.weight", "I8", (2304, 2560)),
        ("layers.0.ffn.experts.383.w1.scale", "F8_E8M0", (2304, 160)),
        ("layers.0.ffn.experts.0.w2.weight", "I8", (5120, 1152)),
        ("layers.0.ffn.experts.0.w2.scale", "F8_E8M0", (5120, 72)),
        ("layers.0.ffn.shared_experts.w2.scale", "F8_E8M0", (160, 72)),
        ("layers.20.attn.compressor.wkv.weight", "BF16", (512, 5120)),
        ("layers.8.attn.compressor.wgate.weight", "BF16", (512, 5120)),
        ("layers.14.attn.indexer.wk.weight", "BF16", (128, 512)),
        ("layers.36.attn.indexer.wq_b.scale", "F8_E8M0", (128, 40)),
        ("layers.36.attn.indexer.weights_proj.weight", "BF16", (32, 5120)),
        ("layers.1.engram.wkv.weight", "F8_E4M3", (25600, 6144)),
        ("layers.1.engram.wkv.scale", "F8_E8M0", (800, 192)),
        ("layers.14.engram.embed.weight", "F8_E4M3", (384016682, 256)),
        ("layers.14.engram.embed.scale", "F8_E8M0", (384016682, 8)),
        ("layers.1.engram.q_weight", "BF16", (4, 5120)),
        ("mtp.1.ffn.gate.weight", "BF16", (128, 5120)),
        ("mtp.2.ffn.experts.127.w3.weight", "I8", (2304, 2560)),
        ("mtp.0.main_proj.weight", "F8_E4M3", (5120, 15360)),
        ("mtp.0.main_proj.scale", "F8_E8M0", (160, 480)),
        ("mtp.2.markov_head.head.weight", "BF16", (129280, 256)),
        ("mtp.2.confidence_head.proj.weight", "BF16", (1, 5376)),
        ("head.weight", "BF16", (129280, 5120)),
        ("aligner.w1.weight", "BF16", (5120, 9216)),
        ("vision.patch_embed.proj.weight", "BF16", (1024, 588)),
        ("vision.blocks.31.mlp.w1.weight", "BF16", (5632, 1024)),
        ("vision.blocks.31.mlp.w2.weight", "BF16", (1024, 2816)),
        ("vision.blocks.0.attn.wqkv.bias", "BF16", (3072,)),
        ("image_newline", "BF16", (5120,)),
    ],
)
def test_released_inventory_entry_matches_spec_table(released, name, tag, shape):
    assert hub_tensor_inventory(released)[name] == (tag, shape)


@pytest.mark.parametrize(
    "absent",
    [
        "layers.20.attn.compressor.wgate.weight",  # ratio-1 compressor has no gate
        "layers.24.attn.compressor.wkv.weight",  # reindex layer: query side only
        "layers.24.attn.indexer.wk.weight",
        "layers.3.attn.indexer.wq_b.weight",  # reuse layer: no indexer
        "layers.0.engram.wkv.weight",
        "mtp.0.attn.compressor.wkv.weight",
        "mtp.0.ffn.experts.128.w1.weight",  # DSpark stages have 128 experts
        "mtp.1.main_proj.weight",  # stage 0 only
        "mtp.0.markov_head.embed.weight",  # last stage only
        "vision.blocks.32.norm1.weight",
    ],
)
def test_released_inventory_omits_tensors_the_layer_role_does_not_have(released, absent):
    assert absent not in hub_tensor_inventory(released)


def test_inventory_without_vision_or_dspark_has_no_such_tensors(released):
    inv = hub_tensor_inventory(released.replace(vision_n_layers=0, n_mtp_layers=0))
    assert not [n for n in inv if n.startswith(("vision.", "aligner.", "image_", "mtp.")) or n.endswith("bias_vl")]
    assert "layers.0.ffn.gate.bias" in inv


def test_inventory_rejects_storage_dtypes_the_hub_does_not_use(released):
    with pytest.raises(CheckpointError, match="expert_dtype"):
        hub_tensor_inventory(released.replace(expert_dtype=None))
