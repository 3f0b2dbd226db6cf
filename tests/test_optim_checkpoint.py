"""Every optimizer state and quantized parameter saves and restores through orbax, and a resumed
run continues bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from jaxlowbit import optim
from jaxlowbit import quantized_training as qt
from test_optim import _mlp_problem

STEPS = 6


def _setup(kind):
  """(params, tx, loss(params, step), value_and_grad) of one configuration."""
  if kind == "int8_weights":
    layer = qt.Int8WeightOnlyDense(256)
    x = jax.random.normal(jax.random.key(1), (STEPS, 64, 128))
    params = layer.init(jax.random.key(0), x[0])["params"]
    loss = lambda p, t: jnp.mean((layer.apply({"params": p}, x[t]) - 1.0) ** 2)  # noqa: E731
    return params, qt.int8_weight_only(optim.adamw_8bit(1e-3), seed=5), loss, qt.value_and_grad
  params, batch_loss, (inputs, labels) = _mlp_problem(steps=STEPS)
  loss = lambda p, t: batch_loss(p, (inputs[t], labels[t]))  # noqa: E731
  if kind == "bf16_stochastic":
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    f32_loss = loss
    loss = lambda p, t: f32_loss(jax.tree.map(lambda a: a.astype(jnp.float32), p), t)  # noqa: E731
    return params, optim.make("adamw_4bit", 1e-3, stochastic_rounding_seed=3), loss, jax.value_and_grad
  return params, optim.make(kind, 1e-3, weight_decay=0.1), loss, jax.value_and_grad


@pytest.mark.parametrize("kind", ["adamw_8bit", "adamw_4bit", "adamw_fp8_o2", "bf16_stochastic", "int8_weights"])
def test_resume_is_bit_identical(kind, tmp_path):
  params, tx, loss, value_and_grad = _setup(kind)

  @jax.jit
  def step(params, state, t):
    _, grads = value_and_grad(loss)(params, t)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def run(params, state, steps, start):
    for t in range(start, start + steps):
      params, state = step(params, state, t)
    return params, state

  state0 = tx.init(params)
  straight = run(params, state0, STEPS, 0)

  half = run(params, state0, STEPS // 2, 0)
  checkpointer = ocp.StandardCheckpointer()
  path = tmp_path / "ckpt"
  checkpointer.save(path, {"params": half[0], "opt_state": half[1]})
  checkpointer.wait_until_finished()
  abstract = jax.eval_shape(lambda: {"params": half[0], "opt_state": half[1]})
  restored = checkpointer.restore(path, abstract)
  assert jax.tree.structure(restored) == jax.tree.structure(abstract), "NamedTuple states come back as themselves"
  jax.tree.map(np.testing.assert_array_equal, restored, {"params": half[0], "opt_state": half[1]})
  assert all(jax.tree.leaves(jax.tree.map(lambda a, b: a.dtype == b.dtype, restored["opt_state"], half[1])))
  resumed = run(restored["params"], restored["opt_state"], STEPS - STEPS // 2, STEPS // 2)

  jax.tree.map(np.testing.assert_array_equal, resumed, straight)
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.any(a != b)), straight[0], params))
  assert any(moved), "training must have changed the parameters"
