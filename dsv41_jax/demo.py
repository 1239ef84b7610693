"""End-to-end demo on a tiny random model: synthetic hub checkpoint -> dsv41-convert -> sharded
load -> jit-compiled generation.

    python -m dsv41_jax.demo [--new-tokens 8] [--prompt 1,17,42,99] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from dsv41_jax.config import ModelArgs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv41_jax.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--prompt", default="1,17,42,99", help="comma-separated token ids")
    p.add_argument("--workdir", default=None, help="keep the checkpoints here (default: a temp dir, removed)")
    a = p.parse_args(argv)

    from convert import main as convert_main
    from dsv41_jax.checkpoint_io import load_converted
    from dsv41_jax.synthetic import write_synthetic_checkpoint

    args = ModelArgs.tiny(max_seq_len=32)
    prompt = [int(t) for t in a.prompt.split(",") if t.strip()]
    with tempfile.TemporaryDirectory(prefix="dsv41-demo-") as tmp:
        work = Path(a.workdir) if a.workdir else Path(tmp)
        hub, out = work / "hub", work / "converted"
        info = write_synthetic_checkpoint(hub, args, shard_bytes=1 << 20)
        print(f"1. synthetic hub checkpoint: {info['tensors']} tensors, {info['bytes'] / 2**20:.1f} MiB in "
              f"{info['shards']} shards -> {hub} ({args.n_layers} layers, {args.n_routed_experts} experts)")
        rc = convert_main(["--hf-ckpt", str(hub), "--out", str(out), "--no-progress"])
        if rc:
            return rc
        print(f"2. converted -> {out}")
        t = time.perf_counter()
        model, margs = load_converted(out)
        n_params = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
        w1 = model.layers[0].ffn.experts.w1.weight[...]
        print(f"3. loaded in {time.perf_counter() - t:.1f} s: {n_params:,} parameters; routed experts laid out as "
              f"{w1.sharding.spec} on mesh {dict(w1.sharding.mesh.shape)}")
        from dsv41_jax.generate import Generator

        gen = Generator(model)
        res = gen.generate([prompt], a.new_tokens)
        print(f"4. greedy from prompt {prompt}: {res.completions()[0]}")
        rate = res.decode_tokens_per_second()
        timed = (f"decode {rate:.1f} tokens/s after the first, compiling step (batch 1, CPU)" if np.isfinite(rate)
                 else "decode not timed (no step after the first, compiling one: ask for --new-tokens 3 or more)")
        print(f"   prefill {res.prefill_seconds:.2f} s (includes compilation); {timed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
