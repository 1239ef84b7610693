"""Peak host memory of dsv41-convert on full-size tensors.

Writes a synthetic hub checkpoint with the released config's tensor shapes for the first
`--layers` layers (all 384 routed experts per layer, full-size embed / head; the Engram table
rows shrunk through `--engram-vocab-size`, since a released table alone is 98 GB), converts it in
a fresh process and prints that process's peak RSS against the largest tensor group it holds at
once (target: peak <= 2x largest group).

    python benchmarks/convert_memory.py [--layers 2] [--mesh expert=1] [--work DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dsv41_jax.config import ModelArgs
from dsv41_jax.synthetic import layer_subset, write_synthetic_checkpoint

_CHILD = """
import json, sys
from convert.stream import rss_bytes
base = rss_bytes()
from convert.run import convert_checkpoint
import jax; jax.devices()
after_imports = rss_bytes()
s = convert_checkpoint(sys.argv[1], sys.argv[2], mesh=sys.argv[3] or None, progress=True)
s["rss_at_start"] = base
s["rss_after_imports"] = after_imports
print("SUMMARY " + json.dumps(s))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2, help="backbone layers of the released config (default 2)")
    p.add_argument("--engram-vocab-size", type=int, default=250_000,
                   help="first Engram bucket prime search start (released: 16000000 -> 98 GB tables)")
    p.add_argument("--mesh", default="", help="mesh spec for the conversion (default: one CPU device)")
    p.add_argument("--work", default=None, help="scratch directory (default: a temp dir, removed afterwards)")
    p.add_argument("--keep", action="store_true", help="keep the synthetic and converted checkpoints")
    a = p.parse_args(argv)

    released = ModelArgs.from_json(REPO / "tests" / "data" / "released_config.json")
    args = layer_subset(released, a.layers, engram_vocab_size=a.engram_vocab_size)
    work = Path(a.work or tempfile.mkdtemp(prefix="dsv41-convert-mem-"))
    src, out = work / "hub", work / "converted"
    try:
        t = time.perf_counter()
        info = write_synthetic_checkpoint(src, args, shard_bytes=4 << 30, progress=True)
        print(f"synthetic hub checkpoint: {info['tensors']} tensors, {info['bytes'] / 2**30:.2f} GiB in "
              f"{info['shards']} shards, {time.perf_counter() - t:.0f} s")
        env = dict(os.environ)
        if a.mesh:
            from dsv41_jax.sharding import parse_mesh_spec

            n = 1
            for v in parse_mesh_spec(a.mesh).values():
                n *= v
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(out), a.mesh], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, text=True, check=True)
        summary = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("SUMMARY "))[8:])
        gib = 2**30
        peak, group, base = summary["peak_rss"], summary["largest_group_bytes"], summary["rss_after_imports"]
        print(f"config: released shapes, {a.layers} layers, {released.n_routed_experts} experts/layer, Engram rows "
              f"{list(args.engram_num_embeddings)}; mesh {a.mesh or 'one CPU device'}")
        print(f"converted {summary['bytes'] / gib:.2f} GiB in {summary['seconds']:.0f} s "
              f"({summary['bytes'] / gib / summary['seconds']:.2f} GiB/s)")
        print(f"largest tensor group in flight: {group / gib:.2f} GiB")
        print(f"peak RSS: {peak / gib:.2f} GiB (process after imports: {base / gib:.2f} GiB)")
        print(f"peak RSS / largest group: {peak / group:.2f}x (target <= 2x); "
              f"(peak - baseline) / largest group: {(peak - base) / group:.2f}x")
        return 0 if peak <= 2 * group else 1
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
