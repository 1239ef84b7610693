"""Parity against golden sets produced by the official PyTorch reference (SPEC §20).

A golden set is a directory with a tiny hub-format checkpoint (`model.safetensors.index.json` +
shards), `config.json`, `inputs.json`, `engram_map.npy` and `expected.npz` (bf16 arrays stored as
uint16 bits under keys ending in `.bf16`). The port runs teacher-forced: each block gets the
golden input of its step, so every block is compared on its own (the tiny random models are
chaotic end to end).

    python -m dsv41_jax.parity GOLDEN_DIR [--out RESULT.npz]

writes every array the port computes under the golden key names / shapes / encodings, prints a
table (array, max abs err, worst err / RMS, ok) and exits 1 if any array fails its criterion.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from dsv41_jax.attention import Attention, Indexer, previous_call_index_k_owner
from dsv41_jax.cache import init_cache
from dsv41_jax.checkpoint import CheckpointError
from dsv41_jax.config import ModelArgs
from dsv41_jax.engram import engram_hash
from dsv41_jax.loading import load_hub_weights, resolve_fp4_options
from dsv41_jax.mhc import identity_pre_mix
from dsv41_jax.model import Transformer
from dsv41_jax.moe import Experts, Gate

# Parts of a golden checkpoint that the text model does not hold (vision tower, DSpark stages).
NOT_IN_TEXT_MODEL = ("vision.", "aligner.", "image_start", "image_end", "image_newline", "mtp.")

# Criteria (SPEC §20), with the bounds measured on the shipped golden sets (tests pin them):
BF16_REL = 2.0**-7  # bf16 streams: |port - gold| <= 2^-7 |gold| + 2^-7 RMS(gold)
PREMIX_ATOL = 3e-4  # measured max 1.0e-4 (tiny-c L08), at single tokens where an upstream rounding flipped
ROUTE_W_ATOL = 6e-4  # measured max 2.6e-4 (tiny-c L08), same tokens
LOGITS_ATOL = 1e-2  # logits from the golden final stream


class GoldenSet:
    """One golden directory: config, inputs, expected arrays (bf16 keys decoded on access)."""

    def __init__(self, path):
        self.path = Path(path)
        self.name = self.path.name
        for f in ("expected.npz", "config.json", "inputs.json"):
            if not (self.path / f).exists():
                raise FileNotFoundError(f"golden set {self.path}: missing {f}")
        self._npz = np.load(self.path / "expected.npz")
        self.inputs = json.loads((self.path / "inputs.json").read_text())

    def keys(self) -> list[str]:
        return list(self._npz.keys())

    def __contains__(self, key: str) -> bool:
        return key in self._npz or key + ".bf16" in self._npz

    def __getitem__(self, key: str) -> np.ndarray:
        """Array by key; the `.bf16` suffix may be omitted (uint16 bits become bfloat16)."""
        if key not in self._npz:
            key = key + ".bf16"
        arr = self._npz[key]
        return arr.view(ml_dtypes.bfloat16) if key.endswith(".bf16") else arr

    @property
    def args(self) -> ModelArgs:
        rt = self.inputs.get("runtime", {})
        return ModelArgs.from_json(self.path / "config.json", max_batch_size=rt.get("max_batch_size", 4),
                                   max_seq_len=rt.get("max_seq_len", 4096))

    def token_types(self) -> np.ndarray | None:
        tt = self.inputs.get("token_types")
        return None if tt is None else np.asarray(tt, np.int32)


def load_model(gs: GoldenSet, **overrides) -> Transformer:
    """The text model with the set's weights and Engram token map (strict: every text tensor used);
    `overrides`: ModelArgs fields to change, e.g. kernels="reference" or max_seq_len=256."""
    model = Transformer(gs.args.replace(**overrides))
    load_hub_weights(model, gs.path, skip=NOT_IN_TEXT_MODEL)
    resolve_fp4_options(model, model.args, source=str(gs.path))
    if model.token_map is not None:
        model.token_map.set_value(jnp.asarray(np.load(gs.path / "engram_map.npy"), jnp.int32))
    return model


@nnx.jit
def _run_block(block, x, pre_mix, shared, image_mask):
    return block(x, pre_mix, shared, image_mask)[:4]


@nnx.jit
def _run_engram(engram, x, hashes, mask):
    return engram(x, hashes, mask)


@nnx.jit
def _logits(model, x, pre_mix):
    return model.logits(x, pre_mix)


@nnx.jit
def _hashes(model, ids, mask):
    history = jnp.zeros((ids.shape[0], model.args.max_seq_len), jnp.int32)
    return engram_hash(ids, 0, history, mask, model.engram_layout, model.token_map[...])[0]


def teacher_forced_prefill(model: Transformer, gs: GoldenSet, n_layers: int | None = None) -> dict[str, np.ndarray]:
    """Runs every block (or the first `n_layers`) on its golden input; returns the port's arrays
    keyed like expected.npz (without the `.bf16` suffix; values in their natural dtype)."""
    a = model.args
    ids = jnp.asarray(gs["inputs.prompt"], jnp.int32)
    b, s = ids.shape
    tt = gs.token_types()
    image_mask = None if tt is None else jnp.asarray(tt >= 0)
    engram_mask = None if image_mask is None else ~image_mask
    out: dict[str, np.ndarray] = {}
    # h0: the embedding lookup; image-span rows carry vision features, taken from the golden set
    h0 = model.embed(ids)
    if image_mask is not None:
        h0 = jnp.where(image_mask[..., None], jnp.asarray(gs["prefill.h0"], jnp.bfloat16), h0)
    out["prefill.h0"] = np.asarray(h0)
    hashes = None
    if a.engram_layer_ids:
        hashes = _hashes(model, ids, engram_mask)
        out["prefill.engram_hashes"] = np.asarray(hashes).astype(np.int64)
    shared: dict = {}
    for i, layer in enumerate(model.layers):
        if n_layers is not None and i >= n_layers:
            return out
        if i == 0:
            g0 = jnp.asarray(gs["prefill.h0"], jnp.bfloat16)
            x = jnp.broadcast_to(g0[:, :, None, :], (b, s, a.hc_mult, a.dim))
            pre = identity_pre_mix(b, s, a.hc_mult)
        else:
            x = jnp.asarray(gs[f"prefill.block_out.L{i - 1:02d}"], jnp.bfloat16)
            pre = jnp.asarray(gs[f"prefill.block_premix.L{i - 1:02d}"])
        tag = f"L{i:02d}"
        if layer.engram is not None:
            col = a.engram_table_index(i)
            golden_hashes = jnp.asarray(gs["prefill.engram_hashes"][:, :, col, :], jnp.int32)
            out[f"prefill.engram_out.{tag}"] = np.asarray(_run_engram(layer.engram, x, golden_hashes, engram_mask))
            x = jnp.asarray(gs[f"prefill.engram_out.{tag}"], jnp.bfloat16)
        x_out, pre_out, shared, aux = _run_block(layer, x, pre, shared, image_mask)
        out[f"prefill.block_out.{tag}"] = np.asarray(x_out)
        out[f"prefill.block_premix.{tag}"] = np.asarray(pre_out)
        for k, v in aux.items():
            out[f"prefill.{_AUX_NAMES.get(k, k)}.{tag}"] = np.asarray(v)
        if a.is_index_source(i):
            out[f"prefill.index_k_owner.{tag}"] = np.asarray(a.kv_source_of(i), np.int64)
    last = a.n_layers - 1
    logits = _logits(model, jnp.asarray(gs[f"prefill.block_out.L{last:02d}"], jnp.bfloat16),
                     jnp.asarray(gs[f"prefill.block_premix.L{last:02d}"]))
    out["prefill.logits"] = np.asarray(logits)
    out["prefill.next_token"] = np.asarray(logits).argmax(-1).astype(np.int64)
    return out


_AUX_NAMES = {"kv_state": "compressor_kv_state", "score_state": "compressor_score_state"}


# ------------------------------------------------------------------------------------ decode

# golden prefix of a decode run -> reference_compat
DECODE_MODES = {"decode_fixed": False, "decode": True}
# columns the reference does not have in decode (it scores only the visible (pos+1)//r rows):
# what the port must hold there, and what the golden arrays pad with
_PADDED = {"candidates": False, "index_score": -np.inf, "cand_block_score": -np.inf}
# golden decode keys that are inputs of the run, not results
_DECODE_INPUTS = ("input", "start_pos", "index_width")
# kinds compared exactly, and every kind not compared as a bf16 stream (`compare_array`)
_EXACT_KINDS = ("topk", "candidates", "engram_hashes", "next_token", "index_k_owner")
_NOT_STREAMS = _EXACT_KINDS + ("route_idx", "route_w", "compressor_kv_state", "compressor_score_state",
                               "block_premix", "logits")


def _tag(i: int) -> str:
    return f"L{i:02d}"


def _bf16(a) -> jax.Array:
    return jnp.asarray(np.asarray(a), jnp.bfloat16)


@nnx.jit
def _tf_prefill(model, ids, token_types, cache, xs, pres, eng):
    """Every block's cached prefill on its golden input (xs / pres / eng: per layer)."""
    b, s = ids.shape
    lengths = jnp.full((b,), s, jnp.int32)
    image_mask = None if token_types is None else token_types >= 0
    engram_mask = None if image_mask is None else ~image_mask
    cache, layers = dict(cache), list(cache["layers"])
    if model.engram_layout is not None:
        _, cache["engram_history"] = engram_hash(
            ids, 0, cache["engram_history"], engram_mask, model.engram_layout, model.token_map[...])
    shared: dict = {}
    for i, layer in enumerate(model.layers):
        x = eng[i] if layer.engram is not None else xs[i]  # prefill Engram parity: teacher_forced_prefill
        _, _, shared, layers[i], _, _ = layer.prefill(x, pres[i], shared, image_mask, layers[i], lengths)
    cache["layers"], cache["seq_len"] = layers, lengths
    return cache


@nnx.jit
def _tf_decode(model, ids, pos, cache, xs, pres, eng, final, compat):
    """One decode step with every block on its golden input; `compat` is a traced bool, so one
    compiled program serves both modes. Returns (golden-named arrays, cache)."""
    a = model.args
    cache, layers = dict(cache), list(cache["layers"])
    rec = {"h0": model.embed(ids)[:, None]}
    if model.engram_layout is not None:
        hashes, cache["engram_history"] = model.decode_hashes(ids, pos, cache["engram_history"])
        rec["engram_hashes"] = hashes
    shared = {}
    if a.kv_source_layers and a.compress_ratios[a.kv_source_layers[-1]] == 1:
        # what the reference's pointer holds when the call starts (read only in compat mode)
        owner = previous_call_index_k_owner(a)
        shared = {"index_k": layers[owner]["index_k"], "index_k_owner": jnp.full(ids.shape, owner, jnp.int32)}
    for i, layer in enumerate(model.layers):
        x = xs[i]
        if layer.engram is not None:
            rec[f"engram_out.{_tag(i)}"] = layer.engram(x, hashes[:, :, a.engram_table_index(i), :], None)
            x = eng[i]
        out, pre, shared, layers[i], aux, _ = layer.decode(x, pres[i], shared, layers[i], pos, compat)
        rec[f"block_out.{_tag(i)}"], rec[f"block_premix.{_tag(i)}"] = out, pre
        rec.update({f"{_AUX_NAMES.get(k, k)}.{_tag(i)}": v for k, v in aux.items()})
    rec["logits"] = model.logits(*final)
    cache["layers"], cache["seq_len"] = layers, pos + 1
    return rec, cache


def _prefill_teacher(gs: GoldenSet):
    a = gs.args
    h0 = _bf16(gs["prefill.h0"])
    b, s = h0.shape[:2]
    xs = [jnp.broadcast_to(h0[:, :, None, :], (b, s, a.hc_mult, a.dim))]
    xs += [_bf16(gs[f"prefill.block_out.{_tag(i - 1)}"]) for i in range(1, a.n_layers)]
    pres = [identity_pre_mix(b, s, a.hc_mult)] + [jnp.asarray(gs[f"prefill.block_premix.{_tag(i - 1)}"])
                                                   for i in range(1, a.n_layers)]
    eng = {i: _bf16(gs[f"prefill.engram_out.{_tag(i)}"]) for i in a.engram_layer_ids}
    return xs, pres, eng


def _step_teacher(gs: GoldenSet, prefix: str, t: int):
    a = gs.args
    h0 = _bf16(gs["decode.h0"][t])  # [b, 1, d]
    b = h0.shape[0]
    xs = [jnp.broadcast_to(h0[:, :, None, :], (b, 1, a.hc_mult, a.dim))]
    xs += [_bf16(gs[f"{prefix}.block_out.{_tag(i - 1)}"][t]) for i in range(1, a.n_layers)]
    pres = [identity_pre_mix(b, 1, a.hc_mult)] + [jnp.asarray(gs[f"{prefix}.block_premix.{_tag(i - 1)}"][t])
                                                  for i in range(1, a.n_layers)]
    eng = {i: _bf16(gs[f"{prefix}.engram_out.{_tag(i)}"][t]) for i in a.engram_layer_ids}
    last = _tag(a.n_layers - 1)
    final = (_bf16(gs[f"{prefix}.block_out.{last}"][t]), jnp.asarray(gs[f"{prefix}.block_premix.{last}"][t]))
    return xs, pres, eng, final


def teacher_forced_cache(model: Transformer, gs: GoldenSet) -> dict:
    """The cache (`dsv41_jax.cache`) after a teacher-forced prefill of the golden prompt: every
    block's cached prefill on its golden input."""
    ids = jnp.asarray(gs["inputs.prompt"], jnp.int32)
    tt = gs.token_types()
    cache = init_cache(gs.args, ids.shape[0], gs.args.max_seq_len)
    return _tf_prefill(model, ids, None if tt is None else jnp.asarray(tt), cache, *_prefill_teacher(gs))


def teacher_forced_decode(model: Transformer, gs: GoldenSet, prefix: str,
                          cache: dict | None = None) -> tuple[dict[str, np.ndarray], list[str]]:
    """The golden decode steps teacher-forced (SPEC §20): the caches seeded by a teacher-forced
    prefill (`teacher_forced_cache`, or `cache`) flow from step to step while every block gets the
    golden input of its step. prefix "decode_fixed" runs the default mode, "decode"
    reference_compat (`DECODE_MODES`).

    Returns (port arrays keyed like expected.npz, stacked over steps, without the `.bf16` suffix;
    problems found while bringing them to the golden shapes - each one a failure).
    """
    if prefix not in DECODE_MODES:
        raise ValueError(f"decode prefix must be one of {sorted(DECODE_MODES)}, got {prefix!r}")
    if "decode.start_pos" not in gs:
        raise KeyError(f"golden set {gs.path} has no decode steps (decode.start_pos)")
    cache = teacher_forced_cache(model, gs) if cache is None else cache
    compat = jnp.asarray(DECODE_MODES[prefix])
    steps = []
    for t in range(len(gs["decode.start_pos"])):
        ids = jnp.asarray(gs["decode.input"][t], jnp.int32)
        pos = jnp.full(ids.shape, int(gs["decode.start_pos"][t]), jnp.int32)
        rec, cache = _tf_decode(model, ids, pos, cache, *_step_teacher(gs, prefix, t), compat)
        steps.append(jax.tree.map(np.asarray, rec))
    rec = {k: np.stack([s[k] for s in steps]) for k in steps[0]}
    return _golden_shaped(gs, prefix, rec)


def _golden_shaped(gs: GoldenSet, prefix: str, rec: dict) -> tuple[dict[str, np.ndarray], list[str]]:
    port, problems = {}, []
    for key, v in rec.items():
        kind = key.split(".")[0]
        name = f"decode.{key}" if kind in ("h0", "engram_hashes") else f"{prefix}.{key}"  # inputs of both runs
        if kind == "index_k_owner":  # [T, b]: one layer per step, the same for every row here
            if not np.all(v == v[:, :1]):
                problems.append(f"{name}: rows read different owners {v.tolist()}")
            v = v[:, 0].astype(np.int64)
        elif kind in _PADDED:
            if name not in gs:  # the golden run did not record it (decode_fixed.index_score, ...)
                continue
            w = gs[name].shape[-1]
            if not np.all(v[..., w:] == _PADDED[kind]):
                problems.append(f"{name}: columns past the reference's width {w} are not {_PADDED[kind]}")
            v = v[..., :w]
        elif kind in ("route_idx", "route_w"):
            v = v.reshape(gs[name].shape) if name in gs else v
        elif kind == "engram_hashes":
            v = v.astype(np.int64)
        port[name] = v
    port[f"{prefix}.next_token"] = port[f"{prefix}.logits"].argmax(-1).astype(np.int64)
    return port, problems


def expected_decode_keys(gs: GoldenSet, prefix: str) -> set[str]:
    """Golden keys of a decode run that the port computes: all `prefix.*` results (not the run's
    inputs, not the DSpark head's arrays, which belong to the draft head, not the backbone)."""
    keys = set()
    for k in gs.keys():
        k = k.removesuffix(".bf16")
        if k.startswith(prefix + ".") and k.split(".")[1] not in _DECODE_INPUTS and ".dspark_" not in k:
            keys.add(k)
    return keys


# ------------------------------------------------------------------------------------ compare


def _stream_out_of_bound(p: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, float]:
    """(bool per element: outside |p - g| <= 2^-7 |g| + 2^-7 RMS(g), or a non-finite mismatch;
    the RMS of g's finite values) for a bf16 stream, both as float64."""
    finite = np.isfinite(g)
    rms = float(np.sqrt(np.mean(g[finite] ** 2))) if finite.any() else 0.0
    with np.errstate(invalid="ignore"):
        bad = np.abs(p - g) > BF16_REL * np.abs(g) + BF16_REL * rms
    bad |= np.isfinite(p) != finite
    bad |= ~finite & (p != g) & ~(np.isnan(p) & np.isnan(g))
    return bad, rms


def _bf16_stream(p, g):
    p, g = p.astype(np.float64), g.astype(np.float64)
    finite = np.isfinite(g)
    if not np.array_equal(finite, np.isfinite(p)) or not np.array_equal(p[~finite], g[~finite]):
        return False, np.inf, np.inf
    if not finite.any():
        return True, 0.0, 0.0
    bad, rms = _stream_out_of_bound(p, g)
    d = np.abs(p - g)[finite]
    return not bool(bad.any()), float(d.max()), float(d.max() / rms) if rms else float(d.max())


def stream_rows_out_of_bound(port: np.ndarray, gold: np.ndarray) -> tuple[list[tuple[int, ...]], int]:
    """For a bf16 stream that fails its bound: the rows (index over every axis but the last) with
    an element outside |port - gold| <= 2^-7 |gold| + 2^-7 RMS(gold) or a non-finite mismatch, and
    the number of rows. A failure at a few rows (one token's hc copies) is an upstream rounding
    flip at that token; at many, a systematic error."""
    g = gold.astype(np.float64)
    bad, _ = _stream_out_of_bound(port.astype(np.float64), g)
    rows = bad.reshape(-1, g.shape[-1]).any(-1)
    return [tuple(int(i) for i in np.unravel_index(r, g.shape[:-1])) for r in np.flatnonzero(rows)], rows.size


def _routing(p_idx, g_idx):
    ok = np.array_equal(np.sort(p_idx, -1), np.sort(g_idx, -1))
    return ok, float(np.sum(np.any(np.sort(p_idx, -1) != np.sort(g_idx, -1), -1))), 0.0


def compare_array(key: str, port: np.ndarray, gold: np.ndarray, port_all: dict, gold_all) -> tuple[bool, float, float]:
    """(ok, max abs err, worst err / RMS(gold)) for one array, by its kind (SPEC §20)."""
    if port.shape != gold.shape:
        return False, np.inf, np.inf
    kind = key.split(".")[1]
    if kind in _EXACT_KINDS:
        ok = np.array_equal(port, gold)
        return ok, float(np.sum(port != gold)), 0.0
    if kind == "route_idx":
        return _routing(port, gold)
    if kind == "route_w":
        idx_key = key.replace("route_w", "route_idx")
        po = np.take_along_axis(port, np.argsort(port_all[idx_key], -1), -1)
        go = np.take_along_axis(gold, np.argsort(gold_all[idx_key], -1), -1)
        d = float(np.abs(po - go).max())
        return d <= ROUTE_W_ATOL, d, d / float(np.sqrt(np.mean(go.astype(np.float64) ** 2)))
    if kind in ("compressor_kv_state", "compressor_score_state"):
        ok = np.array_equal(np.isfinite(port), np.isfinite(gold))
        fin = np.isfinite(gold)
        d = float(np.abs(port[fin] - gold[fin]).max()) if fin.any() else 0.0
        return ok and d <= BF16_REL * max(1e-30, float(np.abs(gold[fin]).max()) if fin.any() else 1.0), d, 0.0
    if kind == "block_premix":
        d = float(np.abs(port - gold).max())
        return d <= PREMIX_ATOL, d, d
    if kind == "logits":
        d = float(np.abs(port - gold).max())
        return d <= LOGITS_ATOL, d, d / float(np.sqrt(np.mean(gold.astype(np.float64) ** 2)))
    return _bf16_stream(port, gold)


def compare(port: dict[str, np.ndarray], gs: GoldenSet) -> list[tuple[str, bool, float, float]]:
    """One row per port array that the golden set also holds: (key, ok, max abs err, err/RMS)."""
    gold_all = {k: gs[k] for k in port if k in gs}
    rows = []
    for key in sorted(port):
        if key in gold_all:
            ok, dmax, rel = compare_array(key, np.asarray(port[key]), np.asarray(gold_all[key]), port, gold_all)
            rows.append((key, ok, dmax, rel))
    return rows


def encode(port: dict[str, np.ndarray], gs: GoldenSet) -> dict[str, np.ndarray]:
    """Port arrays under the golden keys and encodings (bf16 as uint16 bits under `.bf16`)."""
    golden_keys = set(gs.keys())
    out = {}
    for k, v in port.items():
        v = np.asarray(v)
        if k + ".bf16" in golden_keys or v.dtype == ml_dtypes.bfloat16:
            out[k + ".bf16"] = v.astype(ml_dtypes.bfloat16).view(np.uint16)
        else:
            gk = gs[k] if k in golden_keys else None
            out[k] = v.astype(gk.dtype) if gk is not None else v
    return out


# Module switches that move a module attribute off its default (each set on every module of its
# class to try it): name (also the CLI flag, with dashes) -> (class, attribute, value, what it does)
MODULE_SWITCHES = {
    "attn_f64_kernel": (Attention, "f64_kernel", True,
                        ("float64 attention on the GPU kernel's float64 program instead of the jnp reference "
                         "(GPU only; elsewhere the reference runs as before)")),
    "experts_one_row": (Experts, "one_row", True,
                        ("the routed experts' decode gather as one-row programs without tensor cores (GPU kernel "
                         "only)")),
    "experts_stream_k": (Experts, "stream_k", True,
                         ("the routed experts' launches of under two waves (the one-token decode's) as an even "
                          "stream-K split over the SMs (GPU kernel only)")),
    "experts_one_dot": (Experts, "one_dot", True,
                        ("the routed experts' tensor-core tiles as one dot a K step on the 8 decoded code positions "
                         "(GPU kernel only)")),
    "experts_swap_ab": (Experts, "swap_ab", True,
                        ("the routed experts' tensor-core dots with the decoded weight tile as the first operand "
                         "(GPU kernel only)")),
    "experts_no_swap_ab_single": (Experts, "swap_ab_single", False,
                                  ("the routed experts' launches of one weight matrix (w2; w1, w3 unfused) on the "
                                   "fused launch's tiles, without swap_ab and one_dot (GPU kernel only)")),
    "experts_any_height": (Experts, "half_tiles", 3,
                           ("the routed experts' prefill tiles as a K loop of the fewest of 128, 64, 32 or 16 rows "
                            "that holds their rows, at every prefill size (GPU kernel only)")),
    "experts_full_height": (Experts, "half_tiles", 0,
                            ("the routed experts' prefill tiles as K loops of the whole tile's rows, at every prefill "
                             "size (GPU kernel only)")),
    "gate_norm_logits": (Gate, "norm_logits", True,
                         ("a single row's FFN norm (and the experts' quantiser) inside the gate's logits launch "
                          "(GPU kernel only)")),
    "index_score_reference": (Indexer, "score_kernel", False,
                              ("the indexer's scores on XLA's jnp reference (the per-head f32 dots written to memory) "
                               "rather than the GPU kernel")),
    "kv_row_kernel": (Attention, "kv_row_kernel", True,
                      ("a single row's window-KV row (kv_norm, RoPE, QDQ, ring write) in one launch (GPU kernel "
                       "only)")),
}


def set_switches(model: nnx.Module, names) -> None:
    """Sets the `MODULE_SWITCHES` named in `names` on every module of their classes."""
    unknown = sorted(set(names) - set(MODULE_SWITCHES))
    if unknown:
        raise ValueError(f"unknown module switches {unknown}; known: {sorted(MODULE_SWITCHES)}")
    for name in names:
        cls, attr, value, _ = MODULE_SWITCHES[name]
        for _, m in nnx.iter_graph(model):
            if isinstance(m, cls):
                setattr(m, attr, value)


def run_parity(gs: GoldenSet, kernels: str = "auto", decode: bool = True, attn_accumulate: str = "auto",
               fp4_scale_fold: str = "auto", fp4_relaid: str = "auto",
               switches=()) -> tuple[dict[str, np.ndarray], list[str], set[str]]:
    """Everything the port computes teacher-forced on a golden set: the prefill and, where the set
    has decode steps and `decode` holds, both decode runs over caches seeded by the prefill.
    `kernels`, `attn_accumulate`, `fp4_scale_fold`, `fp4_relaid`: the ModelArgs fields; `switches`: names of
    `MODULE_SWITCHES` to set.

    Returns (port arrays keyed like expected.npz, problems (each one a failure), the golden keys
    the port is expected to compute)."""
    model = load_model(gs, kernels=kernels, attn_accumulate=attn_accumulate, fp4_scale_fold=fp4_scale_fold,
                       fp4_relaid=fp4_relaid)
    set_switches(model, switches)
    port = teacher_forced_prefill(model, gs)
    expected = {k.removesuffix(".bf16") for k in gs.keys() if k.startswith("prefill.")}
    problems = []
    if decode and "decode.start_pos" in gs:
        cache = teacher_forced_cache(model, gs)
        for prefix in DECODE_MODES:
            decoded, found = teacher_forced_decode(model, gs, prefix, cache)
            port.update(decoded)
            problems += found
            expected |= expected_decode_keys(gs, prefix)
    return port, problems, expected


def report(port: dict[str, np.ndarray], problems: list[str], expected: set[str], gs: GoldenSet) -> int:
    """Prints the table (array, max abs err, err/RMS, ok) and the problems; returns the exit
    code: 1 if an array fails, a problem was found or an expected array was not computed."""
    rows = compare(port, gs)
    width = max(len(r[0]) for r in rows)
    print(f"{'array':<{width}}  {'max abs err':>12}  {'err/RMS':>10}  ok")
    gold_all = {k: gs[k] for k in port if k in gs}
    for key, ok, dmax, rel in rows:
        print(f"{key:<{width}}  {dmax:12.4g}  {rel:10.3g}  {'ok' if ok else 'FAIL'}")
        if not ok and key.split(".")[1] not in _NOT_STREAMS and port[key].shape == gold_all[key].shape:
            bad, n = stream_rows_out_of_bound(np.asarray(port[key]), np.asarray(gold_all[key]))
            if bad:
                shown = ", ".join(str(b) for b in bad[:4]) + (", ..." if len(bad) > 4 else "")
                print(f"  {len(bad)} of {n} rows out of bound: {shown}")
    for problem in problems:
        print(f"FAIL {problem}")
    failed = [r[0] for r in rows if not r[1]]
    missing = sorted(expected - set(port))
    print(f"{len(rows) - len(failed)}/{len(rows)} arrays ok" + (f"; not computed: {missing}" if missing else ""))
    return 1 if failed or problems or missing else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv41_jax.parity", description=__doc__.split("\n\n")[0])
    p.add_argument("golden_dir", help="golden set directory (checkpoint + config.json + inputs.json + expected.npz)")
    p.add_argument("--out", help="write the port's arrays here (.npz, golden key names and encodings)")
    p.add_argument("--kernels", choices=("auto", "reference", "pallas"), default="auto",
                   help="ModelArgs.kernels: the Pallas kernels on GPU/TPU (auto), the jnp references, or the kernels")
    p.add_argument("--attn-accumulate", choices=("auto", "f64", "f32"), default="auto",
                   help="ModelArgs.attn_accumulate: the sparse attention in float64, the oracle's rounding "
                        "(auto, except on TPU), or in f32 (the attention kernel where --kernels picks it)")
    p.add_argument("--fp4-scale-fold", choices=("off", "auto", "on"), default="auto",
                   help="ModelArgs.fp4_scale_fold: the routed-expert fp4 kernel's x 2^126 folded into the scales "
                        "(auto: when every scale byte is <= 128; on: refuse a checkpoint where one is not)")
    p.add_argument("--fp4-relaid", choices=("off", "auto", "on"), default="auto",
                   help="ModelArgs.fp4_relaid: the routed experts' fp4 words re-laid at load for the kernel's "
                        "'relaid' decode, bit-identical (auto: where the compiled GPU kernel runs)")
    for name, (cls, attr, value, what) in MODULE_SWITCHES.items():
        p.add_argument("--" + name.replace("_", "-"), action="store_true",
                       help=f"{cls.__name__}.{attr} = {value}: {what}")
    p.add_argument("--prefill-only", action="store_true", help="skip the decode runs")
    ns = p.parse_args(argv)
    try:
        gs = GoldenSet(ns.golden_dir)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        port, problems, expected = run_parity(gs, ns.kernels, decode=not ns.prefill_only,
                                              attn_accumulate=ns.attn_accumulate, fp4_scale_fold=ns.fp4_scale_fold,
                                              fp4_relaid=ns.fp4_relaid,
                                              switches=[n for n in MODULE_SWITCHES if getattr(ns, n)])
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if ns.out:
        np.savez(ns.out, **encode(port, gs))
    return report(port, problems, expected, gs)


if __name__ == "__main__":
    sys.exit(main())
