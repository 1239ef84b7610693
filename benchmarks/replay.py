"""Prefill time with and without the decoder-half replay (SPEC §19.1), on CPU.

The config has the released layer roles (40 layers: window-only 0-1, ratio-2 sources 2/8/14 with
reuse layers, the ratio-1 source and candidate source 20, reindex layers 24/28/32/36, Engram on 1
and 14, window 128) at reduced width, random weights. Both prefills run the same jitted program
shape (one prompt of --prompt tokens, a cache of that many positions); the replayed one runs
layers 21-39 only on the last 128 + k * 127 positions (k counted down from layer 39). Each
variant is compiled first (not timed), then timed --reps times; the median is reported, and the
logits of the two are checked to be identical.

    python benchmarks/replay.py [--prompt 4096] [--reps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.model_speed import random_model  # noqa: E402
from dsv41_jax.cache import init_cache  # noqa: E402
from dsv41_jax.config import ModelArgs  # noqa: E402
from dsv41_jax.model import replay_start, replay_width  # noqa: E402
from dsv41_jax.synthetic import layer_subset  # noqa: E402

# reduced widths; layer roles, window, candidate blocks and the hyper-connections stay released
WIDTHS = dict(vocab_size=1024, dim=256, moe_inter_dim=128, n_heads=4, n_routed_experts=16, q_lora_rank=128,
              head_dim=128, o_groups=2, o_lora_rank=64, index_n_heads=4, index_head_dim=64, index_topk=128,
              engram_head_dim=32, engram_compressed_vocab_size=800, vision_n_layers=0,
              image_token_id=1000, dspark_noise_token_id=0)


def bench_args(prompt: int) -> ModelArgs:
    released = ModelArgs.from_json(REPO / "tests" / "data" / "released_config.json", max_seq_len=prompt,
                                   max_batch_size=1)
    return layer_subset(released, released.n_layers, engram_vocab_size=1000).replace(**WIDTHS)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=4096, help="prompt tokens (one row)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", help="also write the results here")
    ns = p.parse_args(argv)
    args = bench_args(ns.prompt)
    graphdef, state = random_model(args)
    ids = jax.random.randint(jax.random.key(2), (1, ns.prompt), 0, args.vocab_size, jnp.int32)
    lengths = jnp.full((1,), ns.prompt, jnp.int32)

    def make(replay: bool):
        @jax.jit
        def run(state, ids, lengths):
            return nnx.merge(graphdef, state).prefill(ids, lengths, init_cache(args, 1, ns.prompt), replay=replay)
        return run

    first = replay_start(args)
    token_layers = {
        True: first * ns.prompt + sum(replay_width(args, i, ns.prompt) for i in range(first, args.n_layers)),
        False: args.n_layers * ns.prompt,
    }
    result = {"prompt": ns.prompt, "n_layers": args.n_layers, "replay_from_layer": first, "backend": jax.default_backend(),
              "devices": str(jax.devices()[0])}
    logits = {}
    for replay in (False, True):
        run = make(replay)
        t0 = time.perf_counter()
        out = jax.block_until_ready(run(state, ids, lengths))
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(ns.reps):
            t0 = time.perf_counter()
            out = jax.block_until_ready(run(state, ids, lengths))
            times.append(time.perf_counter() - t0)
        logits[replay] = np.asarray(out[0])
        name = "replay" if replay else "full"
        result[name] = {"seconds": float(np.median(times)), "all_seconds": times, "first_call_seconds": compile_s,
                        "token_layers": token_layers[replay]}
        print(f"{name:>6}: {np.median(times):8.3f} s (median of {ns.reps}; first call {compile_s:.1f} s), "
              f"{token_layers[replay]:,} token-layers", flush=True)
    result["speedup"] = result["full"]["seconds"] / result["replay"]["seconds"]
    result["token_layer_ratio"] = token_layers[False] / token_layers[True]
    result["logits_identical"] = bool(np.array_equal(logits[True], logits[False]))
    result["max_abs_logit_diff"] = float(np.abs(logits[True] - logits[False]).max())
    result["logit_rms"] = float(np.sqrt(np.mean(logits[False].astype(np.float64) ** 2)))
    result["argmax_equal"] = bool(np.array_equal(logits[True].argmax(-1), logits[False].argmax(-1)))
    print(f"speed-up {result['speedup']:.2f}x (token-layers {result['token_layer_ratio']:.2f}x fewer); "
          f"logits identical: {result['logits_identical']} (max |diff| {result['max_abs_logit_diff']:.3g}, "
          f"RMS {result['logit_rms']:.3g}, argmax equal: {result['argmax_equal']})")
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=2))
    return 0 if result["logits_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
