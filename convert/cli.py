"""Command line of dsv41-convert: hub safetensors checkpoint -> sharded Orbax checkpoint.

    dsv41-convert --hf-ckpt DIR --out DIR [--mesh expert=8,data=1] [--dtype keep|bf16] [--resume]
    python -m convert ...

The work is `convert.run.convert_checkpoint`; this module only parses flags and prints.
"""

from __future__ import annotations

import argparse
import logging
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsv41-convert",
        description="Stream a DeepSeek V4.1 hub checkpoint into a sharded Orbax checkpoint for dsv41-jax.",
    )
    p.add_argument("--hf-ckpt", required=True, help="directory with model.safetensors.index.json and the shards")
    p.add_argument("--out", required=True, help="output directory (must not exist; written via OUT.partial)")
    p.add_argument("--mesh", default=None,
                   help="serving mesh, e.g. expert=8,data=1 (axes data, expert, tensor); default: the local devices")
    p.add_argument("--dtype", choices=("keep", "bf16"), default="keep",
                   help="keep: fp8/fp4 values and scales bit for bit (default); bf16: dequantised (debug)")
    p.add_argument("--resume", action="store_true", help="finish an interrupted run left in OUT.partial")
    p.add_argument("--config", default=None, help="model config (default HF_CKPT/inference/config.json, then config.json)")
    p.add_argument("--engram-map", default=None, help="Engram token map .npy (default HF_CKPT/engram_map.npy)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("convert").setLevel(logging.INFO)
    from convert.plan import ConversionError
    from convert.run import convert_checkpoint

    try:
        summary = convert_checkpoint(args.hf_ckpt, args.out, mesh=args.mesh, dtype=args.dtype, resume=args.resume,
                                     config=args.config, engram_map=args.engram_map, progress=not args.no_progress)
    except ConversionError as e:
        print(f"dsv41-convert: error: {e}", file=sys.stderr)
        return 2
    gib = 2**30
    plan = summary["plan"]
    print(
        f"dsv41-convert: wrote {args.out}: {plan['params']} params in {plan['groups']} groups "
        f"({summary['groups_written']} written, {summary['groups_skipped']} resumed), {plan['dropped']} hub "
        f"tensors dropped (listed in manifest.json); {summary['bytes'] / gib:.2f} GiB in {summary['seconds']:.1f} s; "
        f"peak RSS {summary['peak_rss'] / gib:.2f} GiB, largest group {summary['largest_group_bytes'] / gib:.2f} GiB"
    )
    for row in plan["dropped_summary"]:
        print(f"  dropped {row['tensors']} tensors {row['prefix']} ({row['bytes'] / gib:.2f} GiB): {row['reason']}")
    if plan["engram_rows_multiple"] > 1:
        print(f"  Engram table rows padded to a multiple of {plan['engram_rows_multiple']} (the mesh's split)")
    return 0
