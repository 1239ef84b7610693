"""Rounding points that survive XLA's optimisations.

Under jit, XLA may drop a convert pair f32 -> bf16 -> f32 (excess precision) or fuse a dot with
the element-wise ops after it and ignore the narrowing in between; it may also turn `a / b` into
`a * (1/b)` (for a broadcast divisor). The reference rounds to bf16 at specific points and divides
exactly, and parity depends on both, so every such point goes through these helpers.

XLA:GPU lowers an f32 division to PTX `div.full.f32` (up to 2 ulp off, not correctly rounded):
an e2m1 / e4m3 tie such as x / s = 1.25 can come out as 1.2500001 and round up, which moves a
compressed-KV value by a whole fp4 step (measured on an H200: 2 of 4096 values of a tiny layer,
enough to change 12-24% of the block's outputs). Dividing in float64 and rounding once would be
exact (f64 carries more than the 2 x 24 + 2 bits that rule out a double rounding), but XLA:GPU
folds f32(f64(a) / f64(b)) back into the f32 division (measured on an H200: 30% of random
quotients then differ from IEEE), and an optimization barrier that prevents it splits every
division site into kernels of its own. So on GPUs `exact_div` takes the backend's f32 quotient q,
however rounded, and corrects it in float64 (`correct_quotient`): the residual a - q b is exact
there, and q + (a - q b) / b is a/b to far better than the distance any f32 quotient keeps from
an f32 rounding midpoint, so rounding it once gives the IEEE quotient. Nothing in that is a
pattern XLA narrows, and it fuses with its producers and consumers. On CPU the float64 division
with the barrier stays (same results, cheaper to compile there); TPUs have no float64: there it
is the backend's f32 division.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._dispatch import platform


def round_bf16(x: jax.Array) -> jax.Array:
    """Rounds to bf16 values (RNE), returned as f32; `reduce_precision` is never elided."""
    return jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=8, mantissa_bits=7)


def cast(x: jax.Array, dtype) -> jax.Array:
    """x.astype(dtype), with the bf16 rounding made explicit so a later upcast sees it."""
    if jnp.dtype(dtype) == jnp.bfloat16 and x.dtype != jnp.bfloat16:
        return round_bf16(x).astype(jnp.bfloat16)
    return x.astype(dtype)


def to_bf16(x: jax.Array) -> jax.Array:
    return cast(x, jnp.bfloat16)


def exact_div(a: jax.Array, b) -> jax.Array:
    """a / b, f32, correctly rounded (IEEE) on CPU and GPU; shapes broadcast.

    Chosen by the platform it is lowered for (`jax.lax.platform_dependent`): on GPUs the
    backend's f32 quotient corrected in float64 (`correct_quotient`, module docstring), so the
    result does not depend on how XLA:GPU divides or whether it rewrites a / b as a * (1 / b)
    (which XLA does for a broadcast divisor); on CPU, where XLA's float64 division is kept and
    kernel counts cost nothing, the float64 quotient of the divisor behind a barrier, rounded once
    (cheaper there: tests/test_model_parity.py took 294 against 269 s with the correction); on TPUs (no
    float64) the f32 division, the divisor behind a barrier (against the reciprocal rewrite)."""
    a = jnp.asarray(a, jnp.float32) if not hasattr(a, "dtype") else a
    b = jnp.broadcast_to(jnp.asarray(b, a.dtype), jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b)))
    if a.dtype != jnp.float32:
        return a / jax.lax.optimization_barrier(b)
    a = jnp.broadcast_to(a, b.shape)

    def f64_barrier(a, b):
        with jax.enable_x64(True):
            return (a.astype(jnp.float64) / jax.lax.optimization_barrier(b.astype(jnp.float64))).astype(jnp.float32)

    return jax.lax.platform_dependent(a, b, cpu=f64_barrier, tpu=lambda a, b: a / jax.lax.optimization_barrier(b),
                                      default=lambda a, b: correct_quotient(a, b, a / b))


def correct_quotient(a: jax.Array, b: jax.Array, q: jax.Array) -> jax.Array:
    """The IEEE f32 quotient a / b from any f32 q within a few ulp of it (f32 arrays, one shape).

    In float64: r = a - q b is exact (q b has at most 48 significant bits, and a and q b are
    within a factor of 2, so the subtraction is exact), so a / b = q + r / b exactly, and
    t = q + r / b rounded to float64 is within about 2^-52 |a/b| of it. A quotient of two f32
    values is never an f32 rounding midpoint and stays at least about 2^-49 |a/b| away from one
    (a - m b, for a midpoint m with 25 significant bits, is a nonzero multiple of 2^-48 a or so),
    so t rounds to the same f32 as a / b. Where q is not finite, or b is infinite, q is already
    the IEEE result (inf, nan, or 0 of the right sign); zero results keep q's sign."""
    with jax.enable_x64(True):
        a64, b64, q64 = a.astype(jnp.float64), b.astype(jnp.float64), q.astype(jnp.float64)
        t = (q64 + (a64 - q64 * b64) / b64).astype(jnp.float32)
    return jnp.where(jnp.isfinite(q) & jnp.isfinite(b), jnp.copysign(t, q), q)


def mean(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """The f32 mean as the reference's torch computes it on CPU: the sum, then one correctly
    rounded division by the count (`exact_div`). `jnp.mean` compiles to the sum times the rounded
    reciprocal 1/n, which for a count that is not a power of two (5120, 20480) differs in the
    last bit for about one sum in five."""
    n = x.shape[axis]
    return exact_div(jnp.sum(x, axis=axis, keepdims=keepdims), jnp.float32(n))


def sqrt(x: jax.Array) -> jax.Array:
    """The correctly rounded f32 square root, as torch.sqrt rounds: XLA:GPU's f32 square root is
    not correctly rounded (measured on an H200: tests/test_numerics.py), so it is taken in float64
    and rounded once (a float64 root of an f32 value rounds to the correctly rounded f32 root).

    The rounding is made in float64 (`reduce_precision` to f32's 8 exponent and 23 mantissa bits,
    exact here: the root of an f32 value is never an f32 subnormal, the range it would flush)
    before the conversion: a consumer that widens the root again (`exact_div`'s correction in
    `reciprocal_sqrt`) otherwise lets XLA:GPU drop the f64 -> f32 -> f64 convert pair and use the
    unrounded root (measured on an H100, jax 0.11.2: 1 / root wrong in 27% of 65536 values)."""
    return in_float64(lambda v: jax.lax.reduce_precision(jnp.sqrt(v), exponent_bits=8, mantissa_bits=23), x)


def reciprocal_sqrt(x: jax.Array) -> jax.Array:
    """1 / sqrt(x) in f32 as the reference's torch.rsqrt rounds on CPU: the correctly rounded f32
    square root (`sqrt`), then a correctly rounded division (never XLA's approximate rsqrt)."""
    return exact_div(jnp.ones_like(x), sqrt(x))


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """The reference's RMSNorm: x [..., K], w [K] -> x.dtype [..., K] = w * (x / sqrt(mean(x^2) + eps))
    in fp32 (the mean, root and reciprocal each correctly rounded), cast back to x.dtype."""
    xf = x.astype(jnp.float32)
    var = mean(jnp.square(xf), axis=-1, keepdims=True)
    return cast(w.astype(jnp.float32) * (xf * reciprocal_sqrt(var + jnp.float32(eps))), x.dtype)


def in_float64(fn, x: jax.Array) -> jax.Array:
    """fn(x) for f32 x evaluated in float64 and rounded once to f32: the golden oracle evaluates
    torch's `F.softplus`, `F.silu` and `torch.sigmoid` that way (golden README, "What the oracle's
    numerics are"), which is the correctly rounded f32 value but for float64 libm error far below
    an f32 rounding step. XLA's f32 versions differ from it in the last bits (on CPU: softplus
    16% of values, SiLU 33%, sigmoid 31%). No barrier is needed here, unlike `exact_div`: on an
    H200 XLA:GPU keeps these float64 evaluations in float64 (the optimized HLO, also when fused
    with the producer and consumer) and they match torch's on all 8192 test inputs, the square
    root on 65536; a barrier cost 53 extra kernels and 66 µs of device time per decode step of
    the six-layer benchmark (benchmarks/README.md, ninth run). But where a consumer widens the
    result to float64 again, XLA:GPU may drop that f64 -> f32 -> f64 convert pair and use the
    unrounded value: `sqrt` rounds inside float64 first, the router's square root of its softplus
    takes a barrier (`pallas_kernels.topk.reference.router_scores`). TPUs have no float64 and
    run fn in f32. `reciprocal_sqrt` takes its square root this way too.
    """
    if x.dtype == jnp.float32 and platform() != "tpu":
        with jax.enable_x64(True):
            return fn(x.astype(jnp.float64)).astype(jnp.float32)
    return fn(x)
