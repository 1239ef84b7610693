"""Chunked prefill (`Transformer.prefill_chunk`): a prompt fed in chunks onto a cache computes what
one prefill of the whole prompt computes, bit for bit, and decode continues identically.

The one-shot reference is test_decode's right-padded batch (row 0: 88 tokens, row 1: 63, tiny-a,
window 8, ratio-2 sources, a ratio-1 source with candidates, reindex layers, Engram), so that
its compiled programs serve here too. The chunks are one compiled program of width 32; per-row
lengths place the boundaries: row 0 at 32 and 64 (group boundaries of the ratio-2 compressors),
row 1 at 7 and 39 (inside a group: its first token waits in the compressor state), with chunks
shorter (7) and longer (24, 32) than the window.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from test_decode import DATA, ROW1_LEN, _decode, _model, _per_row_runs

from dsv41_jax.cache import init_cache, update_window
from dsv41_jax.generate import Generator
from dsv41_jax.parity import GoldenSet

TINY_A = DATA / "golden" / "tiny-a"
WIDTH = 32
CHUNK_LENGTHS = [(32, 7), (32, 32), (24, 24)]  # per chunk: (row 0, row 1) real tokens


def _tokens() -> np.ndarray:
    gs = GoldenSet(TINY_A)
    return np.concatenate([gs["inputs.prompt"], gs["decode.input"].T], axis=1).astype(np.int32)  # [2, 88]


@functools.cache
def _generator() -> Generator:
    return Generator(_model(str(TINY_A)), prefill_chunk=WIDTH)


@functools.cache
def _chunked():
    """(logits of the last chunk [2, V], cache) of the chunked prefill of rows [88, 63]."""
    gen, full = _generator(), _tokens()
    cache = init_cache(gen.args, 2)
    done = np.zeros(2, np.int32)
    for lens in CHUNK_LENGTHS:
        ids = np.zeros((2, WIDTH), np.int32)
        for r, n in enumerate(lens):
            ids[r, :n] = full[r, done[r]:done[r] + n]
        logits, cache = gen._prefill_chunk(gen.state, jnp.asarray(ids), jnp.asarray(done), jnp.asarray(lens, np.int32),
                                           cache)
        done = done + np.asarray(lens, np.int32)
    assert done.tolist() == [88, ROW1_LEN]
    return np.asarray(logits), cache


def test_chunked_prefill_equals_one_shot_prefill_bit_for_bit():
    logits, cache = _chunked()
    want_logits, want_cache = _per_row_runs()["mixed"][:2]
    np.testing.assert_array_equal(logits, want_logits[0])
    a = GoldenSet(TINY_A).args
    lengths = [88, ROW1_LEN]
    for i, (got_layer, want_layer) in enumerate(zip(cache["layers"], want_cache["layers"], strict=True)):
        assert got_layer.keys() == want_layer.keys()
        for name, want in want_layer.items():
            for r, n in enumerate(lengths):
                got, exp = np.asarray(got_layer[name][r], np.float32), np.asarray(want[r], np.float32)
                if name in ("compress_kv", "index_k"):  # rows past a row's groups hold padding in one-shot
                    got, exp = got[: n // a.compress_ratios[i]], exp[: n // a.compress_ratios[i]]
                np.testing.assert_array_equal(got, exp, err_msg=f"layer {i} {name} row {r}")
    for r, n in enumerate(lengths):
        np.testing.assert_array_equal(np.asarray(cache["engram_history"])[r, :n],
                                      np.asarray(want_cache["engram_history"])[r, :n])
    np.testing.assert_array_equal(np.asarray(cache["seq_len"]), lengths)


def test_decode_after_a_chunked_prefill_equals_decode_after_one_prefill():
    """Four steps (row 0 greedy, row 1 fed its next tokens) from the chunked cache give the
    logits of the same steps after the one-shot prefill, bit for bit."""
    full = _tokens()
    logits, cache = _chunked()
    want = _per_row_runs()["mixed"][0]
    pos = np.asarray([88, ROW1_LEN], np.int32)
    for k in range(4):
        tok = np.asarray([logits[0].argmax(), full[1, ROW1_LEN + k]], np.int32)
        logits, cache, _ = _decode(_model(str(TINY_A)), jnp.asarray(tok), jnp.asarray(pos), cache)
        logits = np.asarray(logits)
        np.testing.assert_array_equal(logits, want[k + 1], err_msg=f"step {k}")
        pos = pos + 1


def test_generator_prefill_chunk_gives_the_one_shot_logits_with_one_compiled_chunk_program():
    gen, full = _generator(), _tokens()
    _chunked()  # the chunk program is compiled once, for every chunk and every call
    traces = gen.traces["prefill"]
    out = gen.generate([full[0].tolist(), full[1, :ROW1_LEN].tolist()], max_new_tokens=1, return_logits=True)
    # 88 tokens in chunks of 32: row 1 (63 tokens) ends inside the second chunk, adds nothing to the third
    np.testing.assert_array_equal(out.logits[0], _per_row_runs()["mixed"][0][0])
    assert gen.traces["prefill"] == traces


def test_chunk_arguments_are_checked():
    model = _model(str(TINY_A))
    cache = init_cache(model.args, 1)
    ids = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match=r"lengths must be in \[0, 4\]"):
        model.prefill_chunk(ids, jnp.asarray([0]), jnp.asarray([5]), cache)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.prefill_chunk(ids, jnp.asarray([model.args.max_seq_len - 2]), jnp.asarray([4]), cache)
    with pytest.raises(ValueError, match="prefill_chunk must be a positive"):
        Generator(model, prefill_chunk=0)


def test_window_update_keeps_each_rows_newest_positions_from_ring_and_chunk():
    ring = jnp.asarray([[8, 9, 10, 11], [0, 0, 0, 0]], jnp.float32)[..., None]  # row 0 holds positions 8..11
    chunk = jnp.asarray([[12, 13, 14], [0, 1, 99]], jnp.float32)[..., None]  # value = position (99: padding)
    out = np.asarray(update_window(ring, chunk, jnp.asarray([12, 0]), jnp.asarray([15, 2])))[..., 0]
    np.testing.assert_array_equal(out[0], [12, 13, 14, 11])  # positions 12, 13, 14 replace 8, 9, 10
    np.testing.assert_array_equal(out[1], [0, 1, 0, 0])  # positions 0, 1; the padding never lands
