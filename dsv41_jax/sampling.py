"""Token sampling from fp32 logits (SPEC §8), plus top-k / top-p filters.

temperature == 0: argmax. Otherwise exactly the reference's rule: p = softmax(logits / max(T, 1e-5))
in fp32, next = argmax(p / E) with E ~ Exponential(1) i.i.d. (the Gumbel-max form of multinomial
sampling). top-k / top-p (beyond the reference) drop tokens from p before the draw.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Static sampling settings (hashable: part of the compiled decode step)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def filter_probs(probs: jax.Array, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Zero the probabilities outside the top-k and outside the smallest top-p nucleus.

    probs f32 [B, V] -> f32 [B, V] (not renormalised: argmax(p / E) does not need it). The most
    likely token always survives; ties at the k-th value keep every tied token.
    """
    if top_k and top_k < probs.shape[-1]:
        kth = jax.lax.top_k(probs, top_k)[0][..., -1:]
        probs = jnp.where(probs >= kth, probs, 0.0)
    if top_p < 1.0:
        sorted_p = jnp.sort(probs, axis=-1)[..., ::-1]
        before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly above each sorted entry
        kept = jnp.where(before < top_p * jnp.sum(probs, -1, keepdims=True), sorted_p, jnp.inf)
        threshold = jnp.min(kept, axis=-1, keepdims=True)  # smallest probability still kept
        probs = jnp.where(probs >= threshold, probs, 0.0)
    return probs


def sample(logits: jax.Array, key: jax.Array | None, params: SamplingParams) -> jax.Array:
    """logits f32 [B, V] -> token ids int32 [B]."""
    if params.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if key is None:
        raise ValueError("sampling with temperature > 0 needs a PRNG key")
    probs = jax.nn.softmax(logits.astype(jnp.float32) / max(params.temperature, 1e-5), axis=-1)
    probs = filter_probs(probs, params.top_k, params.top_p)
    noise = jax.random.exponential(key, probs.shape, jnp.float32)
    return jnp.argmax(probs / noise, axis=-1).astype(jnp.int32)
