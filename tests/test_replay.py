"""Decoder-half replay (SPEC §19.1): in prefill, the layers above the last kv source run only on
each row's dependency cone; the logits, every cache array and the decode steps after it are
identical to running every layer on every position.

Replay is the default, so test_decode's ragged batch (tiny-a, rows of 88 and 63 tokens) is
replayed; test_chunked_prefill's chunks run every layer on every position, which makes its
comparisons replay-vs-full ones too (reused below at no cost). tiny-c adds an image span
(routing with `bias_vl`) inside the replayed suffixes of a ragged batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from test_chunked_prefill import _chunked
from test_decode import DATA, ROW1_LEN, _model, _per_row_runs

from dsv41_jax.cache import init_cache
from dsv41_jax.config import ModelArgs
from dsv41_jax.model import replay_start, replay_width
from dsv41_jax.parity import GoldenSet


def _assert_trees_equal(got, want, label):
    got_leaves = jax.tree_util.tree_leaves_with_path(got)
    want_leaves = jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for (path, g), w in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                      err_msg=f"{label} {jax.tree_util.keystr(path)}")


def test_replayed_layers_leave_the_rings_and_logits_of_a_prefill_over_all_positions():
    """tiny-a ragged batch: the replayed one-shot prefill against the chunked one (every layer on
    every position); the decode steps after both: test_chunked_prefill."""
    a = GoldenSet(DATA / "golden" / "tiny-a").args
    logits, cache = _chunked()
    want_logits, want_cache = _per_row_runs()["mixed"][:2]
    np.testing.assert_array_equal(logits, want_logits[0])
    for i in range(replay_start(a), a.n_layers):
        np.testing.assert_array_equal(np.asarray(cache["layers"][i]["window_kv"], np.float32),
                                      np.asarray(want_cache["layers"][i]["window_kv"], np.float32), err_msg=str(i))
    assert replay_width(a, replay_start(a), 88) < 88 and ROW1_LEN > replay_width(a, a.n_layers - 1, 88)


@nnx.jit
def _both(model, ids, lengths, token_types, embeds, cache):
    on = model.prefill(ids, lengths, cache, token_types, embeds, replay=True)
    off = model.prefill(ids, lengths, cache, token_types, embeds, replay=False)
    return on, off


def test_replayed_prefill_of_a_ragged_batch_with_an_image_span_equals_the_full_prefill():
    gs = GoldenSet(DATA / "golden" / "tiny-c")
    model, a = _model(str(gs.path)), gs.args
    ids = jnp.asarray(gs["inputs.prompt"], jnp.int32)
    s = ids.shape[1]
    lengths = np.asarray([s, 40], np.int32)
    tt = gs.token_types()
    # row 1's image span lies inside the suffix of a replayed layer that starts after position 0
    first = replay_start(a)
    span = np.flatnonzero(tt[1] >= 0)
    assert any(0 < lengths[1] - replay_width(a, i, s) <= span.min() for i in range(first, a.n_layers))
    embeds = jnp.asarray(gs["prefill.h0"], jnp.bfloat16)  # image rows: the vision tower's features
    (on_logits, on_cache), (off_logits, off_cache) = _both(model, ids, jnp.asarray(lengths), jnp.asarray(tt), embeds,
                                                           init_cache(a, ids.shape[0]))
    np.testing.assert_array_equal(np.asarray(on_logits), np.asarray(off_logits))
    _assert_trees_equal(on_cache, off_cache, "tiny-c")  # padding rows included


def test_replayed_layers_run_only_on_their_cone():
    gs = GoldenSet(DATA / "golden" / "tiny-a")
    a = gs.args
    rec = _per_row_runs()["mixed"][2]  # the prefill's intermediates, 88 padded positions
    first = replay_start(a)
    assert first == a.kv_source_layers[-1] + 1 == 7
    for i in range(a.n_layers):
        width = rec[f"block_out.L{i:02d}"].shape[1]
        assert width == (88 if i < first else a.window_size + (a.n_layers - 1 - i) * (a.window_size - 1)), i
    assert rec[f"block_out.L{a.n_layers - 1:02d}"].shape[1] == a.window_size


def test_replay_widths_of_the_released_layer_roles_are_the_dependency_cone():
    """Layer 39 needs its input at the last 128 positions, each layer below 127 more. (SPEC §19.1
    quotes 128 + 17 * 127 = 2287 for layer 21: that is layer 22's width; 21 is 18 layers below
    39. The bit-exact tests above would fail with a cone one layer too narrow.)"""
    args = ModelArgs.from_json(DATA / "released_config.json", max_seq_len=65536)
    assert replay_start(args) == 21
    assert replay_width(args, 39, 65536) == 128 and replay_width(args, 38, 65536) == 255
    assert replay_width(args, 21, 65536) == 128 + 18 * 127 == 2414
    assert replay_width(args, 21, 1000) == 1000
    # token-layers of layers 21..39 in a 64k prefill: 24,149 instead of 19 * 65536 (51.6x fewer)
    assert sum(replay_width(args, i, 65536) for i in range(21, 40)) == 19 * 128 + 127 * sum(range(19)) == 24149
