"""bf16 weights without a float32 master copy: stochastically rounded updates (jaxlowbit.optim)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxlowbit import optim
from jaxlowbit_numerics.random import hash_bits, round_bf16_with_bits
from helpers import fresh_key
from test_optim import _mlp_problem, train

DRAWS = 1 << 16


def test_apply_updates_stochastic_is_unbiased():
  k1, k2, k3 = jax.random.split(fresh_key(), 3)
  params = {"w": (jax.random.uniform(k1, (64,), minval=0.5, maxval=2.0)).astype(jnp.bfloat16)}
  # Updates below one bf16 ulp (2^-8 relative): plain rounding would drop most of them.
  updates = {"w": jax.random.uniform(k2, (64,), minval=-1, maxval=1) * 2e-3}
  keys = jax.random.split(k3, DRAWS)
  draws = jax.jit(jax.vmap(lambda k: optim.apply_updates_stochastic(params, updates, k)["w"]))(keys)
  assert draws.dtype == jnp.bfloat16
  exact = np.asarray(params["w"], np.float64) + np.asarray(updates["w"], np.float64)
  mean = np.mean(np.asarray(draws, np.float64), axis=0)
  # Each draw is off by < 1 ulp (<= 2^-7 * 2 here); the mean of 2^16 draws by ~1e-5 relative.
  np.testing.assert_allclose(mean, exact, rtol=1e-4, atol=0)
  plain = np.asarray(optax.apply_updates(params, updates)["w"], np.float64)
  assert np.max(np.abs(plain - exact) / exact) > 1e-3, "the test must need stochastic rounding"


def test_hash_bits_round_bf16_unbiased():
  """The kernel's generator (jaxlowbit_numerics.random): rounding with hash_bits(index, seed) over
  2^16 fresh seeds averages to the exact value, as jax.random's bits do above."""
  k1, k2, k3 = jax.random.split(fresh_key(), 3)
  x = jax.random.uniform(k1, (64,), minval=0.5, maxval=2.0) * jnp.where(jax.random.bernoulli(k2, 0.5, (64,)), 1, -1)
  seeds = jax.random.bits(k3, (DRAWS, 1), jnp.uint32)
  draws = jax.jit(lambda s: round_bf16_with_bits(x, hash_bits(jnp.arange(64, dtype=jnp.uint32), s)))(seeds)
  assert draws.dtype == jnp.bfloat16
  exact = np.asarray(x, np.float64)
  np.testing.assert_allclose(np.mean(np.asarray(draws, np.float64), axis=0), exact, rtol=1e-4, atol=0)
  assert np.max(np.abs(np.asarray(x.astype(jnp.bfloat16), np.float64) - exact) / np.abs(exact)) > 1e-3


def test_apply_updates_stochastic_leaves_other_dtypes_alone():
  key = fresh_key()
  params = {"f32": jnp.ones((8,)), "bf16": jnp.ones((8,), jnp.bfloat16), "none": None}
  updates = {"f32": jnp.full((8,), 1e-3), "bf16": jnp.full((8,), 1e-3), "none": None}
  out = optim.apply_updates_stochastic(params, updates, key)
  np.testing.assert_array_equal(out["f32"], optax.apply_updates(params, updates)["f32"])
  assert out["bf16"].dtype == jnp.bfloat16 and out["none"] is None


def test_stochastic_rounding_transformation_lands_exactly():
  """optax.apply_updates(p, u') with u' from the transformation equals the stochastic rounding."""
  key = fresh_key()
  k1, k2 = jax.random.split(key)
  exponents = jax.random.uniform(k1, (4096,), minval=-30, maxval=30)  # magnitudes over 18 decades
  params = {"w": (jnp.exp2(exponents) * jnp.sign(jax.random.normal(k2, (4096,)))).astype(jnp.bfloat16)}
  updates = {"w": jax.random.normal(key, (4096,)) * jnp.exp2(jax.random.uniform(k1, (4096,), minval=-30, maxval=30))}
  tx = optim.stochastic_rounding(seed=3)
  state = tx.init(params)
  u, new_state = tx.update(updates, state, params)
  step_key = jax.random.split(jax.random.wrap_key_data(state.key))[1]
  expected = optim.apply_updates_stochastic(params, updates, step_key)
  np.testing.assert_array_equal(optax.apply_updates(params, u)["w"], expected["w"])
  assert not np.array_equal(new_state.key, state.key), "the key advances every step"
  with pytest.raises(ValueError, match="needs params"):
    tx.update(updates, state)


def test_bf16_weights_train_like_float32():
  """A small learning rate (updates ~1/10 of a bf16 ulp): stochastic rounding trains like float32."""
  params, loss, batches = _mlp_problem()
  lr = 3e-4
  ref, start = train(optax.adamw(lr, weight_decay=0.0), params, loss, batches)
  bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  loss32 = lambda p, b: loss(jax.tree.map(lambda a: a.astype(jnp.float32), p), b)  # noqa: E731
  plain, _ = train(optax.adamw(lr, weight_decay=0.0), bf16, loss32, batches)
  sr, _ = train(optim.make("adamw", lr, weight_decay=0.0, stochastic_rounding_seed=0), bf16, loss32, batches)
  assert ref < 0.9 * start
  assert sr <= 1.03 * ref, (sr, ref)
  assert plain - ref > 2 * abs(sr - ref), ("round-to-nearest bf16 should lag", plain, sr, ref)
