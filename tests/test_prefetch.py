"""Reading a weight into L2 ahead of its use (pallas_kernels/prefetch): the kernel in interpret
mode on CPU (and compiled on a GPU, `gpu` marker), the ordering operands, the model's decode step
with `Attention.read_ahead_wo_a`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fp8_matmul import kernel_gpu as fp8_kernel
from pallas_kernels.prefetch import api, kernel_gpu, read_ahead

HAS_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")


@pytest.mark.parametrize(("n_bytes", "want"), [
    (8192 * 4096, (8192, 1024, 8)),  # the released wo_a: 4 KiB rows, 32 KiB tiles
    (2304 * 5120, (2880, 1024, 8)),
    (8192, (2, 1024, 2)),  # the tiny golden sets' wo_a
    (96 * 4, (3, 32, 1)),
])
def test_layout_of_the_words(n_bytes, want):
    assert kernel_gpu.layout(n_bytes) == want
    rows, _, tile_rows = want
    programs, steps = kernel_gpu.grid_for(rows, tile_rows)
    assert programs * steps * tile_rows == rows and programs <= kernel_gpu.MAX_PROGRAMS


@pytest.mark.parametrize("n_bytes", [60, 8190, 4 * 15])
def test_layout_refuses_sizes_that_are_not_whole_rows(n_bytes):
    with pytest.raises(NotImplementedError, match="whole rows"):
        kernel_gpu.layout(n_bytes)


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=[pytest.mark.gpu, needs_gpu])])
@pytest.mark.parametrize("shape", [(256, 1024), (64, 128), (2304, 160)])
def test_kernel_reads_every_word(shape, interpret):
    """Row p of the token is the maximum of program p's words: each word is read (a word set to
    the int32 maximum shows up in its program's row, and only there)."""
    w = jax.random.bits(jax.random.key(1), shape, jnp.uint8).view(jnp.float8_e4m3fn)
    words = api.as_words(w)
    rows, cols, tile_rows = kernel_gpu.layout(w.size)
    programs, _ = kernel_gpu.grid_for(rows, tile_rows)
    flat = np.asarray(words).reshape(-1).copy()
    spot = int(jax.random.randint(jax.random.key(2), (), 0, flat.size))
    flat[spot] = np.iinfo(np.int32).max
    words = jnp.asarray(flat.reshape(rows, cols))
    token = np.asarray(kernel_gpu.read_words(words, jnp.zeros((16,), jnp.float32), interpret=interpret))
    want = flat.reshape(programs, -1).max(axis=1)
    assert token.shape == (programs, 16)
    np.testing.assert_array_equal(token, np.broadcast_to(want[:, None], token.shape))
    assert np.argmax(token[:, 0]) == spot // (flat.size // programs)


def test_words_are_the_bytes_reinterpreted():
    w = jax.random.bits(jax.random.key(3), (64, 512), jnp.uint8)
    words = np.asarray(api.as_words(w.view(jnp.float8_e4m3fn)))
    np.testing.assert_array_equal(words.reshape(-1).view(np.uint8), np.asarray(w).reshape(-1))
    assert api.as_words(jnp.zeros((32, 256), jnp.bfloat16)).shape == (4, 1024)


def test_read_ahead_runs_only_on_the_kernel_path():
    w = jnp.zeros((64, 512), jnp.float8_e4m3fn)
    after = jnp.ones((4, 8), jnp.bfloat16)
    assert read_ahead(w, after) is None  # CPU, "auto": nothing to compute
    assert read_ahead(w, after, implementation="reference", interpret=True) is None
    token = read_ahead(w, after, implementation="pallas", interpret=True)
    assert token.shape == (kernel_gpu.grid_for(*kernel_gpu.layout(w.size)[::2])[0], 16)
    assert read_ahead(jnp.zeros((3, 5), jnp.float8_e4m3fn), after, implementation="pallas", interpret=True) is None


def test_the_ordering_operand_is_in_both_launches():
    """Lowered for a GPU: the reading kernel takes `after` (reshaped) and the fp8 launch takes the
    reading kernel's token, so neither can be dropped or moved before the other's operand exists
    (XLA removes a kernel whose result no launch takes)."""
    import re

    from pallas_kernels._dispatch import target_platform

    wa = jnp.zeros((256, 128), jnp.float8_e4m3fn)
    sa = jnp.zeros((8, 4), jnp.uint8)

    def f(x, after):
        token = read_ahead(wa, after, implementation="pallas")
        return fp8_kernel.fp8_matmul_many(x, (wa,), (sa,), block_m=1, block_n=32, block_k=128, k_splits=1,
                                          num_warps=4, num_stages=1, decode="native", interpret=False,
                                          after=token)[0]

    with target_platform("gpu"):
        text = jax.jit(f).trace(jnp.zeros((1, 128), jnp.bfloat16), jnp.zeros((64,), jnp.bfloat16)).lower(
            lowering_platforms=("cuda",)).as_text()
    calls = {m[3]: (m[0], m[1].split(", ")) for m in re.findall(
        r"(%\w+) = stablehlo.custom_call @__gpu\$xla.gpu.triton\(([^)]*)\).*?(name = \"(\w+)\")", text)}
    assert set(calls) == {"read_ahead", "fp8_matmul"}
    read, read_operands = calls["read_ahead"]
    fp8_operands = calls["fp8_matmul"][1]
    assert len(read_operands) == 2 and "%arg1" not in read_operands[:1]
    assert fp8_operands[0] == "%arg0" and fp8_operands[-1] == read and len(fp8_operands) == 4


@pytest.mark.parametrize("groups", [1, 4])
def test_fp8_launch_with_a_token_gives_the_same_values(groups):
    """The ordering operand changes nothing the kernel computes (interpret mode)."""
    rng = np.random.default_rng(0)
    k, n = 128, 256
    w = jnp.asarray(rng.standard_normal((n, groups * k if groups == 1 else k)) * 100, jnp.float8_e4m3fn)
    s = jnp.asarray(rng.integers(120, 130, (n // 32, w.shape[1] // 32)), jnp.uint8)
    x = jnp.asarray(rng.standard_normal((1, groups * w.shape[1])), jnp.bfloat16)
    token = read_ahead(w, x, implementation="pallas", interpret=True)
    kw = {"block_m": 1, "block_n": 32, "block_k": 128, "k_splits": 1, "num_warps": 4, "num_stages": 1,
          "decode": "native", "interpret": True, "groups": groups}
    got = fp8_kernel.fp8_matmul_many(x, (w,), (s,), after=token, **kw)[0]
    want = fp8_kernel.fp8_matmul_many(x, (w,), (s,), **kw)[0]
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_model_decode_step_reading_wo_a_ahead(monkeypatch):
    """The one-row golden decode step with `Attention.read_ahead_wo_a` on every layer (kernels
    "pallas", interpret): every layer reads its wo_a ahead, hands the token to wo_a's launch, and
    the step's logits and new caches equal those without the switch, bit for bit."""
    from conftest import GOLDEN_DIRS
    from flax import nnx

    from dsv41_jax import parity
    from dsv41_jax.attention import Attention
    from dsv41_jax.parity import GoldenSet

    gs = GoldenSet(GOLDEN_DIRS[0])
    cache = jax.tree.map(lambda a: a[:1], parity.teacher_forced_cache(parity.load_model(gs), gs))

    def first_step(m):
        ids = jnp.asarray(gs["decode.input"][0], jnp.int32)[:1]
        return m.decode_step(ids, jnp.full(ids.shape, int(gs["decode.start_pos"][0]), jnp.int32), cache)

    want_logits, want_cache = first_step(parity.load_model(gs, kernels="pallas", kernels_interpret=True))
    model = parity.load_model(gs, kernels="pallas", kernels_interpret=True)
    parity.set_switches(model, ["read_ahead_wo_a"])
    assert all(m.read_ahead_wo_a for _, m in nnx.iter_modules(model) if isinstance(m, Attention))
    reads, tokens = [], []
    original_read, original_many = kernel_gpu.read_words, fp8_kernel.fp8_matmul_many
    monkeypatch.setattr(kernel_gpu, "read_words", lambda w, *a, **kw: reads.append(w.shape) or original_read(w, *a, **kw))
    monkeypatch.setattr(fp8_kernel, "fp8_matmul_many",
                        lambda *a, **kw: tokens.append(kw.get("after") is not None) or original_many(*a, **kw))
    jax.clear_caches()
    logits, new_cache = first_step(model)
    a = gs.args
    wo_a_bytes = a.n_heads * a.head_dim // a.o_groups * a.o_groups * a.o_lora_rank
    assert len(reads) == a.n_layers and set(reads) == {kernel_gpu.layout(wo_a_bytes)[:2]}
    assert any(tokens)  # wo_a's launch took a token (`grouped_linear` is traced once for equal shapes)
    np.testing.assert_array_equal(np.asarray(logits, np.float32), np.asarray(want_logits, np.float32))
    for got, want in zip(jax.tree.leaves(new_cache), jax.tree.leaves(want_cache), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
