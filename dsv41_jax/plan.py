"""Memory plan: bytes per device of weights, caches and transients for a mesh, from shapes only.

    python -m dsv41_jax.plan --mesh expert=8,data=1 --max-seq-len 65536 --batch 4
    dsv41-generate --plan --mesh expert=8,data=1 --max-seq-len 65536 --batch 4

Nothing is allocated: parameter shapes come from `nnx.eval_shape(Transformer(args))`, cache shapes
from `jax.eval_shape(init_cache)`, and each array's bytes per device from its PartitionSpec under
the sharding rules (`dsv41_jax.sharding`): an array split over mesh axes of sizes n1, n2, ...
holds nbytes / (n1 * n2 * ...) on each device (the rules only split dims the axes divide, so this
is exact), a replicated one its full nbytes. The mesh is a spec ("expert=8,data=1"); no devices are
needed. The default config is the released one (tests/data/released_config.json).

Parts:
  * weights: routed experts, Engram tables, and the rest (attention, shared experts, router,
    hyper-connections, embedding, bf16 head; replicated by the default rules);
  * cache: `init_cache(args, B, max_seq_len)` for B = the batch padded to a multiple of `data`
    (the generator pads it so); its rows are split over `data`;
  * transient: an estimate of the activations alive at the peak of one program on one device,
    for rows b = B / data:
        hc stream   2 x [b, S, hc, dim] bf16 (a block's input and output)
      + the largest working set of any one layer (layers run one after another), the largest of
          attention  q and o [b, S, H, hd] bf16, the gathered KV rows [b, S, K, hd] bf16 and the
                     attention logits [b, S, H, K] f32, with K = window + index_topk (capped at
                     the compressed rows S // r) on compressed layers, K = window otherwise
          indexer    the per-head products [b, S, ih, C] f32 and the scores [b, S, S // r] bf16
                     (index-source layers; `index_scores.reference` forms the products C keys
                     at a time, at most 1 GiB of them: `index_scores.reference.index_score_block`)
          MoE        the routed w1 / w3 outputs 2 x [b, S, topk, inter] f32 and the expert
                     outputs [b, S, topk, dim] bf16 (every token's experts computed locally)
      + logits [b, V] f32,
    for one prefill call of S = prefill_tokens new positions (`--prefill-chunk`; default
    max_seq_len: a whole prompt in one call) whose context reaches max_seq_len (the indexer of
    the last chunk scores max_seq_len // r rows), and for a decode step (S = 1, scoring all
    max_seq_len // r cached rows); the larger of the two is the transient. It counts matmul
    outputs as materialised (the jnp reference path) and ignores XLA's own scratch space,
    fragmentation and the kernels' tiling, so read it as an order of magnitude.

Verdicts compare the per-device sum with the memory of one chip: H200 141 GB, TPU v5p 95 GB,
TPU v6e 32 GB (1 GB = 1e9 bytes), with and without the transient.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np

from dsv41_jax import sharding as shd
from dsv41_jax.config import ConfigError, ModelArgs
from pallas_kernels.index_scores.reference import index_score_block

__all__ = ["CHIPS", "DEFAULT_PLAN_MESH", "RELEASED_CONFIG", "MemoryPlan", "format_plan", "load_config", "main",
           "memory_plan", "transient_estimate"]

# bytes of memory per chip (GB = 1e9 bytes, as the vendors quote them)
CHIPS: dict[str, int] = {"H200": 141 * 10**9, "TPU v5p": 95 * 10**9, "TPU v6e": 32 * 10**9}
DEFAULT_PLAN_MESH = "expert=8,data=1"
RELEASED_CONFIG = Path(__file__).resolve().parents[1] / "tests" / "data" / "released_config.json"

WEIGHT_PARTS = ("routed experts", "Engram tables", "other weights")


def load_config(path: str | Path | None = None) -> ModelArgs:
    """ModelArgs of a config.json (default: the released config shipped with the tests)."""
    p = Path(path) if path is not None else RELEASED_CONFIG
    if not p.exists():
        raise FileNotFoundError(f"config {p} not found" + ("" if path else "; pass --config PATH/config.json"))
    return ModelArgs.from_json(p)


def _weight_part(path: str) -> str:
    if ".ffn.experts." in path:
        return "routed experts"
    if ".engram.embed." in path:
        return "Engram tables"
    return "other weights"


def _per_device(nbytes: int, spec, sizes: Mapping[str, int]) -> int:
    shards = math.prod(sizes[a] for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e))
    return nbytes // shards


def _nbytes(a) -> int:
    return int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize


@functools.lru_cache(maxsize=4)
def _state_layout(args: ModelArgs) -> tuple[dict, frozenset]:
    """({path: (logical axes, abstract array)} of every Variable, the Param paths): one eval_shape."""
    from flax import nnx

    from dsv41_jax.model import Transformer

    params = frozenset(".".join(str(k) for k in path) for path, node in
                       nnx.iter_graph(nnx.eval_shape(lambda: Transformer(args))) if isinstance(node, nnx.Param))
    return shd.state_logical_axes(args), params


def transient_estimate(args: ModelArgs, rows: int, prefill_tokens: int, max_seq_len: int) -> dict[str, int]:
    """The transient estimate of the module docstring, in bytes for `rows` rows on one device, for
    prefill calls of `prefill_tokens` positions over a context of up to `max_seq_len`:
    {"prefill": ..., "decode": ..., "prefill layer": largest layer working set in prefill,
    "hc stream": ..., "logits": ...}."""
    a = args
    b = rows

    def layer_peak(layer: int, s: int, keys: int) -> int:
        """Largest working set of one layer for s queries over `keys` positions of context."""
        r = a.compress_ratios[layer] if layer < len(a.compress_ratios) else 0
        rows_r = keys // r if r else 0
        k = a.window_size + (min(a.index_topk, rows_r) if r else 0)
        attention = 2 * b * s * a.n_heads * a.head_dim * 2 + b * s * k * a.head_dim * 2 + b * s * a.n_heads * k * 4
        index = 0
        if a.is_index_source(layer):
            cols = index_score_block(b, s, a.index_n_heads, rows_r)
            index = b * s * a.index_n_heads * cols * 4 + b * s * rows_r * 2
        _, topk = a.moe_experts(layer)
        moe = 2 * b * s * topk * a.moe_inter_dim * 4 + b * s * topk * a.dim * 2
        return max(attention, index, moe)

    def program(s: int, keys: int) -> tuple[int, int]:
        peak = max(layer_peak(i, s, keys) for i in range(a.n_layers))
        return 2 * b * s * a.hc_mult * a.dim * 2 + peak + b * a.vocab_size * 4, peak

    prefill, prefill_layer = program(prefill_tokens, max_seq_len)
    decode, _ = program(1, max_seq_len)
    return {"prefill": prefill, "decode": decode, "prefill layer": prefill_layer,
            "hc stream": 2 * b * prefill_tokens * a.hc_mult * a.dim * 2, "logits": b * a.vocab_size * 4}


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device (and in total) of one configuration; see the module docstring."""

    mesh: dict[str, int]
    max_seq_len: int
    batch: int  # as asked
    padded_batch: int  # a multiple of the data axis
    prefill_tokens: int
    params: int  # parameter count (weights; block scales not counted)
    weights_total: dict[str, int]  # part -> bytes of the whole model
    weights_device: dict[str, int]  # part -> bytes on each device
    cache_total: int
    cache_device: int
    transient: dict[str, int]  # transient_estimate(...), per device

    @property
    def n_devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def weights_per_device(self) -> int:
        return sum(self.weights_device.values())

    @property
    def transient_per_device(self) -> int:
        return max(self.transient["prefill"], self.transient["decode"])

    @property
    def resident_per_device(self) -> int:
        """Weights + cache."""
        return self.weights_per_device + self.cache_device

    @property
    def total_per_device(self) -> int:
        return self.resident_per_device + self.transient_per_device

    def fits(self, chip: str, *, with_transient: bool = True) -> bool:
        need = self.total_per_device if with_transient else self.resident_per_device
        return need <= CHIPS[chip]


def memory_plan(args: ModelArgs, mesh: str | Mapping[str, int], max_seq_len: int, batch: int = 1, *,
                prefill_tokens: int | None = None, rules: shd.Rules = shd.DEFAULT_RULES) -> MemoryPlan:
    """The memory plan of `args` on a mesh given as a spec ("expert=8,data=1") or {axis: size}.

    prefill_tokens: positions of one prefill call (a prefill chunk; default max_seq_len).
    Raises ShardingError if the expert axis does not divide the routed experts, ValueError for a
    non-positive batch, max_seq_len or prefill_tokens > max_seq_len.
    """
    sizes = shd.parse_mesh_spec(mesh if isinstance(mesh, str) else shd.format_mesh_spec(mesh))
    shd.check_mesh_sizes(sizes, args)
    if batch < 1 or max_seq_len < 1:
        raise ValueError(f"batch ({batch}) and max_seq_len ({max_seq_len}) must be positive")
    prefill_tokens = max_seq_len if prefill_tokens is None else prefill_tokens
    if not 1 <= prefill_tokens <= max_seq_len:
        raise ValueError(f"prefill_tokens ({prefill_tokens}) must be in [1, max_seq_len={max_seq_len}]")
    if args.engram_layer_ids and args.engram_rows_multiple == 1:
        # a hub config: lay the Engram tables out as dsv41-convert stores them for this mesh, rows
        # padded to the number of pieces the engram_rows rule makes (else a table whose row count
        # that number does not divide would be counted whole on every device)
        args = args.replace(engram_rows_multiple=math.prod(sizes.get(a, 1) for a in rules.mesh_axes("engram_rows")))
    layout, params = _state_layout(args)
    total = dict.fromkeys(WEIGHT_PARTS, 0)
    device = dict.fromkeys(WEIGHT_PARTS, 0)
    n_params = 0
    for path, (axes, a) in layout.items():
        part = _weight_part(path)
        nbytes = _nbytes(a)
        total[part] += nbytes
        device[part] += _per_device(nbytes, shd.logical_to_spec(axes, a.shape, sizes, rules, name=path), sizes)
        if path in params and not path.endswith(".scale"):
            # block scales are not parameters (SPEC §15 counts); a packed fp4 int8 holds two values
            n = int(np.prod(a.shape, dtype=np.int64)) * (2 if a.dtype == np.int8 else 1)
            if path.endswith(".engram.embed.weight"):  # padding rows are not parameters
                layer = int(path.split(".")[1])
                n = n // a.shape[0] * args.engram_num_embeddings[args.engram_table_index(layer)]
            n_params += n

    padded = -(-batch // sizes["data"]) * sizes["data"]
    from dsv41_jax.cache import init_cache

    cache_shapes = jax.eval_shape(lambda: init_cache(args, padded, max_seq_len))
    cache_specs = shd.cache_partition_specs(args, padded, max_seq_len, sizes, rules, strict=True)
    leaves = jax.tree_util.tree_flatten_with_path(cache_shapes)[0]
    cache_total = sum(_nbytes(a) for _, a in leaves)
    cache_device = sum(_per_device(_nbytes(a), cache_specs[shd.cache_path(p)], sizes) for p, a in leaves)
    return MemoryPlan(
        mesh=sizes, max_seq_len=max_seq_len, batch=batch, padded_batch=padded, prefill_tokens=prefill_tokens,
        params=n_params, weights_total=total, weights_device=device, cache_total=cache_total,
        cache_device=cache_device,
        transient=transient_estimate(args, padded // sizes["data"], prefill_tokens, max_seq_len),
    )


def format_plan(plan: MemoryPlan) -> str:
    """A table: rows = parts, columns = whole model / per device (GB, or MB for a model under
    1 GB), then the verdicts."""
    p = plan
    unit, scale = ("GB", 1e9) if sum(p.weights_total.values()) >= 1e9 else ("MB", 1e6)

    def _gb(n: int) -> str:
        return f"{n / scale:10.2f}"

    lines = [
        f"memory plan: mesh {shd.format_mesh_spec(p.mesh)} ({p.n_devices} devices), max_seq_len {p.max_seq_len}, "
        f"batch {p.batch}" + (f" (padded to {p.padded_batch} for data={p.mesh['data']})" if p.padded_batch != p.batch
                              else "") + f", prefill {p.prefill_tokens} tokens per call",
        f"{p.params:,} parameters",
        "",
        f"{'part':<34}{'total ' + unit:>10}  {'per device ' + unit:>13}",
    ]
    for part in WEIGHT_PARTS:
        lines.append(f"{'weights: ' + part:<34}{_gb(p.weights_total[part])}  {_gb(p.weights_device[part]):>13}")
    lines.append(f"{'weights':<34}{_gb(sum(p.weights_total.values()))}  {_gb(p.weights_per_device):>13}")
    lines.append(f"{'cache (batch ' + str(p.padded_batch) + ')':<34}{_gb(p.cache_total)}  {_gb(p.cache_device):>13}")
    t = p.transient
    lines.append(f"{'transient, prefill (estimate)':<34}{'':>10}  {_gb(t['prefill']):>13}")
    lines.append(f"{'transient, decode step (estimate)':<34}{'':>10}  {_gb(t['decode']):>13}")
    lines.append(f"{'weights + cache':<34}{'':>10}  {_gb(p.resident_per_device):>13}")
    lines.append(f"{'weights + cache + transient':<34}{'':>10}  {_gb(p.total_per_device):>13}")
    lines += ["", f"{'fits ' + str(p.n_devices) + ' x':<14}{'GB/chip':>8}  {'weights+cache':>13}  {'+ transient':>11}"]
    for chip, cap in CHIPS.items():
        yes = {False: "no", True: "yes"}
        lines.append(f"{chip:<14}{cap / 1e9:8.0f}  {yes[p.fits(chip, with_transient=False)]:>13}  "
                     f"{yes[p.fits(chip)]:>11}")
    lines.append("")
    lines.append("transient: hc stream + the largest layer working set + logits of one prefill call or decode step "
                 "(dsv41_jax/plan.py docstring); an estimate")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv41_jax.plan", description=__doc__.split("\n")[0])
    ap.add_argument("--mesh", default=DEFAULT_PLAN_MESH, help=f"mesh spec (default {DEFAULT_PLAN_MESH})")
    ap.add_argument("--config", help="config.json (default: the released config)")
    ap.add_argument("--max-seq-len", type=int, default=65536)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prefill-tokens", type=int,
                    help="positions per prefill call, as dsv41-generate --prefill-chunk (default: max_seq_len)")
    ns = ap.parse_args(argv)
    try:
        plan = memory_plan(load_config(ns.config), ns.mesh, ns.max_seq_len, ns.batch,
                           prefill_tokens=ns.prefill_tokens)
    except (ValueError, FileNotFoundError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
