"""Mesh axes and the one rules table that places every parameter (and later cache) on a mesh.

Three mesh axes, always present (size 1 when unused), in this order (outer to inner, so `tensor`
lands on the closest devices): `data` (batch / data-parallel replicas), `expert` (expert
parallelism) and `tensor` (tensor parallelism; no default rule uses it yet).

Every array carries *logical* axis names, one per dim (`PARAM_AXES` for parameters, e.g. a routed
expert's w1 is ("experts", "mlp", "embed")). `Rules` maps logical names to mesh axes; a logical
name without a rule is replicated. A new layout is an edit of `DEFAULT_RULES`, nothing else.

Default layout (`DEFAULT_RULES`):
  * routed experts, stacked on a leading axis: "experts" -> `expert` (each device keeps whole
    experts, as the reference's ranks do);
  * Engram tables `engram.embed.{weight,scale}`: rows ("engram_rows") -> (`expert`, `data`,
    `tensor`), i.e. over every device. The two released tables are 203 GB of the 510 GB checkpoint
    but are read at only n_hash_cols rows per token and layer, so their cost is memory, not
    bandwidth: spreading them over all devices (instead of keeping a copy per data replica)
    is what lets them fit;
  * "batch" -> `data` for activations and caches;
  * everything else (attention, norms, router, shared expert, embedding, head) replicated:
    attention runs data-parallel and heads are not split.

Caches and activations carry logical axes too (`CACHE_AXES`, `ACTIVATION_AXES`): every array of
`dsv41_jax.cache.init_cache` has "batch" first, so a cache is split over `data` by rows and each
data replica holds the whole sequence of its rows (windows, compressed rows, Engram history).
`cache_shardings` gives the NamedSharding tree of a cache for a mesh, used to create it sharded
(jit with out_shardings); `activation_sharding` the one of a generation input or output.

A dim whose size the rule's mesh axes do not divide keeps the longest prefix of those axes that
does divide it (possibly none: replicated) and logs a warning naming the array; `strict=True`
raises instead. (The released Engram table of layer 14 has 384,016,682 = 2 x prime rows, so it
cannot be split 4 or 8 ways as shipped: dsv41-convert pads every table's rows to a multiple of the
split on the requested mesh, `ModelArgs.engram_rows_multiple`, so the rule applies in full.)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dsv41_jax.config import ModelArgs

__all__ = [
    "ACTIVATION_AXES",
    "CACHE_AXES",
    "DEFAULT_RULES",
    "MESH_AXES",
    "PARAM_AXES",
    "Rules",
    "ShardingError",
    "activation_sharding",
    "cache_partition_specs",
    "cache_path",
    "cache_shardings",
    "check_mesh_sizes",
    "default_mesh_spec",
    "format_mesh_spec",
    "logical_to_spec",
    "make_mesh",
    "mesh_axis_sizes",
    "named_shardings",
    "param_logical_axes",
    "param_partition_specs",
    "parse_mesh_spec",
    "specs_from_json",
    "specs_to_json",
    "state_logical_axes",
    "state_partition_specs",
    "state_shapes",
]

log = logging.getLogger(__name__)

MESH_AXES: tuple[str, ...] = ("data", "expert", "tensor")

MeshAxes = str | tuple[str, ...] | None

# Parameter path pattern -> logical axis names of its dims. Paths are module paths joined by '.',
# e.g. `layers.3.ffn.experts.w1.weight`; the first matching row wins, and every parameter must
# match one row. A quantised Linear's `.scale` has the weight's axes (its dims count 32-blocks).
PARAM_AXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"^embed\.weight$", ("vocab", "embed")),
    (r"^head\.weight$", ("vocab", "embed")),
    (r"^norm\.weight$", ("embed",)),
    (r"\.(attn|ffn)_norm\.weight$", ("embed",)),
    (r"\.hc_(attn|ffn)_fn$", ("hc_mix", "hc_embed")),
    (r"\.hc_(attn|ffn)_base$", ("hc_mix",)),
    (r"\.hc_(attn|ffn)_scale$", ("hc_scale",)),
    (r"\.attn\.attn_sink$", ("heads",)),
    (r"\.attn\.q_norm\.weight$", ("q_lora",)),
    (r"\.attn\.kv_norm\.weight$", ("kv",)),
    (r"\.attn\.wq_a\.(weight|scale)$", ("q_lora", "embed")),
    (r"\.attn\.wq_b\.(weight|scale)$", ("q_heads", "q_lora")),
    (r"\.attn\.wkv\.(weight|scale)$", ("kv", "embed")),
    (r"\.attn\.wo_a\.(weight|scale)$", ("o_groups", "o_group_in")),
    (r"\.attn\.wo_b\.(weight|scale)$", ("embed", "o_groups")),
    (r"\.attn\.compressor\.(wkv|wgate)\.weight$", ("kv", "embed")),
    (r"\.attn\.compressor\.norm\.weight$", ("kv",)),
    (r"\.attn\.indexer\.wk\.weight$", ("index_dim", "kv")),
    (r"\.attn\.indexer\.k_norm\.weight$", ("index_dim",)),
    (r"\.attn\.indexer\.wq_b\.(weight|scale)$", ("index_q", "q_lora")),
    (r"\.attn\.indexer\.weights_proj\.weight$", ("index_heads", "embed")),
    (r"\.ffn\.gate\.weight$", ("router", "embed")),
    (r"\.ffn\.gate\.(bias|bias_vl)$", ("router",)),
    (r"\.ffn\.shared_experts\.w[13]\.(weight|scale)$", ("mlp", "embed")),
    (r"\.ffn\.shared_experts\.w2\.(weight|scale)$", ("embed", "mlp")),
    (r"\.ffn\.experts\.w[13]\.(weight|scale)$", ("experts", "mlp", "embed")),
    (r"\.ffn\.experts\.w2\.(weight|scale)$", ("experts", "embed", "mlp")),
    (r"\.engram\.(q_weight|k_weight)$", ("hc", "embed")),
    (r"\.engram\.wkv\.(weight|scale)$", ("engram_kv", "engram_cols")),
    (r"\.engram\.embed\.(weight|scale)$", ("engram_rows", "engram_dim")),
)
_PARAM_AXES_RE = tuple((re.compile(p), axes) for p, axes in PARAM_AXES)

# Non-parameter state of the model (input artifacts) -> logical axes.
_STATE_AXES: dict[str, tuple[str, ...]] = {"token_map": ("raw_vocab",)}

# Cache arrays (dsv41_jax/cache.py, keyed by the leaf's name in the cache dict) -> logical axes.
CACHE_AXES: dict[str, tuple[str, ...]] = {
    "seq_len": ("batch",),                                      # int32 [B]
    "window_kv": ("batch", "cache_window", "kv"),               # bf16 [B, window, hd]
    "compress_kv": ("batch", "cache_rows", "kv"),               # bf16 [B, T // r, hd]
    "index_k": ("batch", "cache_rows", "index_dim"),            # bf16 [B, T // r, ihd]
    "kv_state": ("batch", "compress_slot", "kv"),               # f32 [B, r, hd]
    "score_state": ("batch", "compress_slot", "kv"),            # f32 [B, r, hd]
    "engram_history": ("batch", "cache_seq"),                   # int32 [B, T]
}

# Inputs and outputs of generation (dsv41_jax/generate.py) -> logical axes.
ACTIVATION_AXES: dict[str, tuple[str, ...]] = {
    "ids": ("batch", "seq"),        # int32 [B, S] right-padded prompts
    "lengths": ("batch",),          # int32 [B]
    "tokens": ("batch",),           # int32 [B] one token per row (decode input, sampled output)
    "pos": ("batch",),              # int32 [B]
    "done": ("batch",),             # bool [B] rows that have finished (decode input)
    "logits": ("batch", "vocab"),   # f32 [B, V]
}


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    if isinstance(axes, str):
        return (axes,)
    return tuple(axes)


class ShardingError(ValueError):
    """A mesh spec, rules table or array that cannot be laid out as asked."""


@dataclasses.dataclass(frozen=True)
class Rules:
    """Logical axis name -> mesh axes (one axis name, a tuple of them, or None = replicated).

    Construction validates: mesh axes must be among MESH_AXES, no logical name twice, no mesh
    axis twice within one rule. Whether two dims of one array land on the same mesh axis depends
    on the array, so `logical_to_spec` checks that for each array it lays out.
    """

    table: tuple[tuple[str, MeshAxes], ...]

    def __post_init__(self):
        seen: set[str] = set()
        for entry in self.table:
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)):
                raise ShardingError(f"sharding rule {entry!r}: expected (logical axis name, mesh axes)")
            name, axes = entry
            if name in seen:
                raise ShardingError(f"sharding rules list logical axis {name!r} twice; keep one rule per name")
            seen.add(name)
            axes_t = _as_tuple(axes)
            unknown = [a for a in axes_t if a not in MESH_AXES]
            if unknown:
                raise ShardingError(
                    f"sharding rule {name!r} -> {axes!r}: unknown mesh axes {unknown}; mesh axes are {list(MESH_AXES)}"
                )
            if len(set(axes_t)) != len(axes_t):
                raise ShardingError(f"sharding rule {name!r} -> {axes!r} repeats a mesh axis")

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        """The mesh axes a logical name is split over (empty: replicated)."""
        for name, axes in self.table:
            if name == logical:
                return _as_tuple(axes)
        return ()

    def replace(self, **changes: MeshAxes) -> Rules:
        """A copy with some logical names remapped (or added), e.g. `rules.replace(q_heads="tensor")`."""
        table = [(n, changes.pop(n) if n in changes else a) for n, a in self.table]
        return Rules(tuple(table) + tuple(changes.items()))


DEFAULT_RULES = Rules(
    (
        ("batch", "data"),
        ("experts", "expert"),
        ("engram_rows", ("expert", "data", "tensor")),
    )
)


# ------------------------------------------------------------------------------------------ mesh


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """"expert=8,data=1" -> {"data": 1, "expert": 8, "tensor": 1} (every axis, MESH_AXES order).

    Raises ShardingError naming the offending entry for bad syntax, an unknown or repeated axis,
    or a size that is not a positive integer.
    """
    sizes: dict[str, int] = {}
    entries = [e.strip() for e in str(spec).split(",") if e.strip()]
    if not entries:
        raise ShardingError(f"mesh spec {spec!r} is empty; expected e.g. 'expert=8,data=1' (axes {list(MESH_AXES)})")
    for entry in entries:
        name, sep, value = entry.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            raise ShardingError(f"mesh spec {spec!r}: entry {entry!r} is not AXIS=SIZE")
        if name not in MESH_AXES:
            raise ShardingError(f"mesh spec {spec!r}: unknown axis {name!r}; mesh axes are {list(MESH_AXES)}")
        if name in sizes:
            raise ShardingError(f"mesh spec {spec!r}: axis {name!r} given twice")
        if not value.isdigit() or int(value) < 1:
            raise ShardingError(f"mesh spec {spec!r}: size of axis {name!r} is {value!r}, expected a positive integer")
        sizes[name] = int(value)
    return {a: sizes.get(a, 1) for a in MESH_AXES}


def format_mesh_spec(sizes: Mapping[str, int]) -> str:
    """{"data": 1, "expert": 8, "tensor": 1} -> "data=1,expert=8,tensor=1" (canonical order)."""
    return ",".join(f"{a}={int(sizes.get(a, 1))}" for a in MESH_AXES)


def default_mesh_spec(n_devices: int, args: ModelArgs | None = None) -> str:
    """All devices split as expert = gcd(n_devices, n_routed_experts), the rest over data."""
    expert = math.gcd(n_devices, args.n_routed_experts) if args is not None else n_devices
    return format_mesh_spec({"data": n_devices // expert, "expert": expert})


def check_mesh_sizes(sizes: Mapping[str, int], args: ModelArgs) -> None:
    """Raises ShardingError if the expert axis does not divide the routed experts of `args`
    (each device keeps whole experts)."""
    experts = [args.n_routed_experts]
    if args.dspark_enabled:
        experts.append(args.dspark_n_routed_experts)
    for n in experts:
        if n % sizes.get("expert", 1):
            raise ShardingError(
                f"mesh {format_mesh_spec(sizes)}: the expert axis ({sizes['expert']}) must divide the number "
                f"of routed experts ({n}), since each device keeps whole experts"
            )


def make_mesh(spec: str | Mapping[str, int], *, args: ModelArgs | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A Mesh with axes MESH_AXES (Auto axis types) over `devices` (default `jax.devices()`).

    spec: "expert=8,data=1" or a {axis: size} mapping; missing axes have size 1.
    args: when given, the expert axis must divide the number of routed experts.
    Raises ShardingError when the sizes do not multiply to the device count or do not divide
    the experts.
    """
    sizes = parse_mesh_spec(spec) if isinstance(spec, str) else parse_mesh_spec(format_mesh_spec(spec))
    if args is not None:  # first: a mesh that cannot hold whole experts is wrong on any machine
        check_mesh_sizes(sizes, args)
    devices = list(jax.devices() if devices is None else devices)
    total = math.prod(sizes.values())
    if total != len(devices):
        hint = (
            " (on a CPU host, fake devices with XLA_FLAGS=--xla_force_host_platform_device_count=N set before jax starts)"
            if devices and devices[0].platform == "cpu" else ""
        )
        raise ShardingError(
            f"mesh {format_mesh_spec(sizes)} needs {total} devices, but {len(devices)} "
            f"{devices[0].platform if devices else ''} devices are available{hint}"
        )
    shape = tuple(sizes[a] for a in MESH_AXES)
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        # make_mesh refuses some shapes on some device topologies; keep the given device order then
        return Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES, axis_types=axis_types)


def mesh_axis_sizes(mesh: Mesh | Mapping[str, int]) -> dict[str, int]:
    """{axis: size} of a Mesh / AbstractMesh (its `.shape`) or a plain mapping."""
    shape = mesh.shape if hasattr(mesh, "shape") else mesh
    return {str(k): int(v) for k, v in dict(shape).items()}


# ---------------------------------------------------------------------------------------- specs


def logical_to_spec(logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh | Mapping[str, int],
                    rules: Rules = DEFAULT_RULES, *, name: str = "array", strict: bool = False) -> PartitionSpec:
    """PartitionSpec of one array from its logical axis names.

    logical: one name (or None) per dim; shape: the array's shape; mesh: a Mesh or {axis: size}.
    Raises ShardingError if the rank and the names disagree, if two dims would use the same mesh
    axis, or (strict) if a dim cannot be split as its rule asks; otherwise such a dim keeps the
    longest dividing prefix of its axes, with a warning.
    """
    if len(logical) != len(shape):
        raise ShardingError(f"{name}: {len(logical)} logical axes {tuple(logical)} for an array of shape {tuple(shape)}")
    sizes = mesh_axis_sizes(mesh)
    used: dict[str, int] = {}
    entries: list[MeshAxes] = []
    for dim, (lname, size) in enumerate(zip(logical, shape)):
        axes = rules.mesh_axes(lname)
        for a in axes:
            if a not in sizes:
                raise ShardingError(f"{name}: rule for {lname!r} uses mesh axis {a!r}, which the mesh {sizes} lacks")
            if a in used:
                raise ShardingError(
                    f"{name}: the sharding rules map dim {used[a]} ({logical[used[a]]!r}) and dim {dim} ({lname!r}) "
                    f"both to mesh axis {a!r}; a mesh axis can split only one dim of an array (edit the rules table)"
                )
            used[a] = dim
        kept = axes
        while kept and size % math.prod(sizes[a] for a in kept):
            kept = kept[:-1]
        if kept != axes:
            msg = (
                f"{name}: dim {dim} ({lname!r}, size {size}) is not divisible by mesh axes {axes} "
                f"(sizes {[sizes[a] for a in axes]})"
            )
            if strict:
                raise ShardingError(msg)
            log.warning("%s; %s", msg, f"splitting it over {kept} only" if kept else "leaving it replicated")
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*entries)


def _axes_for(path: str, table) -> tuple[str, ...]:
    for pattern, axes in table:
        if pattern.search(path):
            return axes
    raise ShardingError(
        f"parameter {path!r} has no logical axes: add a row for it to dsv41_jax.sharding.PARAM_AXES"
    )


def _abstract_state(args: ModelArgs, kind) -> dict[str, jax.ShapeDtypeStruct]:
    from flax import nnx

    from dsv41_jax.model import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(args))
    out = {}
    for path, node in nnx.iter_graph(abstract):
        if isinstance(node, kind):
            value = node.get_value()
            out[".".join(str(p) for p in path)] = jax.ShapeDtypeStruct(value.shape, value.dtype)
    return out


def state_shapes(args: ModelArgs) -> dict[str, jax.ShapeDtypeStruct]:
    """{path: abstract array} of every Variable of `Transformer(args)` (params and the Engram
    token map), from `nnx.eval_shape` (nothing allocated)."""
    from flax import nnx

    return _abstract_state(args, nnx.Variable)


def param_logical_axes(args: ModelArgs) -> dict[str, tuple[tuple[str, ...], jax.ShapeDtypeStruct]]:
    """{param path: (logical axes, abstract array)} for every nnx.Param of `Transformer(args)`."""
    from flax import nnx

    return {p: (_axes_for(p, _PARAM_AXES_RE), a) for p, a in _abstract_state(args, nnx.Param).items()}


def param_partition_specs(args: ModelArgs, mesh: Mesh | Mapping[str, int], rules: Rules = DEFAULT_RULES, *,
                          strict: bool = False) -> dict[str, PartitionSpec]:
    """{param path: PartitionSpec} for every parameter of `Transformer(args)`, built abstractly
    (`nnx.eval_shape`, nothing allocated). `mesh` may be a Mesh, an AbstractMesh or {axis: size}."""
    return {
        path: logical_to_spec(axes, a.shape, mesh, rules, name=path, strict=strict)
        for path, (axes, a) in param_logical_axes(args).items()
    }


def state_partition_specs(args: ModelArgs, mesh: Mesh | Mapping[str, int], rules: Rules = DEFAULT_RULES, *,
                          strict: bool = False) -> dict[str, PartitionSpec]:
    """Like `param_partition_specs` but for every Variable of the model (params and the Engram
    token map)."""
    return {
        path: logical_to_spec(axes, a.shape, mesh, rules, name=path, strict=strict)
        for path, (axes, a) in state_logical_axes(args).items()
    }


def state_logical_axes(args: ModelArgs) -> dict[str, tuple[tuple[str, ...], jax.ShapeDtypeStruct]]:
    """{path: (logical axes, abstract array)} for every Variable of `Transformer(args)`."""
    return {path: (_STATE_AXES.get(path) or _axes_for(path, _PARAM_AXES_RE), a)
            for path, a in state_shapes(args).items()}


def named_shardings(specs: Mapping[str, PartitionSpec], mesh: Mesh) -> dict[str, NamedSharding]:
    return {path: NamedSharding(mesh, spec) for path, spec in specs.items()}


# ------------------------------------------------------------------------- caches, activations


def _cache_leaf_name(path) -> str:
    key = path[-1]
    return str(getattr(key, "key", key))


def cache_path(path) -> str:
    """'layers.2.compress_kv' from a pytree path into a cache."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def cache_partition_specs(args: ModelArgs, batch: int, max_seq_len: int, mesh: Mesh | Mapping[str, int],
                          rules: Rules = DEFAULT_RULES, *, strict: bool = False) -> dict[str, PartitionSpec]:
    """{cache path: PartitionSpec} of `init_cache(args, batch, max_seq_len)` (paths like
    "layers.2.compress_kv"), from shapes only (`jax.eval_shape`). Raises ShardingError for a
    cache array without a row in CACHE_AXES."""
    return {cache_path(path): spec for path, spec in
            jax.tree_util.tree_flatten_with_path(_cache_spec_tree(args, batch, max_seq_len, mesh, rules, strict))[0]}


def _cache_spec_tree(args, batch, max_seq_len, mesh, rules, strict):
    from dsv41_jax.cache import init_cache

    shapes = jax.eval_shape(lambda: init_cache(args, batch, max_seq_len))

    def spec(path, a):
        name = _cache_leaf_name(path)
        if name not in CACHE_AXES:
            raise ShardingError(f"cache array {cache_path(path)!r} has no logical axes: add a row for "
                                f"{name!r} to dsv41_jax.sharding.CACHE_AXES")
        return logical_to_spec(CACHE_AXES[name], a.shape, mesh, rules, name=f"cache {cache_path(path)}",
                               strict=strict)

    return jax.tree_util.tree_map_with_path(spec, shapes)


def cache_shardings(args: ModelArgs, batch: int, max_seq_len: int, mesh: Mesh, rules: Rules = DEFAULT_RULES, *,
                    strict: bool = True):
    """NamedSharding tree with the structure of `init_cache(args, batch, max_seq_len)`, for
    creating the cache sharded (`jax.jit(init, out_shardings=...)`) and keeping it so.

    strict (default): raise ShardingError instead of replicating a dim the mesh cannot divide
    (a batch that is not a multiple of the `data` axis)."""
    specs = _cache_spec_tree(args, batch, max_seq_len, mesh, rules, strict)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


def activation_sharding(name: str, shape: Sequence[int], mesh: Mesh, rules: Rules = DEFAULT_RULES, *,
                        strict: bool = True) -> NamedSharding:
    """NamedSharding of a generation input/output named in ACTIVATION_AXES (e.g. "ids")."""
    if name not in ACTIVATION_AXES:
        raise ShardingError(f"activation {name!r} has no logical axes; known: {sorted(ACTIVATION_AXES)}")
    return NamedSharding(mesh, logical_to_spec(ACTIVATION_AXES[name], shape, mesh, rules, name=name, strict=strict))


# ------------------------------------------------------------------------------------ json form


def _entry_to_json(entry: Any) -> Any:
    if entry is None or isinstance(entry, str):
        return entry
    return list(entry)


def specs_to_json(specs: Mapping[str, PartitionSpec]) -> str:
    """Stable JSON text, one parameter per line: {path: [null | "axis" | ["axis", ...] per dim]},
    sorted by path."""
    rows = [f" {json.dumps(p)}: {json.dumps([_entry_to_json(e) for e in specs[p]])}" for p in sorted(specs)]
    return "{\n" + ",\n".join(rows) + "\n}\n"


def specs_from_json(text: str) -> dict[str, PartitionSpec]:
    data = json.loads(text)
    return {p: PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in entries)) for p, entries in data.items()}

