"""Restore a `dsv41-convert` output directory into a sharded `Transformer`.

Layout of a converted checkpoint (format "dsv41-orbax", version 1), written by `convert/`:

    OUT/manifest.json      groups (each with a SHA-256 over its files), per-parameter dtype / shape /
                           PartitionSpec, mesh, `engram_rows_multiple`, dropped names with reasons;
                           written last: its presence with "complete": true marks a finished run
    OUT/config.json        the model config (`ModelArgs.from_json`)
    OUT/engram_map.npy     raw -> compressed token map (configs with Engram layers)
    OUT/state/<group>/     one Orbax PyTree checkpoint per group; its tree is the group's slice of
                           `nnx.state(model, nnx.Param)` nested by module path
                           ({"layers": {"3": {"attn": {"wq_a": {"weight": ...}}}}})
    OUT/tables/<path>/     Engram tables (`layers.L.engram.embed.{weight,scale}`): zarr3 arrays
                           of the raw bytes (uint8, [rows, cols]), row-chunked, written chunk by
                           chunk with tensorstore (a table is up to 98 GB, more than a host
                           holds, and Orbax writes an array only from a whole in-memory jax.Array);
                           rows padded with zero rows to a multiple of `engram_rows_multiple`

Together the groups hold every parameter of the model exactly once. `load_converted` builds the
model abstractly (`nnx.eval_shape`) with the manifest's `engram_rows_multiple` (so its Engram
tables have the stored, padded row count), restores each array straight into its target sharding (Orbax
reads only each device's shard; tables are read per shard with tensorstore), so nothing is
materialised whole on one host or device beyond its shard.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from dsv41_jax import sharding as shd
from dsv41_jax.config import ModelArgs

__all__ = [
    "CONFIG_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "STATE_DIR",
    "TABLES_DIR",
    "TOKEN_MAP_FILE",
    "ConvertedCheckpointError",
    "converted_args",
    "flatten",
    "load_converted",
    "nest",
    "orbax_tree_metadata",
    "read_manifest",
    "table_spec",
]

FORMAT = "dsv41-orbax"
FORMAT_VERSION = 2  # 2: attn.wo_a kept fp8 with its scales (1 stored it widened to bf16)
MANIFEST_FILE = "manifest.json"
CONFIG_FILE = "config.json"
TOKEN_MAP_FILE = "engram_map.npy"
STATE_DIR = "state"
TABLES_DIR = "tables"

class ConvertedCheckpointError(ValueError):
    """A converted checkpoint directory that is incomplete, of another format, or not this model's."""


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of a *completed* conversion; raises ConvertedCheckpointError otherwise."""
    d = Path(directory)
    path = d / MANIFEST_FILE
    if not d.is_dir():
        raise ConvertedCheckpointError(f"converted checkpoint {d} does not exist")
    if not path.exists():
        raise ConvertedCheckpointError(
            f"{d} is not a completed dsv41-convert output: {MANIFEST_FILE} is missing (an interrupted run "
            "leaves OUT.partial; rerun dsv41-convert with --resume to finish it)"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConvertedCheckpointError(f"{path} is not valid JSON ({e})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise ConvertedCheckpointError(
            f"{path}: format {manifest.get('format')!r} version {manifest.get('version')!r}; this reader "
            f"understands {FORMAT!r} version {FORMAT_VERSION} (run dsv41-convert again to rewrite it)"
        )
    if manifest.get("complete") is not True:
        raise ConvertedCheckpointError(f"{path} does not mark the conversion complete")
    return manifest


# ---------------------------------------------------------------------------------- tree helpers


def nest(flat: Mapping[str, Any]) -> dict:
    """{"a.b.c": x} -> {"a": {"b": {"c": x}}} (the Orbax tree of a group)."""
    out: dict = {}
    for path, value in flat.items():
        node = out
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Inverse of `nest`."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def orbax_tree_metadata(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{param path: (shape, dtype)} of an Orbax PyTree checkpoint, from its metadata only."""
    import orbax.checkpoint as ocp

    meta = ocp.PyTreeCheckpointer().metadata(Path(path))
    tree = getattr(meta, "tree", None)
    if tree is None:
        tree = getattr(meta, "item_metadata", meta)
    return {p: (tuple(m.shape), np.dtype(m.dtype)) for p, m in flatten(tree).items()}


def table_spec(path: str | os.PathLike, *, create: dict | None = None) -> dict:
    """tensorstore spec of a table array (zarr3, local file); `create` = {"shape", "chunk_shape"}."""
    spec: dict = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(Path(path).resolve())}}
    if create is None:
        spec["open"] = True
    else:
        spec.update(create=True, delete_existing=True, metadata={
            "shape": list(create["shape"]),
            "data_type": "uint8",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(create["chunk_shape"])}},
        })
    return spec


def _byte_shape(shape: tuple[int, ...], dtype: np.dtype) -> tuple[int, ...]:
    return (*shape[:-1], shape[-1] * dtype.itemsize) if shape else shape


# ---------------------------------------------------------------------------------------- load


def _restore_orbax(path: Path, targets: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    import orbax.checkpoint as ocp

    stored = orbax_tree_metadata(path)
    wanted = {p: (tuple(t.shape), np.dtype(t.dtype)) for p, t in targets.items()}
    if stored != wanted:
        diff = sorted(p for p in stored.keys() | wanted.keys() if stored.get(p) != wanted.get(p))
        raise ConvertedCheckpointError(
            f"{path}: stored arrays differ from the model's: "
            + "; ".join(f"{p}: stored {stored.get(p)}, model {wanted.get(p)}" for p in diff[:10])
        )
    item = nest(targets)
    restored = ocp.PyTreeCheckpointer().restore(
        path, args=ocp.args.PyTreeRestore(item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item))
    )
    return flatten(restored)


def _restore_table(path: Path, target: jax.ShapeDtypeStruct) -> jax.Array:
    import tensorstore as ts

    dtype = np.dtype(target.dtype)
    arr = ts.open(table_spec(path)).result()
    if tuple(arr.shape) != _byte_shape(tuple(target.shape), dtype) or arr.dtype.numpy_dtype != np.uint8:
        raise ConvertedCheckpointError(
            f"table {path}: stored uint8 {tuple(arr.shape)}, expected the bytes of {dtype.name} {tuple(target.shape)}"
        )

    def read(index: tuple[slice, ...]) -> np.ndarray:
        rows = index[0] if index else slice(None)
        return arr[rows].read().result().view(dtype)[(slice(None), *index[1:])]

    return jax.make_array_from_callback(tuple(target.shape), target.sharding, read)


def converted_args(directory: str | os.PathLike, **arg_overrides) -> ModelArgs:
    """The `ModelArgs` of the model a converted checkpoint loads into: its config.json, the
    manifest's `engram_rows_multiple` (the stored table layout) and runtime `arg_overrides`.
    Raises ConvertedCheckpointError for an incomplete directory or an override of the layout."""
    d = Path(directory)
    manifest = read_manifest(d)
    multiple = manifest.get("engram_rows_multiple", 1)
    if arg_overrides.get("engram_rows_multiple", multiple) != multiple:
        raise ConvertedCheckpointError(
            f"{d}: its Engram tables are stored with rows padded to a multiple of {multiple} "
            f"({MANIFEST_FILE}: engram_rows_multiple); engram_rows_multiple="
            f"{arg_overrides['engram_rows_multiple']} cannot load them (convert again for another mesh)"
        )
    return ModelArgs.from_json(d / CONFIG_FILE, **{**arg_overrides, "engram_rows_multiple": multiple})


def load_converted(directory: str | os.PathLike, mesh: Mesh | None = None, *, rules: shd.Rules = shd.DEFAULT_RULES,
                   **arg_overrides) -> tuple[Any, ModelArgs]:
    """Restores a converted checkpoint as a `Transformer` whose arrays are laid out on `mesh`.

    mesh: default `make_mesh(default_mesh_spec(len(jax.devices()), args))`.
    arg_overrides: runtime fields of `ModelArgs` (e.g. max_seq_len, max_batch_size);
      `engram_rows_multiple` comes from the manifest (the stored layout) and cannot be changed.
    Returns (model, args), args with `fp4_scale_fold` and `fp4_relaid` resolved on the restored
    weights (`loading.resolve_fp4_options`). Raises ConvertedCheckpointError if the directory is
    incomplete, or its arrays do not match the model built from its config (CheckpointError for
    fp4_scale_fold="on" with a scale byte above 128).
    """
    from dsv41_jax.engram import prepare_token_map
    from dsv41_jax.loading import resolve_fp4_options
    from dsv41_jax.model import Transformer

    d = Path(directory)
    manifest = read_manifest(d)
    args = converted_args(d, **arg_overrides)
    if mesh is None:
        mesh = shd.make_mesh(shd.default_mesh_spec(len(jax.devices()), args), args=args)
    model = nnx.eval_shape(lambda: Transformer(args))
    variables = {
        ".".join(str(p) for p in path): node for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Variable)
    }
    specs = shd.state_partition_specs(args, mesh, rules)
    params = {p for p, v in variables.items() if isinstance(v, nnx.Param)}
    stored = {p for g in manifest["groups"] for p in g["params"]}
    if stored != params:
        missing, extra = sorted(params - stored), sorted(stored - params)
        raise ConvertedCheckpointError(
            f"{d}: the checkpoint's parameters do not match the model of its config.json: "
            f"{len(missing)} missing {missing[:10]}, {len(extra)} unexpected {extra[:10]}"
        )

    def target(path: str) -> jax.ShapeDtypeStruct:
        v = variables[path].get_value()
        return jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, specs[path]))

    for group in manifest["groups"]:
        paths = sorted(group["params"])
        if group["kind"] == "orbax":
            values = _restore_orbax(d / STATE_DIR / group["name"], {p: target(p) for p in paths})
        elif group["kind"] == "table":
            values = {p: _restore_table(d / TABLES_DIR / p, target(p)) for p in paths}
        else:
            raise ConvertedCheckpointError(f"{d}: group {group['name']!r} has unknown kind {group['kind']!r}")
        for p in paths:
            variables[p].set_value(values[p])

    if getattr(model, "token_map", None) is not None:
        map_path = d / TOKEN_MAP_FILE
        if not map_path.exists():
            raise ConvertedCheckpointError(f"{d}: the config has Engram layers but {TOKEN_MAP_FILE} is missing")
        token_map = prepare_token_map(np.load(map_path), args, source=str(map_path))
        model.token_map.set_value(jax.device_put(token_map, NamedSharding(mesh, specs["token_map"])))
    abstract = [p for p, v in variables.items() if isinstance(v.get_value(), jax.ShapeDtypeStruct)]
    if abstract:
        raise ConvertedCheckpointError(f"{d}: no value for model state {abstract[:10]} (not in the checkpoint)")
    return model, resolve_fp4_options(model, args, source=str(d))

