"""End-to-end demo on a tiny random model: synthetic hub checkpoint -> dsv41-convert -> sharded
load -> greedy tokens.

    python -m dsv41_jax.demo [--new-tokens 8] [--prompt 1,17,42,99] [--workdir DIR]

Decoding here is a greedy loop over the prefill (`Transformer.__call__`): the prompt and the
tokens so far sit in a fixed [1, max_seq_len] buffer, and the logits at the last filled position
are read. Every position depends only on the tokens at or before it (causal attention, causal
compression, Engram n-grams look back), so the trailing filler cannot change them, and one
compiled program serves every step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.config import ModelArgs


@nnx.jit
def _all_logits(model, ids):
    return model(ids, all_logits=True)


def greedy(model, prompt: list[int], new_tokens: int, max_len: int) -> tuple[list[int], list[float]]:
    """Greedy continuation of one prompt; returns (new token ids, seconds per step)."""
    if len(prompt) + new_tokens > max_len:
        raise ValueError(f"prompt {len(prompt)} + {new_tokens} new tokens exceed max_seq_len {max_len}")
    buf = np.zeros((1, max_len), np.int32)
    buf[0, : len(prompt)] = prompt
    n, out, seconds = len(prompt), [], []
    for _ in range(new_tokens):
        t = time.perf_counter()
        logits = _all_logits(model, jnp.asarray(buf))  # [1, max_len, V] f32
        tok = int(jnp.argmax(logits[0, n - 1]))
        seconds.append(time.perf_counter() - t)
        buf[0, n] = tok
        out.append(tok)
        n += 1
    return out, seconds


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
        tokens, seconds = greedy(model, prompt, a.new_tokens, margs.max_seq_len)
        steady = seconds[1:]
        rate = len(steady) / sum(steady) if steady and sum(steady) > 0 else float("nan")
        print(f"4. greedy from prompt {prompt}: {tokens}")
        print(f"   first step {seconds[0]:.2f} s (includes compilation), then {rate:.1f} tokens/s "
              f"(full-buffer prefill per token, batch 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
