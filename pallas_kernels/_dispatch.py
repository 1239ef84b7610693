"""The dispatch rule shared by every kernel's api.py, and the data-parallel split of a kernel call."""

from __future__ import annotations

import contextlib
import logging

import jax
from jax.sharding import PartitionSpec as P

logger = logging.getLogger(__name__)

_PLATFORMS = ("cpu", "gpu", "tpu")
_target: list[str] = []  # the stack of `target_platform` overrides


def platform() -> str:
    """The platform the code being traced is for: "cpu", "gpu" or "tpu". `jax.default_backend()`
    (CUDA and ROCm are "gpu"), unless `target_platform` says otherwise. Every choice that depends
    on the platform (kernels, float64, loop unrolling) asks this."""
    if _target:
        return _target[-1]
    backend = jax.default_backend()
    return "gpu" if backend in ("cuda", "rocm") else backend


@contextlib.contextmanager
def target_platform(name: str):
    """Trace for `name` ("cpu", "gpu", "tpu") rather than the default backend: for compiling
    ahead of time for a platform this process has no device of (`benchmarks.launch_count`
    compiles the GPU program on a CPU-only host). Only the platform-dependent choices change;
    the compile itself must still be asked of that platform (jit's lowering for its devices).
    jax caches traces without this setting in their key: a function traced under it keeps that
    trace for later calls with the same shapes, so use it in a process that traces for that
    platform only."""
    if name not in _PLATFORMS:
        raise ValueError(f"target_platform must be one of {_PLATFORMS}, got {name!r}")
    _target.append(name)
    try:
        yield
    finally:
        _target.pop()


def resolve(implementation: str, target: str | None, interpret: bool) -> tuple[bool, str]:
    """(use the Pallas kernel?, target "gpu" | "tpu").

    "auto": the kernel on GPU/TPU (or when interpreting), the jnp reference on CPU;
    "reference": always the reference; "pallas": always the kernel (on CPU only with interpret).
    """
    if implementation not in ("auto", "reference", "pallas"):
        raise ValueError(f"implementation must be 'auto', 'reference' or 'pallas', got {implementation=}")
    backend = platform()
    if target is None:
        target = "tpu" if backend == "tpu" else "gpu"
    if target not in ("gpu", "tpu"):
        raise ValueError(f"target must be 'gpu' or 'tpu', got {target=}")
    if implementation == "reference":
        return False, target
    if implementation == "auto":
        return backend in ("gpu", "tpu") or interpret, target
    if backend == "cpu" and not interpret:
        raise ValueError("implementation='pallas' on CPU needs interpret=True")
    return True, target


def gpu_kernel(implementation: str, interpret: bool, name: str) -> bool:
    """`resolve` for a kernel that exists for GPUs only: True to run it; on a TPU the reference
    runs, with a logged warning naming `name`."""
    use_kernel, target = resolve(implementation, None, interpret)
    if use_kernel and target != "gpu":
        logger.warning("%s: no %s kernel; using the reference", name, target)
    return use_kernel and target == "gpu"


def split_batch(fn, args, batched, name: str):
    """fn(*args), run once per `data` shard when the active mesh (`jax.set_mesh`) splits `data`.

    A Pallas kernel is a custom call that the SPMD partitioner cannot split: under plain jit on a
    mesh it would gather its operands and compute the whole batch on every device. So on such a
    mesh the call runs inside a `jax.shard_map`: each arg whose `batched` flag is set is split by
    its leading dim over `data` (the layout of activations and caches, `dsv41_jax.sharding`),
    the others (and None) are passed whole, and every output's leading dim is the batch. Inside
    a shard_map that already made `data` manual (the expert-parallel MoE) the call is local as it
    is. A batch that `data` does not divide runs unsplit, with a logged warning.
    """
    mesh = jax.sharding.get_abstract_mesh()
    n = 1 if mesh.empty else dict(mesh.shape).get("data", 1)
    if n <= 1 or "data" in mesh.manual_axes:
        return fn(*args)
    rows = sorted({a.shape[0] for a, b in zip(args, batched) if b and a is not None})
    if any(r % n for r in rows):
        logger.warning("%s: batch %s is not divisible by the mesh's data axis (%d); the kernel runs on the "
                       "whole batch on every device", name, rows, n)
        return fn(*args)
    live = [i for i, a in enumerate(args) if a is not None]

    def local(*xs):
        full = list(args)
        for i, x in zip(live, xs):
            full[i] = x
        return fn(*full)

    specs = tuple(P("data") if batched[i] else P() for i in live)
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P("data"), check_vma=False)(
        *(args[i] for i in live))
