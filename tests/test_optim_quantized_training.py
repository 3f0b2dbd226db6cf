"""INT8 weight-only quantized training (jaxlowbit.quantized_training)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxlowbit import Int8MixedPrecision
from jaxlowbit import quantized_training as qt
from helpers import fresh_key, rel_err
from test_optim import STEPS

D, H, C = 64, 256, 16


class MLP(nn.Module):
  int8: bool
  recipe: object = None

  @nn.compact
  def __call__(self, x):
    def dense(features, name):
      if self.int8:
        return qt.Int8WeightOnlyDense(features, recipe=self.recipe, name=name)
      return nn.DenseGeneral(features, name=name)

    x = jax.nn.gelu(dense(H, "l0")(x))
    x = jax.nn.gelu(dense(H, "l1")(x))
    return dense(C, "l2")(x)


def test_layer_stores_int8_and_matches_dequantized_dense():
  key = fresh_key()
  layer = qt.Int8WeightOnlyDense(features=(4, 32), axis=(-2, -1))
  x = jax.random.normal(key, (3, 5, 8, 16))
  params = layer.init(jax.random.fold_in(key, 1), x)["params"]
  w = params["kernel"]
  assert isinstance(w, qt.Int8Weight)
  assert w.qvalue.dtype == jnp.int8 and w.qvalue.shape == (8, 16, 4, 32)
  assert w.scale.dtype == jnp.float32 and w.scale.shape == (4, 32), "one scale per output channel"
  assert int(jnp.max(jnp.abs(w.qvalue.astype(jnp.int32)))) == 127
  y = layer.apply({"params": params}, x)
  dense = nn.DenseGeneral(features=(4, 32), axis=(-2, -1))
  ref = dense.apply({"params": {"kernel": qt.dequantize_weight(w), "bias": params["bias"]}}, x)
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
  counts = qt.num_int8_bytes(params)
  assert counts == {"int8": 8 * 16 * 4 * 32, "scales": 4 * 32 * 4, "other": 4 * 32 * 4}


def test_gradient_is_the_weight_gradient():
  key = fresh_key()
  model = MLP(int8=True)
  x = jax.random.normal(key, (32, D))
  params = model.init(jax.random.fold_in(key, 1), x)["params"]
  loss = lambda p, x: jnp.mean(model.apply({"params": p}, x) ** 2)  # noqa: E731
  value, grads = qt.value_and_grad(loss)(params, x)
  # Reference: the same network with float kernels equal to the dequantized weights.
  float_params = jax.tree.map(lambda w: qt.dequantize_weight(w) if isinstance(w, qt.Int8Weight) else w, params,
                              is_leaf=lambda w: isinstance(w, qt.Int8Weight))  # fmt: skip
  ref_value, ref_grads = jax.value_and_grad(lambda p, x: jnp.mean(MLP(int8=False).apply({"params": p}, x) ** 2))(
      float_params, x
  )
  np.testing.assert_allclose(value, ref_value, rtol=1e-6)
  for name in params:
    g = grads[name]["kernel"]
    assert isinstance(g, qt.Int8Weight) and g.qvalue.dtype == jnp.float32
    np.testing.assert_allclose(g.qvalue, ref_grads[name]["kernel"], rtol=1e-5, atol=1e-7)
    assert not np.any(g.scale), "the scale gets no gradient (it is recomputed)"
  g_only = qt.grad(loss)(params, x)
  jax.tree.map(np.testing.assert_array_equal, g_only, grads)


def test_update_requantizes_and_is_unbiased():
  key = fresh_key()
  k1, k2, k3 = jax.random.split(key, 3)
  w = qt.quantize_weight(jax.random.normal(k1, (256, 64)))
  lr = 1e-3 * float(jnp.mean(w.scale))  # SGD steps of ~1/1000 of an int8 step
  params = {"kernel": w, "bias": jnp.zeros(64)}
  grads = {"kernel": qt.Int8Weight(jax.random.normal(k2, (256, 64)), jnp.zeros(64)), "bias": jnp.ones(64)}
  tx = qt.int8_weight_only(optax.sgd(lr), seed=1)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  assert updates["kernel"].qvalue.dtype == jnp.float32
  np.testing.assert_array_equal(updates["kernel"].qvalue, jnp.round(updates["kernel"].qvalue))  # integer deltas
  new = optax.apply_updates(params, updates)
  assert new["kernel"].qvalue.dtype == jnp.int8 and new["kernel"].scale.dtype == jnp.float32
  target = np.asarray(qt.dequantize_weight(w), np.float64) - lr * np.asarray(grads["kernel"].qvalue, np.float64)
  scale = np.asarray(new["kernel"].scale, np.float64)
  np.testing.assert_allclose(scale, np.max(np.abs(target), 0) / 127, rtol=1e-6)  # per-channel amax / 127
  steps = target / scale
  q = np.asarray(new["kernel"].qvalue)
  assert np.all((q == np.floor(steps)) | (q == np.ceil(steps)) | (np.abs(q - steps) < 1e-4)), "a neighbouring code"
  np.testing.assert_allclose(new["bias"], -lr * np.ones(64), rtol=1e-6)
  # Stochastic rounding is unbiased: the mean over many draws is the exact updated weight.
  small = qt.quantize_weight(jax.random.normal(k3, (64, 1)))
  exact = qt.dequantize_weight(small) + jax.random.uniform(k1, (64, 1), minval=-0.5, maxval=0.5) * small.scale
  draws = jax.jit(jax.vmap(lambda k: qt.dequantize_weight(qt.requantize_stochastic(exact, small, k))))(
      jax.random.split(k2, 1 << 18)
  )
  mean = np.mean(np.asarray(draws, np.float64), 0)
  assert rel_err(mean, exact) < 1e-4
  off = np.abs(mean - np.asarray(exact)) / np.asarray(small.scale)
  assert np.max(off) < 0.01, "within 1% of an int8 step (~10 sigma)"


def test_zero_update_keeps_codes():
  key = fresh_key()
  w = qt.quantize_weight(jax.random.normal(key, (128, 32)))
  params = {"kernel": w}
  tx = qt.int8_weight_only(optax.sgd(0.0))
  grads = {"kernel": qt.Int8Weight(jnp.ones((128, 32)), jnp.zeros(32))}
  updates, _ = tx.update(grads, tx.init(params), params)
  new = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(new["kernel"].qvalue, w.qvalue)
  np.testing.assert_array_equal(new["kernel"].scale, w.scale)


def _train(model, tx, value_and_grad, steps=STEPS):
  """Online training as in test_optim.train, for Linen models with Int8Weight parameters."""
  teacher = MLP(int8=False)
  inputs = jax.random.normal(jax.random.key(1), (steps, 128, D))
  labels = jnp.argmax(teacher.apply(teacher.init(jax.random.key(1000), inputs[0]), inputs), -1)
  params = model.init(jax.random.key(0), jnp.ones((1, D)))["params"]

  def loss(p, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, x), y).mean()

  @jax.jit
  def run(params, batches):
    def step(carry, batch):
      params, state = carry
      value, grads = value_and_grad(loss)(params, batch)
      updates, state = tx.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), value

    (params, _), losses = jax.lax.scan(step, (params, tx.init(params)), batches)
    return losses, params

  losses, params = run(params, (inputs, labels))
  return float(jnp.mean(losses[-30:])), float(losses[0]), params


def test_int8_weights_train_like_float():
  lr = 1e-3  # updates of ~lr are ~1/10 of an int8 step for these weights: stochastic rounding matters
  ref, start, _ = _train(MLP(int8=False), optax.adamw(lr, weight_decay=0.01), jax.value_and_grad)
  ours, _, params = _train(MLP(int8=True), qt.int8_weight_only(optax.adamw(lr, weight_decay=0.01)), qt.value_and_grad)
  assert ref < 0.8 * start
  assert ours <= 1.03 * ref, (ours, ref)
  kernels = [p["kernel"] for p in params.values()]
  assert all(k.qvalue.dtype == jnp.int8 for k in kernels), "no float kernel appears during training"


def test_int8_matmul_recipe_and_multisteps():
  tx = optax.MultiSteps(qt.int8_weight_only(optax.adamw(1e-3)), 2, accumulator_dtype=jnp.float32)
  ours, start, params = _train(MLP(int8=True, recipe=Int8MixedPrecision()), tx, qt.value_and_grad, steps=40)
  assert ours < 0.9 * start
  assert all(p["kernel"].qvalue.dtype == jnp.int8 for p in params.values())


def test_errors():
  with pytest.raises(ValueError, match="batch_dims"):
    qt.Int8WeightOnlyDense(4, batch_dims=(0,)).init(jax.random.key(0), jnp.ones((2, 3)))
  with pytest.raises(TypeError, match="Int8MixedPrecision or None"):
    from jaxlowbit import Float8

    qt.Int8WeightOnlyDense(4, recipe=Float8()).init(jax.random.key(0), jnp.ones((2, 16)))
  with pytest.raises(ValueError, match="needs params"):
    tx = qt.int8_weight_only(optax.sgd(1.0))
    tx.update({}, tx.init({}))
  with pytest.raises(ValueError, match="n_contracted"):
    qt.quantize_weight(jnp.ones((4,)))
