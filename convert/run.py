"""`convert_checkpoint`: resolve the inputs of a conversion (config, token map, mesh), plan it and
stream it (`convert.plan`, `convert.stream`)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from convert.plan import ConversionError, Group, build_plan, target_args_for
from convert.stream import write_plan
from dsv41_jax import sharding as shd
from dsv41_jax.checkpoint import CheckpointError, HubCheckpoint
from dsv41_jax.config import ConfigError, ModelArgs

__all__ = ["convert_checkpoint", "find_config", "find_token_map"]

log = logging.getLogger(__name__)

TOKEN_MAP_NAME = "engram_map.npy"


def find_config(hf_ckpt: Path, config: str | os.PathLike | None = None) -> Path:
    """The `inference/config.json` that `ModelArgs` is built from: `config` if given, else
    HF_CKPT/inference/config.json, else HF_CKPT/config.json."""
    if config is not None:
        path = Path(config)
        if not path.is_file():
            raise ConversionError(f"--config {path} does not exist")
        return path
    for path in (hf_ckpt / "inference" / "config.json", hf_ckpt / "config.json"):
        if path.is_file():
            return path
    raise ConversionError(
        f"no config in {hf_ckpt}: expected inference/config.json or config.json (or pass --config)"
    )


def find_token_map(hf_ckpt: Path, args: ModelArgs, engram_map: str | os.PathLike | None = None) -> np.ndarray | None:
    """The Engram raw -> compressed token map (int32), checked against the config; None when the
    config has no Engram layers."""
    from dsv41_jax.engram import prepare_token_map

    if not args.engram_layer_ids:
        return None
    candidates = [Path(engram_map)] if engram_map is not None else [hf_ckpt / TOKEN_MAP_NAME,
                                                                    hf_ckpt / "inference" / TOKEN_MAP_NAME]
    for path in candidates:
        if path.is_file():
            try:
                return prepare_token_map(np.load(path), args, source=str(path))
            except ValueError as e:
                raise ConversionError(str(e)) from None
    if engram_map is None:
        for tok_path in (hf_ckpt / "tokenizer.json", hf_ckpt / "inference" / "tokenizer.json"):
            if tok_path.is_file():
                from dsv41_jax.token_map import build_compressed_token_map

                lookup, n_ids = build_compressed_token_map(tok_path)
                if n_ids != args.engram_compressed_vocab_size:
                    raise ConversionError(
                        f"{tok_path}: the compressed token map has {n_ids} ids but the config's "
                        f"engram_compressed_vocab_size is {args.engram_compressed_vocab_size} (SPEC §9.1)")
                try:
                    return prepare_token_map(lookup, args, source=str(tok_path))
                except ValueError as e:
                    raise ConversionError(str(e)) from None
    raise ConversionError(
        f"the config has Engram layers {list(args.engram_layer_ids)}, which need the compressed token map, but "
        f"{' / '.join(str(c) for c in candidates)} does not exist and there is no tokenizer.json to build it from; "
        f"pass --engram-map FILE (an int array [n_tokens] with {args.engram_compressed_vocab_size} distinct ids, "
        "SPEC §9.1)"
    )


def convert_checkpoint(hf_ckpt: str | os.PathLike, out: str | os.PathLike, *, mesh: str | None = None,
                       dtype: str = "keep", resume: bool = False, config: str | os.PathLike | None = None,
                       engram_map: str | os.PathLike | None = None, rules: shd.Rules = shd.DEFAULT_RULES,
                       progress: bool = True, chunk_bytes: int = 256 << 20,
                       on_group_done: Callable[[Group], None] | None = None) -> dict:
    """Converts the hub checkpoint in `hf_ckpt` into a sharded Orbax checkpoint at `out`.

    mesh: "expert=8,data=1"-style spec of the serving mesh (default `default_mesh_spec` of the
      local devices). Only its axis sizes matter here (no devices are needed): they fix each
      parameter's PartitionSpec, recorded in the manifest, and the storage chunks follow it.
    dtype: "keep" (quantised values and scales bit for bit) or "bf16" (dequantised, for debugging;
      its config.json says dtype bf16 / expert_dtype null so it loads into that model).
    Everything is checked before the first write (`convert.plan.build_plan`). Returns the summary
    of `convert.stream.write_plan` plus "plan": {"groups", "params", "dropped", "dropped_summary"
    (`Plan.dropped_summary`), "engram_rows_multiple"}.
    """
    hf_ckpt = Path(hf_ckpt)
    config_path = find_config(hf_ckpt, config)
    try:
        raw_config = json.loads(config_path.read_text())
        source_args = ModelArgs.from_dict(raw_config, source=str(config_path))
    except (ConfigError, json.JSONDecodeError) as e:
        raise ConversionError(f"config {config_path}: {e}") from None
    try:
        ckpt = HubCheckpoint(hf_ckpt)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None
    mesh_spec = mesh if mesh is not None else shd.default_mesh_spec(len(jax.devices()), source_args)
    try:
        mesh_sizes = shd.parse_mesh_spec(mesh_spec)
        shd.check_mesh_sizes(mesh_sizes, target_args_for(source_args, dtype))
        plan = build_plan(ckpt, source_args, dtype_mode=dtype, mesh_sizes=mesh_sizes, rules=rules)
    except shd.ShardingError as e:
        raise ConversionError(f"--mesh {mesh_spec}: {e}") from None
    for row in plan.dropped_summary():
        log.info("dropping %d hub tensors %s (%.2f GiB): %s", row["tensors"], row["prefix"], row["bytes"] / 2**30,
                 row["reason"])
    token_map = find_token_map(hf_ckpt, source_args, engram_map)
    out_config = dict(raw_config)
    if dtype == "bf16":
        out_config.update(dtype="bf16", expert_dtype=None)
    summary = write_plan(plan, ckpt, Path(out), config=out_config, token_map=token_map, resume=resume,
                         progress=progress, chunk_bytes=chunk_bytes, on_group_done=on_group_done)
    summary["plan"] = {"groups": len(plan.groups), "params": sum(len(g.leaves) for g in plan.groups),
                       "dropped": len(plan.dropped), "dropped_summary": plan.dropped_summary(),
                       "engram_rows_multiple": plan.target_args.engram_rows_multiple}
    return summary
