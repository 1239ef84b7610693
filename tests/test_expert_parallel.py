"""Expert-parallel MoE (dsv41_jax/expert_parallel.py): bit-identical to the single-device MoE on
meshes of 8 fake CPU devices, for both communication patterns, and the whole model (prefill
logits, greedy decode steps) under a mesh equal to the single-device run on the golden sets
(`MODEL_SETS`).

The multi-device cases (marked `fake_devices`) run in one subprocess (this pytest process has one
device) that prints one JSON line of results; the tests below read it. tests/conftest.py starts it
right after collection, so it runs beside the rest of the suite.

The whole-model meshes keep `data` = 1: with batch rows split over `data`, the rest of the model
(Engram layer 4 of tiny-a, one element by 1 bf16 ulp, with or without expert parallelism)
already differs from the single-device run, so those meshes are checked at the MoE level here.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from pathlib import Path

import jax
import pytest
from jax.sharding import AbstractMesh

from dsv41_jax import expert_parallel as ep
from dsv41_jax.config import ModelArgs

from conftest import GOLDEN_DIRS, Child

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
MESHES = ("expert=8", "expert=4,data=2", "expert=2,data=2,tensor=2")  # for MOE_ARGS' 8 experts
# the whole-model check's sets: every golden set but tiny-a, whose whole model runs on 8-device
# meshes in tests/test_convert.py (expert=8 and data=2,expert=2,tensor=2: bit-identical logits)
# and tests/test_generate.py (two hosts on expert=4,data=2: the same tokens)
MODEL_SETS = [p for p in GOLDEN_DIRS if p.name != "tiny-a"]
DECODE_STEPS = 2


def _model_mesh(path: Path) -> str:
    """Whole-model mesh for a golden set: as many expert shards of 8 as divide its experts, the
    rest over `tensor` (batch rows stay whole: see the module doc)."""
    args = ModelArgs.from_json(path / "config.json")
    # the converter's mesh check also asks the expert axis to divide the DSpark stages' experts
    expert = math.gcd(8, args.n_routed_experts, args.dspark_n_routed_experts if args.dspark_enabled else 8)
    return f"expert={expert},tensor={8 // expert}"

_CHILD = r"""
import contextlib, json, sys, time
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, sys.argv[1])
from test_moe import MOE_ARGS, random_moe, unit_inputs
from dsv41_jax import expert_parallel as ep, sharding as shd
from dsv41_jax.cache import init_cache
from dsv41_jax.parity import GoldenSet, load_model

meshes, golden, steps = json.loads(sys.argv[2])  # golden: [[directory, mesh], ...]
patterns = []  # the pattern each expert-parallel MoE call traced
_forward = ep.moe_forward


def logged(moe, x, mask=None, *, mesh=None, pattern="auto", **kw):
    patterns.append(ep.choose_pattern(x.shape[0], moe.topk, mesh, moe.gather_max_pairs) if pattern == "auto" else pattern)
    return _forward(moe, x, mask, mesh=mesh, pattern=pattern, **kw)


ep.moe_forward = logged


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def run_moe(m, x, mask, path, mesh, capacity_factor=None):
    def f(x, mask):
        if capacity_factor is None:
            return m(x, mask, path=path)
        xf, mf = x.reshape(-1, m.dim), mask.reshape(-1)
        y, w, idx = ep.moe_forward(m, xf, mf, pattern="all_to_all", capacity_factor=capacity_factor)
        return y.reshape(x.shape), {"route_idx": idx, "route_w": w}
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        y, aux = jax.jit(f)(x, mask)
    return bits(y), np.asarray(aux["route_idx"]), bits(aux["route_w"])


def rounds(idx, n_tok, mesh, n_local, k, factor):
    # all_to_all rounds needed, from the routing alone: max over (source, owner) of ceil(bucket / C)
    groups = 1
    for a in ep.token_axes(n_tok, mesh, with_expert=True):
        groups *= dict(mesh.shape)[a]
    t_d = n_tok // groups
    cap = ep.capacity(t_d, k, n_local, dict(mesh.shape)["expert"], factor)
    owner = idx.reshape(groups, t_d * k) // n_local
    worst = max(int(np.bincount(row).max()) for row in owner)
    return -(-worst // cap)


rng_x = lambda seed, shape: jnp.asarray(unit_inputs(seed, shape), jnp.bfloat16)
mask_of = lambda shape: jnp.asarray(np.random.default_rng(0).random(shape) < 0.3)
moe = random_moe(MOE_ARGS, seed=7, tile_rows=8)
skewed = random_moe(MOE_ARGS, seed=9, tile_rows=8)
skewed.gate.bias.set_value(jnp.asarray([0, 0, 0, 0, 0, 40, 50, 50], jnp.float32))  # every token -> 5, 6, 7
cases = {  # name: (module, input shape, path, capacity_factor)
    "decode_auto": (moe, (2, 3), "auto", None),
    "prefill_auto": (moe, (2, 64), "auto", None),
    "prefill_replicated": (moe, (2, 32), "gather", None),
    "small_all_to_all": (moe, (2, 8), "grouped", None),
    "skewed_multi_round": (skewed, (2, 32), None, 0.25),
}
single = {}
for name, (m, shape, path, factor) in cases.items():
    x, mask = rng_x(len(name), (*shape, 64)), mask_of(shape)
    single[name] = run_moe(m, x, mask, "auto", None)
out = {"moe": {}, "model": {}, "seconds": {}}
t0 = time.process_time()
for spec in meshes:
    mesh = shd.make_mesh(spec, args=MOE_ARGS)
    for name, (m, shape, path, factor) in cases.items():
        x, mask = rng_x(len(name), (*shape, 64)), mask_of(shape)
        patterns.clear()
        got = run_moe(m, x, mask, path, mesh, factor)
        want = single[name]
        n_tok = shape[0] * shape[1]
        out["moe"][f"{spec} {name}"] = {
            "y_equal": bool(np.array_equal(got[0], want[0])),
            "y_differ": float(np.mean(got[0] != want[0])),
            "routes_equal": bool(np.array_equal(got[1], want[1]) and np.array_equal(got[2], want[2])),
            "pattern": patterns[0] if patterns else ("all_to_all" if factor else None),
        }
        if out["moe"][f"{spec} {name}"]["pattern"] == "all_to_all":
            out["moe"][f"{spec} {name}"]["rounds"] = rounds(want[1], n_tok, mesh, 8 // dict(mesh.shape)["expert"], 3,
                                                            factor or 2.0)


out["seconds"]["moe"] = time.process_time() - t0

# the fp4 kernel (Pallas interpret mode) inside the shard_map: K = 128 is the smallest it tiles
from pallas_kernels.expert_matmul import kernel_gpu as expert_kernel
kernel_traces = []
_kernel = expert_kernel.expert_matmul
expert_kernel.expert_matmul = lambda *a, **kw: kernel_traces.append(1) or _kernel(*a, **kw)
kmoe = random_moe(MOE_ARGS.replace(dim=128, moe_inter_dim=128, kernels="pallas", kernels_interpret=True), seed=11,
                  tile_rows=8)
t0 = time.process_time()
for name, (shape, path) in {"kernel_decode": ((2, 3), "auto"), "kernel_prefill": ((2, 16), "grouped")}.items():
    x, mask = rng_x(len(name), (*shape, 128)), mask_of(shape)
    want = run_moe(kmoe, x, mask, path, None)
    for spec in ("expert=8", "expert=4,data=2"):
        patterns.clear()
        kernel_traces.clear()
        got = run_moe(kmoe, x, mask, path, shd.make_mesh(spec, args=MOE_ARGS))
        out["moe"][f"{spec} {name}"] = {
            "y_equal": bool(np.array_equal(got[0], want[0])),
            "y_differ": float(np.mean(got[0] != want[0])),
            "routes_equal": bool(np.array_equal(got[1], want[1]) and np.array_equal(got[2], want[2])),
            "pattern": patterns[0] if patterns else None,
            "kernel_traces": len(kernel_traces),
        }
expert_kernel.expert_matmul = _kernel
out["seconds"]["moe_kernel"] = time.process_time() - t0


def place(state, args, mesh):
    specs = shd.state_partition_specs(args, mesh)

    def put(path, x):
        keys = [k for k in path if not isinstance(k, jax.tree_util.GetAttrKey)]
        return jax.device_put(x, NamedSharding(mesh, specs[".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys)]))

    return jax.tree_util.tree_map_with_path(put, state)


def generate(graphdef, state, args, ids, tt, mesh):
    # prefill then greedy decode steps; fresh jit wrappers per run, traced under the mesh
    prefill = jax.jit(lambda st, ids, tt, c: nnx.merge(graphdef, st).prefill(ids, None, c, tt))
    decode = jax.jit(lambda st, tok, pos, c: nnx.merge(graphdef, st).decode_step(tok, pos, c))
    cache = init_cache(args, ids.shape[0], 128)
    if mesh is not None:
        rows = NamedSharding(mesh, P("data"))  # batch rows (and every cache array's dim 0) over data
        state, cache, ids = place(state, args, mesh), jax.device_put(cache, rows), jax.device_put(ids, rows)
        tt = None if tt is None else jax.device_put(tt, rows)
    logits_all, tokens = [], []
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        logits, cache = prefill(state, ids, tt, cache)
        pos = jnp.full((ids.shape[0],), ids.shape[1], jnp.int32)
        for _ in range(steps):
            logits_all.append(np.asarray(logits))
            tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            tokens.append(np.asarray(tok))
            logits, cache = decode(state, tok, pos, cache)
            pos = pos + 1
        logits_all.append(np.asarray(logits))
    return np.stack(logits_all), np.stack(tokens)


for path, model_mesh in golden:
    t0 = time.process_time()
    gs = GoldenSet(path)
    name = gs.name
    graphdef, state = nnx.split(load_model(gs))
    ids = jnp.asarray(gs["inputs.prompt"], jnp.int32)
    tt = None if gs.token_types() is None else jnp.asarray(gs.token_types())
    want_logits, want_tokens = generate(graphdef, state, gs.args, ids, tt, None)
    patterns.clear()
    logits, tokens = generate(graphdef, state, gs.args, ids, tt, shd.make_mesh(model_mesh, args=gs.args))
    out["model"][name] = {
        "logits_equal": bool(np.array_equal(bits(logits), bits(want_logits))),
        "logits_max_diff": float(np.abs(logits - want_logits).max()),
        "tokens_equal": bool(np.array_equal(tokens, want_tokens)),
        "patterns": sorted(set(patterns)),
        "moe_calls": len(patterns),
    }
    out["seconds"][name] = time.process_time() - t0
print("RESULTS " + json.dumps(out))
"""


def _results() -> dict:
    status, value = _run_child()
    assert status == "ok", value
    return value


@functools.cache
def start_child() -> Child:
    """The one subprocess for every multi-device case (tests/conftest.py starts it right after
    collection when one of its tests is selected)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    golden = [[str(p), _model_mesh(p)] for p in MODEL_SETS]
    payload = json.dumps([list(MESHES), golden, DECODE_STEPS])
    return Child([sys.executable, "-c", _CHILD, str(TESTS), payload], env, REPO)


@functools.cache
def _run_child() -> tuple[str, dict | str]:
    """The subprocess's results (its failure is kept too, not re-run per test)."""
    status, out, err = start_child().wait(timeout=900)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULTS ")]
    if status != 0 or not lines:
        return "failed", f"exit status {status}\n" + err[-4000:]
    return "ok", json.loads(lines[0][len("RESULTS "):])


# ------------------------------------------------------------------------- in-process (1 device)


def _mesh(data=1, expert=1, tensor=1) -> AbstractMesh:
    return AbstractMesh((data, expert, tensor), ("data", "expert", "tensor"))


def test_no_active_mesh_means_the_single_device_paths():
    assert ep.active_expert_mesh() is None


def test_tokens_split_over_data_when_it_divides_them_and_never_over_tensor():
    m = _mesh(data=2, expert=2, tensor=2)
    assert ep.token_axes(8, m, with_expert=False) == ("data",)
    assert ep.token_axes(8, m, with_expert=True) == ("data", "expert")
    assert ep.token_axes(3, m, with_expert=False) == ()  # 3 rows cannot split over data=2
    assert ep.token_axes(8, _mesh(expert=4, tensor=2), with_expert=True) == ("expert",)


def test_pattern_is_replicated_for_few_pairs_or_indivisible_tokens_and_all_to_all_for_many():
    m = _mesh(data=2, expert=4)
    assert ep.choose_pattern(2 * 32, 2, m, 64) == "replicated"  # 32 tokens per group: 64 pairs
    assert ep.choose_pattern(2 * 36, 2, m, 64) == "all_to_all"  # 36 per group: 72 pairs, 4 | 36
    assert ep.choose_pattern(2 * 33, 2, m, 64) == "replicated"  # 4 does not divide 33


def test_capacity_is_the_factor_times_the_mean_bucket_capped_at_the_worst_case():
    assert ep.capacity(t_d=16, k=6, n_local=48, x_size=8, capacity_factor=2.0) == 24  # ceil(2 * 96 / 8)
    assert ep.capacity(t_d=16, k=6, n_local=2, x_size=4, capacity_factor=4.0) == 32  # worst: 16 * min(6, 2)
    assert ep.capacity(t_d=1, k=2, n_local=1, x_size=8, capacity_factor=0.1) == 1


def test_expert_axis_that_does_not_divide_the_experts_is_refused():
    from dsv41_jax.moe import MoE

    moe = MoE(0, ModelArgs.tiny())  # 8 experts
    x = jax.numpy.zeros((4, moe.dim), jax.numpy.bfloat16)
    with pytest.raises(ValueError, match=r"expert axis \(3\) must divide the 8 routed experts"):
        ep.moe_forward(moe, x, mesh=_mesh(expert=3))
    with pytest.raises(ValueError, match="pattern"):
        ep.moe_forward(moe, x, mesh=_mesh(expert=2), pattern="ring")


# --------------------------------------------------------------------- 8 fake devices (subprocess)


@pytest.mark.slow
@pytest.mark.fake_devices
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("case", ["decode_auto", "prefill_auto", "prefill_replicated", "small_all_to_all",
                                  "skewed_multi_round"])
def test_expert_parallel_moe_is_bit_identical_to_one_device(mesh, case):
    r = _results()["moe"][f"{mesh} {case}"]
    assert r["routes_equal"], r
    assert r["y_equal"], r  # measured: bit-identical on every mesh and case
    want_pattern = {"decode_auto": "replicated", "prefill_replicated": "replicated"}.get(case, "all_to_all")
    assert r["pattern"] == want_pattern, r
    if case == "skewed_multi_round":
        assert r["rounds"] > 1, r  # the capacity is exceeded, so the pairs really went in several rounds


@pytest.mark.slow
@pytest.mark.fake_devices
@pytest.mark.parametrize("mesh", ["expert=8", "expert=4,data=2"])
@pytest.mark.parametrize("case", ["kernel_decode", "kernel_prefill"])
def test_expert_parallel_moe_runs_the_fp4_kernel_and_equals_one_device(mesh, case):
    """kernels="pallas" (interpret): each device's local tiles go through the fp4 kernel, and the
    result is the single-device kernel run's (measured: bit-identical)."""
    r = _results()["moe"][f"{mesh} {case}"]
    assert r["kernel_traces"] >= 2, r  # w1 with w3 (one call), w2 of the local experts
    assert r["pattern"] == {"kernel_decode": "replicated", "kernel_prefill": "all_to_all"}[case], r
    assert r["routes_equal"], r
    assert r["y_equal"], r


@pytest.mark.slow
@pytest.mark.fake_devices
@pytest.mark.parametrize("path", MODEL_SETS, ids=[p.name for p in MODEL_SETS])
def test_whole_model_prefill_and_greedy_decode_under_a_mesh_equal_one_device(path):
    r = _results()["model"][path.name]
    # prefill (all_to_all) and decode (replicated) both ran expert-parallel in every layer
    n_layers = ModelArgs.from_json(path / "config.json").n_layers
    assert r["patterns"] == ["all_to_all", "replicated"] and r["moe_calls"] == 2 * n_layers, r
    assert r["tokens_equal"], r
    assert r["logits_equal"], r  # measured: bit-identical (max |diff| 0)
