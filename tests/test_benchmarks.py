"""Helpers of benchmarks/model_speed.py that decide what its rows report (no timing here):
the profile's source attribution, the random model's routing, whose byte counts the decode
rows' fractions of the bandwidth rest on, and the prefill's FLOP count."""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks import fp4_mosaic_probe, model_speed, tma_probe
from dsv41_jax.config import ModelArgs
from dsv41_jax.numerics import rms_norm


def test_hlo_sources_names_the_project_line_of_each_kernel():
    x = jnp.ones((4, 256), jnp.bfloat16)
    w = jnp.ones((256,), jnp.bfloat16)
    text = jax.jit(lambda x, w: rms_norm(x, w, 1e-6)).lower(x, w).compile().as_text()
    src = model_speed.hlo_sources(text)
    assert src and all("." not in name for name in src)  # kernel names: "." and "-" become "_"
    assert any(v.startswith("numerics.py:") and v.endswith("rms_norm") for v in src.values()), src


def test_random_model_routes_tokens_across_the_experts():
    """Zero router biases: 64 distinct tokens spread over the experts (with the random biases
    the model had before, the same tokens picked 2-4 of the 8 experts of each layer)."""
    args = model_speed.bench_args(True, 64, 64, "reference")
    graphdef, state = model_speed.random_model(args)
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    biases = [v for p, v in flat if jax.tree_util.keystr(p).endswith("['gate']['bias'].value")]
    assert len(biases) == args.n_layers and all(not np.any(np.asarray(b)) for b in biases)
    cache = model_speed.seeded_cache(args, 64, 64)
    ids = jax.random.randint(jax.random.key(3), (64,), 0, args.vocab_size)
    pos = cache["seq_len"]
    hit, cache = model_speed.routed_experts(graphdef, state, ids, pos, cache)
    n_exp, _ = args.moe_experts(0)
    assert len(hit) == args.n_layers
    np.testing.assert_array_equal(cache["seq_len"], np.asarray(pos) + 1)  # the step's cache comes back
    assert min(hit) >= n_exp - 1, hit  # uniform routing: 8 * (1 - (6/8)^64) = 8.0 expected


def test_fast_paths_resolve_the_fold_and_layout_as_the_loaders_do():
    """Every path but `fast-nofold` keeps fp4_scale_fold's default "auto", which `random_model`
    resolves on the random e8m0 bytes (all <= 128) as a loader does: the fold is on; `fast-nofold`
    builds the kernel without it. Likewise fp4_relaid: the default but on `fast-released` ("off") and
    `fast-relaid` ("auto"), resolved by `random_model` as a loader does (here, off the compiled GPU
    kernel: released)."""
    for path, (kernels, attn, fold, relaid) in model_speed.PATHS.items():
        args = model_speed.bench_args(True, 1, 64, kernels, attn, fold, relaid)
        assert (args.fp4_scale_fold, args.fp4_relaid) == (fold, relaid), path
        assert relaid == {"fast-released": "off", "fast-relaid": "auto"}.get(path, ModelArgs.fp4_relaid), path
    for path, want in (("fast", True), ("fast-nofold", False)):
        args = model_speed.bench_args(True, 1, 64, *model_speed.PATHS[path])
        model = nnx.merge(*model_speed.random_model(args))
        assert model.layers[0].ffn.experts.scale_fold is want, path
        assert model.args.fp4_scale_fold == ("on" if want else "off"), path
        assert model.args.fp4_relaid == "off" and not model.layers[0].ffn.experts.relaid, path


def test_flag_paths_set_every_module_of_their_class():
    """`fast-onerow`, `fast-streamk`, `fast-onedot` and `fast-f64k` are `fast` (same ModelArgs) with
    `one_row` / `stream_k` / `one_dot` on every Experts module / `f64_kernel` on every Attention
    module, which their kernel options carry; `fast` leaves them off."""
    assert model_speed.PATHS["fast-onerow"] == model_speed.PATHS["fast-f64k"] == model_speed.PATHS["fast"]
    assert model_speed.PATHS["fast-streamk"] == model_speed.PATHS["fast-onedot"] == model_speed.PATHS["fast"]
    assert model_speed.PATHS["fast-swapab"] == model_speed.PATHS["fast-noswapsingle"] == model_speed.PATHS["fast"]
    args = model_speed.bench_args(True, 1, 64, *model_speed.PATHS["fast"])
    graphdef, state = model_speed.random_model(args)
    plain = nnx.merge(graphdef, state)
    one = nnx.merge(*model_speed.with_path_flags(graphdef, state, "fast-onerow"))
    f64k = nnx.merge(*model_speed.with_path_flags(graphdef, state, "fast-f64k"))
    sk = nnx.merge(*model_speed.with_path_flags(graphdef, state, "fast-streamk"))
    od = nnx.merge(*model_speed.with_path_flags(graphdef, state, "fast-onedot"))
    sw = nnx.merge(*model_speed.with_path_flags(graphdef, state, "fast-swapab"))
    nosingle = nnx.merge(*model_speed.with_path_flags(graphdef, state, "fast-noswapsingle"))
    for i in range(args.n_layers):
        assert plain.layers[i].ffn.experts.block_sizes().one_dot is False
        assert od.layers[i].ffn.experts.block_sizes().one_dot is True
        assert plain.layers[i].ffn.experts.block_sizes().swap_ab is od.layers[i].ffn.experts.block_sizes().swap_ab is False
        assert sw.layers[i].ffn.experts.block_sizes().swap_ab is sw.layers[i].ffn.experts.block_sizes().one_dot is True
        assert nosingle.layers[i].ffn.experts.block_sizes().swap_ab_single is False
        assert plain.layers[i].ffn.experts.block_sizes().swap_ab_single is True
        assert sw.layers[i].ffn.experts.block_sizes().swap_ab_single is True
        assert od.layers[i].ffn.experts.block_sizes().stream_k == 0
        assert plain.layers[i].ffn.experts.block_sizes().stream_k == 0
        assert sk.layers[i].ffn.experts.block_sizes().stream_k == 264
        assert sk.layers[i].ffn.experts.block_sizes().one_row is False
        assert plain.layers[i].ffn.experts.block_sizes().one_row is False
        assert one.layers[i].ffn.experts.block_sizes().one_row is True
        assert one.layers[i].ffn.experts.block_sizes().scale_fold is plain.layers[i].ffn.experts.scale_fold is True
        assert plain.layers[i].attn.attn_block_sizes() is None and one.layers[i].attn.attn_block_sizes() is None
        assert f64k.layers[i].attn.attn_block_sizes().f64_kernel is True
        assert f64k.layers[i].ffn.experts.block_sizes().one_row is False


def test_prefill_count_follows_the_positions_each_layer_runs_on():
    """The replayed layers (SPEC §19.1) run on a suffix of the prompt; the prefill's FLOP count
    takes each layer at the positions its MoE routed in a real prefill, not the whole prompt."""
    s = 64
    args = model_speed.bench_args(True, 1, s, "reference")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: model_speed.Transformer(args)))
    cache = jax.eval_shape(lambda: model_speed.init_cache(args, 1, s))
    ids = jax.ShapeDtypeStruct((1, s), jnp.int32)
    record = jax.eval_shape(lambda st, i, c: nnx.merge(graphdef, st).prefill(i, None, c, collect=True)[2],
                            state, ids, cache)  # shapes only: the rows each layer's MoE routed
    rows = [record[f"route_idx.L{i:02d}"].shape[0] for i in range(args.n_layers)]
    assert rows[0] == s and min(rows) < s  # the stack has replayed layers
    pb = model_speed.param_bytes(args)
    got = model_speed.prefill_counts(args, pb, s)
    want = [model_speed.count_layer(args, i, pb, 1, s, tokens_per_row=n) for i, n in enumerate(rows)]
    assert got == want
    # a layer's FLOPs grow with the positions it runs on
    assert all(got[i][1] < model_speed.count_layer(args, i, pb, 1, s, tokens_per_row=s)[1]
               for i, n in enumerate(rows) if n < s)


def test_tma_probe_kernel_lowers_for_cuda_and_checks_its_shapes():
    """benchmarks/tma_probe.py's Mosaic GPU kernel builds for CUDA on this host (lowering only:
    its values and speed are measured on a GPU by the script), scaled and unscaled, with K
    splits, and the persistent variant (programs taking several work items, staged scales);
    shapes they cannot tile are refused by name."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    x = jax.ShapeDtypeStruct((3, 1280), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((256, 1280), jnp.float8_e4m3fn)
    s = jax.ShapeDtypeStruct((8, 40), jnp.float8_e8m0fnu)
    for kernel, kw in ((tma_probe.fp8_matmul_tma, {"block_k": 256, "stages": 2}),
                       (tma_probe.fp8_matmul_tma, {"block_k": 128, "stages": 2, "k_splits": 2, "scaled": False}),
                       (tma_probe.fp8_matmul_tma_persistent, {"block_k": 256, "stages": 4, "programs": 3}),
                       (tma_probe.fp8_matmul_tma_persistent, {"block_k": 256, "stages": 2, "k_splits": 5}),
                       (tma_probe.fp8_matmul_tma_persistent, {"block_k": 256, "stages": 2, "products": False}),
                       (tma_probe.fp8_matmul_tma_persistent, {"block_k": 256, "stages": 2, "products": False,
                                                              "swizzle": 128})):
        fn = jax.jit(lambda x, w, s, kernel=kernel, kw=kw: kernel(x, w, s, **kw))
        text = fn.trace(x, w, s).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
        assert fn.eval_shape(x, w, s).shape == (3, 256)
    # the large-matrix streaming variants (`stream_rows`) at a shape their 512-deep steps divide
    x2, w2 = jax.ShapeDtypeStruct((3, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((256, 2048), jnp.float8_e4m3fn)
    s2 = jax.ShapeDtypeStruct((8, 64), jnp.float8_e8m0fnu)
    for label, kernel, kw in tma_probe.STREAM_VARIANTS:
        if kernel is not None:
            fn = jax.jit(lambda x, w, s, kernel=kernel, kw=kw: kernel(x, w, s, **kw))
            assert "mosaic_gpu" in fn.trace(x2, w2, s2).lower(lowering_platforms=("cuda",)).as_text(), label
    for kernel in (tma_probe.fp8_matmul_tma, tma_probe.fp8_matmul_tma_persistent):
        with pytest.raises(ValueError, match="unsupported shape"):
            kernel(jnp.zeros((1, 1280), jnp.bfloat16), jnp.zeros((100, 1280), jnp.float8_e4m3fn),
                   jnp.zeros((4, 40), jnp.uint8))
    with pytest.raises(ValueError, match="swizzle=128"):  # products slice 32-byte tiles
        tma_probe.fp8_matmul_tma_persistent(jnp.zeros((1, 1280), jnp.bfloat16), jnp.zeros((128, 1280), jnp.float8_e4m3fn),
                                            jnp.zeros((4, 40), jnp.uint8), swizzle=128)
    with pytest.raises(ValueError, match="block_k=128"):
        tma_probe.fp8_matmul_tma_persistent(jnp.zeros((1, 1280), jnp.bfloat16), jnp.zeros((128, 1280), jnp.float8_e4m3fn),
                                            jnp.zeros((4, 40), jnp.uint8), block_k=128)


def test_negative_loop_steps_are_refused_with_the_flag_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        model_speed.main(["--out", str(tmp_path), "--tiny", "--loop-steps", "-1"])
    assert e.value.code == 2 and "--loop-steps must be a number of steps >= 0" in capsys.readouterr().err
    assert model_speed._shapes("1x4096,64x65536:reference,") == {(1, 4096, "fast"), (64, 65536, "reference")}


def test_host_loop_rows_run_both_decode_programs_in_alternating_rounds(tmp_path, monkeypatch):
    # timeit replaced by a counter: what is checked is the rows, not a time
    order = []

    def fake_timeit(fn, **kw):
        order.append(fn)
        jax.block_until_ready(fn())
        return 1e-3

    monkeypatch.setattr(model_speed, "timeit", fake_timeit)
    args = model_speed.bench_args(True, 2, 64, "auto")
    graphdef, state = model_speed.random_model(args)
    holder = {"cache": model_speed.seeded_cache(args, 2, 64)}
    ids = jnp.asarray([5, 9], jnp.int32)
    pos = holder["cache"]["seq_len"] - 4
    rep = model_speed.Report(tmp_path, {})
    model_speed.loop_row(rep, {"hbm": 1e12}, "decode fast", graphdef, state, holder, ids, pos, None, 3, 2, 64,
                         1e6, 1e9, True, host_loop=True)
    rows = {r["name"]: r for r in rep.rows}
    assert list(rows) == ["decode fast loop", "decode fast loop (host loop)"]
    for r in rows.values():
        assert r["rounds_s"] == [1e-3 / 3] * 3 and r["seconds"] == 1e-3 / 3 and r["steps_per_call"] == 3
        assert r["tokens_equal"] is True  # on CPU the options change nothing; the H200 run records its own
    assert len(order) == 6 and order[0] is not order[1] and order[0] is order[2]  # the variants alternate
    model_speed.loop_row(rep, {"hbm": 1e12}, "decode fast", graphdef, state, holder, ids, pos, None, 3, 2, 64,
                         1e6, 1e9, True)
    assert rep.rows[-1]["name"] == "decode fast loop" and "rounds_s" not in rep.rows[-1] and len(order) == 7


def test_a_failed_routing_pass_leaves_a_timed_row_with_uniform_bytes(tmp_path, monkeypatch, capsys):
    """--measure-routing where the routing pass fails (out of memory at 256 x 64k on the H200):
    the row is still timed on a fresh cache, its bytes from uniform routing, and it says so."""
    def fail(*a, **k):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while trying to allocate 8.00GiB")

    monkeypatch.setattr(model_speed, "routed_experts", fail)
    monkeypatch.setattr(model_speed, "timeit", lambda fn, **kw: (jax.block_until_ready(fn()), 1e-3)[1])
    rep = model_speed.Report(tmp_path, {})
    model_speed.decode_section(rep, {"hbm": 1e12}, True, [2], [64], ["fast"], set(), measure_routing=True)
    row = next(r for r in rep.rows if r["name"] == "decode fast")
    assert row["seconds"] == 1e-3 and row["routing"].startswith("uniform")
    assert "RESOURCE_EXHAUSTED" in row["routing_error"] and "unique_experts_measured" not in row
    args = model_speed.bench_args(True, 2, 64, "auto")
    assert row["bytes"] == model_speed.decode_bytes(args, model_speed.param_bytes(args), 2, 64)[1]


def test_profile_file_names_keep_paths_apart():
    names = ["decode fast", "decode reference", "prefill fast", "decode fast-f32"]
    assert [model_speed._path_suffix(n) for n in names] == ["", "_reference", "", "_fast-f32"]


def test_generate_row_times_generator_generate_and_records_its_tokens(tmp_path, capsys):
    """The generate row runs `Generator.generate` on random prompts that leave room for the new
    tokens; its kept call's tokens (batch 2: each Generator compiles its own programs) are those
    of a Generator making one step per call."""
    args = model_speed.bench_args(True, 2, 64, "auto")
    graphdef, state = model_speed.random_model(args)
    rep = model_speed.Report(tmp_path, {})
    prompts, out = model_speed.generate_row(rep, {"hbm": 1e12}, "decode fast", graphdef, state, 2, 64, 64, 7, 2,
                                            1e6, 1e9)
    r = rep.rows[-1]
    assert r["name"] == "decode fast generate" and r["batch"] == 2 and "error" not in r
    assert r["seconds"] > 0 and r["tokens_per_s"] > 0 and r["prefill_s"] > 0
    assert (r["new_tokens"], r["prompt_len"], r["steps_per_call"]) == (7, 56, 2)
    ids = np.asarray(prompts)
    assert ids.shape == (2, 56) and ids.min() >= 0 and ids.max() < args.vocab_size
    assert out.tokens.shape == (2, 7) and list(out.lengths) == [7, 7]
    want = model_speed.Generator(nnx.merge(graphdef, state), max_seq_len=64, decode_steps=1).generate(prompts, 7)
    np.testing.assert_array_equal(out.tokens, want.tokens)
    assert len(rep.rows) == 1
    # prompts of < 1 token, or every decode step in the first (uncounted) call: skipped, said why
    assert model_speed.generate_row(rep, {"hbm": 1e12}, "decode fast", graphdef, state, 1, 64, 64, 63, 2, 1e6, 1e9) is None
    assert "prompts of context - 63 - 1 = 0 tokens" in capsys.readouterr().out
    assert model_speed.generate_row(rep, {"hbm": 1e12}, "decode fast", graphdef, state, 1, 64, 64, 3, 2, 1e6, 1e9) is None
    assert "needs --generate-steps > 3" in capsys.readouterr().out
    assert len(rep.rows) == 1


@pytest.mark.parametrize("flags, message", [
    (["--generate-steps", "-1"], "--generate-steps must be a number of tokens >= 0"),
    (["--loop-steps", "4", "--generate-steps", "5"], "use more than 5"),
])
def test_bad_generate_steps_are_refused_with_the_flag_named(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        model_speed.main(["--out", str(tmp_path), "--tiny", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_kernel_totals_count_overlapping_kernels_in_full_and_their_union_once():
    from benchmarks.model_speed import kernel_totals
    # a: [0, 10); b: [5, 12) overlaps a; a again: [20, 25); c: [21, 22) inside it
    events = [("a", 20, 5), ("b", 5, 7), ("a", 0, 10), ("c", 21, 1)]
    total, busy, per_op, launches = kernel_totals(events)
    assert total == 23 and busy == 12 + 5
    assert per_op == {"a": 15, "b": 7, "c": 1} and launches == {"a": 2, "b": 1, "c": 1}
    assert kernel_totals([]) == (0, 0, {}, {})


def test_kernel_alone_counts_only_the_time_one_kernel_runs_by_itself():
    from benchmarks.model_speed import kernel_alone
    # a: [0, 10) alone on [0, 5); b: [5, 12) alone on [10, 12); a: [20, 25) alone but for c [21, 22);
    # d: [25, 30) starts as a ends (alone all of it)
    events = [("a", 20, 5), ("b", 5, 7), ("a", 0, 10), ("c", 21, 1), ("d", 25, 5)]
    assert kernel_alone(events) == {"a": 5 + 4, "b": 2, "d": 5}
    assert kernel_alone([]) == {}


def test_kind_rows_sum_a_profile_by_part_of_the_model(tmp_path):
    # kernel names and source lines as a batch-64 decode profile on the H100 named them
    sources = {"loop_convert_fusion_4": "reference.py:22 _attend", "gemm_fusion_dot_general_61": "model.py:154 head_logits",
               "input_reduce_fusion_47": "numerics.py:94 mean", "router_logits": "reference.py:67 router_logits",
               "input_exponential_reduce_fusion_1": "reference.py:27 _attend"}
    per_op = {"expert_matmul_fp4_x2": 6000, "expert_matmul_fp4": 3000, "fp8_matmul__3": 400, "fp8_matmul": 100,
              "loop_convert_fusion_4": 300, "sm90_xmma_gemm_f64f64_f64f64_f64_tn_n_tilesize64x64x16_stage": 200,
              "input_exponential_reduce_fusion_1": 50, "gemm_fusion_dot_general_61": 450, "input_reduce_fusion_47": 30,
              "router_logits": 20}
    launches = dict.fromkeys(per_op, 3)
    rep = model_speed.Report(tmp_path, {})
    model_speed.kind_rows(rep, "decode fast", 64, 4096, per_op, launches, sources, 3, sum(per_op.values()),
                          {"routed experts": 2.7e3, "head": 450.0}, hbm=1e9)
    rows = {r["name"]: r for r in rep.rows}
    assert list(rows) == [f"  kind {k}" for k in model_speed.KINDS]
    # (ns over the 3 steps, kernels a step: each op launched 3 times in 3 steps)
    want = {"routed experts": (9000, 2), "dense fp8 kernel": (500, 2), "attention": (550, 3), "head": (450, 1),
            "other": (50, 2)}
    for k, (ns, n) in want.items():
        r = rows[f"  kind {k}"]
        assert r["seconds"] == pytest.approx(ns * 1e-9 / 3) and r["launches_per_step"] == n
        assert r["share"] == round(ns / 10550, 3)
    # bytes a step over time a step over the bandwidth: 2.7e3 B in 3e-6 s at 1e9 B/s
    assert rows["  kind routed experts"]["fraction_of_ceiling"] == pytest.approx(0.9)
    assert rows["  kind head"]["fraction_of_ceiling"] == pytest.approx(3.0)
    assert rows["  kind other"]["fraction_of_ceiling"] is None and "ceiling" not in rows["  kind other"]


def test_decode_kind_bytes_counts_the_routed_experts_hit_the_fp8_projections_and_the_head():
    args = ModelArgs.tiny()
    pb = model_speed.param_bytes(args)
    hit = [3] * args.n_layers
    got = model_speed.decode_kind_bytes(args, pb, 2, hit)
    assert got["routed experts"] == pytest.approx(sum(3 * lp["per_expert"] for lp in pb["layers"]))
    assert got["head"] == pb["head"] == args.vocab_size * args.dim * 2
    # the fp8 projections outside the routed experts: every e4m3 weight and e8m0 scale there
    _, state = nnx.split(nnx.eval_shape(lambda: model_speed.Transformer(args)))
    fp8 = [(k, v) for k, v in model_speed._flat(state) if k[0] == "layers" and k[2:4] != ["ffn", "experts"]
           and v.dtype in (jnp.float8_e4m3fn, jnp.float8_e8m0fnu)]
    assert {".".join(k[2:]) for k, _ in fp8} >= {"attn.wq_a.weight", "attn.wo_b.scale", "ffn.shared_experts.w2.weight"}
    assert got["dense fp8 kernel"] == sum(int(np.prod(v.shape)) for _, v in fp8) > 0
    # uniform routing without a measured count: `unique_experts` of the batch's tokens
    n_exp, k = args.moe_experts(0)
    uniform = model_speed.decode_kind_bytes(args, pb, 2)["routed experts"]
    assert uniform == pytest.approx(sum(model_speed.unique_experts(*args.moe_experts(i), 2) * lp["per_expert"]
                                        for i, lp in enumerate(pb["layers"])))
    assert uniform > 0 and n_exp >= k


def test_fp8_linear_variants_name_block_sizes_fields():
    from benchmarks.fp8_linear import parse_variant
    from pallas_kernels.fp8_matmul import api

    bs = parse_variant("bn=128/bk=128/w=8/st=2/swap=1")
    assert (bs.block_n, bs.block_k, bs.num_warps, bs.num_stages, bs.swap_ab) == (128, 128, 8, 2, True)
    assert parse_variant("q=0/gs=1") == api.BlockSizes(quantise_one_row=False, one_row_group_sums=True)
    assert parse_variant("") == api.BlockSizes() and api.BlockSizes().swap_ab is False
    for bad in ("swp=1", "bn=sixty", "bn"):
        with pytest.raises(ValueError, match=r"--variants: .* is not NAME=INTEGER"):
            parse_variant(bad)


def test_fp4_mosaic_probe_decode_bits_give_every_code_times_every_folded_scale():
    """benchmarks/fp4_mosaic_probe.py's integer steps (the same functions its kernel applies to
    register values), run here on numpy: every byte's low and high nibble, as bf16 bits, times
    the folded scale's bits for every byte 0..128, equals the e2m1 value (`quant.E2M1_VALUES`,
    element 2j the low nibble) times 2^(b - 127) exactly, and that product is a bf16 value (so the kernel's one
    bf16 multiply is exact; subnormals included)."""
    import ml_dtypes

    from dsv41_jax import quant

    def value(bits):
        return np.asarray(bits).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)

    b = np.arange(256, dtype=np.int16)
    lo, hi = fp4_mosaic_probe.decode_bits(b)
    assert lo.dtype == hi.dtype == np.int16
    table = np.asarray(quant.E2M1_VALUES, np.float64)  # float64 here: XLA:CPU flushes fp32 subnormals
    codes = np.stack([table[b & 0x0F], table[(b >> 4) & 0x0F]], -1).reshape(-1)
    for sb in range(129):
        want = codes * 2.0 ** (sb - 127)
        got = np.stack([value(lo), value(hi)], -1).reshape(-1) * value(fp4_mosaic_probe.scale_bits(np.int16(sb)))
        np.testing.assert_array_equal(got, want, err_msg=f"scale byte {sb}")
        np.testing.assert_array_equal(got.astype(ml_dtypes.bfloat16).astype(np.float64), got)


def test_fp4_mosaic_probe_lowers_for_cuda_and_refuses_what_it_cannot_tile(capsys):
    """The Mosaic GPU kernels (one warpgroup; a producer and one or two compute warpgroups) build
    for CUDA on this host (lowering only: values and speed are measured on a GPU by the script,
    against `reference`); shapes and sites they cannot take are refused by name."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    e, m, n, k = 2, 3, 128, 512
    x = jax.ShapeDtypeStruct((e, m, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((e, n, k // 2), jnp.uint8)
    s_t = jax.ShapeDtypeStruct((e, k // 32, n), jnp.uint8)
    for kw in ({}, {"block_k": 256, "stages": 2}, {"ws": True}, {"ws": True, "wgs": 1, "block_k": 64},
               {"bytes8": True}, {"ws": True, "bytes8": True, "block_k": 256}, {"inflight": 4, "bytes8": True},
               {"ws": True, "wgs": 1, "tiles": 2}, {"ws": True, "products": False}):
        fn = jax.jit(lambda x, w, s, kw=kw: fp4_mosaic_probe.fp4_matmul_mgpu(x, w, s, **kw))
        assert "mosaic_gpu" in fn.trace(x, w, s_t).lower(lowering_platforms=("cuda",)).as_text(), kw
        assert fn.eval_shape(x, w, s_t).shape == (e, m, n)
    bad = jnp.zeros((e, m, k), jnp.bfloat16), jnp.zeros((e, 96, k // 2), jnp.uint8), jnp.zeros((e, k // 32, 96), jnp.uint8)
    with pytest.raises(ValueError, match="unsupported shape"):
        fp4_mosaic_probe.fp4_matmul_mgpu(*bad)
    with pytest.raises(ValueError, match="unsupported shape"):  # block_k must be 64, 128 or 256
        fp4_mosaic_probe.fp4_matmul_mgpu(bad[0], jnp.zeros((e, n, k // 2), jnp.uint8),
                                         jnp.zeros((e, k // 32, n), jnp.uint8), block_k=512)
    with pytest.raises(ValueError, match="inflight=1 needs one warpgroup"):
        fp4_mosaic_probe.fp4_matmul_mgpu(bad[0], jnp.zeros((e, n, k // 2), jnp.uint8),
                                         jnp.zeros((e, k // 32, n), jnp.uint8), ws=True, inflight=1)
    with pytest.raises(ValueError, match="tiles=2 needs ws=True"):
        fp4_mosaic_probe.fp4_matmul_mgpu(bad[0], jnp.zeros((e, n, k // 2), jnp.uint8),
                                         jnp.zeros((e, k // 32, n), jnp.uint8), tiles=2)
    assert fp4_mosaic_probe.parse_site("64x64 w1") == (64, 64, "w1")
    # bytes8: thread q of a row holds bytes 4q..4q+3 of each 16-byte block and reads them as the
    # 16-bit operand's columns 2q, 2q+1 (bytes 4q, 4q+1) and 2q+8, 2q+9 (bytes 4q+2, 4q+3)
    order = fp4_mosaic_probe.byte_order(64)
    assert sorted(order) == list(range(64))
    for q in range(4):
        assert list(order[[2 * q, 2 * q + 1, 2 * q + 8, 2 * q + 9]]) == [4 * q, 4 * q + 1, 4 * q + 2, 4 * q + 3]
    assert (order[16:32] == order[:16] + 16).all()
    assert fp4_mosaic_probe.main(["--sites", "6x1 w4"]) == 2
    assert "--sites" in capsys.readouterr().err


def test_tma_probe_refuses_a_bad_stream_shape_with_the_flag_named(capsys):
    with pytest.raises(SystemExit) as e:
        tma_probe.main(["--stream-shapes", "65536by8192"])
    assert e.value.code == 2 and "--stream-shapes takes NxK" in capsys.readouterr().err


# an optimized-HLO entry in the GPU text format: a and b independent, c reads both, the Pallas
# kernel d reads c, the sort e (two kernels) reads a, f reads d and e (f's kernel is a's: XLA
# deduplicates identical fusions)
_CP_HLO = """HloModule m, is_scheduled=true

%fused_a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}

ENTRY %main.1 (x.1: f32[4], y.1: f32[4]) -> (f32[4], f32[4]) {
  %x.1 = f32[4]{0} parameter(0)
  %y.1 = f32[4]{0} parameter(1)
  %fusion.a = f32[4]{0} fusion(%x.1), kind=kLoop, calls=%fused_a, metadata={op_name="jit(f)/neg"}
  %fusion.b = f32[4]{0} fusion(%y.1), kind=kLoop, calls=%fused_a
  %fusion.c = (f32[4]{0}, f32[4]{0}) fusion(%fusion.a, %fusion.b), kind=kLoop, calls=%fused_a
  %get-tuple-element.1 = f32[4]{0} get-tuple-element(%fusion.c), index=0
  %pallas_call.7 = f32[4]{0} custom-call(%get-tuple-element.1), custom_call_target="__gpu$xla.gpu.triton", backend_config={name = \\"fp8_matmul\\", num_warps = 4}
  %sort.3 = f32[4]{0} sort(%fusion.a), dimensions={0}, to_apply=%fused_a
  %bitcast.2 = f32[4]{0} bitcast(%sort.3)
  ROOT %fusion.f = (f32[4]{0}, f32[4]{0}) fusion(%pallas_call.7, %bitcast.2), kind=kLoop, calls=%fused_a, metadata={deduplicated_name="fusion.a"}
}
"""
_CP_EVENTS = [("fusion_a", 2.0), ("fusion_b", 5.0), ("fusion_c", 1.0), ("fp8_matmul__3", 10.0),
              ("memcpy32_post", 0.5), ("sort_3_1", 30.0), ("fusion_a", 1.5)]


def test_critical_path_follows_the_longest_chain_of_dependent_kernels():
    from benchmarks import critical_path as cp

    insts = cp.entry_instructions(_CP_HLO)
    assert [i.name for i in insts if i.launches] == ["fusion.a", "fusion.b", "fusion.c", "pallas_call.7", "sort.3",
                                                      "fusion.f"]
    assert {i.name: i.args for i in insts}["fusion.f"] == ("pallas_call.7", "bitcast.2")
    assert {i.name: i.kernel for i in insts}["pallas_call.7"] == "fp8_matmul"
    secs = cp.align(insts, _CP_EVENTS)
    assert secs == {"fusion.a": 2.0, "fusion.b": 5.0, "fusion.c": 1.0, "pallas_call.7": 10.0, "sort.3": 30.5,
                    "fusion.f": 1.5}
    # a -> sort (memcpy + sort pass) -> f = 34 beats b -> c -> d -> f = 17.5
    assert cp.critical_path(insts, secs) == (34.0, ["fusion.a", "sort.3", "fusion.f"])
    # 6 more a launch: a -> sort -> f = 34 + 3 x 6 = 52 still beats b -> c -> d -> f = 17.5 + 4 x 6
    assert cp.critical_path(insts, secs, per_launch=6.0) == (52.0, ["fusion.a", "sort.3", "fusion.f"])
    assert cp.critical_path(insts, dict(secs, **{"sort.3": 1.0}))[1] == ["fusion.b", "fusion.c", "pallas_call.7",
                                                                         "fusion.f"]
    by = cp.path_by_source(["fusion.a", "sort.3", "fusion.f"], insts, secs, lambda i: i.op)
    assert by == {"sort": (30.5, 1), "fusion": (3.5, 2)}
    steps = cp.steps_of([(n, 100.0 * s + i, d) for s in range(2) for i, (n, d) in enumerate(_CP_EVENTS)], 2)
    assert cp.mean_seconds(insts, steps) == secs


@pytest.mark.parametrize("events, message", [
    (_CP_EVENTS[:3] + [("fusion_x", 1.0)] + _CP_EVENTS[4:], "schedule has pallas_call.7"),
    (_CP_EVENTS + [("fusion_z", 1.0)], "left over"),
    (_CP_EVENTS[:4], "kernel events for 6"),
])
def test_critical_path_refuses_a_trace_that_is_not_the_schedule(events, message):
    from benchmarks import critical_path as cp

    with pytest.raises(ValueError, match=message):
        cp.align(cp.entry_instructions(_CP_HLO), events)


# launches with more or fewer kernels than instructions, as an H100 traced them at batch 64: a
# deduplicated fusion, a cuBLAS call with a second kernel, a sort wrapped in a fusion (a copy of
# its operand, then the pass named after the sort), a copy, a memset before a fusion
_CP_HLO2 = """HloModule m2, is_scheduled=true

%fused_a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}

%fused_sort (q: s32[4]) -> (s32[4], s32[4]) {
  %q = s32[4]{0} parameter(0)
  %iota.1 = s32[4]{0} iota(), iota_dimension=0
  ROOT %sort.84.1 = (s32[4]{0}, s32[4]{0}) sort(%q, %iota.1), dimensions={0}, to_apply=%cmp
}

ENTRY %main.2 (x.1: f32[4], i.1: s32[4]) -> f32[4] {
  %x.1 = f32[4]{0} parameter(0)
  %i.1 = s32[4]{0} parameter(1)
  %input_reduce_fusion.9 = f32[4]{0} fusion(%x.1), kind=kInput, calls=%fused_a, metadata={deduplicated_name="input_reduce_fusion.2"}
  %custom-call.13 = (f32[4]{0}, s8[64]{0}) custom-call(%input_reduce_fusion.9), custom_call_target="__cublas$lt$matmul"
  %get-tuple-element.5 = f32[4]{0} get-tuple-element(%custom-call.13), index=0
  %fusion.77 = (s32[4]{0}, s32[4]{0}) fusion(%i.1), kind=kCustom, calls=%fused_sort
  %copy.3 = f32[4]{0} copy(%get-tuple-element.5)
  ROOT %loop_add_fusion = f32[4]{0} fusion(%copy.3, %fusion.77), kind=kLoop, calls=%fused_a
}
"""
_CP_EVENTS2 = [("input_reduce_fusion_2", 3.0), ("sm90_xmma_gemm_f64f64_cublas", 7.0), ("splitKreduce_kernel", 1.0),
               ("memcpy32_post", 0.5), ("sort_84_1", 4.0), ("memcpy32_post", 0.25), ("Memset 0", 0.125),
               ("loop_add_fusion", 2.0)]


def test_critical_path_aligns_launches_of_several_kernels_by_name():
    from benchmarks import critical_path as cp

    insts = cp.entry_instructions(_CP_HLO2)
    assert [i.name for i in insts if i.wraps_sort] == ["fusion.77"]
    assert cp.align(insts, _CP_EVENTS2) == {"input_reduce_fusion.9": 3.0, "custom-call.13": 8.0, "fusion.77": 4.5,
                                            "copy.3": 0.25, "loop_add_fusion": 2.125}
    for events, message in (
            (_CP_EVENTS2[:4] + [("loop_xor_fusion", 1.0)] + _CP_EVENTS2[4:], "event 4 is 'loop_xor_fusion'"),
            (_CP_EVENTS2[:1] + _CP_EVENTS2[3:], "schedule has fusion.77"),  # the cuBLAS call's kernels missing
            (_CP_EVENTS2[:-1], "end before loop_add_fusion"),
            (_CP_EVENTS2 + [("memcpy32_post", 1.0)], "left over")):
        with pytest.raises(ValueError, match=message):
            cp.align(insts, events)


def test_critical_path_reads_a_compiled_program_and_model_speed_reports_it(tmp_path):
    """The parser on XLA's own optimized text (CPU here): every operand names an earlier
    instruction; and `critical_path_rows` on the synthetic entry: the path row and its sources,
    or the reason when the trace does not fit."""
    from benchmarks import critical_path as cp

    x = jnp.ones((4, 256), jnp.bfloat16)
    text = jax.jit(lambda x, w: rms_norm(x, w, 1e-6) * 2).lower(x, x[0]).compile().as_text()
    insts = cp.entry_instructions(text)
    seen: set = set()
    for i in insts:
        assert set(i.args) <= seen, i
        seen.add(i.name)
    assert any(i.launches for i in insts)
    with pytest.raises(ValueError, match="no ENTRY"):
        cp.entry_instructions("HloModule m\n")

    rep = model_speed.Report(tmp_path, {})
    events = [(n, t * 100_000, int(d * 1000)) for t, (n, d) in enumerate(_CP_EVENTS)]  # ns, as traced
    model_speed.critical_path_rows(rep, "decode fast", 1, 8, _CP_HLO, events, 1, {"sort_3": "moe.py:1 f"}, 5)
    rows = {r["name"]: r for r in rep.rows}
    assert rows["decode fast critical path"]["seconds"] == pytest.approx(34e-6)
    assert rows["decode fast critical path"]["kernels_on_path"] == 3
    assert rows["  path src moe.py:1 f"]["seconds"] == pytest.approx(30.5e-6)
    rep2 = model_speed.Report(tmp_path / "b", {})
    model_speed.critical_path_rows(rep2, "decode fast", 1, 8, _CP_HLO, events[:5], 1, {}, 5)
    assert rep2.rows[0]["seconds"] is None and "kernel events" in rep2.rows[0]["error"]


def test_summary_takes_each_rows_latest_run_and_speed_ups_within_one_run(capsys, tmp_path):
    from benchmarks import summary

    def row(name, batch, context, seconds, run, frac=0.5):
        return {"name": name, "batch": batch, "context": context, "seconds": seconds, "run": run, "part": "a",
                "fraction_of_ceiling": frac, "ceiling": "hbm"}
    rows = [row("decode fast loop", 1, 4096, 2e-3, 20), row("decode fast loop", 1, 4096, 1.5e-3, 22),
            row("decode fast loop", 1, 4096, None, 23),  # a failed row does not count
            row("decode fast loop, variant (not kept)", 1, 4096, 1e-3, 24),
            row("decode reference loop", 1, 4096, 3e-3, 20), row("decode fast loop", 64, 4096, 0.015, 21),
            row("layer fast 10 reuse r1 loop", 1, 4096, 2e-4, 19), row("layer fast 2 window loop", 1, 4096, 1e-4, 19)]
    t = {(e["name"], e["batch"]): e for e in summary.table(rows)}
    assert t[("decode fast loop", 1)]["seconds"] == 1.5e-3 and t[("decode fast loop", 1)]["run"] == 22
    assert t[("decode fast loop", 1)]["goal"] == 0.75 and t[("decode fast loop", 64)]["goal"] == 0.80
    assert summary.layer_names(rows) == ["layer fast 2 window loop", "layer fast 10 reuse r1 loop"]
    # the speed-up pairs run 20's two rows, not run 22's fast row with run 20's reference
    assert summary.speedups(rows) == [{"batch": 1, "context": 4096, "run": 20, "fast_s": 2e-3, "reference_s": 3e-3,
                                       "speedup": 1.5}]
    assert "| decode fast loop | 1 | 4096 | 1500.0 µs | 50.0% of hbm | 75% | 22a |" in summary.markdown(rows)
    # of two rows of one run and part, the later one (timed after the first) is the latest
    twice = [row("prefill fast", 1, 4096, 0.13, 8), row("prefill fast", 1, 4096, 0.129, 8)]
    assert summary.latest(twice, "prefill fast", 1, 4096)["seconds"] == 0.129
    # the table names the cards its runs came from
    meta = {"runs": {"3": {"device": "NVIDIA H200", "jax": "0.11.2"}, "1": {"device": "NVIDIA H200", "jax": "0.11.2"},
                     "2": {"device": "NVIDIA H200", "jax": "0.11.2"}, "10": {"device": "NVIDIA H100 80GB HBM3"}}}
    assert summary.devices(meta) == "NVIDIA H200 (jax 0.11.2): runs 1-3; NVIDIA H100 80GB HBM3: runs 10"
    assert summary.markdown(rows, summary.devices(meta)).startswith("Measured on NVIDIA H200 (jax 0.11.2): runs 1-3; ")
    assert summary.devices({}) == "" and summary.markdown(rows).startswith("| row |")
    # the committed H200 results hold every decode and prefill row the suite reports
    assert summary.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Measured on NVIDIA H200 (jax 0.11.2): runs 1-")
    for name, batch, context in summary.DECODE + summary.PREFILL:
        assert f"| {name} | {batch} | {context} |" in out
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    with pytest.raises(SystemExit):
        summary.main([str(bad)])
    assert "not a results file" in capsys.readouterr().err
    bad.write_text('{"rows": [], "meta": {"runs": {"x": {}}}}')  # a run that is not a number
    with pytest.raises(SystemExit):
        summary.main([str(bad)])
    assert "not a results file" in capsys.readouterr().err


def test_critical_path_cli_names_the_file_it_cannot_read(tmp_path, capsys):
    from benchmarks import critical_path as cp

    hlo, events = tmp_path / "step.hlo.txt", tmp_path / "events.json"
    hlo.write_text(_CP_HLO)
    events.write_text(json.dumps([[n, i * 1000, int(d * 1000)] for i, (n, d) in enumerate(_CP_EVENTS)]))
    assert cp.main([str(hlo), str(events)]) == 0
    assert "3 of 6 kernels on the critical path: 34.0 us of 50.0 us kernel time" in capsys.readouterr().out
    packed = tmp_path / "events.json.gz"  # as model_speed's profiles save them
    packed.write_bytes(gzip.compress(events.read_bytes()))
    assert cp.main([str(hlo), str(packed)]) == 0
    assert "3 of 6 kernels on the critical path: 34.0 us" in capsys.readouterr().out
    for args, what in (([str(tmp_path / "missing.txt"), str(events)], "missing.txt: not an optimized HLO"),
                       ([str(events), str(events)], "events.json: not an optimized HLO"),
                       ([str(hlo), str(hlo)], "step.hlo.txt: not a JSON list"),
                       ([str(hlo), str(events), "--steps", "4"], "events.json: 7 kernel events do not split")):
        with pytest.raises(SystemExit):
            cp.main(args)
        assert what in capsys.readouterr().err


# the routed-expert kernel's K loop as cuobjdump prints it (lines of a real sm_90 listing of the
# default decode tile, compiled by benchmarks/triton_sass.py, with most of the loop left out):
# two instructions before the loop, the loop from 0x1330 to its branch, two after
_SASS = """
        Function : expert_matmul_fp4_x2
        /*1300*/                   STL [R1], RZ ;
        /*1310*/                   LDGDEPBAR ;
        /*1330*/                   UIADD3 UR8, UR8, 0x1, URZ ;
        /*1340*/                   DEPBAR.LE SB0, 0xc ;
        /*1380*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*15b0*/                   LOP3.LUT R10, R10, 0x1c001c0, RZ, 0xc0, !PT ;
        /*15c0*/                   IMAD.MOV.U32 R14, RZ, RZ, R134 ;
        /*15e0*/                   LDS.64 R154, [R6+UR12+0x10000] ;
        /*1620*/                   HMUL2.BF16_V2 R8, R8, 8.50705917302346158658e+37, 8.50705917302346158658e+37 ;
        /*1630*/                   PRMT R43, R58, 0x4400, R59 ;
        /*1660*/                   HMUL2.BF16_V2 R8, R8, R82.reuse.H0_H0 ;
        /*1780*/                   HMMA.16816.F32.BF16 R88, R12, R8, RZ ;
        /*1790*/                   LDS.128 R12, [R249+UR13+0x80] ;
        /*1840*/                   LDS.U8 R3, [R0+UR14+0x18008] ;
        /*bb20*/                   LDGSTS.E.BYPASS.128 [R31+0xa800], desc[UR10][R10.64], !P3 ;
        /*bb60*/                   LDGDEPBAR ;
        /*bba0*/               @P0 BRA 0x1330 ;
        /*bbb0*/                   LDL.LU R38, [R1+0x50] ;
        /*bbc0*/                   DEPBAR.LE SB0, 0x0 ;
"""


def test_triton_sass_counts_the_loop_between_a_backward_branch_and_its_target():
    from benchmarks import triton_sass

    st = triton_sass.loop_stats(_SASS)
    assert st["instructions"] == 15  # 0x1330 .. the branch; not the STL / LDL outside
    assert st["ops"] == {"HMUL2": 2, "UIADD3": 1, "DEPBAR": 1, "BAR": 1, "LOP3": 1, "IMAD.MOV": 1, "LDS.64": 1,
                         "PRMT": 1, "HMMA.16816": 1, "LDS.128": 1, "LDS.U8": 1, "LDGSTS": 1, "LDGDEPBAR": 1,
                         "BRA": 1}
    with pytest.raises(ValueError, match="no backward conditional branch"):
        triton_sass.loop_stats(_SASS.replace("@P0 BRA 0x1330", "@P0 BRA 0xbbc0"))


def test_triton_sass_issue_bound_is_the_rate_of_four_warp_instructions_a_clock_an_sm():
    """w1's decode tile (64 x 512 codes and 64 x 16 scale bytes a step, 16 rows) at 1420 loop
    instructions a warp over 4 warps: 1420 clocks a step on an SM's 4 schedulers, so 17408 bytes
    and 2 x 16 x 64 x 512 FLOPs per 1420 clocks on 132 SMs at 1.98 GHz; programs sharing an SM
    leave it unchanged (their steps add up), twice the warps halve it."""
    from benchmarks import triton_sass

    b = triton_sass.issue_bound(1420, 4, 64 * (256 + 16), 2 * 16 * 64 * 512)
    assert b["weights_tb_s"] == pytest.approx(17408 * 132 * 1.98e9 / 1420 / 1e12) == pytest.approx(3.2041, abs=1e-4)
    assert b["mma_tflop_s"] == pytest.approx(2 * 16 * 64 * 512 * 132 * 1.98e9 / 1420 / 1e12)
    half = triton_sass.issue_bound(1420, 8, 64 * (256 + 16), 2 * 16 * 64 * 512)
    assert half["weights_tb_s"] == pytest.approx(b["weights_tb_s"] / 2)
    assert triton_sass.issue_bound(1420, 4, 17408, 0, sms=66)["weights_tb_s"] == pytest.approx(b["weights_tb_s"] / 2)


def test_triton_sass_lowers_the_expert_kernel_for_cuda_without_a_gpu():
    """The Triton IR comes from jax's own Pallas lowering (no GPU, no triton package): one module
    for the decode tile's fused w1 + w3 launch, at the model's defaults, with the "pairs" PTX; w2's
    launch of one weight, at its defaults and without `swap_ab_single`'s options."""
    from benchmarks import triton_sass

    ir, kw = triton_sass.expert_ir(*triton_sass.SITES["w1+w3 decode"])
    assert (kw["block_n"], kw["block_k"], kw["num_stages"], kw["decode"], kw["rows"]) == (64, 512, 3, "pairs", 16)
    assert ir.count("tt.dot") == 16 and "prmt.b32" in ir  # 8 code positions x 2 weights
    ir, kw = triton_sass.expert_ir(*triton_sass.SITES["w2 decode"], decode="select", num_warps=8)
    # one weight: one dot a K step with the weight tile first by default (BlockSizes.swap_ab_single)
    assert ir.count("tt.dot") == 1 and kw["swap_ab"] and "prmt.b32" not in ir and kw["num_warps"] == 8
    ir, kw = triton_sass.expert_ir(*triton_sass.SITES["w2 decode"], decode="select", one_dot=False, swap_ab=False)
    assert ir.count("tt.dot") == 8 and "prmt.b32" not in ir


def test_programs_per_sm_takes_the_scarcest_resource():
    """sm_90 residency: registers go to a warp 8 a thread at a time (255 and 228 -> 256 and 232: two
    4-warp programs), each program reserves 1 KB of shared memory beside its own (116 KB: one),
    and an SM holds 64 warps."""
    from benchmarks import triton_sass

    assert triton_sass.programs_per_sm(255, 4, 102400) == {"registers": 2, "shared": 2, "warps": 16, "programs": 2}
    assert triton_sass.programs_per_sm(228, 4, 118784)["programs"] == 1  # shared memory
    assert triton_sass.programs_per_sm(112, 4, 41984) == {"registers": 4, "shared": 5, "warps": 16, "programs": 4}
    assert triton_sass.programs_per_sm(121, 4, 0)["registers"] == 4  # 128 a thread: 16 warps of 4096
    assert triton_sass.programs_per_sm(129, 4, 0)["registers"] == 3  # 136: 15 warps of 4352
    assert triton_sass.programs_per_sm(32, 8, 0)["programs"] == 8  # 64 warps


def test_triton_sass_cli_names_the_bad_flag(capsys):
    from benchmarks import triton_sass

    for args, what in ((["--sites", "w9"], "--sites: unknown ['w9']"), (["--variants", "{}"], "--variants: expected"),
                       (["--variants", "[{"], "--variants:")):
        with pytest.raises(SystemExit):
            triton_sass.main(args)
        assert what in capsys.readouterr().err


def test_triton_sass_compiles_the_decode_and_prefill_tiles():
    """With the triton package: the 16-row decode tile multiplies on mma.sync (HMMA, register
    operands: no store of a decoded tile to shared memory in the loop), the 64-row prefill tile
    on wgmma (HGMMA), whose weight operand is stored to shared memory first (STS); with
    `swap_ab` both take wgmma with the decoded weights as the register operand (the default of
    single-weight launches, `BlockSizes.swap_ab_single`)."""
    pytest.importorskip("triton")
    from benchmarks import triton_sass

    plain = {"swap_ab": False, "one_dot": False}
    dec = triton_sass.site_row("w1 decode", plain)
    assert list(dec["mma"]) == ["HMMA.16816"] and dec["sts"] == 0, dec
    pre = triton_sass.site_row("w1 prefill", plain)
    assert list(pre["mma"]) == ["HGMMA.64"] and pre["sts"] > 0, pre
    pre_default = triton_sass.site_row("w1 prefill", {})["kernel"]  # swap_ab + one_dot by default
    assert pre_default["swap_ab"] and pre_default["one_dot"] and pre_default | plain == pre["kernel"], pre_default
    assert triton_sass.site_row("w1+w3 decode", {})["kernel"]["swap_ab"] is False  # fused: not by default
    sel = triton_sass.site_row("w1 decode", {"decode": "select", **plain})
    assert sel["alu_per_code"] > 2 * dec["alu_per_code"], (sel, dec)
    # the folded scale takes one packed multiply of the pair: fewer ALU operations, a higher issue bound
    fold = triton_sass.site_row("w1 decode", {"scale_fold": True, **plain})
    assert fold["alu_per_code"] < dec["alu_per_code"] and fold["loop_instructions"] < dec["loop_instructions"]
    assert fold["issue_bound"]["weights_tb_s"] > dec["issue_bound"]["weights_tb_s"]
    assert dec["issue_bound"] == triton_sass.issue_bound(dec["loop_instructions"], 4, 64 * (256 + 16), 2 * 16 * 64 * 512)
    # one-row programs: no MMA in the loop, one fp32 FMA a code, no spills
    one = triton_sass.site_row("w2 one row", {"scale_fold": True})
    assert one["mma"] == {} and one["spill_ops"] == 0, one
    assert one["top_ops"].get("FFMA", 0) == one["codes_per_thread"], one
    # the weight tile as the MMA's A operand: wgmma with the decoded registers, x from shared
    # memory, no register moves to assemble x's fragments, fewer instructions; at the prefill
    # tile no decoded tile stored to shared memory either
    base = triton_sass.site_row("w1+w3 decode", {"decode": "relaid", "scale_fold": True})
    swap = triton_sass.site_row("w1+w3 decode", {"decode": "relaid", "scale_fold": True, "swap_ab": True})
    assert list(base["mma"]) == ["HMMA.16816"] and list(swap["mma"]) == ["HGMMA.64"], (base, swap)
    assert swap["moves_per_code"] < base["moves_per_code"] / 5, (base, swap)
    assert swap["loop_instructions"] < 0.9 * base["loop_instructions"], (base, swap)
    pre_swap = triton_sass.site_row("w1 prefill", {"decode": "relaid", "scale_fold": True, "swap_ab": True,
                                                   "one_dot": True})
    assert pre_swap["sts"] == 0 and pre_swap["loop_instructions"] < 0.6 * pre["loop_instructions"], pre_swap
    # the fused one-token launch: 216 programs, two an SM by default (one wave of 132 SMs); with
    # swap_ab + one_dot its shared memory holds one an SM (two waves); w2's 480 keep one wave
    swap_od = triton_sass.site_row("w1+w3 decode", {"decode": "relaid", "scale_fold": True, "swap_ab": True,
                                                     "one_dot": True})
    assert base["one_token_programs"] == swap_od["one_token_programs"] == 216
    assert base["programs_per_sm"]["programs"] == 2 and base["one_token_waves"] < 1, base
    assert swap_od["programs_per_sm"]["programs"] == swap_od["programs_per_sm"]["shared"] == 1, swap_od
    assert swap_od["one_token_waves"] > 1.5, swap_od
    w2_swap = triton_sass.site_row("w2 decode", {"decode": "relaid", "scale_fold": True, "swap_ab": True,
                                                 "one_dot": True})
    assert w2_swap["one_token_programs"] == 480 and w2_swap["one_token_waves"] < 1, w2_swap
    assert pre["one_token_waves"] is None


def test_triton_sass_counts_the_float64_attention_program():
    """With the triton package: the float64 attention program multiplies on the CUDA cores (f64
    FMA / MUL, no f64 tensor-core MMA); a decode program (one 32-slot step a split) barely
    spills, a 64-slot step spills several times more than a 32-slot one (why the default steps
    are 32 slots)."""
    pytest.importorskip("triton")
    from benchmarks import triton_sass

    one = triton_sass.attention_f64_row(1)
    assert one["kernel"]["block_k"] == 32 and not one["loop"], one
    assert one["f64_mul_per_thread"] >= one["f64_mul_needed_per_thread"] / 2 and one["dmma"] == 0, one
    assert one["spill_ops"] <= 8, one
    step32 = triton_sass.attention_f64_row(64)
    step64 = triton_sass.attention_f64_row(64, block_k=64)
    assert step32["kernel"]["block_k"] == 32 and step32["loop"] and step64["loop"]
    assert step64["spill_ops"] > 3 * step32["spill_ops"], (step32, step64)


def test_default_expert_variants_are_block_size_fields():
    from pallas_kernels.expert_matmul import api

    for v in model_speed.KERNEL_VARIANTS:
        api.BlockSizes(**v)  # a misspelt field would be a TypeError here, not a silent error row on the GPU
    assert {"one_dot": True} in model_speed.KERNEL_VARIANTS and {"scale_fold": True} in model_speed.KERNEL_VARIANTS
    assert {"one_row": True, "scale_fold": True} in model_speed.KERNEL_VARIANTS


def test_triton_sass_splits_cuobjdump_listings_by_function():
    from benchmarks import triton_sass

    usage = " Function expert_matmul_fp4_x2:\n  REG:255 STACK:88 SHARED:1024 LOCAL:0\n Function other:\n  REG:8\n"
    assert triton_sass.functions(usage) == {"expert_matmul_fp4_x2": "  REG:255 STACK:88 SHARED:1024 LOCAL:0\n",
                                            "other": "  REG:8\n"}
    sass = triton_sass.functions(_SASS + "        Function : second\n        /*0000*/  EXIT ;\n")
    assert list(sass) == ["expert_matmul_fp4_x2", "second"]
    assert triton_sass.loop_stats(sass["expert_matmul_fp4_x2"])["instructions"] == 15


def test_triton_sass_counts_the_loops_of_a_ptx_module(tmp_path, capsys):
    """--ptx (a device's dump): the module is assembled by the package's ptxas and the matching
    kernels' loops are counted; a module without a match is refused naming the flag."""
    pytest.importorskip("triton")
    from benchmarks import triton_sass

    ir, kw = triton_sass.expert_ir(*triton_sass.SITES["w2 decode"], swap_ab=False, one_dot=False)
    (tmp_path / "m.ptx").write_text(triton_sass.compile_ir(ir, kw["num_warps"], kw["num_stages"]).asm["ptx"])
    assert triton_sass.main(["--ptx", str(tmp_path / "m.ptx")]) == 0
    out = capsys.readouterr().out
    assert "| expert_matmul_fp4 |" in out and "HMMA.16816 32" in out, out
    with pytest.raises(SystemExit):
        triton_sass.main(["--ptx", str(tmp_path / "m.ptx"), "--function", "sinkhorn"])
    assert "no kernel with a loop matches --function 'sinkhorn'" in capsys.readouterr().err


def test_triton_sass_fp8_rows_show_the_swapped_operands_keep_the_weight_tile_out_of_shared_memory(capsys):
    """--fp8 (the dense fp8 kernel compiled for sm_90 by the triton package): at 64 rows the
    default tile stores its decoded weight tile to shared memory before the wgmma (STS in the K
    loop), `swap_ab` does not; at 8 rows (16-row tiles) `swap_ab` turns mma.sync into wgmma.
    Measured (triton 3.9.0): wq_b at 64 rows STS 16 -> 0, at 8 rows HMMA.16816 32 -> HGMMA.64 16."""
    pytest.importorskip("triton")
    from benchmarks import triton_sass

    plain, swapped = (triton_sass.fp8_row("wq_b", 64, swap_ab=sw) for sw in (False, True))
    assert plain["sts"] > 0 and swapped["sts"] == 0, (plain, swapped)
    assert plain["kernel"]["swap_ab"] is False and swapped["kernel"]["swap_ab"] is True
    small = triton_sass.fp8_row("wq_b", 8, swap_ab=True)
    assert any(k.startswith("HGMMA") for k in small["mma"]) and not any(k.startswith("HMMA") for k in small["mma"])
    # one K step a program (shared w2 at 16 rows: 9 K blocks in 9 splits): the whole kernel counted
    assert triton_sass.main(["--fp8", '[{"site": "shared w2", "rows": 16}, {"site": "wq_b", "rows": 16}]']) == 0
    out = capsys.readouterr().out
    assert "| shared w2 | 16 |" in out and "(no loop: whole kernel)" in out and "| wq_b | 16 |" in out


def test_triton_sass_fp8_refuses_unknown_sites_and_non_lists_naming_the_flag(capsys):
    """Checked before anything is compiled (no triton package needed)."""
    from benchmarks import triton_sass

    for bad, message in (('[{"site": "wq_c"}]', "--fp8: unknown sites ['wq_c']"), ("{}", "--fp8: expected a JSON list")):
        with pytest.raises(SystemExit):
            triton_sass.main(["--fp8", bad])
        assert message in capsys.readouterr().err


def test_launch_count_chains_a_compiled_decode_step_by_source():
    """`launch_count.chain` on XLA's own optimized decode step (tiny width, CPU here): the chain's
    launches per source add up to the chain, which is no longer than the launches; project lines
    name most of them, and the chain runs through the layers in order."""
    from benchmarks import launch_count

    args = model_speed.bench_args(True, 1, 64, "auto")
    graphdef, state = model_speed.random_model(args)
    cache = model_speed.seeded_cache(args, 1, 64)
    ids, pos = jnp.zeros((1,), jnp.int32), jnp.full((1,), 63, jnp.int32)
    text = model_speed._decode_fn(graphdef).lower(state, ids, pos, cache).compile().as_text()
    n, path, counts = launch_count.chain(text)
    assert 0 < len(path) <= n and sum(counts.values()) == len(path)
    assert list(counts.values()) == sorted(counts.values(), reverse=True)
    ours = sum(c for k, c in counts.items() if re.match(r"\w+\.py:\d+ ", k))
    assert ours >= len(path) // 2, counts
    layers = [layer for _, layer, _ in path]
    assert {"layer_0", "layer_5"} <= set(layers) and layers.index("layer_0") < layers.index("layer_5")


def test_launch_count_describes_each_card_and_names_bad_flags(capsys):
    from benchmarks import launch_count

    h100, h200 = launch_count.target_config("h100"), launch_count.target_config("h200")
    for text in (h100, h200):
        assert "core_count: 132" in text and "major: 9 minor: 0" in text and text.count("{") == text.count("}")
    assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in h100 and "memory_bandwidth: 4800000000000" in h200
    with pytest.raises(ValueError, match="--card must be one of"):
        launch_count.target_config("a100")
    assert launch_count.main(["--paths", "bogus"]) == 2
    assert "--paths: unknown path 'bogus'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--batches: expected a comma-separated list"):
        launch_count.main(["--batches", "0"])


def test_launch_count_compiles_the_full_width_step_for_an_h100_without_one(tmp_path):
    """Where jax's CUDA plugin is installed (pyproject's `aot` extra; not in CI): the six-layer
    full-width step compiled for an H100 on this host, its chain holding the fast path's Pallas
    kernels, and the routed experts' fp4 words re-laid as the loaders lay them for a GPU (the
    "relaid" decode's PTX in the step, not the "pairs" decode's)."""
    import importlib.util
    import subprocess
    import sys

    from pallas_kernels.expert_matmul import kernel_gpu

    if importlib.util.find_spec("jax_plugins") is None or importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        pytest.skip("jax's CUDA plugin is not installed (pyproject's aot extra)")
    out = tmp_path / "counts.json"
    subprocess.run([sys.executable, "-m", "benchmarks.launch_count", "--batches", "1", "--json", str(out),
                    "--hlo", str(tmp_path)], check=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                   cwd=Path(__file__).resolve().parents[1])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["launches"] >= row["on_chain"] > 100 and sum(row["chain_by_source"].values()) == row["on_chain"]
    labels = " ".join(row["chain_by_source"])
    assert "fp8_matmul_many" in labels and "expert_matmul" in labels and "head_logits" in labels
    (hlo,) = tmp_path.glob("decode_fast_*.txt.gz")
    text = gzip.decompress(hlo.read_bytes()).decode()
    relaid, pairs = (re.search(r"and\.b32 r_m, r_m, (0x[0-9a-f]+);", ptx[1]).group(1)
                     for ptx in (kernel_gpu.RELAID_PTX_FOLDED, kernel_gpu.PAIRS_PTX_FOLDED))
    assert relaid in text and pairs not in text


def test_router_rows_check_the_gate_launch_against_the_reference(monkeypatch):
    """`kernels.router_rows`: every row names its bytes (the weight, the row and norm weight, the
    logits, the two rows written) and its check against XLA's path; without a GPU the kernel rows
    say they failed instead of timing anything (no timing here: `_time` is stubbed)."""
    from benchmarks import kernels

    monkeypatch.setattr(kernels, "_time", lambda fn, make, inner, reps: (2e-6, float("nan")))
    rows = kernels.router_rows(copy_bw=1e12)
    assert [r.impl for r in rows] == ["reference", "pallas", "pallas (block_e 4, block_k 512, 4 warps)"]
    nbytes = 384 * 5120 * 2 + 2 * 5120 * 2 + 384 * 4 + 2 * 5120 * 2
    assert all(r.bytes == nbytes for r in rows)
    ref = rows[0]
    assert ref.err == "rows bit-identical; logits max abs diff 0 vs reference"
    assert ref.us == pytest.approx(2.0) and ref.bw_frac == pytest.approx(nbytes / 2e-6 / 1e12)
    for r in rows[1:]:
        if jax.default_backend() == "gpu":
            assert r.err.startswith("rows bit-identical; logits max abs diff"), r
        else:
            assert r.note.startswith("FAILED") and np.isnan(r.us), r


def _scripted_timeit(monkeypatch, seconds: list) -> list:
    """Replaces `model_speed.timeit` by one that runs each call once and returns the next of
    `seconds`; returns the list of the timed callables, in call order."""
    order, it = [], iter(seconds)

    def fake_timeit(fn, **kw):
        order.append(fn)
        jax.block_until_ready(fn())
        return next(it)

    monkeypatch.setattr(model_speed, "timeit", fake_timeit)
    return order


def test_ab_rows_time_two_paths_in_rounds_of_alternating_order(tmp_path, monkeypatch):
    """--ab: two paths that differ only in module switches, one program each on the same weights
    and cache, timed in rounds A B, B A, ...; the second row holds the per-round differences."""
    order = _scripted_timeit(monkeypatch, [3e-3, 5e-3, 4e-3, 2e-3, 3e-3, 6e-3])  # A B | B A | A B
    rep = model_speed.Report(tmp_path, {})
    model_speed.ab_section(rep, {"hbm": 1e12}, True, ("fast", "fast-kvrow"), [1], [64], 3, 2)
    a, b = rep.rows
    assert (a["name"], b["name"]) == ("ab fast loop", "ab fast-kvrow loop")
    assert len(order) == 6 and order[0] is order[3] is order[4] and order[1] is order[2] is order[5]
    assert a["rounds_s"] == [1.5e-3, 1e-3, 1.5e-3] and b["rounds_s"] == [2.5e-3, 2e-3, 3e-3]
    assert a["seconds"] == 1.5e-3 and b["seconds"] == 2.5e-3 and a["steps_per_call"] == 2
    assert b["diff_s"] == pytest.approx([1e-3, 1e-3, 1.5e-3]) and b["diff_median_s"] == pytest.approx(1e-3)
    assert b["b_faster_rounds"] == 0 and "diff_s" not in a
    assert b["tokens_equal"] is True  # on CPU the switch runs the same reference ops
    with pytest.raises(ValueError, match="differ only in module switches"):
        model_speed.ab_section(rep, {"hbm": 1e12}, True, ("fast", "fast-f32"), [1], [64], 3, 2)


def test_ab_prefill_rows_time_two_paths_in_rounds_of_alternating_order(tmp_path, monkeypatch):
    """--ab-on prefill: two paths that differ only in module switches, one prefill program each on
    the same weights and prompt, timed in rounds A B, B A, ...; rows "ab <path> prefill" with the
    per-round differences on the second, against the bf16 ceiling."""
    order = _scripted_timeit(monkeypatch, [3e-3, 5e-3, 4e-3, 2e-3])  # A B | B A
    rep = model_speed.Report(tmp_path, {})
    model_speed.ab_prefill_section(rep, {"bf16": 1e12}, True, ("fast", "fast-onedot"), [32], 2)
    a, b = rep.rows
    assert (a["name"], b["name"]) == ("ab fast prefill", "ab fast-onedot prefill")
    assert len(order) == 4 and order[0] is order[3] and order[1] is order[2] and order[0] is not order[1]
    assert a["rounds_s"] == [3e-3, 2e-3] and b["rounds_s"] == [5e-3, 4e-3]
    assert a["seconds"] == 2.5e-3 and b["context"] == 32 and b["ceiling"] == "bf16"
    assert b["fraction_of_ceiling"] == pytest.approx(b["flops"] / 4.5e-3 / 1e12)
    assert b["diff_s"] == pytest.approx([2e-3, 2e-3]) and b["b_faster_rounds"] == 0
    assert b["tokens_equal"] is True  # on CPU the switch runs the same reference ops
    with pytest.raises(ValueError, match="differ only in module switches"):
        model_speed.ab_prefill_section(rep, {"bf16": 1e12}, True, ("fast", "fast-f32"), [32], 2)


def test_ab_prefill_compares_the_whole_last_position_logits(tmp_path, monkeypatch):
    """B's `tokens_equal` and `logits_max_abs_diff` cover every vocabulary entry of the prompt's
    last position: a change to B's first logit alone shows in both."""
    _scripted_timeit(monkeypatch, [1e-3] * 4)
    real = model_speed._prefill_program
    made = []

    def program(*a):
        f, call, t, logits = real(*a)
        made.append(logits)
        if len(made) == 2:  # path B: its first vocabulary entry far above every other
            logits = logits.at[0, 0].set(jnp.max(logits) + 100.0)
        return f, call, t, logits

    monkeypatch.setattr(model_speed, "_prefill_program", program)
    rep = model_speed.Report(tmp_path, {})
    model_speed.ab_prefill_section(rep, {"bf16": 1e12}, True, ("fast", "fast-onedot"), [32], 2)
    b = rep.rows[1]
    assert made[0].shape == (1, model_speed.bench_args(True, 1, 32, "auto").vocab_size)
    assert int(jnp.argmax(made[0][0])) != 0, "the test needs A's token to differ from entry 0"
    assert b["tokens_equal"] is False
    assert b["logits_max_abs_diff"] == pytest.approx(float(jnp.max(made[1]) + 100.0 - made[0][0, 0]))


def test_ab_section_relaid_swaps_one_copy_of_the_weights(tmp_path, monkeypatch):
    """An A/B of two fp4 layouts (fast-released against a path that re-lays, `fp4_relaid` "on")
    holds one copy of the expert stacks: moved in place to B's layout before each B round and
    back before each A round (so the programs alternate as for any pair), each generator handed
    the arrays of its layout; the two programs' tokens agree (the jnp paths put the words back)."""
    monkeypatch.setitem(model_speed.PATHS, "fast-on", ("auto", "auto", "auto", "on"))
    layouts = []
    real = model_speed._experts_layout

    def spy(g, s, args):
        g, s = real(g, s, args)
        layouts.append((args.fp4_relaid, nnx.merge(g, s).layers[0].ffn.experts.relaid))
        return g, s

    monkeypatch.setattr(model_speed, "_experts_layout", spy)
    monkeypatch.setattr(model_speed, "timeit", lambda fn, **kw: (jax.block_until_ready(fn()), 1e-3)[1])
    rep = model_speed.Report(tmp_path, {})
    model_speed.ab_section(rep, {"hbm": 1e12}, True, ("fast-released", "fast-on"), [1], [64], 3, 2)
    a, b = rep.rows
    assert (a["name"], b["name"]) == ("ab fast-released loop", "ab fast-on loop")
    # B's program is built re-laid; rounds A B | B A | A B swap before A, (B stays), A, B
    assert layouts == [("on", True), ("off", False), ("on", True), ("off", False), ("on", True)]
    assert b["tokens_equal"] is True


@pytest.mark.parametrize(("flags", "message"), [
    (["--ab", "fast"], "expected two different paths"),
    (["--ab", "fast,nope"], "expected two different paths"),
    (["--ab", "fast,fast-f32"], "differ only in module switches"),
    (["--ab", "fast,fast-rows", "--ab-rounds", "1"], "--ab-rounds must be at least 2"),
    (["--ab", "fast,fast-rows", "--loop-steps", "0"], "--loop-steps must be >= 1"),
    (["--ab", "fast,fast-rows", "--ab-on", "decode,nope"], "--ab-on: expected decode, prefill or both"),
    (["--ab", "fast-released,fast-relaid", "--ab-on", "prefill"], "differ only in module switches"),
])
def test_bad_ab_flags_are_refused_with_the_flag_named(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        model_speed.main(["--out", str(tmp_path), "--tiny", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


_LB_HLO = """HloModule m

%fused (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}

ENTRY %main (a: bf16[1024,1024], b: f32[4]) -> (f32[4], bf16[2]) {
  %a = bf16[1024,1024]{1,0} parameter(0)
  %b = f32[4]{0} parameter(1)
  %f = f32[4]{0} fusion(%b), kind=kLoop, calls=%fused
  %g = (bf16[2]{0}, f32[4]{0}) custom-call(%a, %f), custom_call_target="x"
  %t = bf16[2]{0} get-tuple-element(%g), index=0
  ROOT %r = (f32[4]{0}, bf16[2]{0}) tuple(%f, %t)
}
"""


def test_launch_bytes_count_each_launchs_result_and_operands_whole():
    from benchmarks import launch_count

    # the fusion: its f32[4] result and operand; the custom call: its tuple result (4 + 16 bytes),
    # the 2 MiB parameter and the fusion's result. Views and tuples launch nothing.
    assert launch_count.launch_bytes(_LB_HLO) == {"f": 32, "g": 20 + 2**21 + 16}
    assert launch_count.shape_bytes("(f8e4m3fn[32768,1280]{1,0}, s4[4]{0}, pred[])") == 32768 * 1280 + 2 + 1
    # per emitting line (no metadata here: the instruction's own name), most bytes first
    assert list(launch_count.bytes_by_source(_LB_HLO).items()) == [("g", (1, 20 + 2**21 + 16)), ("f", (1, 32))]
    with pytest.raises(SystemExit, match="--prefill: expected a comma-separated list"):
        launch_count.main(["--prefill", "0"])


def test_expert_launches_tiny_rows(tmp_path):
    """`benchmarks.expert_launches` on tiny shapes (interpret mode on the CPU): a row per site and
    variant with the distinct experts' bytes and the launch's FLOPs; the re-laid weights give the
    released layout's outputs (here through the reference fallback, which puts them back);
    malformed sites and tile rows are refused."""
    from benchmarks import expert_launches

    out = tmp_path / "e.json"
    assert expert_launches.main(["--tiny", "--sites", "b1 w1+w3,b4 w2", "--rounds", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ['kernel routed b1 w1+w3 {}', 'kernel routed b1 w1+w3 {"decode": "relaid"}',
                                         'kernel routed b4 w2 {}', 'kernel routed b4 w2 {"decode": "relaid"}']
    # tiny: dim 256, inter 128; w1+w3 reads two matrices of [128, 256] codes per distinct expert
    assert 0 < rows[0]["bytes"] <= 6 * 2 * 128 * (128 + 8) and rows[0]["flops"] == 2.0 * 6 * 128 * 256 * 2
    assert rows[2]["flops"] == 2.0 * 4 * 6 * 256 * 128
    assert all(r["same_as_first"] for r in rows[:2])
    with pytest.raises(ValueError, match="site"):
        expert_launches.parse_site("x1 w1")
    # a variant's "rows" (the grouped path's rows a tile): 128-row tiles give the 64-row tiles'
    # outputs bit for bit; a row count the tiles cannot take is refused by flag
    assert expert_launches.main(["--tiny", "--once", "--sites", "p64 w1", "--json", str(out),
                                 "--variants", '[{}, {"rows": 128, "num_warps": 8}]']) == 0
    assert [r["same_as_first"] for r in json.loads(out.read_text())["rows"]] == [True, True]
    with pytest.raises(SystemExit):
        expert_launches.main(["--tiny", "--variants", '[{"rows": 24}]'])
