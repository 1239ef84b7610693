"""Mesh parsing, the rules table and the per-parameter and per-cache-array PartitionSpecs pinned
per mesh.

The golden files tests/data/sharding/<config>__<mesh>.json hold every parameter's PartitionSpec,
<config>__<mesh>__cache.json every cache array's (batch CACHE_BATCH, max_seq_len
CACHE_SEQ[config]), computed on real meshes of fake CPU devices in a subprocess (this pytest
process has one device). Regenerate them after a deliberate layout change with
`python tests/test_sharding.py --regen`.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from dsv41_jax import sharding as shd
from dsv41_jax.config import ModelArgs

DATA = Path(__file__).parent / "data"
GOLDEN_DIR = DATA / "sharding"
REPO = Path(__file__).resolve().parents[1]

CONFIGS = {
    "tiny-a": DATA / "golden" / "tiny-a" / "config.json",
    "released": DATA / "released_config.json",
}
CASES = [("tiny-a", "expert=8,data=1"), ("tiny-a", "data=2,expert=2,tensor=2"), ("tiny-a", "expert=4,data=2"),
         ("released", "expert=8,data=1")]
N_FAKE_DEVICES = 8
CACHE_BATCH = 8
CACHE_SEQ = {"tiny-a": 64, "released": 65536}


def _golden_path(config: str, mesh: str, kind: str = "") -> Path:
    sizes = shd.parse_mesh_spec(mesh)
    return GOLDEN_DIR / f"{config}__{'-'.join(f'{a}{n}' for a, n in sizes.items())}{kind}.json"


_CHILD = """
import json, sys
import jax
from dsv41_jax import sharding as shd
from dsv41_jax.config import ModelArgs
out = {}
N_DEVICES = int(sys.argv[2])
for key, cache_key, config, mesh, batch, seq in json.loads(sys.argv[1]):
    args = ModelArgs.from_json(config)
    m = shd.make_mesh(mesh, args=args)
    assert len(m.devices.flat) == N_DEVICES and m.axis_names == shd.MESH_AXES
    out[key] = shd.specs_to_json(shd.param_partition_specs(args, m))
    cache = shd.cache_shardings(args, batch, seq, m)
    out[cache_key] = shd.specs_to_json(
        {shd.cache_path(p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(cache)[0]})
print("SPECS " + json.dumps(out))
"""


def _specs_on_fake_devices() -> dict[str, str]:
    """{golden file name: specs JSON} computed with real meshes over 8 fake CPU devices."""
    cases = [(_golden_path(c, m).name, _golden_path(c, m, "__cache").name, str(CONFIGS[c]), m, CACHE_BATCH,
              CACHE_SEQ[c]) for c, m in CASES]
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={N_FAKE_DEVICES}",
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cases), str(N_FAKE_DEVICES)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("SPECS "))
    return json.loads(line[len("SPECS "):])


@pytest.fixture(scope="module")
def tiny_a() -> ModelArgs:
    return ModelArgs.from_json(CONFIGS["tiny-a"])


# ------------------------------------------------------------------------------ golden layouts


def test_partition_specs_on_fake_device_meshes_match_the_pinned_golden_files():
    computed = _specs_on_fake_devices()
    for name, text in computed.items():
        golden = GOLDEN_DIR / name
        assert golden.exists(), f"{golden} missing; run `python tests/test_sharding.py --regen`"
        want, got = json.loads(golden.read_text()), json.loads(text)
        changed = sorted(p for p in want.keys() | got.keys() if want.get(p) != got.get(p))
        assert not changed, f"{name}: layout changed for {len(changed)} params, e.g. " + "; ".join(
            f"{p}: pinned {want.get(p)}, now {got.get(p)}" for p in changed[:5])


def test_golden_layouts_put_experts_on_the_expert_axis_and_replicate_attention():
    # reads the pinned files themselves, so a regenerated file with a broken layout fails here
    specs = json.loads(_golden_path("released", "expert=8,data=1").read_text())
    assert len(specs) == 1498  # 40 layers: wo_a.scale beside wo_a.weight in each
    assert specs["layers.7.ffn.experts.w2.weight"] == ["expert", None, None]
    assert specs["layers.7.ffn.experts.w2.scale"] == ["expert", None, None]
    assert specs["layers.7.attn.wq_b.weight"] == [None, None]
    assert specs["layers.7.attn.wo_a.scale"] == specs["layers.7.attn.wo_a.weight"] == [None, None]
    assert specs["head.weight"] == [None, None]
    # table 0 (384,006,168 rows) splits 8 ways; table 1 (2 x prime rows) cannot and stays whole
    assert specs["layers.1.engram.embed.weight"] == [["expert", "data", "tensor"], None]
    assert specs["layers.14.engram.embed.weight"] == [None, None]
    sharded = {p for p, s in specs.items() if any(e is not None for e in s)}
    assert all(".ffn.experts." in p or ".engram.embed." in p for p in sharded)


def test_golden_cache_layouts_split_every_cache_array_by_rows_over_data_only():
    specs = json.loads(_golden_path("released", "expert=8,data=1", "__cache").read_text())
    # seq_len + 40 window rings + 4 kv sources x (compress_kv, index_k) + 3 ratio-2 x (kv_state,
    # score_state) + the Engram history
    assert len(specs) == 1 + 40 + 4 * 2 + 3 * 2 + 1
    assert all(s[0] == "data" and all(e is None for e in s[1:]) for s in specs.values())
    assert specs["layers.20.compress_kv"] == ["data", None, None] and specs["engram_history"] == ["data", None]
    tiny = json.loads(_golden_path("tiny-a", "expert=4,data=2", "__cache").read_text())
    assert set(tiny) == set(shd.cache_partition_specs(ModelArgs.from_json(CONFIGS["tiny-a"]), 2, 64,
                                                      {"data": 2, "expert": 4, "tensor": 1}))


def test_cache_shardings_refuse_a_batch_the_data_axis_does_not_divide(tiny_a):
    mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
    fake = {"data": 2, "expert": 1, "tensor": 1}
    with pytest.raises(shd.ShardingError,
                       match=r"cache engram_history: dim 0 \('batch', size 3\) is not divisible by mesh axes \('data',\)"):
        shd.cache_partition_specs(tiny_a, 3, 64, fake, strict=True)
    assert shd.cache_partition_specs(tiny_a, 3, 64, fake)["seq_len"] == jax.sharding.PartitionSpec(None)
    sh = shd.cache_shardings(tiny_a, 3, 64, mesh)  # data=1 divides any batch
    assert sh["layers"][2]["compress_kv"].spec == jax.sharding.PartitionSpec("data", None, None)


def test_activation_shardings_put_the_batch_on_data():
    mesh = shd.make_mesh("data=1", devices=jax.devices()[:1])
    assert shd.activation_sharding("ids", (4, 16), mesh).spec == jax.sharding.PartitionSpec("data", None)
    assert shd.activation_sharding("logits", (4, 512), mesh).spec == jax.sharding.PartitionSpec("data", None)
    with pytest.raises(shd.ShardingError, match="activation 'hidden' has no logical axes"):
        shd.activation_sharding("hidden", (4,), mesh)


# ------------------------------------------------------------------------------------- mesh spec


@pytest.mark.parametrize("spec, needle", [
    ("expert=8,model=1", "unknown axis 'model'"),
    ("expert=8,expert=1", "axis 'expert' given twice"),
    ("expert=0", "expected a positive integer"),
    ("expert", "is not AXIS=SIZE"),
    ("", "is empty"),
])
def test_mesh_spec_errors_name_the_offending_entry(spec, needle):
    with pytest.raises(shd.ShardingError, match=needle):
        shd.parse_mesh_spec(spec)


def test_mesh_spec_fills_missing_axes_with_one_in_canonical_order():
    assert shd.parse_mesh_spec(" expert=8 , data=1") == {"data": 1, "expert": 8, "tensor": 1}
    assert shd.format_mesh_spec({"expert": 4}) == "data=1,expert=4,tensor=1"


def test_make_mesh_rejects_a_device_count_mismatch():
    with pytest.raises(shd.ShardingError, match=r"needs 8 devices, but 1 cpu devices.*xla_force_host_platform"):
        shd.make_mesh("expert=8", devices=jax.devices()[:1])


def test_make_mesh_rejects_an_expert_axis_that_does_not_divide_the_experts(tiny_a):
    devices = jax.devices()[:1] * 3  # the count matches; the expert check comes before placement
    with pytest.raises(shd.ShardingError, match=r"expert axis \(3\) must divide the number of routed experts \(8\)"):
        shd.make_mesh("expert=3", args=tiny_a, devices=devices)
    # checked before the device count: the mesh is wrong on any machine
    with pytest.raises(shd.ShardingError, match=r"expert axis \(3\) must divide"):
        shd.make_mesh("expert=3", args=tiny_a, devices=jax.devices()[:1])


def test_make_mesh_builds_all_three_axes_with_auto_types():
    m = shd.make_mesh("data=1", devices=jax.devices()[:1])
    assert m.axis_names == ("data", "expert", "tensor")
    assert all(t == jax.sharding.AxisType.Auto for t in m.axis_types)


# ---------------------------------------------------------------------------------------- rules


def test_rules_mapping_two_dims_of_one_array_to_one_mesh_axis_are_rejected(tiny_a):
    rules = shd.DEFAULT_RULES.replace(mlp="expert")  # experts and mlp both on `expert`
    with pytest.raises(shd.ShardingError, match=r"'experts'.*'mlp'.*both to mesh axis 'expert'"):
        shd.param_partition_specs(tiny_a, {"data": 1, "expert": 2, "tensor": 1}, rules)


def test_rules_table_rejects_unknown_mesh_axes_and_repeated_names():
    with pytest.raises(shd.ShardingError, match=r"unknown mesh axes \['model'\]"):
        shd.Rules((("experts", "model"),))
    with pytest.raises(shd.ShardingError, match="list logical axis 'experts' twice"):
        shd.Rules((("experts", "expert"), ("experts", None)))
    with pytest.raises(shd.ShardingError, match="repeats a mesh axis"):
        shd.Rules((("engram_rows", ("expert", "expert")),))


def test_a_tensor_parallel_layout_is_a_table_edit(tiny_a):
    rules = shd.DEFAULT_RULES.replace(q_heads="tensor", o_groups="tensor")
    specs = shd.param_partition_specs(tiny_a, {"data": 1, "expert": 1, "tensor": 2}, rules)
    assert specs["layers.3.attn.wq_b.weight"] == jax.sharding.PartitionSpec("tensor", None)
    assert specs["layers.3.attn.wo_a.weight"] == jax.sharding.PartitionSpec("tensor", None)
    assert specs["layers.3.attn.wo_b.weight"] == jax.sharding.PartitionSpec(None, "tensor")


def test_every_parameter_has_logical_axes_of_its_rank(tiny_a):
    for path, (axes, abstract) in shd.param_logical_axes(tiny_a).items():
        assert len(axes) == len(abstract.shape), path


def test_a_dim_the_mesh_cannot_divide_falls_back_with_a_warning_or_raises_when_strict(caplog):
    mesh = {"data": 1, "expert": 8, "tensor": 1}
    with caplog.at_level(logging.WARNING, logger="dsv41_jax.sharding"):
        spec = shd.logical_to_spec(("engram_rows", "engram_dim"), (3252, 32), mesh, name="t")
    assert spec == jax.sharding.PartitionSpec(None, None)
    assert "t: dim 0 ('engram_rows', size 3252) is not divisible" in caplog.text
    with pytest.raises(shd.ShardingError, match="not divisible"):
        shd.logical_to_spec(("engram_rows", "engram_dim"), (3252, 32), mesh, name="t", strict=True)
    # a prefix of the rule's axes is kept when it divides
    spec = shd.logical_to_spec(("engram_rows",), (8,), {"data": 3, "expert": 4, "tensor": 1})
    assert spec == jax.sharding.PartitionSpec("expert")


def test_specs_json_round_trips():
    specs = {"a": jax.sharding.PartitionSpec(("expert", "data"), None), "b": jax.sharding.PartitionSpec("expert")}
    assert shd.specs_from_json(shd.specs_to_json(specs)) == specs


if __name__ == "__main__" and "--regen" in sys.argv:
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for file_name, text in _specs_on_fake_devices().items():
        (GOLDEN_DIR / file_name).write_text(text)
        print("wrote", GOLDEN_DIR / file_name)
