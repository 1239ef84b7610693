"""Memory plan: bytes per device checked against independent arithmetic (SPEC §15, §19.2,
cache.cache_bytes), the transient formula, fit verdicts and the two command lines."""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest
from conftest import DATA, GOLDEN_ROOT

from dsv41_jax import generate as G
from dsv41_jax import plan as P
from dsv41_jax import sharding as shd
from dsv41_jax.cache import cache_bytes
from dsv41_jax.config import ModelArgs
from pallas_kernels.index_scores.reference import index_score_block

T64K = 65536
# SPEC §15: text backbone without the Engram tables, and one routed expert's parameters
BACKBONE_PARAMS = 551_880_835_184
EXPERT_PARAMS = 3 * 2304 * 5120
# one routed expert in memory: packed fp4 (half a byte per value) + one e8m0 byte per 32 values
# along K (w1, w3: K = dim = 5120; w2: K = moe_inter_dim = 2304)
EXPERT_BYTES = EXPERT_PARAMS // 2 + 2 * 2304 * (5120 // 32) + 5120 * (2304 // 32)


@pytest.fixture(autouse=True)
def _quiet_sharding(caplog):
    # the released layer-14 Engram table cannot be split 8 ways; the fallback warning is expected
    caplog.set_level(logging.ERROR, logger="dsv41_jax.sharding")


@pytest.fixture(scope="module")
def released() -> ModelArgs:
    return P.load_config()


@pytest.fixture(scope="module")
def no_engram() -> ModelArgs:
    """The released config without its Engram layers (its layout does not hinge on table rows)."""
    cfg = json.loads((DATA / "released_config.json").read_text())
    cfg.update(engram_layer_ids=[], engram_num_embeddings=[])
    return ModelArgs.from_dict(cfg)


def test_parameter_count_is_spec_15s_backbone_plus_the_engram_tables(released):
    plan = P.memory_plan(released, "expert=8", T64K)
    tables = [a for p, a in shd.state_shapes(released).items() if p.endswith(".engram.embed.weight")]
    assert [a.shape[0] >= n for a, n in zip(tables, released.engram_num_embeddings, strict=True)] == [True, True]
    assert plan.params == BACKBONE_PARAMS + sum(a.shape[0] * a.shape[1] for a in tables)


@pytest.mark.parametrize("mesh, expert", [("expert=8", 8), ("expert=4,data=2", 4), ("expert=128", 128)])
def test_routed_experts_per_device_are_the_devices_share_of_40_x_384_experts(released, mesh, expert):
    plan = P.memory_plan(released, mesh, T64K)
    assert plan.weights_total["routed experts"] == 40 * 384 * EXPERT_BYTES == 288_777_830_400
    assert plan.weights_device["routed experts"] == 40 * 384 * EXPERT_BYTES // expert
    # everything else (but the Engram tables) is replicated by the default rules
    assert plan.weights_device["other weights"] == plan.weights_total["other weights"]


def _cache_arithmetic(batch: int, t: int) -> int:
    """SPEC §5.12 / §19.2 at the released config, stored as the reference stores it (QDQ'd bf16)."""
    window = 40 * 128 * 512 * 2  # §19.2: 40 layers x 128 slots, here bf16 values
    rows = 3 * (t // 2) + t  # §19.2: layers 2/8/14 add a row per 2 tokens, layer 20 one per token
    compressed = rows * (512 + 128) * 2  # compress_kv + index_k rows, bf16
    states = 3 * 2 * (2 * 512 * 4)  # ratio-2 kv_state + score_state [2, 512] f32
    return batch * (window + compressed + states + t * 4 + 4)  # + Engram history int32 [T] + seq_len


def test_cache_bytes_follow_spec_19_2s_row_counts_and_split_over_data(released):
    plan = P.memory_plan(released, "data=2,expert=4", T64K, batch=3)
    assert plan.padded_batch == 4  # the generator pads the batch to the data axis
    assert plan.cache_total == _cache_arithmetic(4, T64K) == cache_bytes(released, 4, T64K)
    assert plan.cache_device == plan.cache_total // 2
    assert cache_bytes(released, 1, T64K) == 215_244_804
    # per token of context: 2.5 rows of 1280 B (bf16) where the packed layout of §19.2 needs 890 B
    grow = cache_bytes(released, 1, 2 * T64K) - cache_bytes(released, 1, T64K)
    assert grow == T64K * (2.5 * 1280 + 4) and 890 == 2.5 * (288 + 68)


def test_decode_transient_is_the_stated_sum_at_the_released_config(released):
    t = P.transient_estimate(released, rows=1, prefill_tokens=16, max_seq_len=T64K)
    stream = 2 * 4 * 5120 * 2  # block input and output [1, 1, hc, dim] bf16
    index = 32 * T64K * 4 + T64K * 2  # layer 20 (ratio 1) scores all 65536 cached rows
    attention = 2 * 64 * 512 * 2 + 640 * 512 * 2 + 64 * 640 * 4  # q, o; 128 + 512 gathered rows
    moe = 2 * 6 * 2304 * 4 + 6 * 5120 * 2
    assert index > attention > moe
    assert t["decode"] == stream + index + 129280 * 4


def test_prefill_transient_is_led_by_attention_once_the_indexer_works_in_key_blocks(released):
    # a compressed layer's attention: q, o, 640 gathered rows, f32 logits per query
    def attention(s):
        return 2 * s * 64 * 512 * 2 + s * 640 * 512 * 2 + s * 64 * 640 * 4

    short = P.transient_estimate(released, 1, 4096, 4096)
    assert short["prefill layer"] == attention(4096)
    a = P.transient_estimate(released, 1, 8192, 8192)
    b = P.transient_estimate(released, 1, 16384, 16384)
    # the layer-20 indexer's [S, 32 heads, S] f32 products (32 GiB at 16k) are formed 1 GiB at a
    # time, so they no longer lead: the working set grows linearly with the prompt
    assert index_score_block(1, 16384, 32, 16384) == 512
    assert 16384 * 32 * 512 * 4 + 16384 * 16384 * 2 < attention(16384)
    assert a["prefill layer"] == attention(8192)
    assert b["prefill layer"] == attention(16384) == 2 * a["prefill layer"]
    # chunks of 4096 over a 64k context: the last chunk's indexer scores all 65536 rows
    chunk = P.transient_estimate(released, 1, 4096, T64K)
    assert chunk["prefill layer"] == attention(4096)
    plan = P.memory_plan(released, "data=2,expert=4", T64K, batch=4, prefill_tokens=4096)
    assert plan.transient["prefill layer"] == 2 * chunk["prefill layer"]  # 2 rows per device


def test_engram_tables_are_planned_split_as_the_converter_pads_them(released):
    plan = P.memory_plan(released, "expert=8", T64K)
    # rows padded to a multiple of 8 (layer 14: 384,016,682 -> 384,016,688), then split evenly
    padded = released.replace(engram_rows_multiple=8)
    tables = {p: a for p, a in shd.state_shapes(padded).items() if ".engram.embed." in p}
    total = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in tables.values())
    assert plan.weights_total["Engram tables"] == total
    assert plan.weights_device["Engram tables"] * 8 == total
    assert plan.weights_device["Engram tables"] == 25_344_754_248  # what dsv41-convert's layout gives


def test_verdicts_for_a_few_meshes(no_engram, released):
    eight = P.memory_plan(no_engram, "expert=8", T64K, prefill_tokens=2048)
    # 36.1 GB of experts + 9.6 GB replicated (the head in bf16; wo_a in fp8, 1.4 GB less than
    # the reference's bf16 copy) + cache, + 2.1 GB transient
    # (2048-token chunks: a compressed layer's attention 1.95 GB; the indexer scoring 64k rows
    # works in 1 GiB key blocks): one H200 or v5p, not a v6e
    assert 45.8e9 < eight.resident_per_device < 46e9 and 2.1e9 < eight.transient_per_device < 2.2e9
    assert [eight.fits(c) for c in P.CHIPS] == [True, True, False]
    # a 64k prompt in one prefill call: 62.3 GB of attention working set + 5.4 GB of hc stream;
    # it fits an H200 beside the weights, not a v5p
    whole = P.memory_plan(no_engram, "expert=8", T64K)
    assert 67e9 < whole.transient_per_device < 68e9
    assert whole.fits("H200") and whole.fits("TPU v5p", with_transient=False) and not whole.fits("TPU v5p")
    # the released model on 8 v6e: the experts alone (36.1 GB per device) exceed a chip
    assert P.memory_plan(released, "expert=8", T64K).weights_device["routed experts"] > P.CHIPS["TPU v6e"]
    assert not P.memory_plan(released, "expert=8", T64K, prefill_tokens=16).fits("TPU v6e")


def test_a_mesh_that_does_not_divide_the_experts_or_bad_sizes_are_refused(released):
    with pytest.raises(shd.ShardingError, match=r"expert axis \(5\) must divide the number of routed experts \(384\)"):
        P.memory_plan(released, "expert=5", T64K)
    with pytest.raises(ValueError, match=r"prefill_tokens \(9\) must be in \[1, max_seq_len=8\]"):
        P.memory_plan(released, "expert=8", 8, prefill_tokens=9)


def test_plan_commands_print_the_table(capsys):
    assert P.main(["--mesh", "expert=8,data=1", "--max-seq-len", "65536", "--batch", "2",
                   "--prefill-tokens", "4096"]) == 0
    text = capsys.readouterr().out
    assert "mesh data=1,expert=8,tensor=1 (8 devices), max_seq_len 65536, batch 2" in text
    assert f"{P.memory_plan(P.load_config(), 'expert=8', 65536).params:,} parameters" in text
    assert "fits 8 x" in text and "TPU v6e" in text
    tiny = GOLDEN_ROOT / "tiny-a"
    assert G.main(["--plan", "--ckpt", str(tiny), "--mesh", "expert=4,data=2", "--batch", "3",
                   "--max-seq-len", "64"]) == 0
    text = capsys.readouterr().out
    assert "batch 3 (padded to 4 for data=2)" in text and "total MB" in text
    assert G.main(["--plan", "--mesh", "expert=5"]) == 2
    assert "expert axis (5) must divide" in capsys.readouterr().err


def test_plan_of_a_tiny_config_matches_its_cache_and_state_bytes():
    args = ModelArgs.from_json(GOLDEN_ROOT / "tiny-a" / "config.json")
    plan = P.memory_plan(args, "expert=4,data=2", 64, batch=4)
    assert plan.cache_total == cache_bytes(args, 4, 64) and plan.cache_device == plan.cache_total // 2
    # the Engram tables as dsv41-convert stores them on this mesh: rows padded to the 8 pieces
    shapes = shd.state_shapes(args.replace(engram_rows_multiple=8))
    total = sum(int(a.size) * a.dtype.itemsize for a in shapes.values())
    assert sum(plan.weights_total.values()) == total
    assert dataclasses.asdict(plan)["mesh"] == {"data": 2, "expert": 4, "tensor": 1}
