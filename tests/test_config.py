"""ModelArgs: parsing, derived per-layer facts, validation errors."""

import json

import pytest

from dsv41_jax.config import ConfigError, ModelArgs

from conftest import DATA

RELEASED = DATA / "released_config.json"


@pytest.fixture(scope="module")
def released() -> ModelArgs:
    return ModelArgs.from_json(RELEASED)


def test_released_config_parses_with_every_key_a_field(released):
    raw = json.loads(RELEASED.read_text())
    for k, v in raw.items():
        got = getattr(released, k)
        assert (list(got) if isinstance(got, tuple) else got) == v, k
    assert released.total_layers == 43
    assert released.vision_enabled and released.dspark_enabled
    assert released.max_seq_len == 4096 and released.max_batch_size == 4  # reference defaults


def test_released_layer_roles_match_spec_table(released):
    roles = [released.attn_role(i) for i in range(40)]
    assert roles[:2] == ["window", "window"]
    assert [i for i, r in enumerate(roles) if r == "source"] == [2, 8, 14, 20]
    assert [i for i, r in enumerate(roles) if r == "reindex"] == [24, 28, 32, 36]
    assert roles.count("reuse") == 30
    assert released.kv_source_of(7) == 2 and released.kv_source_of(19) == 14
    assert released.kv_source_of(39) == 20 and released.index_source_of(39) == 36
    assert released.index_source_of(23) == 20 and released.index_source_of(25) == 24
    assert released.is_candidate_source(20) and not released.uses_candidates(20)
    assert all(released.uses_candidates(i) for i in (24, 28, 32, 36))
    assert not released.uses_candidates(25)  # a reuse layer runs no indexer
    assert released.kv_source_of(0) is None and released.attn_role(40) == "window"


def test_released_rope_and_engram_facts(released):
    assert released.rope_base(0) == 10000 and not released.uses_yarn(1)
    assert released.rope_base(2) == 160000 and released.rope_original_seq_len(39) == 65536
    assert released.rope_original_seq_len(41) == 0  # DSpark stages: no YaRN
    assert released.engram_table_index(1) == 0 and released.engram_table_index(14) == 1
    assert released.engram_table_index(2) is None
    assert released.n_hash_cols == 24
    assert released.moe_experts(5) == (384, 6) and released.moe_experts(41) == (128, 3)


def test_golden_configs_parse(golden):
    a = golden.args
    assert a.n_layers == len([k for k in golden.keys() if k.startswith("prefill.block_out.")])
    assert a.max_seq_len == golden.inputs["runtime"]["max_seq_len"]


def test_args_are_hashable_and_replaceable():
    t = ModelArgs.tiny()
    assert hash(t) == hash(ModelArgs.tiny())
    assert t.replace(max_seq_len=64).max_seq_len == 64
    assert t.attn_role(4) == "source" and t.uses_candidates(6)


def test_runtime_attn_accumulate_defaults_to_auto_and_overrides(released):
    assert released.attn_accumulate == "auto" and "attn_accumulate" not in _released_dict()
    assert ModelArgs.from_json(RELEASED, attn_accumulate="f32").attn_accumulate == "f32"
    assert ModelArgs.tiny().replace(attn_accumulate="f64").attn_accumulate == "f64"


def _released_dict():
    return json.loads(RELEASED.read_text())


@pytest.mark.parametrize(
    "change, message",
    [
        ({"bogus_key": 1}, "unknown config keys ['bogus_key']"),
        ({"kv_source_layers": [0, 2]}, "layer 0, whose compress ratio is 0"),
        ({"compress_ratios": [0, 0, 2]}, "compress_ratios has 3 entries"),
        ({"dim": 5000}, "dim = 5000 must be a positive multiple of 32"),
        ({"moe_inter_dim": 2300}, "moe_inter_dim = 2300"),
        ({"engram_num_embeddings": [1]}, "engram_num_embeddings has 1 entries"),
        ({"candidate_source_layer": 21}, "candidate_source_layer 21 must be one of index_source_layers"),
        ({"kv_source_layers": [8, 14, 20]}, "layer 2 has compress ratio 2 but no kv source layer"),
        ({"kv_source_layers": [2, 8, 14, 50]}, "outside the backbone"),
        ({"dtype": "fp16"}, "dtype must be 'fp8' or 'bf16'"),
        ({"attn_accumulate": "bf16"}, "attn_accumulate must be 'auto', 'f64' or 'f32', got 'bf16'"),
        ({"fp4_scale_fold": True}, "fp4_scale_fold must be 'off', 'auto' or 'on', got True"),
        ({"fp4_relaid": "yes"}, "fp4_relaid must be 'off', 'auto' or 'on', got 'yes'"),
    ],
)
def test_invalid_configs_are_rejected_with_a_clear_message(change, message):
    d = _released_dict()
    d.update(change)
    with pytest.raises(ConfigError) as e:
        ModelArgs.from_dict(d, source="config.json")
    assert message in str(e.value)


def test_reuse_layer_reading_a_source_of_another_ratio_is_rejected():
    d = _released_dict()
    d["compress_ratios"] = [0, 0, 2] + [1] * 17 + [1] * 20 + [0] * 3
    d["kv_source_layers"], d["index_source_layers"] = [2, 20], [2, 20]
    with pytest.raises(ConfigError, match="layer 3 \\(ratio 1\\) would read the compressed KV of layer 2 \\(ratio 2\\)"):
        ModelArgs.from_dict(d)


def test_missing_config_file_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.json"):
        ModelArgs.from_json(tmp_path / "nope.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelArgs.from_json(tmp_path)
