"""The key table of a conversion: which hub tensors fill which model parameter, and how.

`build_plan` checks the source first (`verify_source`: every index name expected by the config,
none unknown, none duplicated, every dtype / shape as the config implies) and then maps every
parameter of `Transformer(target_args)` (module paths, from `nnx.eval_shape`) to its hub tensors:

  * name rule: the hub name equals the module path, except the routed experts, which the model
    stacks: tree `L.ffn.experts.w1.weight` <- hub `L.ffn.experts.{0..E-1}.w1.weight`;
  * value rule, from (hub dtype, parameter dtype):
      copy          same dtype, bits kept (fp8 e4m3, e8m0 scales, packed-fp4 int8, bf16, f32);
      widen         bf16 -> f32 (exact);
      dequant_fp8   e4m3 + its `.scale` sibling -> bf16 / f32 (every fp8 Linear
                    in `--dtype bf16` mode);
      dequant_fp4   packed e2m1 + `.scale` -> bf16 / f32 (routed experts in bf16 mode).

Hub tensors of parts dsv41_jax does not port (the DSpark draft stages `mtp.*`, the vision tower,
aligner and image delimiter vectors: `NOT_IN_TEXT_MODEL`) are dropped, each with the reason of its
prefix (`DROP_REASONS`), listed in the manifest and printed by the CLI. They are not carried along
under their hub names: the output is the state of the model that loads it, and no module of the
port reads them (a port of DSpark or vision converts them from the hub then). They are still
checked against the config's inventory like every other tensor. The plan is total: every index
name is consumed by exactly one parameter or dropped, which `build_plan` checks before anything
is written.

Engram tables are stored with their rows padded (zero rows at the end) up to a multiple of the
number of devices their sharding rule splits them over on the requested mesh
(`engram_rows_multiple`; the released layer-14 table has 384,016,682 = 2 x prime rows, which no
larger device count divides). The output's model is built with that multiple
(`ModelArgs.engram_rows_multiple`, recorded in the manifest); hash ids never reach the padding.

Groups (the unit of writing, of memory in flight and of `--resume`): `embed` (embed + final
norm), `head`, per layer `layers.L` (everything but the routed experts and the Engram table),
`layers.L.ffn.experts.w{1,2,3}` (weight + scale, stacked) and the table group
`layers.L.engram.embed` (written row chunk by row chunk).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
from collections.abc import Mapping

import numpy as np
from jax.sharding import PartitionSpec

from dsv41_jax import sharding as shd
from dsv41_jax.checkpoint import CheckpointError, HubCheckpoint, check_against_inventory, hub_tensor_inventory
from dsv41_jax.config import ModelArgs
from dsv41_jax.engram import stored_table_rows
from dsv41_jax.parity import NOT_IN_TEXT_MODEL

__all__ = ["DROP_REASONS", "ConversionError", "Group", "Leaf", "Plan", "build_plan", "engram_rows_multiple",
           "target_args_for", "verify_source"]

_STACKED = re.compile(r"^(?P<head>.*\.ffn\.experts)\.(?P<w>w[123])\.(?P<kind>weight|scale)$")
_TABLE = re.compile(r"^(?P<layer>layers\.\d+)\.engram\.embed\.(weight|scale)$")
_EXPERTS_GROUP = re.compile(r"^(?P<g>layers\.\d+\.ffn\.experts\.w[123])\.(weight|scale)$")
_LAYER = re.compile(r"^(?P<g>layers\.\d+)\.")
_MAX_LISTED = 20

_ITEMSIZE = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4}

HOW = ("copy", "widen", "dequant_fp8", "dequant_fp4")

# Why each hub prefix of `NOT_IN_TEXT_MODEL` is not converted (the key table of the dropped names).
_NOT_PORTED = "dsv41_jax has no module that reads it, so the converted model could not use it"
DROP_REASONS: dict[str, str] = {
    "mtp.": f"DSpark draft stages (SPEC §11, speculative drafting): {_NOT_PORTED}",
    "vision.": f"vision tower (SPEC §12): {_NOT_PORTED}; image rows enter the text model as embeddings",
    "aligner.": f"vision aligner (SPEC §12): {_NOT_PORTED}",
    "image_start": f"image delimiter vector of the vision merge (SPEC §12): {_NOT_PORTED}",
    "image_end": f"image delimiter vector of the vision merge (SPEC §12): {_NOT_PORTED}",
    "image_newline": f"image delimiter vector of the vision merge (SPEC §12): {_NOT_PORTED}",
}


class ConversionError(ValueError):
    """A source that cannot be converted as asked; the message lists every offending name."""


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter to write.

    path: module path; sources: hub names (several for stacked experts, in expert order);
    stacked: the sources fill the leading axis one by one (routed experts);
    scales: hub `.scale` names consumed to dequantise (one per source) or ();
    how: one of HOW; dtype / shape: the parameter's; spec: its PartitionSpec on the mesh;
    source_bytes: bytes read from the hub for it; pad_rows: zero rows written after the hub's
    rows (Engram tables, see the module doc), so shape[0] = hub rows + pad_rows.
    """

    path: str
    sources: tuple[str, ...]
    stacked: bool
    scales: tuple[str, ...]
    how: str
    dtype: np.dtype
    shape: tuple[int, ...]
    spec: PartitionSpec
    source_bytes: int
    pad_rows: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def record(self) -> dict:
        rec = {"dtype": self.dtype.name, "shape": list(self.shape),
               "spec": [e if e is None or isinstance(e, str) else list(e) for e in self.spec],
               "how": self.how, "sources": len(self.sources)}
        if self.pad_rows:
            rec["pad_rows"] = self.pad_rows
        return rec


@dataclasses.dataclass(frozen=True)
class Group:
    """name: directory name of the group; kind: "orbax" (one PyTree item) or "table" (row chunks)."""

    name: str
    kind: str
    leaves: tuple[Leaf, ...]

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)

    @property
    def source_bytes(self) -> int:
        return sum(leaf.source_bytes for leaf in self.leaves)

    def record(self) -> dict:
        return {"name": self.name, "kind": self.kind, "params": {leaf.path: leaf.record() for leaf in self.leaves}}


@dataclasses.dataclass(frozen=True)
class Plan:
    source_args: ModelArgs
    target_args: ModelArgs
    dtype_mode: str
    mesh_sizes: dict[str, int]
    groups: tuple[Group, ...]
    dropped: dict[str, str]  # hub name -> reason
    dropped_bytes: dict[str, int] = dataclasses.field(default_factory=dict)  # hub name -> bytes

    @property
    def source_bytes(self) -> int:
        return sum(g.source_bytes for g in self.groups)

    def dropped_summary(self) -> list[dict]:
        """One row per dropped prefix: {"prefix", "reason", "tensors", "bytes"}."""
        rows: dict[str, dict] = {}
        for name, reason in sorted(self.dropped.items()):
            prefix = next(p for p in DROP_REASONS if name.startswith(p))
            row = rows.setdefault(prefix, {"prefix": prefix + "*", "reason": reason, "tensors": 0, "bytes": 0})
            row["tensors"] += 1
            row["bytes"] += self.dropped_bytes.get(name, 0)
        return list(rows.values())


def _listing(title: str, items: list[str]) -> str:
    shown = items[:_MAX_LISTED]
    more = f"\n    ... and {len(items) - len(shown)} more" if len(items) > len(shown) else ""
    return f"  {len(items)} {title}:\n" + "".join(f"    {s}\n" for s in shown) + more


def _duplicates(ckpt: HubCheckpoint) -> list[str]:
    """Names given twice in the index JSON, or present in the headers of two shards."""
    seen: collections.Counter = collections.Counter()

    def pairs(items):
        for k, _ in items:
            seen[k] += 1
        return dict(items)

    try:
        raw = json.loads(ckpt.index_path.read_text(), object_pairs_hook=pairs)
    except (OSError, json.JSONDecodeError):
        raw = None  # HubCheckpoint already parsed it; a later read failing is reported elsewhere
    weight_map = set(raw.get("weight_map", {})) if isinstance(raw, dict) else set()
    dups = [f"{n} (listed {c} times in {ckpt.index_path.name})" for n, c in sorted(seen.items())
            if c > 1 and n in weight_map]
    holders = collections.defaultdict(list)
    for shard in ckpt.shards():
        try:
            for n in ckpt.shard_tensor_names(shard):
                holders[n].append(shard)
        except CheckpointError:
            continue  # unreadable shards are reported by check_against_inventory
    dups += [f"{n} (in shards {', '.join(s)})" for n, s in sorted(holders.items()) if len(s) > 1]
    return dups


def verify_source(ckpt: HubCheckpoint, args: ModelArgs) -> None:
    """Raises ConversionError listing duplicated names and every difference between the checkpoint
    and the hub inventory of `args` (missing, unknown, dtype / shape mismatches, unreadable)."""
    parts = []
    dups = _duplicates(ckpt)
    if dups:
        parts.append(_listing("duplicated", dups))
    try:
        check_against_inventory(ckpt, args)
    except CheckpointError as e:
        parts.append(str(e))
    if parts:
        raise ConversionError(f"cannot convert {ckpt.directory}:\n" + "\n".join(parts))


def engram_rows_multiple(mesh_sizes: Mapping[str, int], rules: shd.Rules = shd.DEFAULT_RULES) -> int:
    """The number of pieces the `engram_rows` rule splits a table's rows into on the mesh: the
    product of the sizes of its mesh axes (8 on expert=8,data=1: every device holds 1/8)."""
    return math.prod(int(mesh_sizes.get(a, 1)) for a in rules.mesh_axes("engram_rows"))


def target_args_for(args: ModelArgs, dtype_mode: str) -> ModelArgs:
    """The config of the model the output is for: `keep` -> the source's; `bf16` -> plain bf16
    Linears and experts (`dtype="bf16"`, `expert_dtype=None`)."""
    if dtype_mode == "keep":
        return args
    if dtype_mode == "bf16":
        return args.replace(dtype="bf16", expert_dtype=None)
    raise ConversionError(f"--dtype must be 'keep' or 'bf16', got {dtype_mode!r}")


def _how(path: str, hub_tag: str, param: np.dtype) -> str:
    name = param.name
    if (hub_tag, name) in {("F8_E4M3", "float8_e4m3fn"), ("F8_E8M0", "float8_e8m0fnu"), ("I8", "int8"),
                           ("BF16", "bfloat16"), ("F32", "float32")}:
        return "copy"
    if hub_tag == "BF16" and name == "float32":
        return "widen"
    if hub_tag == "F8_E4M3" and name in ("bfloat16", "float32"):
        return "dequant_fp8"
    if hub_tag == "I8" and name in ("bfloat16", "float32"):
        return "dequant_fp4"
    raise ConversionError(f"parameter {path}: no rule converts a hub {hub_tag} tensor into a {name} parameter")


def _expected_shape(how: str, hub_shape: tuple[int, ...], stacked: int | None) -> tuple[int, ...]:
    shape = hub_shape
    if how == "dequant_fp4":
        shape = (*shape[:-1], shape[-1] * 2)
    return shape if stacked is None else (stacked, *shape)


def _group_of(path: str) -> tuple[str, str]:
    m = _TABLE.match(path)
    if m:
        return f"{m['layer']}.engram.embed", "table"
    m = _EXPERTS_GROUP.match(path)
    if m:
        return m["g"], "orbax"
    m = _LAYER.match(path)
    if m:
        return m["g"], "orbax"
    if path.startswith("head."):
        return "head", "orbax"
    return "embed", "orbax"


def _layer_key(name: str) -> tuple:
    parts = name.split(".")
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in parts)


def build_plan(ckpt: HubCheckpoint, source_args: ModelArgs, *, dtype_mode: str = "keep",
               mesh_sizes: Mapping[str, int], rules: shd.Rules = shd.DEFAULT_RULES) -> Plan:
    """Verifies the source and returns the full, total conversion plan. Raises ConversionError."""
    verify_source(ckpt, source_args)
    inventory = hub_tensor_inventory(source_args)
    target = target_args_for(source_args, dtype_mode)
    if target.engram_layer_ids:
        target = target.replace(engram_rows_multiple=engram_rows_multiple(mesh_sizes, rules))
    params = shd.param_logical_axes(target)
    used: collections.Counter = collections.Counter()
    leaves: dict[str, Leaf] = {}
    problems: list[str] = []
    for path, (axes, abstract) in params.items():
        dtype = np.dtype(abstract.dtype)
        m = _STACKED.match(path)
        if m:
            n = abstract.shape[0]
            sources = tuple(f"{m['head']}.{e}.{m['w']}.{m['kind']}" for e in range(n))
        else:
            n, sources = None, (path,)
        absent = [s for s in sources if s not in inventory]
        if absent:
            problems.append(f"{path}: hub tensors {absent[:3]}{' ...' if len(absent) > 3 else ''} not in the checkpoint")
            continue
        tag, hub_shape = inventory[sources[0]]
        try:
            how = _how(path, tag, dtype)
        except ConversionError as e:
            problems.append(str(e))
            continue
        scales = ()
        if how.startswith("dequant"):
            scales = tuple(s[: -len("weight")] + "scale" for s in sources)
            if not all(s.endswith(".weight") for s in sources) or any(s not in inventory for s in scales):
                problems.append(f"{path}: {how} needs the `.scale` siblings of {sources[0]}, absent from the checkpoint")
                continue
        shape = _expected_shape(how, hub_shape, n)
        pad_rows = 0
        if (_TABLE.match(path) and how == "copy" and shape[1:] == tuple(abstract.shape[1:])
                and abstract.shape[0] == stored_table_rows(shape[0], target.engram_rows_multiple)):
            pad_rows = abstract.shape[0] - shape[0]
            shape = tuple(abstract.shape)
        if shape != tuple(abstract.shape):
            problems.append(f"{path}: the hub tensors give {shape}, the model parameter is {tuple(abstract.shape)}")
            continue
        nbytes = sum(math.prod(inventory[s][1]) * _ITEMSIZE[inventory[s][0]] for s in sources + scales)
        spec = shd.logical_to_spec(axes, abstract.shape, mesh_sizes, rules, name=path)
        leaves[path] = Leaf(path, sources, m is not None, scales, how, dtype, tuple(abstract.shape), spec, nbytes,
                            pad_rows)
        used.update(sources + scales)

    unexplained = [p for p in NOT_IN_TEXT_MODEL if p not in DROP_REASONS]
    if unexplained:
        raise ConversionError(f"internal: hub prefixes {unexplained} are skipped by the model but have no drop reason "
                              "in convert.plan.DROP_REASONS")
    dropped = {n: DROP_REASONS[next(p for p in NOT_IN_TEXT_MODEL if n.startswith(p))]
               for n in ckpt.names() if n.startswith(NOT_IN_TEXT_MODEL)}
    dropped_bytes = {n: math.prod(inventory[n][1]) * _ITEMSIZE[inventory[n][0]] for n in dropped if n in inventory}
    twice = sorted(n for n, c in used.items() if c > 1)
    leftover = sorted(set(ckpt.names()) - used.keys() - dropped.keys())
    consumed_and_dropped = sorted(used.keys() & dropped.keys())
    if twice:
        problems.append(_listing("hub tensors claimed by two parameters", twice))
    if leftover:
        problems.append(_listing("hub tensors with no parameter in the model (and no reason to drop them)", leftover))
    if consumed_and_dropped:
        problems.append(_listing("hub tensors both consumed and dropped", consumed_and_dropped))
    if problems:
        raise ConversionError(f"cannot convert {ckpt.directory} into the parameters of Transformer:\n  "
                              + "\n  ".join(problems))

    grouped: dict[str, tuple[str, list[Leaf]]] = {}
    for path in sorted(leaves, key=_layer_key):
        name, kind = _group_of(path)
        grouped.setdefault(name, (kind, []))[1].append(leaves[path])
    order = sorted(grouped, key=lambda g: (g == "head", _layer_key(g)))
    groups = tuple(Group(g, grouped[g][0], tuple(grouped[g][1])) for g in order)
    return Plan(source_args, target, dtype_mode, dict(mesh_sizes), groups, dropped, dropped_bytes)

