"""The one dispatch rule shared by every kernel's api.py."""

from __future__ import annotations

import jax


def resolve(implementation: str, target: str | None, interpret: bool) -> tuple[bool, str]:
    """(use the Pallas kernel?, target "gpu" | "tpu").

    "auto": the kernel on GPU/TPU (or when interpreting), the jnp reference on CPU;
    "reference": always the reference; "pallas": always the kernel (on CPU only with interpret).
    """
    if implementation not in ("auto", "reference", "pallas"):
        raise ValueError(f"implementation must be 'auto', 'reference' or 'pallas', got {implementation=}")
    backend = jax.default_backend()
    if target is None:
        target = "tpu" if backend == "tpu" else "gpu"
    if target not in ("gpu", "tpu"):
        raise ValueError(f"target must be 'gpu' or 'tpu', got {target=}")
    if implementation == "reference":
        return False, target
    if implementation == "auto":
        return backend in ("gpu", "cuda", "rocm", "tpu") or interpret, target
    if backend == "cpu" and not interpret:
        raise ValueError("implementation='pallas' on CPU needs interpret=True")
    return True, target
