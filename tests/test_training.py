"""A 3-layer MLP trained 200 steps per recipe ends within 5% of the bf16 run's loss.

The task is language-model-like: cross-entropy on labels *sampled* from a fixed random
teacher's softmax, so it has an irreducible entropy floor that a correct run approaches
(2.9 -> ~1.6 nats). A bf16 run with a 10x smaller learning rate lands ~6% above, outside
the bound (the negative control below), so the bound does tell a slower learner apart.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import flax.linen as nn

import jaxlowbit
from jaxlowbit import BitNet, Float8, Int8MixedPrecision
from helpers import fresh_key

STEPS, LR = 200, 3e-3
D_IN, HIDDEN, CLASSES, BATCH = 64, 256, 16, 256
TOLERANCE = 1.05


class MLP(nn.Module):
  recipe: object = None

  @nn.compact
  def __call__(self, x):
    bitnet = isinstance(self.recipe, BitNet)
    for i in range(3):
      if bitnet:
        x = nn.RMSNorm(dtype=jnp.bfloat16)(x)  # BitNet model surgery: norm before each linear
      features = HIDDEN if i < 2 else CLASSES
      x = jaxlowbit.dense_for(self.recipe, features=features, dtype=jnp.bfloat16, name=f"dense_{i}")(x)
      x = nn.gelu(x) if i < 2 else x
    return x


def _teacher_data(key):
  ka, kb, kx, kl = jax.random.split(key, 4)
  a = jax.random.normal(ka, (D_IN, 128)) / np.sqrt(D_IN)
  b = jax.random.normal(kb, (128, CLASSES)) * (4 / np.sqrt(128))
  xs = jax.random.normal(kx, (STEPS, BATCH, D_IN))
  labels = jax.random.categorical(kl, jnp.tanh(xs @ a) @ b)
  return xs, labels


@functools.partial(jax.jit, static_argnums=(0, 1))
def _train(recipe, lr, xs, labels):
  model = MLP(recipe)
  params = model.init(jax.random.key(0), xs[0])
  opt = optax.adamw(lr)

  def loss_fn(params, x, y):
    logits = model.apply(params, x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def step(carry, batch):
    params, state = carry
    loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
    updates, state = opt.update(grads, state, params)
    return (optax.apply_updates(params, updates), state), loss

  _, losses = jax.lax.scan(step, (params, opt.init(params)), (xs, labels))
  return losses


def _final(losses) -> float:
  return float(jnp.mean(losses[-20:]))


@pytest.mark.parametrize(
    "recipe", [Int8MixedPrecision(), Float8("tensorwise"), Float8("rowwise"), Float8("rowwise_gw_hp"), BitNet()],
    ids=str,
)
def test_recipe_trains_like_bf16(recipe):
  xs, labels = _teacher_data(fresh_key())
  bf16, low = _train(None, LR, xs, labels), _train(recipe, LR, xs, labels)
  print(f"{recipe}: start {float(bf16[0]):.3f} bf16 {_final(bf16):.4f} low-bit {_final(low):.4f}")
  assert np.all(np.isfinite(low))
  assert _final(bf16) < 0.75 * float(bf16[0]), "the task must be learnt for the comparison to mean anything"
  assert _final(low) <= TOLERANCE * _final(bf16), f"{recipe}: {_final(low):.4f} vs bf16 {_final(bf16):.4f}"


def test_bound_rejects_a_slower_learner():
  """The 5% bound can fail: bf16 at a 30th of the learning rate ends 38-48% above (six seeds). At a 10th it
  ended 5.5-7.2% above, too close to the bound to hold for every seed."""
  xs, labels = _teacher_data(fresh_key())
  bf16, slow = _train(None, LR, xs, labels), _train(None, LR / 30, xs, labels)
  assert _final(slow) > TOLERANCE * _final(bf16)
