"""Explicit execution options reach every kernel choice: ``$JAXLOWBIT_BACKEND`` is read only where a public
entry point got none.

Each check runs with ``JAXLOWBIT_BACKEND`` set to a value that is no backend, so any read of the variable
raises: given explicit options (``backend="xla"``), the inference linear (Linen and NNX conversion), the
low-bit AdamW update, ``Int8WeightOnlyDense`` and the trainer (init, a step with BitNet step weights and
an 8-bit optimizer, evaluation, generation's converted model) all run, and give what the default options
give with the variable unset. Without options, the same calls raise naming the variable.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import fresh_key
from test_train_loop import corpus, micro_config  # noqa: F401  (fixture)

from jaxlowbit import ExecutionOptions, Int8MixedPrecision, inference, optim
from jaxlowbit.quantized_training import Int8WeightOnlyDense
from pallas_kernels import policy
from train import generate, steps
from train.spec import resolve

XLA = ExecutionOptions(backend="xla")
NOT_A_BACKEND = "no_such_backend"  # any read of the variable raises ValueError naming it
K, N, M = 64, 48, 8


@pytest.fixture
def environment(monkeypatch):
  """``unset()`` / ``poisoned()``: the variable unset, or set to a value every reader refuses."""

  class Environment:
    def unset(self):
      monkeypatch.delenv(policy.BACKEND_ENV, raising=False)

    def poisoned(self):
      monkeypatch.setenv(policy.BACKEND_ENV, NOT_A_BACKEND)

  return Environment()


def _refused(fn):
  with pytest.raises(ValueError, match=policy.BACKEND_ENV):
    fn()


class OneLinear(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(N, name="up")(x)


@pytest.mark.parametrize("scheme", inference.SCHEMES)
def test_the_inference_linear_and_its_conversions_take_explicit_options(scheme, environment):
  w = jax.random.normal(fresh_key(), (K, N))
  x = jax.random.normal(fresh_key(), (M, K))
  leaves = inference.quantize_weight(w, scheme)
  model = OneLinear()
  params = inference.quantize_params({"up": {"kernel": w, "bias": jnp.zeros(N)}}, scheme)
  linear = nnx.Linear(K, N, rngs=nnx.Rngs(0))
  linear.kernel[...] = w
  environment.unset()
  expected = inference.quantized_linear(x, leaves, scheme)
  expected_linen = inference.convert_for_inference(model, scheme).apply({"params": params}, x)
  environment.poisoned()
  np.testing.assert_array_equal(inference.quantized_linear(x, leaves, scheme, options=XLA), expected)
  linen = inference.convert_for_inference(model, scheme, execution=XLA)
  np.testing.assert_array_equal(linen.apply({"params": params}, x), expected_linen)
  converted = inference.convert_for_inference(linear, scheme, execution=XLA)
  assert converted.execution == XLA
  np.testing.assert_array_equal(converted(x), expected + converted.bias[...])
  _refused(lambda: inference.quantized_linear(x, leaves, scheme))
  _refused(lambda: inference.convert_for_inference(model, scheme).apply({"params": params}, x))
  default = inference.convert_for_inference(nnx.Linear(K, N, rngs=nnx.Rngs(0)), scheme)
  assert default.execution is None  # no options given: the environment's, read when it runs
  _refused(lambda: default(x))


def test_the_low_bit_adamw_update_takes_explicit_options(environment):
  params = {"w": jax.random.normal(fresh_key(), (64, 128))}  # 8192 elements: quantized moments
  grads = {"w": jax.random.normal(fresh_key(), (64, 128))}
  environment.unset()
  tx = optim.make("adamw_8bit", 1e-3)
  # Both under jit: op by op, XLA rounds some elements differently (1 ulp) than the fused program.
  expected, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  environment.poisoned()
  tx = optim.make("adamw_8bit", 1e-3, execution=XLA)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  np.testing.assert_array_equal(updates["w"], expected["w"])
  fused, _ = jax.jit(lambda g, s, p: optim.apply_step(tx, g, s, p))(grads, tx.init(params), params)
  np.testing.assert_allclose(fused["w"], optax.apply_updates(params, expected)["w"], rtol=1e-6, atol=1e-7)
  assert optim.make("adamw", 1e-3, execution=XLA) is not None  # optax's: the same arguments, nothing to choose
  default = optim.make("adamw_8bit", 1e-3)
  _refused(lambda: jax.jit(default.update)(grads, default.init(params), params))


def test_int8_weight_only_dense_takes_explicit_options(environment):
  x = jax.random.normal(fresh_key(), (M, K))
  environment.unset()
  layer = Int8WeightOnlyDense(N, recipe=Int8MixedPrecision())
  params = layer.init(jax.random.key(0), x)
  expected = layer.apply(params, x)
  environment.poisoned()
  explicit = Int8WeightOnlyDense(N, recipe=Int8MixedPrecision(), execution=XLA)
  np.testing.assert_array_equal(explicit.apply(params, x), expected)
  _refused(lambda: layer.apply(params, x))


def test_the_trainer_runs_on_its_specs_options_alone(corpus, environment):  # noqa: F811
  """BitNet with accumulation (the step's ternary weights, ``runtime.step_weights``) and the 8-bit AdamW
  (the fused update): init, two steps, evaluation and generation's converted model, the variable poisoned."""
  config = micro_config(corpus, recipe="bitnet", optimizer="adamw_8bit", grad_accum_steps=2)
  environment.unset()
  spec = resolve(config)
  reference = steps.step_functions(spec)
  batch = np.asarray(jax.random.randint(fresh_key(), (spec.batch_size, spec.seq_len + 1), 0, 256), np.int32)
  _, expected = reference.train_step(reference.init(), batch)
  environment.poisoned()
  _refused(lambda: resolve(config))  # the trainer's one reading of the variable
  spec = resolve(config, execution=XLA)
  assert spec.execution == XLA and spec.compiled != resolve(config, execution=ExecutionOptions("auto")).compiled
  functions = steps.step_functions(spec)
  assert functions.model.execution == XLA
  state = functions.init()
  assert functions.runtime.step_weights(state.params)  # BitNet weights quantized once, on the spec's backend
  state, metrics = functions.train_step(state, functions.shard_train_batch(batch))
  np.testing.assert_allclose(float(metrics["loss"]), float(expected["loss"]), rtol=1e-6)
  state, _ = functions.train_step(state, functions.shard_train_batch(batch))
  assert np.isfinite(float(functions.eval_step(state.params, state.scales, batch[:, : spec.seq_len + 1])))
  model, params = generate.prepare(spec.model, state.params, "ternary", execution=spec.execution)
  cache = generate.init_cache(model, 1, 8)
  logits, _ = model.apply({"params": params, "cache": cache}, jnp.zeros((1, 4), jnp.int32), mutable=["cache"])
  assert logits.shape == (1, 4, spec.model.vocab_size) and bool(jnp.all(jnp.isfinite(logits)))
