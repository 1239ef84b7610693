"""Decode with caches (SPEC §5.4-5.7, §5.12, §21).

* Teacher-forced decode parity with the official reference, per block (SPEC §20): the caches are
  seeded by a teacher-forced prefill, then at each of the 24 golden steps every block gets the
  golden input of that step while the caches flow from step to step. Default mode against
  `decode_fixed.*`, reference_compat against `decode.*` (the official index-key hand-off).
* The caches a prefill leaves equal the reference's.
* Per-row positions: rows of different lengths in one right-padded batch compute what each row
  computes alone, and a decode step computes exactly what a prefill of the same tokens computes.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import parity
from dsv41_jax.attention import previous_call_index_k_owner
from dsv41_jax.cache import cache_bytes, init_cache, seed_group_state, seed_window, write_row
from dsv41_jax.config import ModelArgs
from dsv41_jax.model import Transformer
from dsv41_jax.parity import GoldenSet, load_model

DATA = Path(__file__).parent / "data"
MODES = parity.DECODE_MODES  # golden prefix -> reference_compat
_RENAME = {"kv_state": "compressor_kv_state", "score_state": "compressor_score_state"}


@functools.cache
def _model(path: str):
    return load_model(GoldenSet(path))


def _tag(i: int) -> str:
    return f"L{i:02d}"


@functools.cache
def _prefilled(path: str):
    return parity.teacher_forced_cache(_model(path), GoldenSet(path))


@functools.cache
def _decoded(path: str, prefix: str):
    """The teacher-forced decode of all golden steps (`parity.teacher_forced_decode`)."""
    return parity.teacher_forced_decode(_model(path), GoldenSet(path), prefix, _prefilled(path))


def _assert_all_ok(rows, label, allowed=()):
    bad = [r for r in rows if not r[1] and r[0] not in allowed]
    by_kind = {}
    for key, _, dmax, rel in rows:
        kind = key.split(".")[1]
        if dmax > by_kind.get(kind, (None, -1.0))[1]:
            by_kind[kind] = (key, dmax, rel)
    for kind, (key, dmax, rel) in sorted(by_kind.items()):
        print(f"{label} {kind}: worst {key} max|err| {dmax:.4g} err/RMS {rel:.3g}")
    assert not bad, bad


# ------------------------------------------------------------------------------ cache layout


def test_cache_of_the_released_config_at_64k_is_what_spec_arithmetic_says():
    args = ModelArgs.from_json(DATA / "released_config.json", max_seq_len=65536)
    t, r2 = 65536, [i for i in args.kv_source_layers if args.compress_ratios[i] == 2]
    r1 = [i for i in args.kv_source_layers if args.compress_ratios[i] == 1]
    assert (len(r2), len(r1)) == (3, 1)
    window = 40 * 128 * 512 * 2
    compressed = (3 * (t // 2) + t) * 512 * 2
    index_keys = (3 * (t // 2) + t) * 128 * 2
    states = 3 * 2 * (2 * 512 * 4)
    engram_history = t * 4
    per_row = window + compressed + index_keys + states + engram_history + 4  # + seq_len
    got = cache_bytes(args, 1, t)
    print(f"released config, 64k positions: {got:,} bytes per sequence ({got / 2**20:.1f} MiB), of which window "
          f"ring {window:,}, compressed KV {compressed:,}, index keys {index_keys:,}")
    assert got == per_row
    assert cache_bytes(args, 4, t) == 4 * per_row


def test_init_cache_has_the_reference_shapes_dtypes_and_fill_values():
    args = ModelArgs.tiny()
    c = init_cache(args, 3, 64)
    assert c["seq_len"].shape == (3,) and c["engram_history"].shape == (3, 64)
    assert len(c["layers"]) == args.n_layers
    for i, lc in enumerate(c["layers"]):
        assert lc["window_kv"].shape == (3, args.window_size, args.head_dim) and lc["window_kv"].dtype == jnp.bfloat16
        r = args.compress_ratios[i]
        assert ("compress_kv" in lc) == args.is_kv_source(i) and ("kv_state" in lc) == (args.is_kv_source(i) and r > 1)
        if args.is_kv_source(i):
            assert lc["compress_kv"].shape == (3, 64 // r, args.head_dim)
            assert lc["index_k"].shape == (3, 64 // r, args.index_head_dim)
        if "kv_state" in lc:
            assert np.all(np.asarray(lc["kv_state"]) == 0) and np.all(np.asarray(lc["score_state"]) == -np.inf)


def test_seeded_ring_holds_each_rows_last_window_positions():
    kv = jnp.arange(2 * 10, dtype=jnp.float32).reshape(2, 10, 1) + 1  # value = 1 + row * 10 + position
    ring = np.asarray(seed_window(kv, jnp.asarray([10, 3]), 4))[..., 0]
    np.testing.assert_array_equal(ring[0], [9, 10, 7, 8])  # positions 8, 9, 6, 7
    np.testing.assert_array_equal(ring[1], [11, 12, 13, 0])  # positions 0, 1, 2; slot 3 never written


def test_seeded_compressor_state_parks_each_rows_open_group():
    v = jnp.arange(2 * 7, dtype=jnp.float32).reshape(2, 7, 1) + 1
    st = np.asarray(seed_group_state(v, jnp.asarray([7, 4]), 2, -np.inf))[..., 0]
    np.testing.assert_array_equal(st[0], [7, -np.inf])  # length 7: position 6 waits in slot 0
    np.testing.assert_array_equal(st[1], [-np.inf, -np.inf])  # length 4: no open group


def test_masked_row_write_leaves_masked_rows_untouched():
    buf = jnp.zeros((2, 3, 1))
    out = np.asarray(write_row(buf, jnp.asarray([2, 1]), jnp.ones((2, 1)), jnp.asarray([True, False])))[..., 0]
    np.testing.assert_array_equal(out, [[0, 0, 1], [0, 0, 0]])


def test_one_row_write_is_the_scatter_including_dropped_indices():
    """A batch of one row writes with a dynamic_update_slice: the same buffer as the batched
    scatter (a row of a two-row batch) at every index, negative ones (from the end), out-of-range
    ones (dropped) and masks included; the value may be of another dtype (cast to the buffer's)."""
    rng = np.random.default_rng(3)
    buf = jnp.asarray(rng.standard_normal((2, 5, 3, 2)), jnp.bfloat16)
    value = jnp.asarray(rng.standard_normal((2, 3, 2)), jnp.float32)
    one = jax.jit(write_row)
    for index in (-6, -1, 0, 3, 4, 5, 9):
        for mask in (None, True, False):
            m1 = None if mask is None else jnp.asarray([mask])
            m2 = None if mask is None else jnp.asarray([mask, not mask])
            got = one(buf[:1], jnp.asarray([index]), value[:1], m1)
            want = one(buf, jnp.asarray([index, 2]), value, m2)[:1]
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
            changed = bool(np.any(np.asarray(got, np.float32) != np.asarray(buf[:1], np.float32)))
            assert changed == (-5 <= index < 5 and mask is not False), (index, mask)


# ------------------------------------------------------------------- golden: caches, decode


def test_caches_after_prefill_equal_the_references(golden):
    cache = _prefilled(str(golden.path))
    a = golden.args
    s = golden["inputs.prompt"].shape[1]
    port = {}
    for i, lc in enumerate(cache["layers"]):
        port[f"prefill.window_kv.{_tag(i)}"] = np.asarray(lc["window_kv"])
        if "compress_kv" in lc:
            n = s // a.compress_ratios[i]
            for name in ("compress_kv", "index_k"):
                full = np.asarray(lc[name])
                assert np.all(full[:, n:].astype(np.float32) == 0), f"{name} {_tag(i)}: rows past the prompt written"
                port[f"prefill.{name}.{_tag(i)}"] = full[:, :n]
            for name in ("kv_state", "score_state"):
                if name in lc:
                    port[f"prefill.{_RENAME[name]}.{_tag(i)}"] = np.asarray(lc[name])
    rows = parity.compare(port, golden)
    kinds = ("window_kv", "compress_kv", "index_k", "compressor_kv_state", "compressor_score_state")
    names = golden.keys()
    expected = {k.removesuffix(".bf16") for k in names if k.split(".")[1] in kinds and k.startswith("prefill.")}
    assert {r[0] for r in rows} == expected
    _assert_all_ok(rows, golden.name)
    hist = np.asarray(cache["engram_history"])
    emap = np.load(golden.path / "engram_map.npy")
    tt = golden.token_types()
    want = np.where(tt < 0, emap[golden["inputs.prompt"]], -1) if tt is not None else emap[golden["inputs.prompt"]]
    np.testing.assert_array_equal(hist[:, :s], want)


# Measured: every decode array meets its criterion on both sets, in both modes. (Before the
# hyper-connection projection was accumulated in float64 like the reference, one token of tiny-c,
# reference_compat, layer 5, step 21 flipped a bf16 rounding and sat 1.09x outside the bound.)
# The allowance stays as a named knob at zero.
MAX_TOKENS_OUTSIDE_BOUND = 0
MAX_OUTSIDE_RATIO = 1.5


def _tokens_outside_bound(port: np.ndarray, gold: np.ndarray) -> tuple[int, float]:
    """(number of tokens [step, row] with an element outside 2^-7 |g| + 2^-7 RMS(g), worst ratio)."""
    p, g = port.astype(np.float64), gold.astype(np.float64)
    ratio = np.abs(p - g) / (parity.BF16_REL * np.abs(g) + parity.BF16_REL * np.sqrt(np.mean(g**2)))
    per_token = ratio.reshape(*ratio.shape[:2], -1).max(-1)
    return int((per_token > 1).sum()), float(per_token.max())


@pytest.mark.parametrize("prefix", list(MODES))
def test_teacher_forced_decode_matches_reference_block_by_block(golden, prefix):
    """decode_fixed: default mode (each owner scores its own index keys); decode: reference_compat."""
    port, problems = _decoded(str(golden.path), prefix)
    assert not problems
    rows = parity.compare(port, golden)
    allowed = set()
    for key, ok, _, _ in rows:
        if not ok and key.split(".")[1] in ("block_out", "engram_out"):
            n, worst = _tokens_outside_bound(port[key], golden[key])
            print(f"{golden.name} {key}: {n} token(s) outside the bound, worst {worst:.3g}x")
            if n <= MAX_TOKENS_OUTSIDE_BOUND and worst <= MAX_OUTSIDE_RATIO:
                allowed.add(key)
    _assert_all_ok(rows, f"{golden.name} {prefix}", allowed)
    names = golden.keys()
    not_computed = {k.removesuffix(".bf16") for k in names if k.startswith(prefix + ".") and k.removesuffix(".bf16") not in port}
    # inputs of the run, and the DSpark head (not part of the backbone's decode)
    assert {k.split(".")[1] for k in not_computed if ".dspark_" not in k} <= {"input", "start_pos", "index_width"}


# One whole token of the 48 (24 steps x 2 rows) is 2.1% of an array; measured at most 1.13% (the
# token above). A dropped rounding point changes far more (about 20% in prefill).
MAX_DIFFERING_FRACTION = 0.025


def test_decode_block_outputs_are_bit_identical_except_rare_rounding_flips(golden):
    for prefix in MODES:
        port, _ = _decoded(str(golden.path), prefix)
        for i in range(golden.args.n_layers):
            key = f"{prefix}.block_out.{_tag(i)}"
            frac = float(np.mean(port[key].astype(np.float32) != golden[key].astype(np.float32)))
            assert frac <= MAX_DIFFERING_FRACTION, f"{golden.name} {key}: {frac:.2%} of elements differ"


def test_parity_cli_writes_both_decode_runs_under_golden_names_and_fails_on_a_wrong_one(tmp_path, capsys):
    gs = GoldenSet(DATA / "golden" / "tiny-a")
    out = tmp_path / "result.npz"
    assert parity.main([str(gs.path), "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "FAIL" not in table and "not computed" not in table
    res = np.load(out)
    for prefix in MODES:
        port, _ = _decoded(str(gs.path), prefix)
        want = parity.expected_decode_keys(gs, prefix)
        written = {k.removesuffix(".bf16") for k in res.files if k.startswith(prefix + ".")}
        assert written == want
        for key in want:
            name = key + ".bf16" if key + ".bf16" in gs.keys() else key
            assert res[name].shape == gs._npz[name].shape and res[name].dtype == gs._npz[name].dtype, name
            assert f"{key} " in table, key  # a table row
            got = res[name].view(gs[key].dtype) if name.endswith(".bf16") else res[name]
            np.testing.assert_array_equal(got, port[key].astype(gs[key].dtype), err_msg=key)  # one implementation

    # the same arrays against the set with one decode step's golden logits shifted: that row
    # fails and the exit code is 1; a decode array left out is reported and fails too
    bad = tmp_path / "tampered"
    bad.mkdir()
    for f in gs.path.iterdir():
        if f.name != "expected.npz":
            (bad / f.name).symlink_to(f)
    arrays = dict(np.load(gs.path / "expected.npz"))
    arrays["decode_fixed.logits"] = arrays["decode_fixed.logits"].copy()
    arrays["decode_fixed.logits"][5] += 0.05
    np.savez(bad / "expected.npz", **arrays)
    port = {k.removesuffix(".bf16"): res[k].view(gs[k.removesuffix(".bf16")].dtype) for k in res.files}
    expected = {k.removesuffix(".bf16") for k in gs.keys() if k.startswith("prefill.")}
    expected |= parity.expected_decode_keys(gs, "decode") | parity.expected_decode_keys(gs, "decode_fixed")
    assert parity.report(port, [], expected, GoldenSet(bad)) == 1
    failed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.endswith("FAIL")]
    assert failed == ["decode_fixed.logits"]
    del port["decode.topk.L02"]
    assert parity.report(port, [], expected, gs) == 1
    assert "not computed: ['decode.topk.L02']" in capsys.readouterr().out


def test_compat_mode_reads_the_ratio1_sources_keys_on_open_group_steps_only(golden):
    """The hand-off itself (SPEC §21): where a ratio-2 owner's group is still open it scores the
    last ratio-1 kv source's keys; by default it scores its own."""
    a = golden.args
    fallback = previous_call_index_k_owner(a)
    assert a.compress_ratios[fallback] == 1
    pos = golden["decode.start_pos"]
    for prefix, compat in MODES.items():
        port, _ = _decoded(str(golden.path), prefix)
        for i in a.index_source_layers:
            got = port[f"{prefix}.index_k_owner.{_tag(i)}"]
            own = a.kv_source_of(i)
            if compat and a.compress_ratios[own] > 1:
                want = np.where((pos + 1) % a.compress_ratios[own] == 0, own, fallback)
                assert len(set(want.tolist())) == 2  # both kinds of step occur
            else:
                want = np.full_like(pos, own)
            np.testing.assert_array_equal(got, want, err_msg=f"{prefix} {_tag(i)}")


def test_reference_compat_is_refused_when_the_fallback_owner_depends_on_history():
    args = ModelArgs.tiny(compress_ratios=(0, 0, 2, 2, 2, 2, 2), kv_source_layers=(2, 4),
                          index_source_layers=(2, 4, 6), candidate_source_layer=4)
    with pytest.raises(NotImplementedError, match="last kv source, layer 4"):
        previous_call_index_k_owner(args)

    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(args)))
    cache = jax.eval_shape(lambda: init_cache(args, 1, 32))
    ids = jax.ShapeDtypeStruct((1,), jnp.int32)

    def step(compat):
        return jax.eval_shape(
            lambda st, i, p, c: nnx.merge(graphdef, st).decode_step(i, p, c, reference_compat=compat),
            state, ids, ids, cache)

    with pytest.raises(NotImplementedError, match="reference_compat"):
        step(True)
    logits, _ = step(False)  # the default mode has no such restriction
    assert logits.shape == (1, args.vocab_size)


# ------------------------------------------------------------------------- per-row positions


_DECODE_TRACES = []


@nnx.jit
def _prefill(model, ids, lengths, cache):
    return model.prefill(ids, lengths, cache, collect=True)


@nnx.jit
def _decode(model, ids, pos, cache):
    _DECODE_TRACES.append(ids.shape)
    return model.decode_step(ids, pos, cache, collect=True)


# A right-padded batch of two rows: row 0 = prompt 0 + its 24 golden continuations (88 tokens),
# row 1 = the first 63 tokens of prompt 1 (odd: its last token waits in the ratio-2 compressor
# states), padded with unrelated tokens. Row 1 is then fed the rest of its 88 tokens one decode
# step at a time (positions 63..87) while row 0 continues greedily (positions 88..).
ROW1_LEN = 63
STEPS = 25


def _greedy(k, row, logits):
    return int(logits.argmax())


@functools.cache
def _per_row_runs():
    """{name: (logits [1 + steps, 2, V] (prefill, then each step), cache after the prefill,
    intermediates of the prefill, intermediates of the first step)}."""
    gs = GoldenSet(DATA / "golden" / "tiny-a")
    model, a = _model(str(gs.path)), gs.args
    full = np.concatenate([gs["inputs.prompt"], gs["decode.input"].T], axis=1).astype(np.int32)  # [2, 88]
    n = full.shape[1]

    def run(ids, lengths, feed, steps):
        """prefill, then `steps` decode steps; feed(k, row, logits) gives the row's token at step k."""
        logits, cache, prefill_rec = _prefill(model, jnp.asarray(ids), jnp.asarray(lengths, jnp.int32),
                                              init_cache(a, 2))
        seeded, out, step_recs = cache, [np.asarray(logits)], []
        pos = np.asarray(lengths, np.int32)
        for k in range(steps):
            tok = np.asarray([feed(k, r, out[-1][r]) for r in range(2)], np.int32)
            logits, cache, rec = _decode(model, jnp.asarray(tok), jnp.asarray(pos), cache)
            out.append(np.asarray(logits))
            step_recs.append(rec)
            pos = pos + 1
        return np.stack(out), seeded, prefill_rec, step_recs[0] if step_recs else None

    def forced(k, row, logits):
        return int(full[1, ROW1_LEN + k])

    mixed_ids = full.copy()
    mixed_ids[1, ROW1_LEN:] = full[0, ROW1_LEN:]  # padding: any tokens
    return {
        "mixed": run(mixed_ids, [n, ROW1_LEN], lambda k, r, lg: _greedy(k, r, lg) if r == 0 else forced(k, r, lg),
                     STEPS),
        "whole": run(full, [n, n], _greedy, 0),  # one prefill over all 88 tokens of both rows
        # each row alone (the same prompt in both rows, unpadded)
        "row0_alone": run(np.stack([full[0]] * 2), [n, n], _greedy, 4),
        "row1_alone": run(np.stack([full[1, :ROW1_LEN]] * 2), [ROW1_LEN] * 2, forced, 4),
    }


def _bf16_level(port, gold) -> tuple[bool, float]:
    """(|port - gold| <= 2^-7 |gold| + 2^-7 RMS(gold) everywhere, max |port - gold|)."""
    p, g = np.asarray(port, np.float64), np.asarray(gold, np.float64)
    d = np.abs(p - g)
    return bool(np.all(d <= parity.BF16_REL * (np.abs(g) + np.sqrt(np.mean(g**2))))), float(d.max())


def test_rows_at_different_positions_compute_what_each_row_computes_alone():
    runs = _per_row_runs()
    mixed = runs["mixed"][0]
    worst = 0.0
    for row, alone in ((0, runs["row0_alone"][0]), (1, runs["row1_alone"][0])):
        for k in range(alone.shape[0]):  # the prefill, then 4 decode steps
            got, want = mixed[k, row], alone[k, 0]
            ok, dmax = _bf16_level(got, want)
            worst = max(worst, dmax)
            assert ok, f"row {row} step {k}: max |diff| {dmax}"
            assert got.argmax() == want.argmax(), f"row {row} step {k}"
    print("batch vs each row alone (prefill + 4 steps): max |logit diff|", worst)


def test_padded_prefill_equals_unpadded_prefill():
    runs = _per_row_runs()
    (mixed, padded), (alone, unpadded) = runs["mixed"][:2], runs["row1_alone"][:2]
    ok, dmax = _bf16_level(mixed[0, 1], alone[0, 0])
    print("padded vs unpadded prefill: max |logit diff|", dmax)
    assert ok and mixed[0, 1].argmax() == alone[0, 0].argmax()
    a = GoldenSet(DATA / "golden" / "tiny-a").args
    for i, (p, u) in enumerate(zip(padded["layers"], unpadded["layers"], strict=True)):
        for name, arr in u.items():
            got, want = np.asarray(p[name][1], np.float32), np.asarray(arr[0], np.float32)
            if name in ("compress_kv", "index_k"):  # rows >= L // r hold padding until overwritten
                n = ROW1_LEN // a.compress_ratios[i]
                got, want = got[:n], want[:n]
            np.testing.assert_array_equal(got, want, err_msg=f"{name} {_tag(i)}")
    np.testing.assert_array_equal(np.asarray(padded["engram_history"])[1, :ROW1_LEN],
                                  np.asarray(unpadded["engram_history"])[0, :ROW1_LEN])
    np.testing.assert_array_equal(np.asarray(padded["seq_len"]), [88, ROW1_LEN])


def test_decode_steps_reproduce_a_prefill_of_the_same_tokens_bit_for_bit():
    """Row 1: a padded 63-token prefill plus 25 decode steps at positions 63..87 gives the logits
    of one prefill over its 88 tokens (the reference's decode_fixed does the same, README
    Findings); row 0's prefill is unaffected by its padded neighbour."""
    runs = _per_row_runs()
    mixed, whole = runs["mixed"][0], runs["whole"][0]
    np.testing.assert_array_equal(mixed[STEPS, 1], whole[0, 1])
    np.testing.assert_array_equal(mixed[0, 0], whole[0, 0])


def test_one_compiled_decode_step_serves_every_position_and_row_mix():
    _per_row_runs()
    assert _DECODE_TRACES == [(2,)]


def test_collect_returns_golden_named_intermediates_consistent_with_the_logits():
    a = GoldenSet(DATA / "golden" / "tiny-a").args
    model = _model(str(DATA / "golden" / "tiny-a"))
    logits, _, prefill_rec, step_rec = _per_row_runs()["mixed"]
    per_layer = {"block_out", "block_premix", "route_idx", "route_w"}
    for rec in (prefill_rec, step_rec):
        names = {k.rsplit(".", 1)[0] for k in rec if k.startswith("L", len(k) - 3)}
        assert per_layer | {"topk", "candidates", "engram_out", "index_k_owner", "index_score"} <= names
        for i in range(a.n_layers):
            assert {f"{n}.{_tag(i)}" for n in per_layer} <= rec.keys()
            assert (f"topk.{_tag(i)}" in rec) == a.is_index_source(i)
            assert (f"engram_out.{_tag(i)}" in rec) == (i in a.engram_layer_ids)
        assert "engram_hashes" in rec
    last = _tag(a.n_layers - 1)
    # the decode step's logits are the head on its recorded final stream
    again = nnx.jit(lambda m, x, p: m.logits(x, p))(model, step_rec[f"block_out.{last}"], step_rec[f"block_premix.{last}"])
    np.testing.assert_array_equal(np.asarray(again), logits[1])
    assert step_rec[f"topk.{_tag(a.index_source_layers[0])}"].shape == (2, 1, a.index_topk)
    np.testing.assert_array_equal(np.asarray(step_rec[f"index_k_owner.{_tag(a.index_source_layers[0])}"]),
                                  [a.index_source_layers[0]] * 2)


def test_parity_cli_prefill_only_with_a_kernel_choice_writes_no_decode_arrays(tmp_path, capsys):
    gs = GoldenSet(DATA / "golden" / "tiny-a")
    out = tmp_path / "prefill.npz"
    assert parity.main([str(gs.path), "--kernels", "reference", "--prefill-only", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "FAIL" not in table and "not computed" not in table
    res = np.load(out)
    assert res.files and all(k.startswith("prefill.") for k in res.files)
    assert {k.removesuffix(".bf16") for k in res.files} >= {
        k.removesuffix(".bf16") for k in gs.keys() if k.startswith("prefill.")}
    with pytest.raises(SystemExit):
        parity.main([str(gs.path), "--kernels", "fast"])


def test_parity_cli_passes_the_attention_precision_to_the_model(monkeypatch):
    seen = {}

    class Stop(Exception):
        pass

    def load_model(gs, **overrides):
        seen.update(overrides)
        raise Stop

    monkeypatch.setattr(parity, "load_model", load_model)
    golden = str(DATA / "golden" / "tiny-a")
    with pytest.raises(Stop):
        parity.main([golden, "--attn-accumulate", "f32", "--prefill-only"])
    assert seen == {"kernels": "auto", "attn_accumulate": "f32", "fp4_scale_fold": "auto", "fp4_relaid": "auto"}
    seen.clear()
    with pytest.raises(Stop):
        parity.main([golden, "--kernels", "reference", "--fp4-scale-fold", "on", "--fp4-relaid", "on",
                     "--prefill-only"])
    assert seen == {"kernels": "reference", "attn_accumulate": "auto", "fp4_scale_fold": "on", "fp4_relaid": "on"}
    for bad in (["--attn-accumulate", "bf16"], ["--fp4-scale-fold", "yes"], ["--fp4-relaid", "yes"]):
        with pytest.raises(SystemExit):
            parity.main([golden, *bad])


def test_parity_cli_sets_the_float64_attention_kernel_and_one_row_experts_on_every_layer(monkeypatch):
    """`--attn-f64-kernel` sets `Attention.f64_kernel`, `--experts-one-row` `Experts.one_row` and
    `--experts-no-swap-ab-single` clears `Experts.swap_ab_single` (on by default) on every layer of
    the loaded model before anything runs (without them, none is changed)."""
    seen = []

    class Stop(Exception):
        pass

    def prefill(model, gs):
        seen.append([(model.layers[i].attn.attn_block_sizes(), model.layers[i].ffn.experts.block_sizes().one_row,
                      model.layers[i].ffn.experts.block_sizes().swap_ab_single) for i in range(len(model.layers))])
        raise Stop

    monkeypatch.setattr(parity, "teacher_forced_prefill", prefill)
    golden = str(DATA / "golden" / "tiny-a")
    for flag in ([], ["--attn-f64-kernel"], ["--experts-one-row"], ["--experts-no-swap-ab-single"]):
        with pytest.raises(Stop):
            parity.main([golden, "--prefill-only", *flag])
    plain, f64k, one_row, no_single = seen
    assert plain and all(bs is None and not row and single for bs, row, single in plain)
    assert len(f64k) == len(plain) and all(bs.f64_kernel and not row and single for bs, row, single in f64k)
    assert len(one_row) == len(plain) and all(bs is None and row and single for bs, row, single in one_row)
    assert len(no_single) == len(plain) and all(bs is None and not row and not single for bs, row, single in no_single)


def test_parity_cli_reports_a_scale_fold_the_checkpoint_refuses(monkeypatch, capsys):
    """`--fp4-scale-fold on` on a checkpoint with a routed-expert scale byte above 128: exit 2 and
    the loader's message naming the tensor (the tiny set's bytes are <= 128, so one is raised)."""
    real = parity.load_hub_weights

    def load_then_raise_a_byte(model, path, **kw):
        real(model, path, **kw)
        lin = model.layers[0].ffn.experts.w3
        bad = np.asarray(lin.scale[...]).view(np.uint8).copy()
        bad[2, 0, 0] = 130
        lin.scale[...] = jnp.asarray(bad.view(ml_dtypes.float8_e8m0fnu))

    monkeypatch.setattr(parity, "load_hub_weights", load_then_raise_a_byte)
    rc = parity.main([str(DATA / "golden" / "tiny-a"), "--fp4-scale-fold", "on", "--prefill-only"])
    assert rc == 2
    assert "layers.0.ffn.experts.2.w3.scale holds e8m0 scale byte 130" in capsys.readouterr().err


def test_decode_step_with_a_context_bound_equals_the_whole_cache_arrays():
    # the indexers score only the rows positions < bound can see; every aux array (scores padded
    # with -inf, top-k with -1, candidates with False, block scores) and every cache array match
    # (tiny-a: ratio-2 and ratio-1 indexers, a candidate source and its users; tiny-c passes too)
    model = load_model(GoldenSet(DATA / "golden" / "tiny-a"), max_seq_len=256)
    args = model.args
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 400, (2, 24)), jnp.int32)
    lengths = jnp.asarray([24, 13], jnp.int32)
    _, cache = nnx.jit(lambda m, i, n, c: m.prefill(i, n, c))(model, ids, lengths, init_cache(args, 2, 256))
    step = nnx.jit(lambda m, t, p, c, bound: m.decode_step(t, p, c, collect=True, context_bound=bound),
                   static_argnums=4)
    tok = jnp.asarray([7, 11], jnp.int32)
    for bound in (None, 32):
        _, c_b, rec_b = step(model, tok, lengths, jax.tree.map(jnp.copy, cache), bound)
        if bound is None:
            want = (c_b, rec_b)
    got = (c_b, rec_b)
    assert set(got[1]) == set(want[1]) and any(k.startswith("index_score") for k in got[1])
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=jax.tree_util.keystr(path))
