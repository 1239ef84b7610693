"""Engram (SPEC §9): layout constants, exact n-gram hashes, and module parity with the reference."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax import engram as eg
from dsv41_jax.checkpoint import hub_tensor_inventory
from dsv41_jax.config import ConfigError, ModelArgs
from dsv41_jax.loading import load_hub_weights

RELEASED_CONFIG = Path(__file__).parent / "data" / "released_config.json"

# Eager dispatch of the many small integer ops is slow; jit also exercises the jitted path.
_hash = jax.jit(eg.engram_hash, static_argnames="layout")


@pytest.fixture(scope="module")
def released() -> ModelArgs:
    return ModelArgs.from_json(RELEASED_CONFIG)


def _bound(gold: np.ndarray) -> np.ndarray:
    """Per-element tolerance of a bf16 stream: 2^-7 |gold| + 2^-7 RMS(gold)."""
    rms = np.sqrt(np.mean(np.square(gold)))
    return 2.0**-7 * np.abs(gold) + 2.0**-7 * rms


def _token_mask(golden):
    types = golden.inputs.get("token_types")
    return None if types is None else jnp.asarray(np.asarray(types) < 0)


def _prefill_hashes(golden):
    args = golden.args
    layout = eg.EngramLayout.from_args(args)
    token_map = eg.prepare_token_map(np.load(golden.path / "engram_map.npy"), args)
    ids = jnp.asarray(golden["inputs.prompt"])
    history = eg.new_engram_history(ids.shape[0], args.max_seq_len)
    hashes, history = _hash(ids, 0, history, _token_mask(golden), layout, token_map)
    return hashes, history, layout, token_map


def _loaded_engram(golden, layer: int) -> eg.Engram:
    module = eg.Engram(layer, golden.args)
    load_hub_weights(module, golden.path, f"layers.{layer}.engram.")
    return module


# ------------------------------------------------------------------------------------- layout


def test_released_primes_are_the_spec_values_and_sum_to_the_table_rows(released):
    layout = eg.EngramLayout.from_args(released)
    assert layout.primes[0] == (
        16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183,
        16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321,
        16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463,
    )
    l14 = layout.primes[1]
    assert (l14[0], l14[7], l14[8], l14[15], l14[16], l14[23]) == (
        16000477, 16000627, 16000667, 16000769, 16000781, 16000889,
    )
    assert [sum(p) for p in layout.primes] == [384006168, 384016682] == list(released.engram_num_embeddings)
    flat = [p for row in layout.primes for p in row]
    assert len(set(flat)) == len(flat) == 48


def test_column_offsets_lay_the_prime_ranges_end_to_end(released):
    layout = eg.EngramLayout.from_args(released)
    for primes, offsets, rows in zip(layout.primes, layout.offsets, layout.num_embeddings):
        assert offsets[0] == 0
        assert all(offsets[c + 1] == offsets[c] + primes[c] for c in range(len(primes) - 1))
        assert offsets[-1] + primes[-1] == rows


def test_released_multipliers_are_the_spec_values(released):
    layout = eg.EngramLayout.from_args(released)
    assert layout.multipliers == (
        (76632096046245, 4839876093313, 35959672319349, 73987337458391),
        (67716810739261, 51510806800915, 30921347202721, 82619226485591),
    )


def test_multipliers_are_odd_and_keep_every_product_inside_int64(released, golden):
    for args in (released, golden.args):
        for row in eg.EngramLayout.from_args(args).multipliers:
            assert all(m % 2 == 1 for m in row)
            assert max(row) * (args.engram_compressed_vocab_size - 1) < 2**63


def test_table_rows_that_differ_from_the_prime_sum_are_rejected_by_name(released):
    bad = released.replace(engram_num_embeddings=(384006168, 384016683))
    with pytest.raises(ConfigError, match=r"engram_num_embeddings\[1\] = 384016683 .*sum to 384016682"):
        eg.EngramLayout.from_args(bad)


def test_token_map_with_the_wrong_number_of_compressed_ids_is_rejected(golden):
    args = golden.args
    token_map = np.load(golden.path / "engram_map.npy")
    assert eg.prepare_token_map(token_map, args).dtype == np.int32
    merged = np.where(token_map == token_map.max(), 0, token_map)  # one compressed id fewer
    with pytest.raises(ValueError, match=f"distinct compressed ids, but engram_compressed_vocab_size = "
                                         f"{args.engram_compressed_vocab_size}"):
        eg.prepare_token_map(merged, args)


# ------------------------------------------------------------------------- 64-bit arithmetic


def test_uint32_pair_arithmetic_matches_numpy_int64_wrapping_and_floor_mod():
    rng = np.random.default_rng(0)
    info = np.iinfo(np.int64)
    a = rng.integers(info.min, info.max, size=4096, dtype=np.int64)
    b = rng.integers(info.min, info.max, size=4096, dtype=np.int64)
    a[:4] = [0, -1, info.max, info.min]
    b[:4] = [info.max, info.min, info.max, -1]

    def pair(v):
        return tuple(jnp.asarray(h) for h in eg._split_u64(v))

    def join(hi, lo):
        return (np.asarray(hi).astype(np.uint64) << np.uint64(32) | np.asarray(lo)).view(np.int64)

    with np.errstate(over="ignore"):
        assert np.array_equal(join(*eg._mul_i64(pair(a), pair(b))), a * b)  # numpy int64 wraps
    assert np.array_equal(join(*eg._xor_i64(pair(a), pair(b))), a ^ b)
    small = rng.integers(-(2**31), 2**31, size=4096).astype(np.int32)
    assert np.array_equal(join(*eg._from_i32(jnp.asarray(small))), small.astype(np.int64))
    for p in (2, 3, 97, 16000057, 2**31 - 1):  # the chunk width depends on the modulus size
        got = np.asarray(eg._floor_mod_i64(pair(a), np.array(p, np.uint32)))
        assert np.array_equal(got.astype(np.int64), a % p), p  # floor-mod: non-negative for negative a


# ------------------------------------------------------------------------------------ hashing


def test_prefill_hashes_equal_the_reference_exactly_without_x64(golden):
    assert not jax.config.jax_enable_x64
    hashes, _, _, _ = _prefill_hashes(golden)
    assert hashes.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(hashes), golden["prefill.engram_hashes"])


def test_decode_hashes_equal_the_reference_exactly_one_token_at_a_time_under_jit(golden):
    _, history, layout, token_map = _prefill_hashes(golden)
    traces = []

    @jax.jit
    def step(ids, start_pos, history):
        traces.append(start_pos)
        return eg.engram_hash(ids, start_pos, history, None, layout, token_map)

    prompt_len = golden["inputs.prompt"].shape[1]
    tokens, expected = golden["decode.input"], golden["decode.engram_hashes"]
    for t in range(tokens.shape[0]):
        hashes, history = step(jnp.asarray(tokens[t])[:, None], jnp.int32(prompt_len + t), history)
        np.testing.assert_array_equal(np.asarray(hashes), expected[t], err_msg=f"decode step {t}")
    assert len(traces) == 1  # start_pos is traced: one compile serves every step


def test_ngrams_never_span_an_image_token_and_a_blocked_lookback_stays_blocked():
    args = ModelArgs.tiny()
    layout = eg.EngramLayout.from_args(args)
    token_map = jnp.asarray(np.arange(args.vocab_size) % args.engram_compressed_vocab_size, jnp.int32)
    ids = jnp.asarray([[11, 12, 13, 14, 15, 16, 17, 18]])
    mask = jnp.asarray([[True, True, True, False, True, True, True, True]])  # image token at position 3
    hist = eg.new_engram_history(1, 16)
    hashes, _ = _hash(ids, 0, hist, mask, layout, token_map)
    fresh, _ = _hash(ids[:, 4:], 0, hist, None, layout, token_map)
    # After the image token the look-back restarts as at the start of a sequence: position 5's
    # 4-gram would reach position 2 (valid) past the image token at 3, but must be padded.
    np.testing.assert_array_equal(np.asarray(hashes[:, 4:]), np.asarray(fresh))
    plain, _ = _hash(ids, 0, hist, None, layout, token_map)
    assert not np.array_equal(np.asarray(plain[:, 4:]), np.asarray(fresh))


def test_hashing_past_the_end_of_the_history_is_rejected():
    args = ModelArgs.tiny()
    layout = eg.EngramLayout.from_args(args)
    token_map = jnp.zeros((args.vocab_size,), jnp.int32)
    with pytest.raises(ValueError, match=r"positions 6\.\.9 do not fit the history of length 8"):
        eg.engram_hash(jnp.zeros((1, 4), jnp.int32), 6, eg.new_engram_history(1, 8), None, layout, token_map)


# ------------------------------------------------------------------------------------- module


def test_engram_parameters_match_the_hub_inventory_at_released_size(released):
    abstract = nnx.eval_shape(lambda: eg.Engram(14, released))  # 384M table rows: shapes only
    inventory = hub_tensor_inventory(released)
    params = {".".join(map(str, path)): v for path, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}
    expected = {k[len("layers.14.engram."):]: v for k, v in inventory.items() if k.startswith("layers.14.engram.")}
    assert set(params) == set(expected)
    tags = {"F8_E4M3": jnp.float8_e4m3fn, "F8_E8M0": jnp.float8_e8m0fnu, "BF16": jnp.bfloat16}
    for name, (tag, shape) in expected.items():
        assert params[name].shape == tuple(shape), name
        assert params[name].dtype == tags[tag], name


def test_hash_ids_stay_below_the_real_table_rows_so_padding_rows_are_never_read(released):
    """dsv41-convert pads the tables (e.g. layer 14: 384,016,682 -> 384,016,688 rows on 8 devices);
    the padding is safe because every hash id of column c lies in [offsets[c], offsets[c] + primes[c])
    (floor-mod by primes[c], checked against numpy in the test above), and those ranges tile
    exactly the table's real rows."""
    layout = eg.EngramLayout.from_args(released)
    for t, rows in enumerate(released.engram_num_embeddings):
        ends = [o + p for o, p in zip(layout.offsets[t], layout.primes[t])]
        assert list(layout.offsets[t][1:]) == ends[:-1] and layout.offsets[t][0] == 0
        assert ends[-1] == rows
        assert eg.stored_table_rows(rows, 8) >= rows
    assert eg.stored_table_rows(384016682, 8) == 384016688 and eg.stored_table_rows(384006168, 8) == 384006168
    # hashes of n-grams over the extreme compressed ids and random ones stay inside their ranges
    from dsv41_jax.synthetic import synthetic_token_map

    token_map = synthetic_token_map(released, seed=1)
    raw_of = {int(c): r for r, c in enumerate(token_map)}
    n = released.engram_compressed_vocab_size
    rng = np.random.default_rng(5)
    ids = rng.integers(0, released.vocab_size, size=(2, 192)).astype(np.int32)
    ids[0, :64] = [raw_of[c] for c in np.tile([0, n - 1, n - 2, 1], 16)]
    history = eg.new_engram_history(2, 192)
    hashes, _ = _hash(jnp.asarray(ids), 0, history, None, layout, jnp.asarray(token_map))
    hashes = np.asarray(hashes)  # [b, s, layer, col]
    lo = np.asarray(layout.offsets)
    hi = lo + np.asarray(layout.primes)
    assert (hashes >= lo).all() and (hashes < hi).all()
    assert (hashes.max(axis=(0, 1, 3)) < np.asarray(released.engram_num_embeddings)).all()


def test_padded_table_rows_change_no_output_and_read_as_zero(golden):
    """The model built with padded tables (engram_rows_multiple) gives bit-identical Engram outputs
    even with garbage in the padding rows, and an id in the padding reads a zero row."""
    args = golden.args
    padded_args = args.replace(engram_rows_multiple=8)
    rows = args.engram_num_embeddings
    padded_tables = [(t, layer) for t, layer in enumerate(args.engram_layer_ids) if rows[t] % 8]
    assert padded_tables  # each golden set has a table that gets padding rows
    for table, layer in padded_tables:
        plain = _loaded_engram(golden, layer)
        module = eg.Engram(layer, padded_args)
        load_hub_weights(module, golden.path, f"layers.{layer}.engram.")
        stored = eg.stored_table_rows(rows[table], 8)
        assert module.embed.weight.shape[0] == stored and module.embed.rows == rows[table]
        w = np.asarray(module.embed.weight[...]).view(np.uint8).copy()
        assert not w[rows[table]:].any()  # the loader pads with zero bytes
        w[rows[table]:] = 0x7E  # e4m3 448: would be loud if any lookup read it
        module.embed.weight.set_value(jnp.asarray(w.view(jnp.float8_e4m3fn)))
        x = jnp.asarray(golden[f"prefill.block_out.L{layer - 1:02d}"])
        hashes = jnp.asarray(golden["prefill.engram_hashes"][..., table, :])
        run = nnx.jit(lambda m, x, h: m(x, h))
        assert np.array_equal(np.asarray(run(module, x, hashes)).view(np.uint16),
                              np.asarray(run(plain, x, hashes)).view(np.uint16)), f"layer {layer}"
        pad_ids = jnp.arange(rows[table], stored + 1, dtype=jnp.int32)
        assert stored > rows[table] and not np.asarray(module.embed(pad_ids), np.float32).any()


def test_engram_layer_outside_engram_layer_ids_is_rejected():
    with pytest.raises(ValueError, match="layer 2 is not in engram_layer_ids"):
        eg.Engram(2, ModelArgs.tiny())


def _module_errors(golden, phase: str):
    """Per Engram layer: (port, gold, input) for `phase` in prefill/decode, teacher-forced."""
    args = golden.args
    out = []
    for table, layer in enumerate(args.engram_layer_ids):
        module = _loaded_engram(golden, layer)
        x = golden[f"{phase}.block_out.L{layer - 1:02d}"]
        hashes = golden[f"{phase}.engram_hashes"][..., table, :]
        gold = golden[f"{phase}.engram_out.L{layer:02d}"]
        mask = _token_mask(golden) if phase == "prefill" else None
        if phase == "decode":  # fold the step axis into the batch: [T, B, 1, ...] -> [T*B, 1, ...]
            x, hashes, gold = (a.reshape(-1, *a.shape[2:]) for a in (x, hashes, gold))
        port = nnx.jit(lambda m, x, h, k: m(x, h, k))(module, jnp.asarray(x), jnp.asarray(hashes), mask)
        out.append((layer, np.asarray(port).astype(np.float32), gold.astype(np.float32), x))
    return out


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_engram_output_matches_reference_within_bf16_tolerance(golden, phase, record_property):
    for layer, port, gold, _ in _module_errors(golden, phase):
        err = np.abs(port - gold)
        record_property(f"{phase}.L{layer:02d}.max_abs_err", float(err.max()))
        bad = err > _bound(gold)
        assert not bad.any(), (
            f"{golden.name} {phase} layer {layer}: {bad.sum()} elements out of tolerance, max |err| {err.max()}"
        )


def test_image_positions_pass_through_engram_unchanged(golden):
    mask = _token_mask(golden)
    if mask is None:
        pytest.skip(f"{golden.name} has no image span")
    image = ~np.asarray(mask)
    assert image.any()
    for layer, port, gold, x in _module_errors(golden, "prefill"):
        np.testing.assert_array_equal(port[image], x[image].astype(np.float32), err_msg=f"layer {layer}")
        np.testing.assert_array_equal(gold[image], x[image].astype(np.float32))
        assert not np.array_equal(port[~image], x[~image].astype(np.float32))  # text positions do change


def test_normalising_jointly_over_the_copies_fails_the_reference(golden):
    """Negative twin: the RMS statistics must be per hc copy; pooling them over the copies breaks parity."""
    args = golden.args
    for table, layer in enumerate(args.engram_layer_ids):
        module = _loaded_engram(golden, layer)
        x = jnp.asarray(golden[f"prefill.block_out.L{layer - 1:02d}"])
        hashes = jnp.asarray(golden["prefill.engram_hashes"][..., table, :])
        key, value = nnx.jit(lambda m, ids: m.key_value(ids))(module, hashes)
        h = x.astype(jnp.float32)
        weight = module.q_weight[...].astype(jnp.float32) * module.k_weight[...].astype(jnp.float32)
        rstd = jax.lax.rsqrt(jnp.mean(h**2, axis=(-2, -1), keepdims=True)[..., 0] + args.norm_eps) * jax.lax.rsqrt(
            jnp.mean(key**2, axis=(-2, -1), keepdims=True)[..., 0] + args.norm_eps
        )
        dot = jnp.sum(h * weight * key, axis=-1) * rstd * args.dim**-0.5
        gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), eg.GATE_CLAMP)), dot))
        mask = _token_mask(golden)
        if mask is not None:
            gate = jnp.where(mask[..., None], gate, 0.0)
        joint = (h + gate[..., None] * value.astype(jnp.float32)[..., None, :]).astype(x.dtype)
        gold = golden[f"prefill.engram_out.L{layer:02d}"].astype(np.float32)
        err = np.abs(np.asarray(joint).astype(np.float32) - gold)
        assert (err > _bound(gold)).any(), f"{golden.name} layer {layer}: joint normalisation went undetected"
