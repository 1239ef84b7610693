"""Golden prefill parity with the Pallas kernels in the model (SPEC §20), teacher-forced per block.

`ModelArgs.kernels="pallas"` routes both Pallas-backed sites of every block, the Sinkhorn split of
the two hyper-connection mixes and the sparse attention, through the kernels; the arrays are then
held to the same criteria as the reference path (`dsv41_jax.parity.compare`, and the block outputs'
bit-identical fraction of tests/test_model_parity.py).

On CPU the GPU kernels run in Pallas interpret mode (`kernels_interpret=True`) over the first
`CPU_LAYERS` blocks of the first golden set (window-only blocks, one with Engram, and a ratio-2
source: both kernels, the attention over window and compressed rows), because interpret mode costs
several seconds per block. Every block of both shipped sets was run so once (about 5 min of CPU)
and passed with the reference path's figures: block_out max |err| 0.031 (tiny-a L05) / 0.0625
(tiny-c L06, L08), differing fraction at most 0.47% (tiny-c L08), pre-mix max 1.0e-4, logits
within the bound. The `gpu`-marked test runs every block of every set compiled.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN_DIRS

from dsv41_jax import parity
from dsv41_jax.loading import load_hub_weights
from dsv41_jax.model import Transformer
from dsv41_jax.parity import NOT_IN_TEXT_MODEL, GoldenSet
from pallas_kernels.sinkhorn import kernel_gpu as sinkhorn_gpu
from pallas_kernels.sparse_attention import kernel_gpu as attn_gpu

# blocks run in interpret mode on CPU: layers 0-2 of tiny-a (window, window + Engram, ratio-2 source)
CPU_LAYERS = 3
# the block-output criterion of tests/test_model_parity.py (reference path: at most 0.46% differ)
MAX_DIFFERING_FRACTION = 0.01

HAS_GPU = jax.default_backend() == "gpu"


def _kernel_model(path: str, interpret: bool) -> tuple[Transformer, GoldenSet]:
    gs = GoldenSet(path)
    args = dataclasses.replace(gs.args, kernels="pallas", kernels_interpret=interpret)
    model = Transformer(args)
    load_hub_weights(model, gs.path, skip=NOT_IN_TEXT_MODEL)
    if model.token_map is not None:
        model.token_map.set_value(jnp.asarray(np.load(gs.path / "engram_map.npy"), jnp.int32))
    return model, gs


def _counting(monkeypatch, module, name, counter):
    original = getattr(module, name)

    @functools.wraps(original)
    def wrapped(*a, **kw):
        counter[name] = counter.get(name, 0) + 1
        return original(*a, **kw)

    monkeypatch.setattr(module, name, wrapped)


def _run(path: str, interpret: bool, n_layers: int | None, monkeypatch, caplog):
    """Teacher-forced prefill with the kernels on; asserts both kernels were traced and no site fell back."""
    traced: dict[str, int] = {}
    _counting(monkeypatch, sinkhorn_gpu, "hc_split_sinkhorn", traced)
    _counting(monkeypatch, attn_gpu, "sparse_attn", traced)
    model, gs = _kernel_model(path, interpret)
    jax.clear_caches()  # the blocks' jit caches must not serve a trace of the reference path
    with caplog.at_level(logging.WARNING):
        port = parity.teacher_forced_prefill(model, gs, n_layers=n_layers)
    assert "using the reference" not in caplog.text, caplog.text
    assert traced.get("hc_split_sinkhorn", 0) > 0 and traced.get("sparse_attn", 0) > 0, traced
    return port, gs


def _assert_parity(port, gs, n_layers):
    rows = parity.compare(port, gs)
    layers = range(n_layers if n_layers is not None else gs.args.n_layers)
    compared = {r[0] for r in rows}
    for i in layers:
        assert f"prefill.block_out.L{i:02d}" in compared
    bad = [r for r in rows if not r[1]]
    worst = max((r for r in rows if r[0].startswith("prefill.block_out")), key=lambda r: r[2])
    fracs = []
    for i in layers:
        key = f"prefill.block_out.L{i:02d}"
        fracs.append(float(np.mean(np.asarray(port[key], np.float32) != gs[key].astype(np.float32))))
    print(f"{gs.name} kernels on, {len(fracs)} blocks: worst {worst[0]} max|err| {worst[2]:.4g} "
          f"err/RMS {worst[3]:.3g}; block_out differing fraction max {max(fracs):.3%}")
    assert not bad, bad
    assert max(fracs) <= MAX_DIFFERING_FRACTION, fracs


def test_prefill_parity_with_interpreted_kernels_on_first_blocks(monkeypatch, caplog):
    if jax.default_backend() != "cpu":
        pytest.skip("interpret mode is the CPU path; the gpu test compiles the kernels")
    port, gs = _run(str(GOLDEN_DIRS[0]), True, CPU_LAYERS, monkeypatch, caplog)
    _assert_parity(port, gs, CPU_LAYERS)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
def test_full_prefill_parity_with_compiled_kernels(golden, monkeypatch, caplog):
    port, gs = _run(str(golden.path), False, None, monkeypatch, caplog)
    _assert_parity(port, gs, None)
    rows = {r[0]: r for r in parity.compare(port, gs)}
    assert rows["prefill.logits"][1] and rows["prefill.next_token"][1]
