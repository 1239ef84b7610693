"""Generation: jit-compiled prefill and decode step over a donated KV cache, and the
`dsv41-generate` command line.

    dsv41-generate --ckpt DIR --prompt-ids '[[1, 2, 3]]' --max-new-tokens 32
    python -m dsv41_jax.generate --ckpt DIR --prompt "Hello" --tokenizer tokenizer.json

Compilation: one prefill program per (batch, prompt bucket) and one decode program per
(batch, sampling settings). Prompts are right-padded to a bucket (powers of two from 16, capped at
max_seq_len) so a new prompt length usually reuses a program; each row keeps its own position, so
a row's tokens equal those of running it alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.cache import init_cache
from dsv41_jax.config import ConfigError, ModelArgs
from dsv41_jax.sampling import SamplingParams, sample

MIN_BUCKET = 16


def prompt_bucket(length: int, max_seq_len: int) -> int:
    """Smallest power of two >= length (at least MIN_BUCKET), capped at max_seq_len."""
    b = MIN_BUCKET
    while b < length:
        b *= 2
    return min(b, max_seq_len)


@dataclasses.dataclass
class GenerateOutput:
    tokens: np.ndarray  # int32 [B, steps]: generated ids, -1 after a row finished
    lengths: np.ndarray  # int32 [B]: generated tokens per row (eos included)
    logits: np.ndarray | None  # f32 [steps, B, V] when requested
    prefill_seconds: float  # includes compilation on a first call
    step_seconds: list[float]  # per decode step; the first includes compilation on a first call
    prompt_tokens: int

    def decode_tokens_per_second(self) -> float:
        """Rows x steps per second over the decode steps after the first (compile excluded)."""
        steps = self.step_seconds[1:]
        return len(self.lengths) * len(steps) / sum(steps) if steps and sum(steps) > 0 else float("nan")

    def completions(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths, strict=True)]


class Generator:
    """Holds a model split into (graphdef, state) and its compiled prefill / decode programs.

    `traces` counts how often each program was traced (= compiled): a test pins that decode
    compiles once however many steps run.
    """

    def __init__(self, model, *, max_seq_len: int | None = None, reference_compat: bool = False):
        self.args: ModelArgs = model.args
        self.max_seq_len = max_seq_len or self.args.max_seq_len
        self.reference_compat = reference_compat
        self.graphdef, self.state = nnx.split(model)
        self.traces = {"prefill": 0, "decode": 0}
        self._prefill = jax.jit(self._prefill_impl, donate_argnums=(3,))
        self._decode = jax.jit(self._decode_impl, donate_argnums=(3,), static_argnums=(5,))

    def _prefill_impl(self, state, ids, lengths, cache):
        self.traces["prefill"] += 1
        model = nnx.merge(self.graphdef, state)
        return model.prefill(ids, lengths, cache)

    def _decode_impl(self, state, tokens, pos, cache, key, params: SamplingParams):
        self.traces["decode"] += 1
        model = nnx.merge(self.graphdef, state)
        logits, cache = model.decode_step(tokens, pos, cache, reference_compat=self.reference_compat)
        return sample(logits, key, params), logits, cache

    def generate(self, prompts: list[list[int]], max_new_tokens: int, params: SamplingParams = SamplingParams(),
                 key: jax.Array | None = None, eos_ids: tuple[int, ...] = (), return_logits: bool = False
                 ) -> GenerateOutput:
        """Greedy or sampled continuation of each prompt (a list of token-id lists)."""
        a = self.args
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        lengths = np.asarray([len(p) for p in prompts], np.int32)
        if lengths.max() >= self.max_seq_len:
            raise ValueError(f"prompt of {lengths.max()} tokens does not fit max_seq_len={self.max_seq_len} "
                             "(raise --max-seq-len)")
        flat = np.concatenate([np.asarray(p) for p in prompts])
        if flat.min() < 0 or flat.max() >= a.vocab_size:
            bad = int(flat[(flat < 0) | (flat >= a.vocab_size)][0])
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {a.vocab_size})")
        if params.temperature > 0 and key is None:
            key = jax.random.key(0)
        b = len(prompts)
        s = prompt_bucket(int(lengths.max()), self.max_seq_len)
        ids = np.zeros((b, s), np.int32)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = p
        steps = int(min(max_new_tokens, self.max_seq_len - lengths.max()))
        cache = init_cache(a, b, self.max_seq_len)

        t0 = time.perf_counter()
        logits, cache = self._prefill(self.state, jnp.asarray(ids), jnp.asarray(lengths), cache)
        step_key = None if key is None else jax.random.fold_in(key, 0)
        tok = sample(logits, step_key, params)
        tok.block_until_ready()
        t_prefill = time.perf_counter() - t0

        out = np.full((b, steps), -1, np.int32)
        all_logits = [] if return_logits else None
        done = np.zeros(b, bool)
        n = np.zeros(b, np.int32)
        pos = jnp.asarray(lengths)
        step_seconds = []
        for t in range(steps):
            tok_np = np.asarray(tok)
            live = ~done
            out[live, t] = tok_np[live]
            n[live] += 1
            if return_logits:
                all_logits.append(np.asarray(logits, np.float32))
            done |= np.isin(tok_np, np.asarray(eos_ids, np.int32)) if eos_ids else False
            if done.all() or t == steps - 1:
                break
            t1 = time.perf_counter()
            step_key = None if key is None else jax.random.fold_in(key, t + 1)
            tok, logits, cache = self._decode(self.state, tok, pos, cache, step_key, params)
            tok.block_until_ready()
            step_seconds.append(time.perf_counter() - t1)
            pos = pos + 1
        n_steps = int(n.max()) if steps else 0
        return GenerateOutput(
            tokens=out[:, :n_steps], lengths=n,
            logits=np.stack(all_logits) if return_logits and all_logits else None,
            prefill_seconds=t_prefill, step_seconds=step_seconds, prompt_tokens=int(lengths.sum()),
        )


# ------------------------------------------------------------------------------------------- CLI


def load_for_generate(ckpt: str | os.PathLike, max_seq_len: int, max_batch_size: int):
    """A model from a dsv41-convert output directory (restored sharded on the default mesh), or from
    a hub-format directory (config.json or inference/config.json + safetensors shards, plus
    engram_map.npy when the config has Engram layers; every weight loaded on the host: for tiny and
    test checkpoints)."""
    from dsv41_jax.loading import load_hub_weights
    from dsv41_jax.model import Transformer
    from dsv41_jax.parity import NOT_IN_TEXT_MODEL

    d = Path(ckpt)
    if not d.is_dir():
        raise FileNotFoundError(f"--ckpt {d}: not a directory")
    if not (d / "model.safetensors.index.json").exists() and (d / "manifest.json").exists():
        # a dsv41-convert output: restore it sharded
        from dsv41_jax.checkpoint_io import load_converted

        return load_converted(d, max_seq_len=max_seq_len, max_batch_size=max_batch_size)[0]
    cfg = d / "config.json" if (d / "config.json").exists() else d / "inference" / "config.json"
    if not cfg.exists():
        raise FileNotFoundError(f"--ckpt {d}: no config.json or inference/config.json")
    if not (d / "model.safetensors.index.json").exists():
        raise FileNotFoundError(f"--ckpt {d}: no model.safetensors.index.json (expected a hub-format checkpoint)")
    args = ModelArgs.from_json(cfg, max_seq_len=max_seq_len, max_batch_size=max_batch_size)
    model = Transformer(args)
    load_hub_weights(model, d, skip=NOT_IN_TEXT_MODEL)
    if args.engram_layer_ids:
        from dsv41_jax.engram import prepare_token_map

        emap = d / "engram_map.npy"
        if not emap.exists():
            raise FileNotFoundError(
                f"--ckpt {d}: the config has Engram layers {list(args.engram_layer_ids)} but no engram_map.npy "
                "(the compressed-token map; build it from tokenizer.json with the converter)")
        model.token_map.set_value(jnp.asarray(prepare_token_map(np.load(emap), args)))
    return model


def _prompts_from_args(ns) -> tuple[list[list[int]], object]:
    if (ns.prompt is None) == (ns.prompt_ids is None):
        raise ValueError("give exactly one of --prompt (with --tokenizer) or --prompt-ids")
    if ns.prompt_ids is not None:
        try:
            ids = json.loads(ns.prompt_ids)
        except json.JSONDecodeError as e:
            raise ValueError(f"--prompt-ids is not valid JSON: {e}") from None
        if not (isinstance(ids, list) and ids and all(isinstance(r, list) and all(isinstance(t, int) for t in r)
                                                      for r in ids)):
            raise ValueError("--prompt-ids must be a JSON list of lists of token ids, e.g. [[1, 2, 3]]")
        return ids, None
    if not ns.tokenizer:
        raise ValueError("--prompt needs --tokenizer PATH/tokenizer.json")
    if not os.path.exists(ns.tokenizer):
        raise FileNotFoundError(f"--tokenizer {ns.tokenizer}: file not found")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(ns.tokenizer)
    return [tok.encode(ns.prompt).ids], tok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="dsv41-generate", description="Generate text with DeepSeek V4.1 in JAX.")
    p.add_argument("--ckpt", required=True, help="dsv41-convert output directory, or a (tiny) hub-format checkpoint")
    p.add_argument("--prompt", help="prompt text (needs --tokenizer)")
    p.add_argument("--tokenizer", help="path to tokenizer.json")
    p.add_argument("--prompt-ids", help="JSON list of lists of token ids, one list per batch row")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--eos-id", type=int, action="append", default=[], help="stop token id (repeatable)")
    p.add_argument("--reference-compat", action="store_true",
                   help="reproduce the official decode's index-key hand-off (SPEC §21) instead of the consistent one")
    p.add_argument("--logits-out", help="write tokens [B, steps] and logits [steps, B, V] float32 to this .npz")
    ns = p.parse_args(argv)
    try:
        prompts, tokenizer = _prompts_from_args(ns)
        params = SamplingParams(ns.temperature, ns.top_k, ns.top_p)
        model = load_for_generate(ns.ckpt, ns.max_seq_len, max(1, len(prompts)))
        gen = Generator(model, max_seq_len=ns.max_seq_len, reference_compat=ns.reference_compat)
        res = gen.generate(prompts, ns.max_new_tokens, params, jax.random.key(ns.seed), tuple(ns.eos_id),
                           return_logits=bool(ns.logits_out))
    except (ValueError, FileNotFoundError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for i, row in enumerate(res.completions()):
        text = f" {tokenizer.decode(row)!r}" if tokenizer is not None else ""
        print(f"[{i}] {row}{text}")
    print(f"prefill: {res.prompt_tokens} tokens in {res.prefill_seconds:.3f} s "
          f"({res.prompt_tokens / max(res.prefill_seconds, 1e-9):.1f} tok/s, compile included)")
    print(f"decode: {len(res.step_seconds)} steps x {len(prompts)} rows in {sum(res.step_seconds):.3f} s "
          f"({res.decode_tokens_per_second():.1f} tok/s after the first, compiling step)")
    if ns.logits_out:
        np.savez(ns.logits_out, tokens=res.tokens, logits=res.logits.astype(np.float32))
    return 0


if __name__ == "__main__":
    sys.exit(main())
