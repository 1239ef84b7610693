"""Generation: jit-compiled prefill and decode step over a donated KV cache, and the
`dsv41-generate` command line.

    dsv41-generate --ckpt DIR --prompt-ids '[[1, 2, 3]]' --max-new-tokens 32
    python -m dsv41_jax.generate --ckpt DIR --prompt "Hello" --tokenizer tokenizer.json

Compilation: one prefill program per (batch, prompt bucket) and one decode program per
(batch, sampling settings, context bucket). The decode program runs up to `decode_steps` steps
on the device (`jax.lax.while_loop`: step, sample, stop once every row has finished), so the host
dispatches once per `decode_steps` tokens rather than once per token. Prompts are right-padded
to a bucket (powers of two from 16, capped at max_seq_len) so a new prompt length usually reuses
a program; each row keeps its own position, so a row's tokens equal those of running it alone.

Meshes: `Generator(model, mesh=mesh)` places the state by the sharding rules (a no-op for a model
restored onto that mesh by `load_converted`), creates the cache already split over `data` (a jit
with out_shardings, so no device ever holds the whole cache), feeds every input with its
`dsv41_jax.sharding.ACTIVATION_AXES` sharding and traces and runs prefill and decode under
`jax.set_mesh(mesh)`, so the MoE sees the `expert` axis (expert parallelism when it is > 1). A
batch that is not a multiple of the `data` axis is padded with one-token rows that are dropped
from the output (`pad_batch=False`: raise instead). Sampled tokens come back replicated, so every
process of a multi-host run reads them from its own devices.

The command line runs on a mesh always: `--mesh expert=4,data=2` (it must use every device), by
default `sharding.default_mesh_spec` over all devices. Multi-host (`--distributed`): "auto"
(default) calls `jax.distributed.initialize()` before touching a device when `--coordinator
HOST:PORT` is given (with `--num-processes N --process-id I`), the environment names a coordinator
(JAX_COORDINATOR_ADDRESS) or is a multi-process SLURM / Open MPI / GKE TPU job
(`distributed_environment`); "on" always calls it (jax detects the cluster itself, e.g. on Cloud
TPU pods), "off" never. Only process 0 prints and writes --logits-out.
`--plan` prints the memory plan of `dsv41_jax.plan` instead of generating.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import inspect
import json
import logging
import os
import sys
import time
import weakref
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dsv41_jax import sharding as shd
from dsv41_jax.cache import init_cache
from dsv41_jax.config import ConfigError, ModelArgs
from dsv41_jax.sampling import SamplingParams, sample

log = logging.getLogger(__name__)

MIN_BUCKET = 16
# decode steps compile per context bound (`Transformer.decode_step(context_bound=...)`): powers of
# two from this many positions; at and past max_seq_len the whole cache is scored
MIN_CONTEXT_BUCKET = 4096
# decode steps per call (`Generator.decode_steps`) and the most bytes a call keeps for its logits
# (two calls may be in flight: `Generator.generate` dispatches the next before reading one)
DECODE_STEPS = 32
MAX_CALL_LOGITS_BYTES = 1 << 30
# XLA:GPU command-buffer commands of the decode program: XLA's default set plus WHILE and
# CONDITIONAL, so the on-device loop runs inside one CUDA graph whose condition is evaluated on
# the device instead of a host round trip each step. On an H200 (benchmarks/README.md, nineteenth
# run; same process, 16 steps a call, same tokens): 1955 -> 1794 µs a step at batch 1, 4443 ->
# 4243 at batch 8, 15663 -> 15733 at batch 64 (within the rounds' spread)
DECODE_GPU_COMMAND_BUFFER = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"
# how the graph orders its kernels: "CONCURRENT" links each kernel only to the kernels whose
# buffers it reads or writes, so independent small kernels (the hyper-connection sites, norms,
# quantisers, the router) overlap each other and the weight-streaming matmuls; XLA's default
# ("LHS") follows the scheduled sequence. On an H200 (twentieth run; same lowering, 16 steps a
# call, same tokens): 1823 -> 1582 µs a step at batch 1, 4260 -> 4178 at batch 8, 15730 -> 15430
# at batch 64; temporary buffers 4.7 -> 4.8 MB, 60 -> 110 MB, 249 -> 358 MB (fewer reused)
DECODE_GPU_SCHEDULING = "CONCURRENT"


def decode_compiler_options(platform: str, xla_flags: str | None = None) -> dict[str, str] | None:
    """XLA options the decode program compiles with: on GPUs the command buffers
    `DECODE_GPU_COMMAND_BUFFER` scheduled `DECODE_GPU_SCHEDULING`, each unless XLA_FLAGS
    (`xla_flags`, default the environment's) sets that option itself (its choice wins: e.g.
    `--xla_gpu_enable_command_buffer=` for a driver without CUDA graph conditional nodes);
    elsewhere none (None)."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    if platform != "gpu":
        return None
    options = {"xla_gpu_enable_command_buffer": DECODE_GPU_COMMAND_BUFFER,
               "xla_gpu_command_buffer_scheduling_mode": DECODE_GPU_SCHEDULING}
    return {k: v for k, v in options.items() if k not in flags} or None


def prompt_bucket(length: int, max_seq_len: int) -> int:
    """Smallest power of two >= length (at least MIN_BUCKET), capped at max_seq_len."""
    b = MIN_BUCKET
    while b < length:
        b *= 2
    return min(b, max_seq_len)


def context_bucket(positions: int, max_seq_len: int, smallest: int | None = MIN_CONTEXT_BUCKET) -> int | None:
    """The decode context bound for a step whose positions are all < `positions`: the smallest
    power of two >= positions, at least `smallest`; None (score the whole cache) when that
    reaches max_seq_len or `smallest` is None."""
    if smallest is None:
        return None
    b = smallest
    while b < positions:
        b *= 2
    return None if b >= max_seq_len else b


@dataclasses.dataclass
class GenerateOutput:
    tokens: np.ndarray  # int32 [B, steps]: generated ids, -1 after a row finished
    lengths: np.ndarray  # int32 [B]: generated tokens per row (eos included)
    logits: np.ndarray | None  # f32 [steps, B, V] when requested
    prefill_seconds: float  # includes compilation on a first call
    # per decode step: the time from reading the previous call's tokens (the prefill's for the
    # first call) to reading its call's, over the steps the call ran
    step_seconds: list[float]
    prompt_tokens: int
    first_call_steps: int = 1  # decode steps of the first call (its time includes compilation)

    def decode_tokens_per_second(self) -> float:
        """Rows x steps per second over the decode steps after the first call (compile excluded)."""
        steps = self.step_seconds[self.first_call_steps:]
        return len(self.lengths) * len(steps) / sum(steps) if steps and sum(steps) > 0 else float("nan")

    def completions(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths, strict=True)]


def _state_path(path) -> str:
    """'layers.3.attn.wq_a.weight' from a pytree path into an nnx.State (its last key is `.value`)."""
    keys = [k for k in path if not isinstance(k, jax.tree_util.GetAttrKey)]
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys)


def place_state(state, args: ModelArgs, mesh: Mesh, rules: shd.Rules = shd.DEFAULT_RULES):
    """The nnx.State of `Transformer(args)` with every array on its rule sharding over `mesh`
    (arrays already there are not copied)."""
    specs = shd.state_partition_specs(args, mesh, rules)

    def put(path, x):
        name = _state_path(path)
        if name not in specs:
            raise shd.ShardingError(f"model state {name!r} has no sharding rule (not a Variable of Transformer(args))")
        target = NamedSharding(mesh, specs[name])
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(target, x.ndim):
            return x
        return jax.device_put(x, target)

    return jax.tree_util.tree_map_with_path(put, state)


def _to_host(x: jax.Array) -> np.ndarray:
    """A global array as numpy on every process (gathered across hosts when not all local)."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _weak_method(method):
    """A bound method as a plain function that holds its instance weakly (same name and
    signature, for jit's static / donated argument numbers and its program names). A jit wrapper
    of the bound method stored on the instance would make a reference cycle, and the instance with
    its device arrays (a model's shard) would outlive its last reference until Python's next cyclic
    collection."""
    ref, name, qualname = weakref.WeakMethod(method), method.__name__, method.__qualname__

    def call(*args, **kwargs):
        bound = ref()
        if bound is None:
            raise ReferenceError(f"{qualname}: its Generator was dropped")
        return bound(*args, **kwargs)

    call.__name__, call.__qualname__ = name, qualname
    call.__signature__ = inspect.signature(method)
    return call


class Generator:
    """Holds a model split into (graphdef, state) and its compiled prefill / decode programs.

    mesh: run on this mesh (axes `sharding.MESH_AXES`): the state is placed by `rules`, the cache
    and inputs are split over `data`, and the programs are traced under the mesh. None: the
    arrays stay where they are (one device).
    pad_batch: on a mesh, pad a batch to a multiple of the `data` axis (True) or raise (False).
    prefill_chunk: prefill prompts in chunks of this many tokens (`Transformer.prefill_chunk`, one
    program for every chunk), so activation memory is bounded by the chunk, not the prompt; the
    same logits and caches as one prefill. None: one prefill per prompt bucket.

    min_context_bucket: decode steps promise `context_bound` = the power of two (at least this)
    above the furthest position, so the indexers score only the cache rows the context can see
    (same tokens and logits; one decode program per bucket, at most log2(max_seq_len /
    min_context_bucket) + 1). None: every step scores the whole max_seq_len cache.

    decode_steps: decode steps per call: each call runs up to this many steps in one on-device loop
    (the sampled token fed back, stopping early once every row has met an eos id) and returns
    their tokens, so per-token host dispatch (hundreds of µs for the model's state pytree) is paid
    once per call; the next call is dispatched before a call's tokens are read (from its tokens
    and finished rows on the device), so that dispatch and the host's reading overlap the steps.
    Same tokens and logits as one step per call (1). A call stops at the end of its context
    bucket; with `return_logits` it also keeps its steps' logits on the device (f32 [steps, B, V]),
    at most `MAX_CALL_LOGITS_BYTES`.
    decode_options: XLA compiler options of the decode program. None: `decode_compiler_options`
    (on GPUs the loop runs inside the step's CUDA graph, its kernels scheduled concurrently); {}:
    XLA's defaults (the host tests the loop's condition each step).

    `traces` counts how often each program was traced (= compiled): a test pins that decode
    compiles once per context bucket however many steps run.
    """

    def __init__(self, model, *, max_seq_len: int | None = None, reference_compat: bool = False,
                 mesh: Mesh | None = None, rules: shd.Rules = shd.DEFAULT_RULES, pad_batch: bool = True,
                 prefill_chunk: int | None = None, min_context_bucket: int | None = MIN_CONTEXT_BUCKET,
                 decode_steps: int = DECODE_STEPS, decode_options: Mapping[str, str] | None = None):
        if not isinstance(decode_steps, int) or decode_steps < 1:
            raise ValueError(f"decode_steps must be a positive number of steps per call, got {decode_steps!r}")
        self.decode_steps = decode_steps
        if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be a positive number of tokens or None, got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        if min_context_bucket is not None and (not isinstance(min_context_bucket, int) or min_context_bucket < 1):
            raise ValueError(f"min_context_bucket must be a positive number of positions or None, got {min_context_bucket!r}")
        self.min_context_bucket = min_context_bucket
        self.args: ModelArgs = model.args
        self.max_seq_len = max_seq_len or self.args.max_seq_len
        self.reference_compat = reference_compat
        self.mesh = mesh
        self.rules = rules
        self.pad_batch = pad_batch
        self.graphdef, self.state = nnx.split(model)
        self.traces = {"prefill": 0, "decode": 0}
        if decode_options is None:
            device = jax.devices()[0] if mesh is None else mesh.devices.flat[0]
            decode_options = decode_compiler_options(device.platform)
        decode_options = dict(decode_options or {}) or None
        # the programs refer to this Generator weakly (`_weak_method`): with no reference cycle,
        # dropping it frees its state's device arrays at once
        prefill_impl, prefill_chunk_impl = _weak_method(self._prefill_impl), _weak_method(self._prefill_chunk_impl)
        decode_impl, sample_impl = _weak_method(self._decode_impl), _weak_method(self._sample_impl)
        args, max_seq_len = self.args, self.max_seq_len
        if mesh is None:
            self.data = 1
            self._prefill = jax.jit(prefill_impl, donate_argnums=(3,))
            self._prefill_chunk = jax.jit(prefill_chunk_impl, donate_argnums=(4,))
            self._decode = jax.jit(decode_impl, donate_argnums=(3,), static_argnums=(8, 9, 10, 11, 12),
                                   compiler_options=decode_options)
            self._init_cache = lambda b: init_cache(args, b, max_seq_len)
            self._sample = jax.jit(sample_impl, static_argnums=(2, 3))
            return
        if tuple(mesh.axis_names) != shd.MESH_AXES:
            raise shd.ShardingError(f"Generator mesh has axes {tuple(mesh.axis_names)}; expected {shd.MESH_AXES} "
                                    "(build it with dsv41_jax.sharding.make_mesh)")
        sizes = shd.mesh_axis_sizes(mesh)
        shd.check_mesh_sizes(sizes, self.args)
        self.data = sizes["data"]
        self.state = place_state(self.state, self.args, mesh, rules)
        # shardings do not depend on the batch once it is a multiple of `data` (checked per call)
        cache_sh = shd.cache_shardings(self.args, self.data, self.max_seq_len, mesh, rules)
        logits_sh = shd.activation_sharding("logits", (self.data, self.args.vocab_size), mesh, rules)
        replicated = NamedSharding(mesh, PartitionSpec())
        self._prefill = jax.jit(prefill_impl, donate_argnums=(3,), out_shardings=(logits_sh, cache_sh))
        self._prefill_chunk = jax.jit(prefill_chunk_impl, donate_argnums=(4,),
                                      out_shardings=(logits_sh, cache_sh))
        # (tokens [B, steps], last tokens, steps run, logits [steps, B, V] or None, cache, done
        # [B]: as the next call takes it)
        step_logits_sh = NamedSharding(mesh, PartitionSpec(None, *logits_sh.spec))
        done_sh = shd.activation_sharding("done", (self.data,), mesh, rules)
        self._decode = jax.jit(decode_impl, donate_argnums=(3,), static_argnums=(8, 9, 10, 11, 12),
                               out_shardings=(replicated, replicated, replicated, step_logits_sh, cache_sh, done_sh),
                               compiler_options=decode_options)
        self._init_cache = jax.jit(lambda b: init_cache(args, b, max_seq_len), static_argnums=(0,),
                                   out_shardings=cache_sh)
        self._sample = jax.jit(sample_impl, static_argnums=(2, 3), out_shardings=replicated)

    def _mesh_context(self):
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def _put(self, name: str, x: np.ndarray) -> jax.Array:
        """A host array (the same on every process) as a global array with its activation sharding."""
        if self.mesh is None:
            return jnp.asarray(x)
        sharding = shd.activation_sharding(name, x.shape, self.mesh, self.rules)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    def _key_data(self, key: jax.Array | None, step: int | None = None):
        """(raw uint32 key data of fold_in(key, step) (of key itself for None) on the host, key
        impl) or (None, None): plain host data, so the key reaches the programs the same way on
        every process."""
        if key is None:
            return None, None
        key_at = key if step is None else jax.random.fold_in(key, step)
        return np.asarray(jax.random.key_data(key_at)), jax.random.key_impl(key)

    @staticmethod
    def _wrap_key(key_data, impl):
        return None if key_data is None else jax.random.wrap_key_data(key_data, impl=impl)

    def _sample_impl(self, logits, key_data, impl, params: SamplingParams):
        return sample(logits, self._wrap_key(key_data, impl), params)

    def _prefill_impl(self, state, ids, lengths, cache):
        self.traces["prefill"] += 1
        model = nnx.merge(self.graphdef, state)
        return model.prefill(ids, lengths, cache)

    def _prefill_chunk_impl(self, state, ids, start, lengths, cache):
        self.traces["prefill"] += 1
        model = nnx.merge(self.graphdef, state)
        return model.prefill_chunk(ids, start, lengths, cache)

    def _chunked_prefill(self, ids: np.ndarray, lengths: np.ndarray, cache):
        """Prefill of ids [b, s] (row b real up to lengths[b]) in chunks of `prefill_chunk`
        tokens; a row whose prompt ended adds nothing to later chunks. Returns (logits at each
        row's last prompt token, cache)."""
        c, b = self.prefill_chunk, ids.shape[0]
        logits = None
        for first in range(0, int(lengths.max()), c):
            start = np.minimum(first, lengths).astype(np.int32)
            n = np.clip(lengths - first, 0, c).astype(np.int32)
            chunk = np.zeros((b, c), np.int32)
            for r in range(b):
                chunk[r, : n[r]] = ids[r, start[r] : start[r] + n[r]]
            new, cache = self._prefill_chunk(self.state, self._put("ids", chunk), self._put("lengths", start),
                                             self._put("lengths", n), cache)
            if logits is None:
                logits = new
            else:  # the row mask as a global array too, so this also runs across hosts
                logits = jnp.where(self._put("lengths", n)[:, None] > 0, new, logits)
        return logits, cache

    def _decode_impl(self, state, tokens, pos, cache, done, key_data, start, n_steps, impl, params: SamplingParams,
                     context_bound: int | None, eos_ids: tuple[int, ...], logits_steps: int):
        """Up to n_steps decode steps (n_steps <= decode_steps, traced) from tokens int32 [B] at
        positions pos [B]; step j samples with fold_in(key, start + j). Stops early once every row
        is done (done bool [B] on entry; a row is done once it samples an eos id). Returns
        (tokens int32 [B, decode_steps] (-1 past the steps run), the last tokens int32 [B], the
        steps run, f32 [logits_steps, B, V] logits of the steps or None, cache, done bool [B] after
        the steps run)."""
        self.traces["decode"] += 1
        model = nnx.merge(self.graphdef, state)
        base = self._wrap_key(key_data, impl)
        b, width = tokens.shape[0], self.decode_steps
        eos = jnp.asarray(eos_ids, jnp.int32)

        def body(carry):
            j, tok, pos, cache, done, out, logits_out = carry
            logits, cache = model.decode_step(tok, pos, cache, reference_compat=self.reference_compat,
                                              context_bound=context_bound)
            tok = sample(logits, None if base is None else jax.random.fold_in(base, start + j), params)
            out = jax.lax.dynamic_update_slice(out, tok[:, None], (0, j))
            if logits_out is not None:
                logits_out = jax.lax.dynamic_update_slice(logits_out, logits[None], (j, 0, 0))
            done = done | jnp.isin(tok, eos) if eos_ids else done
            return j + 1, tok, pos + 1, cache, done, out, logits_out

        def cond(carry):
            return (carry[0] < n_steps) & ~jnp.all(carry[4])

        logits_out = jnp.zeros((logits_steps, b, self.args.vocab_size), jnp.float32) if logits_steps else None
        carry = (jnp.int32(0), tokens, pos, cache, done, jnp.full((b, width), -1, jnp.int32), logits_out)
        j, tok, _, cache, done, out, logits_out = jax.lax.while_loop(cond, body, carry)
        return out, tok, j, logits_out, cache, done

    def _padded_batch(self, prompts: list[list[int]]) -> list[list[int]]:
        extra = -len(prompts) % self.data
        if not extra:
            return prompts
        if not self.pad_batch:
            raise shd.ShardingError(
                f"a batch of {len(prompts)} rows is not a multiple of the mesh's data axis ({self.data}); "
                "pass a multiple, or pad_batch=True to pad it with dropped one-token rows")
        log.info("padding a batch of %d rows to %d (a multiple of the data axis)", len(prompts), len(prompts) + extra)
        return prompts + [[0]] * extra

    def generate(self, prompts: list[list[int]], max_new_tokens: int, params: SamplingParams = SamplingParams(),
                 key: jax.Array | None = None, eos_ids: tuple[int, ...] = (), return_logits: bool = False
                 ) -> GenerateOutput:
        """Greedy or sampled continuation of each prompt (a list of token-id lists)."""
        a = self.args
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        n_rows = len(prompts)
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
        prompts = self._padded_batch(prompts)
        lengths = np.asarray([len(p) for p in prompts], np.int32)
        b = len(prompts)
        s = prompt_bucket(int(lengths.max()), self.max_seq_len)
        ids = np.zeros((b, s), np.int32)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = p
        steps = int(min(max_new_tokens, self.max_seq_len - lengths.max()))

        with self._mesh_context():
            cache = self._init_cache(b)
            t0 = time.perf_counter()
            if self.prefill_chunk is None:
                logits, cache = self._prefill(self.state, self._put("ids", ids), self._put("lengths", lengths), cache)
            else:
                logits, cache = self._chunked_prefill(ids, lengths, cache)
            tok = self._sample(logits, *self._key_data(key, 0), params)
            tok.block_until_ready()
            t_prefill = time.perf_counter() - t0

            out = np.full((b, steps), -1, np.int32)
            all_logits = [] if return_logits else None
            done = np.arange(b) >= n_rows  # padding rows are finished from the start
            n = np.zeros(b, np.int32)
            pos = lengths.copy()
            step_seconds, first_call_steps = [], None
            eos = tuple(sorted({int(e) for e in eos_ids}))
            eos_np = np.asarray(eos, np.int32)
            key_data, impl = self._key_data(key)  # the calls fold in each step's index on the device
            # a call's logits buffer: at most MAX_CALL_LOGITS_BYTES (and one step at the least)
            logits_steps = (max(1, min(self.decode_steps, MAX_CALL_LOGITS_BYTES // (4 * b * a.vocab_size)))
                            if return_logits else 0)
            # the tokens (and logits) still to record: the prefill's token first
            toks = np.asarray(tok)[:, None] if steps > 0 else np.zeros((b, 0), np.int32)
            logits_np, t = _to_host(logits)[None] if return_logits else None, 0
            # decode calls in flight, oldest first: (tokens, steps run, logits); t_s / pos_s: tokens
            # and positions once they have run, each counted at the steps it asked for (a call
            # stops short only when every row is done, and then the host stops too)
            in_flight, t_s, pos_s, done_dev = collections.deque(), t, pos, None
            t_last = time.perf_counter()
            while True:
                for j in range(toks.shape[1]):  # the tokens of the last call, in order
                    live = ~done
                    out[live, t] = toks[live, j]
                    n[live] += 1
                    if return_logits:
                        all_logits.append(logits_np[j].astype(np.float32)[:n_rows])
                    done |= np.isin(toks[:, j], eos_np)
                    t += 1
                if done.all() or t >= steps:
                    break
                if not in_flight:  # the first call starts from the host's state
                    t_s, pos_s, done_dev = t, pos, self._put("done", done)
                # the call after the one read next is dispatched before that read, from its
                # outputs on the device (tokens, done), so the host's reading and dispatching
                # overlap the device's steps; same calls, same arguments as one call at a time
                while len(in_flight) < 2 and t_s < steps:
                    top = int(pos_s.max())  # the call writes positions pos_s; the bound covers it
                    bound = context_bucket(top + 1, self.max_seq_len, self.min_context_bucket)
                    m = min(self.decode_steps, steps - t_s)  # >= 1 steps, ending at the call's bucket
                    if return_logits:
                        m = min(m, logits_steps)
                    if bound is not None:
                        m = min(m, bound - top)
                    step_toks, tok, ran, step_logits, cache, done_dev = self._decode(
                        self.state, tok, self._put("pos", pos_s), cache, done_dev, key_data, np.int32(t_s),
                        np.int32(m), impl, params, bound, eos, logits_steps)
                    in_flight.append((step_toks, ran, step_logits))
                    t_s, pos_s = t_s + m, pos_s + m
                step_toks, ran, step_logits = in_flight.popleft()
                ran = int(ran)
                toks = np.asarray(step_toks)[:, :ran]
                logits_np = _to_host(step_logits)[:ran] if return_logits else None
                now = time.perf_counter()
                elapsed, t_last = now - t_last, now
                step_seconds += [elapsed / ran] * ran
                first_call_steps = ran if first_call_steps is None else first_call_steps
                pos = pos + ran
        n = n[:n_rows]
        n_steps = int(n.max()) if steps else 0
        return GenerateOutput(
            tokens=out[:n_rows, :n_steps], lengths=n,
            logits=np.stack(all_logits) if return_logits and all_logits else None,
            prefill_seconds=t_prefill, step_seconds=step_seconds, prompt_tokens=int(lengths[:n_rows].sum()),
            first_call_steps=first_call_steps or 1,
        )


# ------------------------------------------------------------------------------------------- CLI


def _is_converted(d: Path) -> bool:
    # golden sets carry a manifest.json too; a hub index makes a directory hub-format
    return not (d / "model.safetensors.index.json").exists() and (d / "manifest.json").exists()


def checkpoint_args(ckpt: str | os.PathLike, **overrides) -> ModelArgs:
    """The ModelArgs of a dsv41-convert output or hub-format directory (config only, no weights)."""
    d = Path(ckpt)
    if not d.is_dir():
        raise FileNotFoundError(f"--ckpt {d}: not a directory")
    if _is_converted(d):  # with the stored Engram table layout (manifest's engram_rows_multiple)
        from dsv41_jax.checkpoint_io import converted_args

        return converted_args(d, **overrides)
    cfg = d / "config.json" if (d / "config.json").exists() else d / "inference" / "config.json"
    if not cfg.exists():
        raise FileNotFoundError(f"--ckpt {d}: no config.json or inference/config.json")
    return ModelArgs.from_json(cfg, **overrides)


def load_for_generate(ckpt: str | os.PathLike, max_seq_len: int, max_batch_size: int, mesh: Mesh | None = None,
                      **overrides):
    """A model from a dsv41-convert output directory (restored straight into its shardings on
    `mesh`, default `sharding.default_mesh_spec` over all devices), or from a hub-format directory
    (config.json or inference/config.json + safetensors shards, plus engram_map.npy when the config
    has Engram layers; every weight loaded on the host, then placed by `Generator`: for tiny and
    test checkpoints). overrides: further runtime fields of `ModelArgs` (e.g. kernels,
    attn_accumulate)."""
    from dsv41_jax.loading import load_hub_weights, resolve_fp4_options
    from dsv41_jax.model import Transformer
    from dsv41_jax.parity import NOT_IN_TEXT_MODEL

    d = Path(ckpt)
    args = checkpoint_args(d, max_seq_len=max_seq_len, max_batch_size=max_batch_size, **overrides)
    if _is_converted(d):
        from dsv41_jax.checkpoint_io import load_converted

        return load_converted(d, mesh, max_seq_len=max_seq_len, max_batch_size=max_batch_size, **overrides)[0]
    if not (d / "model.safetensors.index.json").exists():
        raise FileNotFoundError(f"--ckpt {d}: no model.safetensors.index.json (expected a hub-format checkpoint)")
    model = Transformer(args)
    load_hub_weights(model, d, skip=NOT_IN_TEXT_MODEL)
    resolve_fp4_options(model, args, source=str(d))
    if args.engram_layer_ids:
        from dsv41_jax.engram import prepare_token_map

        emap = d / "engram_map.npy"
        if not emap.exists():
            raise FileNotFoundError(
                f"--ckpt {d}: the config has Engram layers {list(args.engram_layer_ids)} but no engram_map.npy "
                "(the compressed-token map; build it from tokenizer.json with the converter)")
        model.token_map.set_value(jnp.asarray(prepare_token_map(np.load(emap), args)))
    return model


# ------------------------------------------------------------------------------------ multi-host


def distributed_environment(env: Mapping[str, str] | None = None) -> str | None:
    """What in the environment asks for a multi-process run (its name), or None.

    A coordinator address (JAX_COORDINATOR_ADDRESS), or a multi-process job of a launcher that
    `jax.distributed.initialize()` detects by itself: SLURM (srun with more than one task), Open
    MPI (mpirun, more than one rank), GKE TPU (TPU_WORKER_HOSTNAMES with more than one host).
    Cloud TPU VMs without those variables need `--distributed on` (jax then asks the metadata
    server)."""
    env = os.environ if env is None else env
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS"

    def more_than_one(name: str) -> bool:
        value = env.get(name, "")
        return value.isdigit() and int(value) > 1

    if all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")) \
            and more_than_one("SLURM_NTASKS"):
        return "SLURM"
    if "OMPI_MCA_orte_hnp_uri" in env and more_than_one("OMPI_COMM_WORLD_SIZE"):
        return "Open MPI"
    if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]) > 1:
        return "GKE TPU"
    return None


def init_distributed(mode: str = "auto", env: Mapping[str, str] | None = None, *, coordinator: str | None = None,
                     num_processes: int | None = None, process_id: int | None = None) -> bool:
    """Calls `jax.distributed.initialize(coordinator, num_processes, process_id)` for mode "on",
    or for "auto" when a coordinator is given or `distributed_environment` finds a multi-process
    setting; must run before any device is used. Arguments left None are detected by jax (from
    JAX_COORDINATOR_ADDRESS and the launcher). Returns whether it initialised."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"--distributed {mode!r}: expected auto, on or off")
    if (num_processes is None) != (process_id is None):
        raise ValueError("--num-processes and --process-id go together (or leave both to the launcher)")
    if process_id is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id {process_id} is outside [0, --num-processes {num_processes})")
    found = ("--coordinator" if coordinator else distributed_environment(env)) if mode == "auto" else None
    if mode == "off" or (mode == "auto" and found is None):
        return False
    if getattr(jax.distributed, "is_initialized", lambda: False)():
        return True  # a second command in the same processes
    log.info("jax.distributed.initialize() (%s)", found or "--distributed on")
    jax.distributed.initialize(coordinator, num_processes, process_id)
    return True


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
    p.add_argument("--ckpt", help="dsv41-convert output directory, or a (tiny) hub-format checkpoint")
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
    p.add_argument("--prefill-chunk", type=int, help="prefill in chunks of this many tokens (bounded memory for "
                   "long prompts; same results)")
    p.add_argument("--min-context-bucket", type=int, default=MIN_CONTEXT_BUCKET,
                   help="decode compiles per power-of-two context from this many positions and scores only the "
                   "index keys the context can see (same results); 0: always score the whole cache")
    p.add_argument("--decode-steps", type=int, default=DECODE_STEPS,
                   help="decode steps per compiled call (an on-device loop; same results); 1: a call per token")
    p.add_argument("--logits-out", help="write tokens [B, steps] and logits [steps, B, V] float32 to this .npz")
    p.add_argument("--mesh", help="device mesh, e.g. expert=4,data=2 (axes data, expert, tensor; must use every "
                                  "device; default: expert = gcd(devices, routed experts), the rest data)")
    p.add_argument("--distributed", choices=("auto", "on", "off"), default="auto",
                   help="call jax.distributed.initialize(): auto = when --coordinator is given, the environment "
                        "names one (JAX_COORDINATOR_ADDRESS) or is a multi-process SLURM / Open MPI / GKE TPU job")
    p.add_argument("--coordinator", help="multi-host: HOST:PORT of process 0 (default: detected by jax)")
    p.add_argument("--num-processes", type=int, help="multi-host: number of processes (default: detected by jax)")
    p.add_argument("--process-id", type=int, help="multi-host: this process's index (default: detected by jax)")
    p.add_argument("--kernels", choices=("auto", "reference", "pallas"), default="auto",
                   help="ModelArgs.kernels: the Pallas kernels on GPU/TPU (auto), the jnp references, or the kernels")
    p.add_argument("--attn-accumulate", choices=("auto", "f64", "f32"), default="auto",
                   help="ModelArgs.attn_accumulate: the sparse attention in float64, the golden oracle's rounding "
                        "(auto, except on TPU), or in f32 (faster: the attention kernel where --kernels picks it)")
    p.add_argument("--fp4-scale-fold", choices=("off", "auto", "on"), default="auto",
                   help="ModelArgs.fp4_scale_fold: the routed-expert fp4 kernel's x 2^126 folded into the scales "
                        "(auto: when every scale byte is <= 128; on: refuse a checkpoint where one is not)")
    p.add_argument("--fp4-relaid", choices=("off", "auto", "on"), default="auto",
                   help="ModelArgs.fp4_relaid: the routed experts' fp4 words re-laid at load for the kernel's "
                        "'relaid' decode, bit-identical (auto: where the compiled GPU kernel runs)")
    p.add_argument("--plan", action="store_true",
                   help="print the memory plan per device for --mesh, --max-seq-len, --batch and exit")
    p.add_argument("--batch", type=int, default=1, help="with --plan: batch rows of the cache")
    p.add_argument("--config", help="with --plan: config.json (default: --ckpt's, else the released config)")
    ns = p.parse_args(argv)
    for flag, value, low, what in (("--prefill-chunk", ns.prefill_chunk, 1, "positions"),
                                   ("--min-context-bucket", ns.min_context_bucket, 0, "positions"),
                                   ("--decode-steps", ns.decode_steps, 1, "steps")):
        if value is not None and value < low:
            print(f"error: {flag} must be a number of {what} >= {low}, got {value}", file=sys.stderr)
            return 2
    if ns.plan:
        from dsv41_jax import plan

        try:
            # --config wins; else the checkpoint's config; else the released config
            args = checkpoint_args(ns.ckpt) if ns.ckpt and not ns.config else plan.load_config(ns.config)
            print(plan.format_plan(plan.memory_plan(args, ns.mesh or plan.DEFAULT_PLAN_MESH, ns.max_seq_len,
                                                    ns.batch, prefill_tokens=ns.prefill_chunk)))
        except (ValueError, FileNotFoundError, ConfigError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        if not ns.ckpt:
            raise ValueError("--ckpt is required (except with --plan)")
        prompts, tokenizer = _prompts_from_args(ns)
        params = SamplingParams(ns.temperature, ns.top_k, ns.top_p)
        init_distributed(ns.distributed, coordinator=ns.coordinator, num_processes=ns.num_processes,
                         process_id=ns.process_id)
        batch = max(1, len(prompts))
        runtime = {"kernels": ns.kernels, "attn_accumulate": ns.attn_accumulate, "fp4_scale_fold": ns.fp4_scale_fold,
                   "fp4_relaid": ns.fp4_relaid}
        args = checkpoint_args(ns.ckpt, max_seq_len=ns.max_seq_len, max_batch_size=batch, **runtime)
        mesh = shd.make_mesh(ns.mesh or shd.default_mesh_spec(len(jax.devices()), args), args=args)
        model = load_for_generate(ns.ckpt, ns.max_seq_len, batch, mesh, **runtime)
        gen = Generator(model, max_seq_len=ns.max_seq_len, reference_compat=ns.reference_compat, mesh=mesh,
                        prefill_chunk=ns.prefill_chunk, min_context_bucket=ns.min_context_bucket or None,
                        decode_steps=ns.decode_steps)
        res = gen.generate(prompts, ns.max_new_tokens, params, jax.random.key(ns.seed), tuple(ns.eos_id),
                           return_logits=bool(ns.logits_out))
    except (ValueError, FileNotFoundError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if jax.process_index() != 0:
        return 0
    print(f"mesh: {shd.format_mesh_spec(shd.mesh_axis_sizes(mesh))} over {mesh.devices.size} "
          f"{mesh.devices.flat[0].platform} devices, {jax.process_count()} process(es)")
    for i, row in enumerate(res.completions()):
        text = f" {tokenizer.decode(row)!r}" if tokenizer is not None else ""
        print(f"[{i}] {row}{text}")
    print(f"prefill: {res.prompt_tokens} tokens in {res.prefill_seconds:.3f} s "
          f"({res.prompt_tokens / max(res.prefill_seconds, 1e-9):.1f} tok/s, compile included)")
    print(f"decode: {len(res.step_seconds)} steps x {len(prompts)} rows in {sum(res.step_seconds):.3f} s "
          f"({res.decode_tokens_per_second():.1f} tok/s after the first, compiling call)")
    if ns.logits_out:
        np.savez(ns.logits_out, tokens=res.tokens, logits=res.logits.astype(np.float32))
    return 0


if __name__ == "__main__":
    sys.exit(main())
