"""Sampling: greedy, the reference's temperature rule, top-k / top-p filters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.sampling import SamplingParams, filter_probs, sample


def test_temperature_zero_is_argmax():
    logits = jnp.asarray([[0.1, 3.0, -1.0], [5.0, 4.9, 0.0]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(sample(logits, None, SamplingParams())), [1, 0])


def test_temperature_sampling_is_argmax_of_softmax_over_exponential_noise():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, 50)).astype(np.float32))
    key = jax.random.key(7)
    got = np.asarray(sample(logits, key, SamplingParams(temperature=0.7)))
    p = np.asarray(jax.nn.softmax(logits / 0.7, axis=-1))
    e = np.asarray(jax.random.exponential(key, p.shape, jnp.float32))
    np.testing.assert_array_equal(got, np.argmax(p / e, axis=-1))


def test_temperature_sampling_follows_the_softmax_distribution():
    logits = jnp.log(jnp.asarray([[0.6, 0.3, 0.1]], jnp.float32))
    keys = jax.random.split(jax.random.key(1), 4000)
    draws = np.asarray(jax.vmap(lambda k: sample(logits, k, SamplingParams(temperature=1.0)))(keys))[:, 0]
    freq = np.bincount(draws, minlength=3) / len(draws)
    np.testing.assert_allclose(freq, [0.6, 0.3, 0.1], atol=0.03)


def test_top_k_only_ever_draws_from_the_k_most_likely():
    logits = jnp.log(jnp.asarray([[0.4, 0.3, 0.2, 0.1]], jnp.float32))
    keys = jax.random.split(jax.random.key(2), 2000)
    draws = np.asarray(jax.vmap(lambda k: sample(logits, k, SamplingParams(1.0, top_k=2)))(keys))[:, 0]
    assert set(draws.tolist()) == {0, 1}
    np.testing.assert_allclose(np.mean(draws == 0), 0.4 / 0.7, atol=0.04)


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    p = jnp.asarray([[0.5, 0.25, 0.15, 0.1]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(filter_probs(p, top_p=0.7)) > 0, [[True, True, False, False]])
    np.testing.assert_array_equal(np.asarray(filter_probs(p, top_p=0.75)) > 0, [[True, True, False, False]])
    np.testing.assert_array_equal(np.asarray(filter_probs(p, top_p=0.76)) > 0, [[True, True, True, False]])
    np.testing.assert_array_equal(np.asarray(filter_probs(p, top_p=0.1)) > 0, [[True, False, False, False]])


def test_bad_sampling_settings_are_rejected():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="PRNG key"):
        sample(jnp.zeros((1, 3)), None, SamplingParams(temperature=1.0))
