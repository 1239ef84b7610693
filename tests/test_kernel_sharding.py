"""Kernel calls on a mesh that splits `data` (`pallas_kernels._dispatch.split_batch`): each kernel
runs once per batch shard, on the shard's rows, with the single-device values.

A Pallas call is a custom call that the SPMD partitioner cannot split, so under plain jit on a
mesh it would gather its operands (a whole KV cache, for the attention) and compute the whole
batch on every device. The cases run in one subprocess on 8 CPU devices (this pytest process has
one), with the kernels in interpret mode, and record the shapes each kernel was traced with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

_CHILD = r"""
import contextlib, json, logging, sys
import jax, jax.numpy as jnp, ml_dtypes, numpy as np
from jax.sharding import PartitionSpec as P

sys.path.insert(0, sys.argv[1])
from test_moe import MOE_ARGS, random_moe, unit_inputs
from dsv41_jax import expert_parallel as ep, quant
from dsv41_jax.sharding import make_mesh
from pallas_kernels.expert_matmul import api as em_api, kernel_gpu as em_gpu
from pallas_kernels.fp8_matmul import api as fp8_api, kernel_gpu as fp8_gpu
from pallas_kernels.sinkhorn import api as sk_api, kernel_gpu as sk_gpu
from pallas_kernels.sparse_attention import api as attn_api, kernel_gpu as attn_gpu

seen = []  # leading dim of the first operand of every kernel trace


def spy(module, name):
    original = getattr(module, name)

    def traced(*a, **kw):
        seen.append(int(a[0].shape[0]))
        return original(*a, **kw)

    setattr(module, name, traced)


for module, name in ((attn_gpu, "sparse_attn"), (sk_gpu, "hc_split_sinkhorn"), (fp8_gpu, "fp8_matmul_many"),
                     (em_gpu, "expert_matmul")):
    spy(module, name)
warnings = []
logging.getLogger("pallas_kernels._dispatch").addHandler(
    type("H", (logging.Handler,), {"emit": lambda self, r: warnings.append(r.getMessage())})())
rng = np.random.default_rng(0)
bf = lambda shape: jnp.asarray(rng.standard_normal(shape).astype(ml_dtypes.bfloat16))
kw = dict(implementation="pallas", interpret=True)


def attn_inputs(b):
    idx = jnp.asarray(rng.integers(-1, 48, (b, 1, 20)), jnp.int32)
    return bf((b, 1, 16, 64)), bf((b, 48, 64)), jnp.asarray(rng.uniform(0.5, 3, 16), jnp.float32), idx


def sk_inputs(b):
    return (jnp.asarray(rng.standard_normal((b, 3, 24)), jnp.float32), jnp.asarray([0.6, 0.5, 0.8], jnp.float32),
            jnp.asarray(rng.standard_normal(24), jnp.float32))


def fp8_inputs(b):
    w = rng.integers(0, 256, (64, 128), dtype=np.uint8)
    w = np.where((w & 0x7F) == 0x7F, w ^ 0x40, w).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
    s = rng.integers(118, 124, (2, 4), dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)
    return bf((b, 2, 128)), jnp.asarray(w), jnp.asarray(s)


def gather_inputs(b):
    x = quant.act_quant_dequant(jnp.asarray(rng.standard_normal((3 * b, 128)), jnp.float32)).astype(jnp.bfloat16)
    w = jnp.asarray(rng.integers(-128, 128, (4, 64, 64), dtype=np.int8))
    s = jnp.asarray(rng.integers(118, 124, (4, 64, 4), dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu))
    return x, w, s, jnp.asarray(rng.integers(0, 4, 3 * b), jnp.int32)


calls = {  # name: (inputs, call, which inputs are batched)
    "sparse_attn": (attn_inputs, lambda q, kv, sink, idx: attn_api.sparse_attn(q, kv, sink, idx, 0.125,
                                                                                accumulate="f32", **kw),
                    (1, 1, 0, 1)),
    # the token layout: in interpret mode XLA:CPU compiles the lane layout's exp and multiply-adds
    # differently inside the shard_map than outside (FMA contraction: 1-ulp differences in up to
    # 180 of 384 comb values, measured), which says nothing of the split; the dispatch is the same
    "hc_split_sinkhorn": (sk_inputs, lambda m, sc, ba: sk_api.hc_split_sinkhorn(
        m, sc, ba, hc=4, iters=20, eps=1e-6, block_sizes=sk_api.BlockSizes(lanes=False), **kw), (1, 0, 0)),
    "fp8_linear": (fp8_inputs, lambda x, w, s: fp8_api.linear(x, w, s, **kw), (1, 0, 0)),
    "gather_matmul": (gather_inputs, lambda x, w, s, e: em_api.gather_matmul(x, w, s, e, **kw), (1, 0, 0, 1)),
}
mesh = make_mesh({"data": 4, "expert": 2})
out = {}


def run(f, args, ctx):
    seen.clear()
    warnings.clear()
    with ctx:
        y = jax.jit(f)(*args)
    return [np.asarray(a, np.float32).view(np.uint32).tolist() for a in jax.tree.leaves(y)], list(seen), list(warnings)


for name, (make, f, batched) in calls.items():
    args = make(8)
    one, shapes_one, _ = run(f, args, contextlib.nullcontext())
    split, shapes_mesh, _ = run(f, args, jax.set_mesh(mesh))
    odd_args = make(6)  # 6 rows: data = 4 does not divide them
    _, shapes_odd, warned_odd = run(f, odd_args, jax.set_mesh(mesh))
    # inside a shard_map that made `data` manual: the call is local already (no second split)
    specs = tuple(P("data") if b else P() for b in batched)
    inner = jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=P("data"), check_vma=False)
    nested, shapes_nested, _ = run(inner, args, jax.set_mesh(mesh))
    out[name] = dict(equal=one == split, nested_equal=one == nested, shapes_one=shapes_one, shapes_mesh=shapes_mesh,
                     shapes_odd=shapes_odd, warned_odd=bool(warned_odd),
                     shapes_nested=shapes_nested)

# the MoE on a data-only mesh: one shard_map (tokens split over data), the kernels per shard
forward_calls = []
_forward = ep.moe_forward
ep.moe_forward = lambda *a, **k: forward_calls.append(1) or _forward(*a, **k)
m = random_moe(MOE_ARGS.replace(kernels="pallas", kernels_interpret=True), seed=7, tile_rows=8)
x = jnp.asarray(unit_inputs(3, (8, 2, MOE_ARGS.dim)), jnp.bfloat16)
f = lambda x: m(x)[0]
one, shapes_one, _ = run(f, (x,), contextlib.nullcontext())
split, shapes_mesh, _ = run(f, (x,), jax.set_mesh(make_mesh({"data": 8})))
out["moe_data8"] = dict(equal=one == split, forward_calls=len(forward_calls), shapes_one=shapes_one,
                        shapes_mesh=shapes_mesh)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(TESTS)], capture_output=True, text=True, env=env,
                          timeout=600, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


KERNELS = {  # name -> rows of the first kernel operand per 8-row batch (attention / Sinkhorn: batch or tokens)
    "sparse_attn": 8, "hc_split_sinkhorn": 24, "fp8_linear": 16, "gather_matmul": 24 + 15}


@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_runs_per_data_shard_with_the_single_device_values(results, name):
    r = results[name]
    assert r["equal"], name
    one = KERNELS[name]
    # data = 4: a quarter of the rows per trace (the gather kernel pads 15 rows to its 16-row tile)
    local = (one - 15) // 4 + 15 if name == "gather_matmul" else one // 4
    assert set(r["shapes_one"]) == {one} and set(r["shapes_mesh"]) == {local}, r


@pytest.mark.parametrize("name", list(KERNELS))
def test_indivisible_batch_runs_whole_and_warns(results, name):
    r = results[name]
    one = KERNELS[name] * 6 // 8 if name != "gather_matmul" else 18 + 15
    assert r["warned_odd"] and set(r["shapes_odd"]) == {one}, r


@pytest.mark.parametrize("name", list(KERNELS))
def test_inside_a_data_manual_shard_map_the_call_is_not_split_again(results, name):
    r = results[name]
    assert r["nested_equal"] and set(r["shapes_nested"]) == set(r["shapes_mesh"]), r


def test_moe_on_a_data_only_mesh_is_one_shard_map_with_the_single_device_values(results):
    r = results["moe_data8"]
    assert r["equal"] and r["forward_calls"] == 1, r
    # 16 tokens x top-3 = 48 pairs on one device; 2 tokens (6 pairs) per device of data = 8
    assert r["shapes_one"] and r["shapes_mesh"] and max(r["shapes_mesh"]) < max(r["shapes_one"]), r
