"""Fill an nnx module tree from a hub-format checkpoint by name.

Module paths equal the reference's parameter names: the param at tree path
`layers.3.attn.wq_a.weight` is read from the hub tensor of that name. One structural rule maps
the routed experts, which the port stores stacked along a leading expert axis (for expert
parallelism and for gathering a token's experts in one op): hub
`...ffn.experts.{e}.w1.weight` -> tree `...ffn.experts.w1.weight[e]`.

Dtype rules (the same conversions the reference's loader applies):
- quantised params (e4m3 / e8m0 / packed-fp4 int8) must match the hub dtype bit for bit;
- bf16 hub values go into fp32 params unchanged (exact widening);
- a bf16 param whose hub tensor is fp8 with a `.scale` sibling is dequantised (every fp8 Linear
  of a `dtype="bf16"` model); that scale is then consumed too. (attn.wo_a, which the
  reference's convert.py widens to bf16, stays fp8 here and is widened inside its matmul.)

An Engram table parameter may have more rows than the hub's (`ModelArgs.engram_rows_multiple`,
storage padding for sharding): the hub rows fill the first rows, the rest are zero.

This path materialises the module's weights on the host: it is for tiny checkpoints and tests.
The released model goes through `dsv41-convert` (streaming, sharded) instead.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from dsv41_jax import quant
from dsv41_jax.checkpoint import CheckpointError, HubCheckpoint

_STACKED = re.compile(r"(^|\.)experts\.(w[123])\.(weight|scale)$")
_TABLE = re.compile(r"(^|\.)engram\.embed\.(weight|scale)$")


def module_param_paths(module: nnx.Module) -> dict[str, nnx.Variable]:
    """Tree path (joined by '.') -> Param variable, for every nnx.Param in the module."""
    out = {}
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Param):
            out[".".join(str(p) for p in path)] = node
    return out


def _hub_names_for(path: str, prefix: str, stack: int | None) -> list[str]:
    m = _STACKED.search(path)
    if m and stack is not None:
        head = path[: m.start()] + (m.group(1) if m.group(1) else "")
        return [f"{prefix}{head}experts.{e}.{m.group(2)}.{m.group(3)}" for e in range(stack)]
    return [prefix + path]


def _convert(name: str, arr: np.ndarray, target: np.dtype, ckpt: HubCheckpoint) -> tuple[np.ndarray, list[str]]:
    """Hub array -> the param's dtype; returns (array, extra consumed names)."""
    src = arr.dtype
    if src == target:
        return arr, []
    if target == np.float32 and src == ml_dtypes.bfloat16:
        return arr.astype(np.float32), []
    if target == ml_dtypes.bfloat16 and src == ml_dtypes.float8_e4m3fn:
        scale_name = name[: -len("weight")] + "scale"
        if not name.endswith(".weight") or scale_name not in ckpt:
            raise CheckpointError(f"{name}: fp8 tensor for a bf16 parameter but no {scale_name} to dequantise it with")
        scale = ckpt.get(scale_name)
        return np.asarray(quant.dequant_fp8_weight(jnp.asarray(arr), jnp.asarray(scale), jnp.bfloat16)), [scale_name]
    raise CheckpointError(f"{name}: checkpoint dtype {src} cannot be loaded into a {np.dtype(target)} parameter")


def load_hub_weights(module: nnx.Module, ckpt: HubCheckpoint | str | os.PathLike, prefix: str = "",
                     *, strict: bool = True, skip: tuple[str, ...] = ()) -> set[str]:
    """Assign every nnx.Param of `module` from hub tensors named `prefix + path`.

    strict: also require that every hub tensor under `prefix` is consumed, so nothing in the
    checkpoint is silently ignored (name the leftovers otherwise); `skip` lists name prefixes of
    parts the module deliberately does not hold (e.g. "vision." for a text-only model).
    Returns the consumed names.
    """
    if not isinstance(ckpt, HubCheckpoint):
        ckpt = HubCheckpoint(ckpt)
    consumed: set[str] = set()
    missing: list[str] = []
    for path, var in module_param_paths(module).items():
        target = var[...]
        stacked = _STACKED.search(path) is not None
        names = _hub_names_for(path, prefix, target.shape[0] if stacked else None)
        absent = [n for n in names if n not in ckpt]
        if absent:
            missing.extend(absent)
            continue
        parts = []
        for n in names:
            arr, extra = _convert(n, ckpt.get(n), np.dtype(target.dtype), ckpt)
            consumed.update(extra)
            parts.append(arr)
        value = np.stack(parts) if stacked else parts[0]
        if (_TABLE.search(names[0]) and value.ndim == len(target.shape) and value.shape[1:] == tuple(target.shape[1:])
                and value.shape[0] < target.shape[0]):
            # zero bytes (weight 0), as dsv41-convert writes them; e8m0 has no zero value to ask numpy for
            padded = np.zeros(tuple(target.shape), f"u{value.dtype.itemsize}").view(value.dtype)
            padded[: value.shape[0]] = value
            value = padded
        if value.shape != tuple(target.shape):
            raise CheckpointError(
                f"{names[0]}{' (stacked over experts)' if stacked else ''}: checkpoint shape {value.shape}, "
                f"module parameter {path} expects {tuple(target.shape)}"
            )
        var.set_value(jnp.asarray(value))
        consumed.update(names)
    if missing:
        raise CheckpointError(f"{len(missing)} tensors missing from the checkpoint for prefix {prefix!r}: {missing[:20]}")
    if strict:
        leftover = sorted(
            n for n in ckpt.names() if n.startswith(prefix) and n not in consumed and not n.startswith(skip)
        )
        if leftover:
            raise CheckpointError(
                f"{len(leftover)} checkpoint tensors under {prefix!r} have no parameter in the module: {leftover[:20]}"
            )
    return consumed


@jax.jit
def _scale_byte_max(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """e8m0 scales [E, ...] -> (their largest byte, the first expert holding it), int32 scalars."""
    b = jax.lax.bitcast_convert_type(scale, jnp.uint8).reshape(scale.shape[0], -1).max(axis=1).astype(jnp.int32)
    return b.max(), jnp.argmax(b).astype(jnp.int32)


def resolve_fp4_scale_fold(model: nnx.Module, args, source: str = "the checkpoint"):
    """Applies `args.fp4_scale_fold` to a model whose weights are loaded; returns args with "auto"
    resolved to "on" or "off" (also written to every module's `args`).

    The routed-expert fp4 kernel may fold its decode's x 2^126 into the e8m0 scales only while
    every scale byte is <= 128 (`kernel_gpu.FOLD_MAX_BYTE`: scales <= 2). One on-device max per
    stacked scale tensor ([E, out, in/32], sharded or not), read back as two scalars.
    Raises CheckpointError for "on" when a byte is larger, naming the hub tensor and the byte.
    """
    from dsv41_jax.moe import Experts
    from pallas_kernels.expert_matmul.kernel_gpu import FOLD_MAX_BYTE

    mode = args.fp4_scale_fold
    experts = [(".".join(str(p) for p in path), m) for path, m in nnx.iter_graph(model)
               if isinstance(m, Experts) and m.dtype == "fp4"]
    worst = None  # (byte, hub name)
    if mode != "off":
        found = [(path, w, _scale_byte_max(getattr(m, w).scale[...])) for path, m in experts for w in ("w1", "w2", "w3")]
        for path, w, (byte, e) in jax.device_get(found):
            if worst is None or byte > worst[0]:
                worst = (int(byte), f"{path}.{int(e)}.{w}.scale")
    too_large = worst is not None and worst[0] > FOLD_MAX_BYTE
    if mode == "on" and too_large:
        raise CheckpointError(
            f"{source}: {worst[1]} holds e8m0 scale byte {worst[0]} (2^{worst[0] - 127}); fp4_scale_fold='on' "
            f"needs every routed-expert scale byte <= {FOLD_MAX_BYTE} (scales <= 2): use 'auto' or 'off'")
    fold = mode == "on" or (mode == "auto" and worst is not None and not too_large)
    for _, m in experts:
        m.scale_fold = fold
    return _set_args(model, args.replace(fp4_scale_fold="on" if fold else "off"))


def _set_args(model: nnx.Module, args):
    """Writes args to every module's `args` field; returns args."""
    from dsv41_jax.config import ModelArgs

    for _, node in nnx.iter_graph(model):
        if isinstance(getattr(node, "args", None), ModelArgs):
            node.args = args
    return args


def resolve_fp4_relaid(model: nnx.Module, args):
    """Applies `args.fp4_relaid` to a model whose weights are loaded; returns args with "auto"
    resolved to "on" or "off" (also written to every module's `args`).

    "auto" re-lays the routed experts' packed fp4 words (`Experts.set_relaid`, in place) where they
    run the compiled GPU kernel (`Experts.use_kernel`, not in interpret mode), whose "relaid"
    decode then reads them; "on" re-lays them anywhere (the jnp paths, interpret mode included,
    put gathered words back first: slower, same values). The old arrays are donated on
    accelerators, so the stacks are never held twice."""
    from dsv41_jax.moe import Experts

    experts = [m for _, m in nnx.iter_graph(model) if isinstance(m, Experts) and m.dtype == "fp4"]
    mode = args.fp4_relaid
    relaid = bool(experts) and (mode == "on" or (mode == "auto" and all(
        m.use_kernel() and not m.kernels_interpret for m in experts)))
    donate = jax.default_backend() != "cpu"
    for m in experts:
        m.set_relaid(relaid, donate=donate)
    return _set_args(model, args.replace(fp4_relaid="on" if relaid else "off"))


def resolve_fp4_options(model: nnx.Module, args, source: str = "the checkpoint"):
    """`resolve_fp4_scale_fold` then `resolve_fp4_relaid`: the routed-expert fp4 kernel's options
    for the loaded weights, as every loader applies them; returns args with both resolved."""
    return resolve_fp4_relaid(model, resolve_fp4_scale_fold(model, args, source=source))
