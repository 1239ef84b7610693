"""Model configuration: one frozen, typed `ModelArgs` built from the official `inference/config.json`.

Field names equal the JSON keys. Keys absent from the JSON keep the defaults below (the runtime
limits `max_batch_size`, `max_seq_len`, `temperature`, `gate_temp`, `norm_topk_prob`, the
kernel choices `kernels`, `kernels_interpret`, `fp4_scale_fold`, `fp4_relaid`, the attention's precision
`attn_accumulate` and the Engram storage padding `engram_rows_multiple` are not in the released
file). Per-layer facts (attention role, which source layer a reuse layer reads, RoPE base,
Engram table) are derived here as plain Python, so jitted code can branch on them statically.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Literal

# Blocks of the quantised formats (SPEC §13): activations / fp8 weights / fp4 weights per 32
# elements along K; compressed KV is FP4-QDQ'd in groups of 16.
QUANT_BLOCK = 32
COMPRESSED_KV_BLOCK = 16

AttnRole = Literal["window", "source", "reindex", "reuse"]


class ConfigError(ValueError):
    """A config.json (or override) that the model cannot run with."""


_TUPLE_FIELDS = (
    "compress_ratios",
    "kv_source_layers",
    "index_source_layers",
    "engram_layer_ids",
    "engram_num_embeddings",
    "dspark_target_layer_ids",
)


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """Every field of SPEC §1.1 plus the runtime limits; hashable, so usable as a jit static."""

    # runtime limits: they size caches and the RoPE table
    max_batch_size: int = 4
    max_seq_len: int = 4096
    temperature: float = 1.0
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    # Pallas-backed sites (pallas_kernels/_dispatch.py): "auto" = the kernel on GPU/TPU and the
    # jnp reference on CPU, "reference" = always the reference, "pallas" = always the kernel (on
    # CPU only with kernels_interpret=True, Pallas interpret mode)
    kernels: str = "auto"
    kernels_interpret: bool = False
    # the sparse attention's accumulation: "f64" = float64, the golden oracle's rounding (the XLA
    # float64 reference on every backend that has float64); "f32" = f32 (the Pallas kernels where
    # `kernels` picks them, else the f32 reference): faster, and about 0.04-0.2% of the attention's
    # bf16 outputs round to the other neighbour; "auto" = "f64" except on TPU (no float64): "f32"
    attn_accumulate: str = "auto"
    # the routed experts' fp4 kernel ("pairs" decode): "on" folds its x 2^126 into the e8m0 scales,
    # one packed bf16 multiply per two codes fewer, bit-identical while every routed-expert scale
    # byte is <= 128 (scales <= 2); the loaders check the bytes and refuse "on" otherwise; "auto":
    # the loaders turn it "on" when the bytes allow, else "off" (`loading.resolve_fp4_scale_fold`);
    # a model built without a loader treats "auto" as "off". "auto" by default: 3% faster decode at
    # batch 1, 7.5% at 64 on an H200 (benchmarks/README.md, twenty-third run)
    fp4_scale_fold: str = "auto"
    # the routed experts' packed fp4 words in HBM: "on" re-laid once at load for the fp4 kernel's
    # "relaid" decode (a bit permutation within each int32 word, same bytes: fewer integer steps a
    # code, bit-identical outputs; the jnp paths put gathered words back first); "off": as released;
    # "auto": the loaders re-lay where the compiled GPU kernel runs, else keep them as released
    # (`loading.resolve_fp4_relaid`); a model built without a loader treats "auto" as "off".
    # "auto" by default: the GPU golden parity passes with it and a decode step at batch 1 is 1.4%
    # faster on an H100 (benchmarks/README.md, thirty-sixth session)
    fp4_relaid: str = "auto"
    # storage layout: Engram table rows are padded with zero rows up to a multiple of this, so a
    # table splits evenly over the devices of its sharding rule (no hash id reaches a padded row);
    # dsv41-convert picks it for the mesh and records it in the manifest of the converted checkpoint
    engram_rows_multiple: int = 1
    # storage dtypes
    dtype: str = "fp8"
    expert_dtype: str | None = "fp4"
    # shape
    vocab_size: int = 129280
    dim: int = 5120
    moe_inter_dim: int = 2304
    n_layers: int = 40
    n_mtp_layers: int = 3
    n_heads: int = 64
    # MoE
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    # attention
    q_lora_rank: int = 1280
    head_dim: int = 512
    rope_head_dim: int = 64
    norm_eps: float = 1e-20
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0,) * 3
    kv_source_layers: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layers: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    # RoPE / YaRN
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 65536
    rope_theta: float = 10000.0
    rope_factor: float = 16.0
    beta_fast: int = 32
    beta_slow: int = 1
    # indexer
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    # hyper-connections
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Engram
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # vision
    vision_n_layers: int = 32
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14
    vision_rope_theta: float = 10000.0
    vision_downsample_ratio: int = 3
    vision_max_n_token: int = 1024
    vision_min_pixels: int = 295936
    vision_max_wh_ratio: float | None = None
    image_token_id: int = 129264
    # DSpark draft head
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_n_activated_experts: int = 3

    def __post_init__(self):
        for name in _TUPLE_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        self.validate()

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config", **overrides) -> ModelArgs:
        """Builds from a config.json dict; unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        merged = {**data, **overrides}
        unknown = sorted(set(merged) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown config keys {unknown}; expected a subset of the ModelArgs fields")
        return cls(**merged)

    @classmethod
    def from_json(cls, path: str | os.PathLike, **overrides) -> ModelArgs:
        """Reads `inference/config.json` (or a directory holding `config.json`)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
        return cls.from_dict(data, source=path, **overrides)

    def replace(self, **changes) -> ModelArgs:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def tiny(cls, **overrides) -> ModelArgs:
        """A seven-layer model with every attention role, Engram and candidates, for unit tests."""
        base = dict(
            max_batch_size=2, max_seq_len=128, vocab_size=256, dim=64, moe_inter_dim=64, n_layers=7,
            n_mtp_layers=0, n_heads=4, n_routed_experts=8, n_activated_experts=2, q_lora_rank=64,
            head_dim=64, rope_head_dim=16, o_groups=2, o_lora_rank=32, window_size=8,
            compress_ratios=(0, 0, 2, 2, 1, 1, 1), kv_source_layers=(2, 4), index_source_layers=(2, 4, 6),
            index_n_heads=4, index_head_dim=32, index_topk=6, candidate_source_layer=4,
            candidate_topk_blocks=4, candidate_block_size=2, engram_layer_ids=(1,),
            engram_num_embeddings=(1618,), engram_vocab_size=256, engram_n_heads=2, engram_head_dim=32,
            engram_compressed_vocab_size=200, vision_n_layers=0, image_token_id=250,
            dspark_block_size=0, dspark_noise_token_id=0, dspark_target_layer_ids=(),
            dspark_markov_rank=32, dspark_n_routed_experts=4, dspark_n_activated_experts=2,
        )
        base.update(overrides)
        return cls(**base)

    # ------------------------------------------------------------------ validation

    def validate(self) -> None:
        def fail(msg):
            raise ConfigError(msg)

        n, n_all = self.n_layers, self.total_layers
        if n <= 0:
            fail(f"n_layers must be positive, got {n}")
        if self.kernels not in ("auto", "reference", "pallas"):
            fail(f"kernels must be 'auto', 'reference' or 'pallas', got {self.kernels!r}")
        if self.attn_accumulate not in ("auto", "f64", "f32"):
            fail(f"attn_accumulate must be 'auto', 'f64' or 'f32', got {self.attn_accumulate!r}")
        if self.fp4_scale_fold not in ("off", "auto", "on"):
            fail(f"fp4_scale_fold must be 'off', 'auto' or 'on', got {self.fp4_scale_fold!r}")
        if self.fp4_relaid not in ("off", "auto", "on"):
            fail(f"fp4_relaid must be 'off', 'auto' or 'on', got {self.fp4_relaid!r}")
        if self.dtype not in ("fp8", "bf16"):
            fail(f"dtype must be 'fp8' or 'bf16', got {self.dtype!r}")
        if self.expert_dtype not in ("fp4", None):
            fail(f"expert_dtype must be 'fp4' or null, got {self.expert_dtype!r}")
        if self.score_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
            fail(f"score_func must be sqrtsoftplus/softmax/sigmoid, got {self.score_func!r}")
        if len(self.compress_ratios) < n_all:
            fail(
                f"compress_ratios has {len(self.compress_ratios)} entries but the model has {n_all} layers "
                f"(n_layers={n} + {n_all - n} DSpark stages); one ratio per layer is required"
            )
        for i, r in enumerate(self.compress_ratios):
            if not isinstance(r, int) or r < 0:
                fail(f"compress_ratios[{i}] = {r!r}: ratios must be non-negative integers")
        for name in ("kv_source_layers", "index_source_layers", "engram_layer_ids", "dspark_target_layer_ids"):
            ids = getattr(self, name)
            bad = [i for i in ids if not 0 <= i < n]
            if bad:
                fail(f"{name} {list(ids)}: layer ids {bad} are outside the backbone 0..{n - 1}")
            if list(ids) != sorted(set(ids)):
                fail(f"{name} {list(ids)} must be strictly increasing")
        for i in self.kv_source_layers:
            if self.compress_ratios[i] == 0:
                fail(f"kv_source_layers contains layer {i}, whose compress ratio is 0: a kv source must compress")
        for i in self.index_source_layers:
            if self.compress_ratios[i] == 0:
                fail(f"index_source_layers contains layer {i}, whose compress ratio is 0")
        for i in range(n):
            r = self.compress_ratios[i]
            if r == 0:
                continue
            src = self.kv_source_of(i)
            if src is None:
                fail(f"layer {i} has compress ratio {r} but no kv source layer at or below it")
            if self.compress_ratios[src] != r:
                fail(f"layer {i} (ratio {r}) would read the compressed KV of layer {src} (ratio {self.compress_ratios[src]})")
            if self.index_source_of(i) is None:
                fail(f"layer {i} has compress ratio {r} but no index source layer at or below it")
            isrc = self.index_source_of(i)
            if self.compress_ratios[isrc] != r:
                fail(f"layer {i} (ratio {r}) would reuse the top-k of layer {isrc} (ratio {self.compress_ratios[isrc]})")
        if self.candidate_source_layer >= 0:
            c = self.candidate_source_layer
            if c not in self.index_source_layers:
                fail(f"candidate_source_layer {c} must be one of index_source_layers {list(self.index_source_layers)}")
            if self.candidate_block_size <= 0 or self.candidate_topk_blocks <= 0:
                fail("candidate_block_size and candidate_topk_blocks must be positive when candidate_source_layer >= 0")
            for i in self.index_source_layers:
                if i > c and self.compress_ratios[i] != self.compress_ratios[c]:
                    fail(f"index source {i} masks with layer {c}'s candidates but has a different compress ratio")
        # widths the 32-blocks must divide (activation quant along K, fp8 32x32 and fp4 per-32 scales)
        blocked = {
            "dim": self.dim,
            "q_lora_rank": self.q_lora_rank,
            "head_dim": self.head_dim,
            "moe_inter_dim": self.moe_inter_dim,
            "index_head_dim": self.index_head_dim,
            "o_groups * o_lora_rank": self.o_groups * self.o_lora_rank,
        }
        if self.engram_layer_ids:
            blocked["engram_head_dim"] = self.engram_head_dim
        for what, width in blocked.items():
            if width <= 0 or width % QUANT_BLOCK:
                fail(f"{what} = {width} must be a positive multiple of {QUANT_BLOCK} (the quantisation block)")
        if self.n_heads % self.o_groups:
            fail(f"n_heads = {self.n_heads} must be divisible by o_groups = {self.o_groups}")
        if (self.n_heads * self.head_dim // self.o_groups) % QUANT_BLOCK:
            fail("n_heads * head_dim / o_groups must be a multiple of 32")
        if self.rope_head_dim % 2 or not 0 < self.rope_head_dim <= min(self.head_dim, self.index_head_dim):
            fail(f"rope_head_dim = {self.rope_head_dim} must be even and at most head_dim and index_head_dim")
        if self.hc_mult < 1 or self.hc_sinkhorn_iters < 1:
            fail("hc_mult and hc_sinkhorn_iters must be >= 1")
        if self.n_shared_experts != 1:
            fail(f"n_shared_experts = {self.n_shared_experts}: the model has exactly one shared expert")
        if not 0 < self.n_activated_experts <= self.n_routed_experts:
            fail(f"n_activated_experts = {self.n_activated_experts} must be in 1..n_routed_experts ({self.n_routed_experts})")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            fail(
                f"engram_num_embeddings has {len(self.engram_num_embeddings)} entries for "
                f"{len(self.engram_layer_ids)} engram_layer_ids"
            )
        if self.engram_layer_ids and (self.engram_max_ngram_size < 2 or self.engram_n_heads < 1):
            fail("Engram needs engram_max_ngram_size >= 2 and engram_n_heads >= 1")
        if self.engram_layer_ids and self.engram_compressed_vocab_size <= 0:
            fail("engram_compressed_vocab_size must be positive when Engram layers exist")
        if self.dspark_enabled and not self.dspark_target_layer_ids:
            fail("DSpark stages (n_mtp_layers > 0, dspark_block_size > 0) need dspark_target_layer_ids")
        if self.max_seq_len <= 0 or self.max_batch_size <= 0:
            fail("max_seq_len and max_batch_size must be positive")
        if not isinstance(self.engram_rows_multiple, int) or self.engram_rows_multiple < 1:
            fail(f"engram_rows_multiple must be a positive integer, got {self.engram_rows_multiple!r}")

    # ------------------------------------------------------------------ derived facts

    @property
    def dspark_enabled(self) -> bool:
        return self.dspark_block_size > 0 and self.n_mtp_layers > 0

    @property
    def total_layers(self) -> int:
        """Backbone layers plus the DSpark stages that exist (ids n_layers..)."""
        return self.n_layers + (self.n_mtp_layers if self.dspark_enabled else 0)

    @property
    def vision_enabled(self) -> bool:
        return self.vision_n_layers > 0

    @property
    def n_hash_cols(self) -> int:
        """Engram hash columns per layer: (max n-gram - 1) sizes x heads."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def compress_ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def is_kv_source(self, layer: int) -> bool:
        """Owns a Compressor, compressed-KV cache and index keys."""
        return layer < self.n_layers and layer in self.kv_source_layers

    def is_index_source(self, layer: int) -> bool:
        """Runs its own Indexer (query side) and publishes top-k."""
        return layer < self.n_layers and layer in self.index_source_layers

    def is_candidate_source(self, layer: int) -> bool:
        return layer == self.candidate_source_layer

    def uses_candidates(self, layer: int) -> bool:
        """An index source above the candidate source masks its scores to the candidate blocks."""
        return self.is_index_source(layer) and 0 <= self.candidate_source_layer < layer

    def attn_role(self, layer: int) -> AttnRole:
        """window-only / full source / reindex (own indexer query side) / reuse."""
        if self.compress_ratios[layer] == 0 or layer >= self.n_layers:
            return "window"
        if self.is_kv_source(layer):
            return "source"
        if self.is_index_source(layer):
            return "reindex"
        return "reuse"

    def kv_source_of(self, layer: int) -> int | None:
        """The layer whose compressed KV (and index keys) `layer` reads: the latest kv source <= layer."""
        if layer >= self.n_layers or self.compress_ratios[layer] == 0:
            return None
        srcs = [s for s in self.kv_source_layers if s <= layer]
        return srcs[-1] if srcs else None

    def index_source_of(self, layer: int) -> int | None:
        """The layer whose top-k `layer` uses: the latest index source <= layer."""
        if layer >= self.n_layers or self.compress_ratios[layer] == 0:
            return None
        srcs = [s for s in self.index_source_layers if s <= layer]
        return srcs[-1] if srcs else None

    def uses_yarn(self, layer: int) -> bool:
        return self.compress_ratios[layer] > 0

    def rope_base(self, layer: int) -> float:
        return self.compress_rope_theta if self.compress_ratios[layer] > 0 else self.rope_theta

    def rope_original_seq_len(self, layer: int) -> int:
        """YaRN's original length for this layer's table; 0 disables YaRN (window-only layers)."""
        return self.original_seq_len if self.compress_ratios[layer] > 0 else 0

    def engram_table_index(self, layer: int) -> int | None:
        """Which Engram table (and hash column slice) a layer uses, or None."""
        return self.engram_layer_ids.index(layer) if layer in self.engram_layer_ids else None

    def moe_experts(self, layer: int) -> tuple[int, int]:
        """(routed, activated) experts; DSpark stages have their own counts."""
        if layer < self.n_layers:
            return self.n_routed_experts, self.n_activated_experts
        return (
            self.dspark_n_routed_experts or self.n_routed_experts,
            self.dspark_n_activated_experts or self.n_activated_experts,
        )

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    def compressed_len(self, layer: int, seq_len: int) -> int:
        """Rows of compressed KV a kv source holds for `seq_len` tokens."""
        r = self.compress_ratios[layer]
        return seq_len // r if r else 0

    def describe_layers(self) -> list[str]:
        """One human-readable line per backbone layer (role, source, RoPE, Engram)."""
        out = []
        for i in range(self.n_layers):
            role = self.attn_role(i)
            parts = [f"layer {i}: ratio {self.compress_ratios[i]}, {role}"]
            if role in ("reuse", "reindex"):
                parts.append(f"kv of {self.kv_source_of(i)}")
            if role == "reuse":
                parts.append(f"top-k of {self.index_source_of(i)}")
            if self.is_candidate_source(i):
                parts.append("candidate source")
            if self.uses_candidates(i):
                parts.append(f"masked to candidates of {self.candidate_source_layer}")
            parts.append(f"rope {self.rope_base(i):g}{' + YaRN' if self.uses_yarn(i) else ''}")
            if self.engram_table_index(i) is not None:
                parts.append(f"Engram table {self.engram_table_index(i)}")
            out.append(", ".join(parts))
        return out


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
