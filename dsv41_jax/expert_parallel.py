"""The MoE under expert parallelism: one `jax.shard_map` whose `expert` axis splits the experts.

The stacked routed experts (`experts.w{1,2,3}.{weight,scale}` [E, ...]) are split over the
`expert` mesh axis by the rules of `dsv41_jax.sharding`: device x of that axis owns the E_loc =
E / X experts [x * E_loc, (x + 1) * E_loc), whole, as the reference's ranks do. `moe_forward`
is `MoE.__call__` on such a mesh: Gate (replicated weights), quantised input, routed experts,
shared expert and `moe.combine` (ascending expert id in fp32, then the shared expert, one bf16
cast) all run inside one shard_map, so the partitioner cannot re-split the router's or the
shared expert's GEMMs along their output columns (which changes their fp32 rounding: it did,
for the router, before the Gate moved inside).

Exactness. Each (token, expert) pair's output is computed by exactly one device, from the same
bf16 operands, through `Experts.dense` / `Experts.ffn` (the single-device rounding points), and
combined on the device that owns the token. The only cross-device sum (the `psum` of the
replicated pattern) adds one real output to exact zeros, which is exact in any order; no partial
fp32 sums are ever added across devices. So the MoE output equals the single-device one bit for
bit, provided the backend's GEMMs round a row the same whatever the number of rows in the call
(XLA:CPU: true for 2+ rows; a 1-row call takes the matrix-vector kernel, which rounds
differently, so a decode batch split down to one row per device can differ from a batch run on
one device, in attention as much as here). No pair is ever dropped.

Token layout. Tokens are split over `data` when it divides the token count (attention runs
data-parallel, so the tokens are already there); `tensor` devices are replicas. The devices along
`expert` with the same (data, tensor) coordinates form one expert-parallel group holding all E
experts; a group serves T_g tokens, R_g = T_g * k pairs.

Two communication patterns, chosen statically from the token count (`choose_pattern`). Bytes
per device and MoE layer for the released config (d = 5120, k = 6, E = 384) on X = 8
(E_loc = 48); a pair row is 2d = 10 KiB of bf16:

  * "replicated" (decode: R_g <= gather_max_pairs, or X does not divide T_g). Every device of
    the group holds the group's T_g tokens (the MoE input is replicated over `expert`: nothing
    to send), routes them, computes only the pairs whose expert it owns, and the group `psum`s
    the bf16 [R_g, d] pair outputs, each non-zero on one device only; then each device
    combines all T_g tokens. One all-reduce of R_g * 2d bytes: a decode batch of 8 rows per
    group is 48 pairs = 480 KiB (a ring moves 2 (X-1)/X of it). Latency-bound: one collective,
    no capacity question (a device's local pairs are at most R_g), any batch size.

  * "all_to_all" (prefill). Tokens are split over `expert` too (T_d = T_g / X per device,
    R_d = T_d * k pairs); each device routes its own T_d tokens, buckets the pairs by owning
    device and sends them with `lax.all_to_all`: per round an [X, C] block (quantised token row
    2d bytes + routing weight 4 + local expert id 4); the owner computes what it received,
    grouped by expert; a second all_to_all returns the bf16 outputs [X, C, d]; the shared
    expert and the combine run on the T_d own tokens; an all_gather over `expert` returns the
    group's T_g rows of y. C = ceil(capacity_factor * R_d / X) (factor 2 by default); a bucket
    larger than C goes over several rounds (a while loop whose trip count is the max over all
    devices of ceil(bucket / C)), so nothing is dropped and a balanced routing takes one round;
    C is capped at the worst case T_d * min(k, E_loc), which always fits in one round.
    4096 tokens per group: T_d = 512, R_d = 3072, C = 768, so one round sends 6144 rows
    (63 MB) and receives as many back (63 MB), then the all_gather of y 42 MB: ~170 MB,
    against ~440 MB for the replicated pattern (the ring all-reduce of R_g * 2d = 252 MB),
    which would also hold and sort all R_g pairs on every device.
    `lax.ragged_all_to_all` would send exactly R_d rows, but XLA:CPU (jax 0.10.2) does not
    implement it ("HLO opcode ragged-all-to-all is not supported by XLA:CPU"), so the port uses
    dense capacity rounds, which run on every backend.

The threshold is `MoE.gather_max_pairs` (64 pairs per group, the single-device gather / grouped
threshold): below it the replicated pattern's single small all-reduce beats two all_to_alls plus
an all_gather on latency, and it needs no divisibility of the batch by X. Measured on 8 fake CPU
devices (one 2-core host, so only the relative order means anything; dim 64, 8 experts, top-3,
ms per MoE call, replicated / all_to_all, one device for scale): 8 tokens: expert=8 2.1 / 2.6,
expert=4,data=2 2.7 / 3.3 (one device 3.2); 512 tokens: 9.9 / 9.5 and 8.0 / 6.3 (8.9); 2048
tokens: 67 / 18.5 and 23.6 / 15.7 (30.7).

Local compute (both patterns): `Experts.grouped`, the single-device grouped path, over the local
experts: the device's pairs sorted by local expert id and cut into tiles of one expert each, a
local expert's packed bytes read once per tile it fills and never when no pair picked it; with
the fp4 kernel (`ModelArgs.kernels`, as on one device) the tiles go through
`expert_matmul.grouped_matmul` inside the shard_map, otherwise the jnp scan over tiles of
`MoE.tile_rows` rows. (Checked in Pallas interpret mode on 8 CPU devices; not yet run on several
GPUs.)

Mesh discovery (the contract with `MoE.__call__`): `active_expert_mesh()` reads
`jax.sharding.get_abstract_mesh()`, which `jax.set_mesh(mesh)` sets, in jax 0.10.2 and 0.11.2
(`jax.sharding.use_mesh` does not exist in 0.10.2: use `jax.set_mesh`). The path is taken when
that mesh has an `expert` or a `data` axis of size > 1 (data only: each device keeps every
expert and routes its own tokens). The shard_map is `jax.shard_map` (both versions)
over that mesh.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from dsv41_jax.sharding import MESH_AXES

__all__ = ["EPPattern", "active_expert_mesh", "capacity", "choose_pattern", "moe_forward", "token_axes"]

EPPattern = Literal["auto", "replicated", "all_to_all"]

_F32 = jnp.float32
_BF16 = jnp.bfloat16
_EXPERT = "expert"


def active_expert_mesh():
    """The active mesh (`jax.set_mesh`) when its `expert` or `data` axis is > 1, else None.

    A data-only mesh takes the shard_mapped MoE too (every device holds all experts): the fp4
    kernel is a custom call the partitioner cannot split by tokens, so under plain jit each
    device would run the whole batch's experts."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.manual_axes:
        return None
    if dict(mesh.shape).get(_EXPERT, 1) <= 1 and dict(mesh.shape).get("data", 1) <= 1:
        return None
    missing = [a for a in MESH_AXES if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"expert-parallel MoE: the active mesh has axes {mesh.axis_names}, expected all of {MESH_AXES} "
            f"(missing {missing}); build it with dsv41_jax.sharding.make_mesh"
        )
    return mesh


def token_axes(n_tokens: int, mesh, *, with_expert: bool) -> tuple[str, ...]:
    """The mesh axes that split the token dim inside the shard_map: `data` when it divides
    n_tokens (the data-parallel layout of the attention around the MoE), then `expert` when
    with_expert. `tensor` (no default rule uses it) holds replicas: splitting tokens over it
    would make the partitioner re-split the neighbouring attention by rows as well, which
    changes its rounding (measured on the tiny-c golden set)."""
    sizes = dict(mesh.shape)
    axes: list[str] = []
    if sizes["data"] > 1 and n_tokens % sizes["data"] == 0:
        axes.append("data")
    if with_expert:
        axes.append(_EXPERT)
    return tuple(axes)


def choose_pattern(n_tokens: int, topk: int, mesh, gather_max_pairs: int) -> str:
    """"replicated" for few pairs per expert group (or tokens that X does not divide), else
    "all_to_all" (see the module docstring)."""
    sizes = dict(mesh.shape)
    groups = math.prod(sizes[a] for a in token_axes(n_tokens, mesh, with_expert=False))
    t_g = n_tokens // groups
    if t_g * topk <= gather_max_pairs or t_g % sizes[_EXPERT]:
        return "replicated"
    return "all_to_all"


def capacity(t_d: int, k: int, n_local: int, x_size: int, capacity_factor: float) -> int:
    """Pairs per (source, owner) and all_to_all round: ceil(factor * R_d / X), at least 1, at
    most the worst case t_d * min(k, n_local) (a token has at most that many pairs on one device)."""
    worst = t_d * min(k, n_local)
    return max(1, min(worst, math.ceil(capacity_factor * t_d * k / x_size)))


def moe_forward(moe, x: jax.Array, image_mask: jax.Array | None = None, *, mesh=None,
                pattern: EPPattern = "auto", capacity_factor: float = 2.0):
    """`MoE.__call__` with the routed experts split over the mesh's `expert` axis.

    moe: a `moe.MoE` (its stacked experts sharded over `expert` or not: the shard_map splits
    them); x bf16 [N, dim]; image_mask bool [N] or None; mesh: Mesh / AbstractMesh with axes
    MESH_AXES (default: the active one). Returns (y bf16 [N, dim], weights f32 [N, k], indices
    int32 [N, k]), the single-device values.

    The whole MoE is one shard_map: tokens split over `token_axes` (data), the Gate and
    the shared expert replicated; so the partitioner never re-splits the router or the shared
    expert's GEMMs along their output columns, which would change their fp32 rounding.
    """
    from dsv41_jax.moe import _quantise_input, combine  # moe imports this module

    mesh = active_expert_mesh() if mesh is None else mesh
    if mesh is None:
        raise ValueError("moe_forward: no mesh given and no active mesh with an 'expert' axis > 1 (jax.set_mesh)")
    n, dim = x.shape
    k, n_exp = moe.topk, moe.n_experts
    x_size = dict(mesh.shape)[_EXPERT]
    if n_exp % x_size:
        raise ValueError(
            f"expert-parallel MoE (layer {moe.layer_id}): the mesh's expert axis ({x_size}) must divide the "
            f"{n_exp} routed experts (each device keeps whole experts)"
        )
    if pattern == "auto":
        pattern = choose_pattern(n, k, mesh, moe.gather_max_pairs)
    if pattern not in ("replicated", "all_to_all"):
        raise ValueError(f"expert-parallel pattern must be 'auto', 'replicated' or 'all_to_all', got {pattern!r}")
    n_local = n_exp // x_size
    tok = token_axes(n, mesh, with_expert=False)
    t_g = n // math.prod(dict(mesh.shape)[a] for a in tok)  # tokens of one expert group
    if pattern == "all_to_all" and t_g % x_size:
        raise ValueError(
            f"expert-parallel all_to_all pattern (layer {moe.layer_id}): {t_g} tokens per expert group do not "
            f"split over the expert axis ({x_size}); use pattern='replicated'"
        )
    t_d = t_g // x_size
    cap = capacity(t_d, k, n_local, x_size, capacity_factor)
    tile_rows = moe.tile_rows
    graphdef, state = nnx.split(moe)
    state_specs = jax.tree_util.tree_map_with_path(
        lambda path, _: P(_EXPERT) if any(getattr(q, "key", None) == "experts" for q in path) else P(), state)

    def body(state, x, mask):
        m = nnx.merge(graphdef, state)
        if pattern == "all_to_all":
            # this device's share of the group's tokens; the group's rows come back by all_gather
            me = jax.lax.axis_index(_EXPERT)
            x = jax.lax.dynamic_slice_in_dim(x, me * t_d, t_d)
            mask = None if mask is None else jax.lax.dynamic_slice_in_dim(mask, me * t_d, t_d)
        weights, indices = m.gate(x, mask)
        xq = _quantise_input(x, m.experts.dtype)
        if pattern == "replicated":
            idx = indices.reshape(-1)
            mine = idx // n_local == jax.lax.axis_index(_EXPERT)
            e_loc = jnp.where(mine, idx % n_local, n_local)  # n_local marks another device's pair
            pair_token = jnp.arange(idx.shape[0], dtype=jnp.int32) // k
            out = m.experts.grouped(xq, pair_token, weights.reshape(-1), e_loc, n_local, tile_rows)
            # one device holds each pair's output, the others exact zeros: the sum is exact
            pair_out = jax.lax.psum(out, _EXPERT)
        else:
            pair_out = _all_to_all_pairs(m.experts, xq, weights, indices, n_local, x_size, cap, tile_rows)
        y = combine(pair_out.reshape(-1, k, dim), indices, m.shared_experts(x))
        if pattern == "all_to_all":
            y, weights, indices = (jax.lax.all_gather(a, _EXPERT, axis=0, tiled=True) for a in (y, weights, indices))
        return y, weights, indices

    spec = P(tok if tok else None)
    args = (state, x) if image_mask is None else (state, x, image_mask)
    # check_vma off: the scan / cond carries start as constants that the checker would need
    # marked per device (an API that differs between jax versions); the specs above are exact
    fn = jax.shard_map(lambda st, x, mask=None: body(st, x, mask), mesh=mesh,
                       in_specs=(state_specs,) + (spec,) * (len(args) - 1), out_specs=(spec, spec, spec),
                       check_vma=False)
    return fn(*args)


def _all_to_all_pairs(experts, xq, weights, indices, n_local: int, x_size: int, cap: int, tile_rows: int):
    """One device's tokens xq [T, dim], weights / indices [T, k] -> bf16 [T * k, dim] pair outputs,
    each pair sent to its expert's owner in rounds of at most `cap` pairs per (source, owner)."""
    t, k = indices.shape
    dim = xq.shape[-1]
    idx = indices.reshape(-1)
    owner = idx // n_local
    onehot = (owner[:, None] == jnp.arange(x_size)[None, :]).astype(jnp.int32)  # [R, X]
    rank = jnp.take_along_axis(jnp.cumsum(onehot, axis=0), owner[:, None], axis=1)[:, 0] - 1  # within its bucket
    n_rounds = (jnp.max(jnp.sum(onehot, axis=0)) + cap - 1) // cap
    n_rounds = jax.lax.pmax(n_rounds, MESH_AXES)  # the same trip count everywhere (collectives inside)
    x_pairs = jnp.repeat(xq, k, axis=0)
    w_pairs = weights.reshape(-1)
    e_pairs = idx % n_local
    slots = x_size * cap

    def one_round(r, out):
        sel = rank // cap == r
        dest = jnp.where(sel, owner * cap + rank - r * cap, slots)  # slots: not sent this round
        send_x = jnp.zeros((slots, dim), xq.dtype).at[dest].set(x_pairs, mode="drop")
        send_w = jnp.zeros((slots,), _F32).at[dest].set(w_pairs, mode="drop")
        send_e = jnp.full((slots,), n_local, jnp.int32).at[dest].set(e_pairs, mode="drop")
        recv = [jax.lax.all_to_all(a, _EXPERT, 0, 0, tiled=True) for a in (send_x, send_w, send_e)]
        y = experts.grouped(recv[0], jnp.arange(slots, dtype=jnp.int32), recv[1], recv[2], n_local, tile_rows)
        back = jax.lax.all_to_all(y, _EXPERT, 0, 0, tiled=True)  # row owner * cap + slot = my pair's output
        return jnp.where(sel[:, None], jnp.take(back, jnp.minimum(dest, slots - 1), axis=0), out)

    out0 = jnp.zeros((t * k, dim), _BF16)
    return jax.lax.fori_loop(0, n_rounds, one_round, out0)
