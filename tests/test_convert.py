"""dsv41-convert: coverage and inventory errors, keep-mode bit identity, atomic output and
--resume (with content checksums), Engram row padding, dropped hub tensors with their reasons,
the bf16 debug mode, and convert -> load round trips against direct loading."""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from conftest import Child, max_routed_scale_byte
from convert import ConversionError, convert_checkpoint, main
from convert.plan import DROP_REASONS, engram_rows_multiple
from dsv41_jax import quant
from dsv41_jax import sharding as shd
from dsv41_jax.checkpoint import INDEX_FILE, HubCheckpoint, hub_tensor_inventory
from dsv41_jax.checkpoint_io import ConvertedCheckpointError, load_converted, read_manifest
from dsv41_jax.config import ModelArgs
from dsv41_jax.loading import load_hub_weights, module_param_paths
from dsv41_jax.engram import Engram
from dsv41_jax.model import Transformer
from dsv41_jax.parity import NOT_IN_TEXT_MODEL, load_model
from dsv41_jax.synthetic import write_synthetic_checkpoint

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "data" / "golden"
# fp4_relaid's default as the loaders resolve it ("auto": re-laid only where the compiled GPU kernel runs)
RELAID = {"on": "on", "off": "off"}.get(ModelArgs.fp4_relaid, "on" if jax.default_backend() == "gpu" else "off")
QUANTISED = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e8m0fnu), np.dtype(np.int8))


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


def _params(model) -> dict[str, np.ndarray]:
    return {p: np.asarray(v[...]) for p, v in module_param_paths(model).items()}


def _assert_params_bit_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for p, w in want.items():
        assert got[p].dtype == w.dtype and got[p].shape == w.shape, p
        assert np.array_equal(_bits(got[p]), _bits(w)), f"{p} differs"


@pytest.fixture(scope="module")
def tiny_args() -> ModelArgs:
    return ModelArgs.tiny()


@pytest.fixture(scope="module")
def tiny_hub(tmp_path_factory, tiny_args) -> Path:
    d = tmp_path_factory.mktemp("hub") / "tiny"
    write_synthetic_checkpoint(d, tiny_args, shard_bytes=200_000, seed=3)
    return d


@pytest.fixture(scope="module")
def tiny_converted(tmp_path_factory, tiny_hub) -> Path:
    out = tmp_path_factory.mktemp("out") / "tiny"
    convert_checkpoint(tiny_hub, out, progress=False)
    return out


def _direct(hub: Path, args: ModelArgs) -> dict[str, np.ndarray]:
    model = Transformer(args)
    load_hub_weights(model, hub)
    return _params(model)


def _tampered_hub(tmp_path: Path, args: ModelArgs, edit) -> Path:
    inv = dict(hub_tensor_inventory(args))
    edit(inv)
    d = tmp_path / "hub"
    write_synthetic_checkpoint(d, args, shard_bytes=200_000, inventory=inv)
    return d


# --------------------------------------------------------------------------------- coverage


def test_missing_unknown_and_duplicated_names_are_all_listed_and_nothing_is_written(tmp_path, tiny_args):
    def edit(inv):
        del inv["layers.3.attn.wkv.scale"]
        inv["layers.3.attn.wkv.bias"] = ("BF16", (64,))

    hub = _tampered_hub(tmp_path, tiny_args, edit)
    index = json.loads((hub / INDEX_FILE).read_text())
    # a name listed twice in the index JSON (json.load alone would keep only the last)
    entries = [f'"{k}": "{v}"' for k, v in index["weight_map"].items()]
    entries.append(f'"layers.0.attn_norm.weight": "{index["weight_map"]["layers.0.attn_norm.weight"]}"')
    (hub / INDEX_FILE).write_text('{"weight_map": {' + ", ".join(entries) + "}}")
    out = tmp_path / "out"
    with pytest.raises(ConversionError) as e:
        convert_checkpoint(hub, out, progress=False)
    msg = str(e.value)
    assert "1 duplicated:\n    layers.0.attn_norm.weight (listed 2 times" in msg
    assert "1 missing (expected by the config, not in the index):\n    layers.3.attn.wkv.scale" in msg
    assert "1 unexpected (in the index, not expected by the config):\n    layers.3.attn.wkv.bias" in msg
    assert not out.exists() and not out.with_name("out.partial").exists()


def test_dtype_and_shape_mismatches_name_the_tensor_expected_and_found(tmp_path, tiny_args):
    def edit(inv):
        inv["layers.2.attn.q_norm.weight"] = ("F32", inv["layers.2.attn.q_norm.weight"][1])
        inv["layers.4.ffn.experts.5.w2.weight"] = ("I8", (64, 64))

    hub = _tampered_hub(tmp_path, tiny_args, edit)
    with pytest.raises(ConversionError) as e:
        convert_checkpoint(hub, tmp_path / "out", progress=False)
    msg = str(e.value)
    assert "2 dtype/shape mismatches" in msg
    assert "layers.2.attn.q_norm.weight: expected BF16 [64], found F32 [64]" in msg
    assert "layers.4.ffn.experts.5.w2.weight: expected I8 [64, 32], found I8 [64, 64]" in msg
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_truncated_shard_is_refused_naming_the_shard_and_cut_tensor_and_nothing_is_written(tmp_path, tiny_hub):
    hub = tmp_path / "hub"
    shutil.copytree(tiny_hub, hub)
    shard = sorted(hub.glob("*.safetensors"))[-1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    out = tmp_path / "out"
    with pytest.raises(ConversionError) as e:
        convert_checkpoint(hub, out, progress=False)
    assert re.search(rf"{shard.name}.*truncated", str(e.value)), str(e.value)
    assert not out.exists() and not (tmp_path / "out.partial").exists()
    with pytest.raises(ConvertedCheckpointError):
        load_converted(out)


def test_mesh_whose_expert_axis_does_not_divide_the_experts_is_refused_before_any_write(tmp_path, tiny_hub, capsys):
    out = tmp_path / "out"
    rc = main(["--hf-ckpt", str(tiny_hub), "--out", str(out), "--mesh", "expert=3", "--no-progress"])
    assert rc == 2
    assert "the expert axis (3) must divide the number of routed experts (8)" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_engram_config_without_a_token_map_is_refused_naming_the_file(tmp_path, tiny_hub):
    hub = tmp_path / "hub"
    shutil.copytree(tiny_hub, hub)
    (hub / "engram_map.npy").unlink()
    with pytest.raises(ConversionError, match=r"Engram layers \[1\].*engram_map\.npy does not exist.*--engram-map"):
        convert_checkpoint(hub, tmp_path / "out", progress=False)
    assert not (tmp_path / "out.partial").exists()


def test_cli_reports_a_bad_mesh_with_exit_code_2(tmp_path, tiny_hub, capsys):
    rc = main(["--hf-ckpt", str(tiny_hub), "--out", str(tmp_path / "o"), "--mesh", "expert=8,rows=2", "--no-progress"])
    assert rc == 2
    assert "unknown axis 'rows'" in capsys.readouterr().err


# ------------------------------------------------------------------------------ keep mode


def test_keep_mode_writes_every_quantised_value_and_scale_bit_identical(tiny_converted, tiny_hub):
    model, _ = load_converted(tiny_converted)
    hub = HubCheckpoint(tiny_hub)
    params = _params(model)
    n_quantised = 0
    for path, value in params.items():
        if value.dtype not in QUANTISED:
            continue
        n_quantised += 1
        if ".ffn.experts.w" in path:
            head, w, kind = path.rsplit(".", 2)
            want = np.stack([hub.get(f"{head}.{e}.{w}.{kind}") for e in range(value.shape[0])])
        else:
            want = hub.get(path)
        assert want.dtype == value.dtype and np.array_equal(_bits(want), _bits(value)), path
    assert n_quantised > 100
    # wo_a stays fp8 with its scales (the reference's convert.py widens it; same values)
    assert params["layers.2.attn.wo_a.weight"].dtype == ml_dtypes.float8_e4m3fn
    assert params["layers.2.attn.wo_a.scale"].dtype == ml_dtypes.float8_e8m0fnu
    # the non-quantised conversion: exact bf16 -> f32 widening
    np.testing.assert_array_equal(params["head.weight"], np.asarray(hub.get("head.weight"), np.float32))


def test_load_converted_resolves_fp4_scale_fold_against_the_restored_scales(tiny_converted, tiny_hub):
    top = max_routed_scale_byte(tiny_hub)
    assert top <= 128  # the synthetic scales: 2^-k for a weight RMS ~ 1/sqrt(fan-in)
    _, args = load_converted(tiny_converted, fp4_scale_fold="off")
    assert args.fp4_scale_fold == "off"
    model, args = load_converted(tiny_converted)  # the default: "auto"
    assert args.fp4_scale_fold == "on" == model.args.fp4_scale_fold
    assert model.layers[0].ffn.experts.scale_fold


def test_manifest_records_every_param_with_its_dtype_shape_and_spec(tiny_converted, tiny_args):
    manifest = read_manifest(tiny_converted)
    params = {p: rec for g in manifest["groups"] for p, rec in g["params"].items()}
    assert params.keys() == module_param_paths(nnx.eval_shape(lambda: Transformer(tiny_args))).keys()
    assert params["layers.3.ffn.experts.w1.weight"] == {"dtype": "int8", "shape": [8, 64, 32],
                                                        "spec": ["expert", None, None], "how": "copy", "sources": 8}
    kinds = {g["name"]: g["kind"] for g in manifest["groups"]}
    assert kinds["layers.1.engram.embed"] == "table" and kinds["layers.1"] == "orbax"
    assert manifest["engram_rows_multiple"] == 1  # one device: nothing to pad
    assert params["layers.2.attn.wo_a.weight"]["how"] == params["layers.2.attn.wo_a.scale"]["how"] == "copy"


def test_an_output_of_format_1_is_refused_with_a_request_to_convert_again(tiny_converted, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    manifest = json.loads((tiny_converted / "manifest.json").read_text())
    (old / "manifest.json").write_text(json.dumps({**manifest, "version": 1}))
    with pytest.raises(ConvertedCheckpointError, match="version 1; this reader understands .* version 2 .*dsv41-convert"):
        read_manifest(old)


# --------------------------------------------------------------------- Engram row padding


def test_engram_rows_are_padded_to_the_mesh_split_recorded_and_loaded_with_the_padded_shape(tmp_path, tiny_hub,
                                                                                            tiny_args):
    rows = tiny_args.engram_num_embeddings[0]
    assert rows == 1618  # = 2 x 809: no split of 4 or 8 without padding
    out = tmp_path / "out"
    summary = convert_checkpoint(tiny_hub, out, mesh="expert=8", progress=False)  # converting needs no devices
    manifest = read_manifest(out)
    assert manifest["engram_rows_multiple"] == summary["plan"]["engram_rows_multiple"] == 8
    table = next(g for g in manifest["groups"] if g["name"] == "layers.1.engram.embed")["params"]
    assert table["layers.1.engram.embed.weight"] == {
        "dtype": "float8_e4m3fn", "shape": [1624, tiny_args.engram_head_dim],
        "spec": [["expert", "data", "tensor"], None], "how": "copy", "sources": 1, "pad_rows": 6}
    assert table["layers.1.engram.embed.scale"]["shape"] == [1624, tiny_args.engram_head_dim // 32]
    # restored here on one device, with the stored (padded) shape: hub rows bit for bit, then zero bytes
    model, args = load_converted(out)
    assert args == tiny_args.replace(engram_rows_multiple=8, fp4_scale_fold="on", fp4_relaid=RELAID)  # "auto"s resolved
    params, direct = _params(model), _direct(tiny_hub, tiny_args)
    for p, want in direct.items():
        got = params[p]
        if ".engram.embed." in p:
            assert got.shape == (1624, *want.shape[1:]), p
            assert np.array_equal(_bits(got[:rows]), _bits(want)) and not _bits(got[rows:]).any(), p
        else:
            assert np.array_equal(_bits(got), _bits(want)), p
    with pytest.raises(ConvertedCheckpointError, match="rows padded to a multiple of 8"):
        load_converted(out, engram_rows_multiple=1)


def test_released_engram_tables_take_an_eighth_per_device_on_expert8_once_padded():
    released = ModelArgs.from_json(REPO / "tests" / "data" / "released_config.json")
    sizes = shd.parse_mesh_spec("expert=8,data=1")
    assert engram_rows_multiple(sizes) == 8

    def per_device_bytes(args: ModelArgs, layer: int) -> int:
        params = nnx.state(nnx.eval_shape(lambda: Engram(layer, args)), nnx.Param)
        total = 0
        for kind in ("weight", "scale"):
            a = params["embed"][kind].get_value()
            spec = shd.logical_to_spec(("engram_rows", "engram_dim"), a.shape, sizes, name=f"layers.{layer}.{kind}")
            split = 1 if spec[0] is None else int(np.prod([sizes[x] for x in spec[0]]))
            total += a.shape[0] // split * a.shape[1] * a.dtype.itemsize
        return total

    # layer 14: 384,016,682 rows x (256 + 8) bytes, replicated as shipped; padded to 384,016,688, an eighth each
    assert per_device_bytes(released, 14) == 384_016_682 * 264 == 101_380_404_048
    assert per_device_bytes(released.replace(engram_rows_multiple=8), 14) == 384_016_688 // 8 * 264 == 12_672_550_704
    # layer 1 (384,006,168 = 8 x 48,000,771 rows) splits either way and gets no padding
    assert per_device_bytes(released, 1) == per_device_bytes(released.replace(engram_rows_multiple=8), 1) == \
        384_006_168 // 8 * 264


# ------------------------------------------------------------------------ atomicity, resume


class _Crash(RuntimeError):
    pass


def _crash_after(n: int):
    done = []

    def hook(group):
        done.append(group.name)
        if len(done) == n:
            raise _Crash(f"simulated crash after {group.name}")

    return hook


def test_a_crash_mid_run_leaves_nothing_that_loads_and_resume_finishes_it(tmp_path, tiny_hub, tiny_args):
    out = tmp_path / "out"
    partial = tmp_path / "out.partial"
    with pytest.raises(_Crash):
        convert_checkpoint(tiny_hub, out, progress=False, on_group_done=_crash_after(6))
    assert not out.exists() and partial.is_dir()
    for d in (out, partial):
        with pytest.raises(ConvertedCheckpointError):
            load_converted(d)
    with pytest.raises(ConversionError, match="pass --resume"):
        convert_checkpoint(tiny_hub, out, progress=False)
    # one finished group loses its data: resume must notice and rewrite it, not skip it
    first = json.loads((partial / "run.json").read_text())
    assert first["dtype_mode"] == "keep"
    shutil.rmtree(partial / "state" / "layers.0")
    # and an Orbax save cut off mid-group leaves its temporary directory behind
    (partial / "state" / "layers.3.orbax-checkpoint-tmp-1234").mkdir()
    summary = convert_checkpoint(tiny_hub, out, progress=False, resume=True)
    assert summary["groups_skipped"] == 5
    assert summary["groups_written"] == summary["plan"]["groups"] - 5
    assert not partial.exists() and not list((out / "state").glob("*tmp*"))
    model, _ = load_converted(out)
    _assert_params_bit_equal(_params(model), _direct(tiny_hub, tiny_args))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


# Orbax stamps these two files of every save with the time; everything else is a function of the inputs
_TIMESTAMPED = ("_CHECKPOINT_METADATA", "commit_success.txt")


def _file_digests(out: Path) -> dict[str, str]:
    files = {}
    for rec in (out / "progress").glob("*.json"):
        files.update(json.loads(rec.read_text())["files"])
    return {p: d for p, d in files.items() if not p.endswith(_TIMESTAMPED)}


def test_resume_rewrites_groups_whose_stored_bytes_no_longer_match_their_checksums(tmp_path, tiny_hub, tiny_args,
                                                                                  tiny_converted, caplog):
    out, partial = tmp_path / "out", tmp_path / "out.partial"
    with pytest.raises(_Crash):
        convert_checkpoint(tiny_hub, out, progress=False, on_group_done=_crash_after(9))
    # same-size damage that no shape or record check sees: one bit in an Orbax array chunk, one in a table chunk
    layer1 = [f for f in (partial / "state" / "layers.1").rglob("*") if f.is_file()]
    _flip_byte(max(layer1, key=lambda f: f.stat().st_size))
    _flip_byte(partial / "tables" / "layers.1.engram.embed.weight" / "c" / "0" / "0")
    with caplog.at_level(logging.WARNING, logger="convert.stream"):
        summary = convert_checkpoint(tiny_hub, out, progress=False, resume=True)
    warned = [r.getMessage() for r in caplog.records if "recorded checksums" in r.getMessage()]
    assert [m.split(":")[0] for m in warned] == ["group layers.1", "group layers.1.engram.embed"]
    assert summary["groups_skipped"] == 7 and summary["groups_written"] == summary["plan"]["groups"] - 7
    # the result is the clean conversion's: every file (bar Orbax's timestamps) and every group checksum
    assert _file_digests(out) == _file_digests(tiny_converted)
    model, _ = load_converted(out)
    _assert_params_bit_equal(_params(model), _direct(tiny_hub, tiny_args))


_KILLED_CHILD = """
import os, signal, sys
from convert import convert_checkpoint
done = []
def kill_after(group):
    done.append(group.name)
    if len(done) == int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)
convert_checkpoint(sys.argv[1], sys.argv[2], progress=False, on_group_done=kill_after)
"""


def test_a_killed_conversion_resumes_to_the_same_checkpoint(tmp_path, tiny_hub, tiny_converted):
    out = tmp_path / "out"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _KILLED_CHILD, str(tiny_hub), str(out), "12"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == -9, proc.stderr[-2000:]  # SIGKILL: no cleanup of any kind ran
    assert not out.exists() and len(list((tmp_path / "out.partial" / "progress").glob("*.json"))) == 12
    summary = convert_checkpoint(tiny_hub, out, progress=False, resume=True)
    assert summary["groups_skipped"] == 12
    assert _file_digests(out) == _file_digests(tiny_converted)
    # every group carries a checksum; the tables' (no timestamped files) equal the clean run's
    got, want = ({g["name"]: g["sha256"] for g in read_manifest(d)["groups"]} for d in (out, tiny_converted))
    assert got.keys() == want.keys() and all(re.fullmatch("[0-9a-f]{64}", v) for v in got.values())
    assert got["layers.1.engram.embed"] == want["layers.1.engram.embed"]


def test_resume_refuses_a_run_with_different_options(tmp_path, tiny_hub):
    out = tmp_path / "out"
    with pytest.raises(_Crash):
        convert_checkpoint(tiny_hub, out, progress=False, on_group_done=_crash_after(2))
    with pytest.raises(ConversionError, match=r"differs from this one in \['dtype_mode'\]"):
        convert_checkpoint(tiny_hub, out, progress=False, resume=True, dtype="bf16")


def test_an_existing_output_is_never_overwritten(tiny_converted, tiny_hub):
    with pytest.raises(ConversionError, match="already exists"):
        convert_checkpoint(tiny_hub, tiny_converted, progress=False)


# ------------------------------------------------------------------------------ bf16 mode


def test_bf16_mode_loads_as_the_bf16_model_with_dequantised_weights(tmp_path, tiny_hub):
    out = tmp_path / "bf16"
    convert_checkpoint(tiny_hub, out, dtype="bf16", progress=False)
    model, args = load_converted(out)
    assert (args.dtype, args.expert_dtype) == ("bf16", None)
    hub = HubCheckpoint(tiny_hub)
    params = _params(model)
    assert "layers.2.attn.wq_a.scale" not in params and "layers.2.ffn.experts.w1.scale" not in params
    wq_a = quant.dequant_fp8_weight(jnp.asarray(hub.get("layers.2.attn.wq_a.weight")),
                                    jnp.asarray(hub.get("layers.2.attn.wq_a.scale")), jnp.bfloat16)
    assert np.array_equal(_bits(params["layers.2.attn.wq_a.weight"]), _bits(wq_a))
    e5 = quant.dequant_fp4_weight(jnp.asarray(hub.get("layers.2.ffn.experts.5.w1.weight")),
                                  jnp.asarray(hub.get("layers.2.ffn.experts.5.w1.scale")), jnp.bfloat16)
    assert np.array_equal(_bits(params["layers.2.ffn.experts.w1.weight"][5]), _bits(e5))
    # the Engram table is fp8 in the bf16 model too, so it is still copied bit for bit
    assert np.array_equal(_bits(params["layers.1.engram.embed.weight"]), _bits(hub.get("layers.1.engram.embed.weight")))


# ----------------------------------------------------------------------- golden round trip


@pytest.fixture(scope="module")
def prefill():
    return nnx.jit(lambda model, ids: model(ids))


def test_convert_then_load_equals_direct_loading_bit_for_bit_with_identical_logits(tmp_path, golden, prefill, capsys):
    gs = golden  # every golden set, DSV41_EXTRA_GOLDEN ones included
    out = tmp_path / gs.name
    assert main(["--hf-ckpt", str(gs.path), "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    rt = gs.inputs.get("runtime", {})
    converted, args = load_converted(out, max_batch_size=rt.get("max_batch_size", 4),
                                     max_seq_len=rt.get("max_seq_len", 4096))
    # "auto"s resolved: every routed scale byte <= 128; the layout by backend
    assert args == gs.args.replace(fp4_scale_fold="on", fp4_relaid=RELAID)
    direct = load_model(gs)
    _assert_params_bit_equal(_params(converted), _params(direct))
    assert np.array_equal(np.asarray(converted.token_map[...]), np.load(gs.path / "engram_map.npy"))
    # everything the text model does not hold is dropped with its prefix's reason, recorded and printed
    # (tiny-c has vision + DSpark); each hub tensor is converted or dropped, never both, never neither
    manifest = read_manifest(out)
    dropped = manifest["dropped"]
    assert set(DROP_REASONS) == set(NOT_IN_TEXT_MODEL)
    assert all(reason == next(r for p, r in DROP_REASONS.items() if n.startswith(p)) for n, reason in dropped.items())
    assert (len(dropped) > 0) == (gs.args.vision_enabled or gs.args.dspark_enabled)
    assert f"{len(dropped)} hub tensors dropped" in printed
    summary = manifest["dropped_summary"]
    assert sum(row["tensors"] for row in summary) == len(dropped)
    for row in summary:
        assert f"dropped {row['tensors']} tensors {row['prefix']} " in printed and row["reason"] in printed
    prefixes = {row["prefix"] for row in summary}
    assert ("mtp.*" in prefixes) == gs.args.dspark_enabled and ("vision.*" in prefixes) == gs.args.vision_enabled
    consumed = [n for rec in (out / "progress").glob("*.json") for n in json.loads(rec.read_text())["consumed"]]
    assert len(consumed) == len(set(consumed)) and not set(consumed) & dropped.keys()
    assert set(consumed) | dropped.keys() == set(HubCheckpoint(gs.path).names())
    # one executable for both (same shardings), so any difference would come from the weights
    graph, state = nnx.split(direct)
    direct = nnx.merge(graph, jax.device_put(state, jax.tree.map(lambda a: a.sharding, nnx.state(converted))))
    ids = jnp.asarray(gs["inputs.prompt"], jnp.int32)
    want, got = np.asarray(prefill(direct, ids)), np.asarray(prefill(converted, ids))
    assert np.isfinite(want).all()
    assert np.array_equal(got, want)


_SHARDED_CHILD = """
import json, sys
import jax.numpy as jnp
import numpy as np
from flax import nnx
from convert import convert_checkpoint
from dsv41_jax import sharding as shd
from dsv41_jax.checkpoint_io import load_converted
from dsv41_jax.loading import module_param_paths, resolve_fp4_relaid
from dsv41_jax.parity import GoldenSet, load_model
from jax.sharding import NamedSharding
gs = GoldenSet(sys.argv[1])
args = gs.args
prefill = nnx.jit(lambda model, ids: model(ids))
ids = jnp.asarray(gs["inputs.prompt"], jnp.int32)
direct = load_model(gs)
want = {p: np.asarray(v[...]) for p, v in module_param_paths(direct).items()}
want_logits = np.asarray(prefill(direct, ids))  # one device, hub weights, unpadded tables
bits = lambda a: np.asarray(a).view(np.uint8)
report = {}
for spec, with_logits in json.loads(sys.argv[3]):
    out = sys.argv[2] + "/" + spec.replace(",", "_").replace("=", "")
    convert_checkpoint(gs.path, out, mesh=spec, progress=False)
    mesh = shd.make_mesh(spec, args=args)
    # fp4_scale_fold's default "auto": checked on the sharded scales
    model, margs = load_converted(out, mesh, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len)
    got = module_param_paths(model)
    specs = shd.param_partition_specs(margs, mesh, strict=True)  # strict: every rule applies in full
    unequal = []
    for p, w in want.items():
        g = np.asarray(got[p][...])
        same = np.array_equal(bits(g), bits(w)) if g.shape == w.shape else (  # padded table: hub rows, zero rows
            ".engram.embed." in p and np.array_equal(bits(g[: len(w)]), bits(w)) and not bits(g[len(w):]).any())
        if not same:
            unequal.append(p)
    report[spec] = {
        "unequal": unequal,
        "misplaced": [p for p in got if got[p][...].sharding.spec != specs[p] and
                      not (all(e is None for e in specs[p]) and got[p][...].sharding.is_fully_replicated)],
        "expert_shard": got["layers.3.ffn.experts.w1.weight"][...].addressable_shards[0].data.shape[0],
        "table_rows": [got[f"layers.{l}.engram.embed.weight"][...].shape[0] for l in args.engram_layer_ids],
        "table_shard": [got[f"layers.{l}.engram.embed.weight"][...].addressable_shards[0].data.shape[0]
                        for l in args.engram_layer_ids],
        "n_devices": len(got["layers.3.ffn.experts.w1.weight"][...].sharding.device_set),
        "fp4_scale_fold": margs.fp4_scale_fold,
    }
    if with_logits:
        report[spec]["logits_equal"] = bool(np.array_equal(np.asarray(prefill(model, ids)), want_logits))
        # fp4_relaid "on": the stacks re-laid in place keep their shardings and the logits
        resolve_fp4_relaid(model, margs.replace(fp4_relaid="on"))
        stacks = {p: v[...] for p, v in module_param_paths(model).items() if ".ffn.experts.w" in p and "weight" in p}
        report[spec]["relaid_shardings_kept"] = all(
            v.sharding.is_equivalent_to(NamedSharding(mesh, specs[p]), v.ndim) for p, v in stacks.items())
        report[spec]["relaid_logits_equal"] = bool(np.array_equal(np.asarray(prefill(model, ids)), want_logits))
print("REPORT " + json.dumps(report))
"""


SHARDED_MESHES = [("expert=8", True), ("expert=4,data=2", False), ("data=2,expert=2,tensor=2", True)]
_CHILD_DIRS: list = []  # the child's output directories, removed when this process exits


@functools.cache
def start_child() -> Child:
    """The 8-fake-device conversions of the test below, in one subprocess writing to a temporary
    directory (tests/conftest.py starts it right after collection when the test is selected)."""
    out = tempfile.TemporaryDirectory()
    _CHILD_DIRS.append(out)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    return Child([sys.executable, "-c", _SHARDED_CHILD, str(GOLDEN / "tiny-a"), out.name, json.dumps(SHARDED_MESHES)],
                 env, REPO)


@pytest.mark.fake_devices
def test_conversions_for_several_eight_device_meshes_restore_their_rule_shardings_and_give_identical_logits():
    """tiny-a's tables have 3252 and 3496 rows; 3252 is padded to 3256 so that both split 8 ways
    (every mesh of 8 devices: the rule splits tables over all axes). Logits are compared bit for
    bit with the single-device model loaded from the hub (measured: equal on every mesh), also
    after re-laying the routed experts' fp4 words in place (`fp4_relaid` "on"), which keeps every
    stack's sharding."""
    status, stdout, stderr = start_child().wait(timeout=600)
    assert status == 0, stderr[-3000:]
    report = json.loads(next(ln for ln in stdout.splitlines() if ln.startswith("REPORT "))[7:])
    # fp4_scale_fold "auto" resolves to "on": tiny-a's routed-expert scale bytes are all <= 128
    common = {"unequal": [], "misplaced": [], "table_rows": [3256, 3496], "table_shard": [407, 437], "n_devices": 8,
              "fp4_scale_fold": "on"}
    logits = {"logits_equal": True, "relaid_shardings_kept": True, "relaid_logits_equal": True}
    assert report == {
        "expert=8": {**common, "expert_shard": 1, **logits},
        "expert=4,data=2": {**common, "expert_shard": 2},
        "data=2,expert=2,tensor=2": {**common, "expert_shard": 4, **logits},
    }
