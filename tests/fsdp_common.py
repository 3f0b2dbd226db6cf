"""A small Linen model and an FSDP training run shared by the FSDP tests and their 2-process worker.

The model exercises every path of ``jaxlowbit.fsdp.apply``: an ``nn.Embed`` table (a
sharded non-linear parameter, gathered in float32 before the model runs), a
``DenseGeneral`` contracting two axes into two feature axes (kernel ``[4, 32, 2, 64]``,
sharded along its first contracted axis), a kernel whose leading dim (2) does not divide
by 4 devices (replicated), and a plain ``[64, 16]`` kernel; BitNet adds an RMSNorm before
each linear.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import flax.linen as nn

import jaxlowbit
from jaxlowbit import BitNet, fsdp

VOCAB, SEQ, EMBED, CLASSES = 64, 4, 32, 16
# 8 devices x 256 examples. Two XLA programs (per-device and unsharded) can round one value
# differently in the last bit, and a value that sits on an int8/ternary rounding tie then
# quantizes differently: one token's output changes by ~1/127 of its range. With 64 examples
# that moved the mean loss by up to 1.3e-5 (1 run in 30); with 2048, by at most 2.3e-6 (BitNet,
# 20 runs; the other recipes <= 2.6e-7), under the 1e-5 bound with room to spare.
BATCH = 2048
# SGD: the update is linear in the gradient, so summation-order differences between a sharded
# and an unsharded run stay at rounding level (Adam's g/sqrt(v) would amplify them where g ~ 0).
# BitNet, with its RMSNorms, fits ~10x faster than the others: a 10x smaller rate keeps its
# five steps as gentle.
LEARNING_RATE, BITNET_LEARNING_RATE, MOMENTUM = 0.5, 0.05, 0.9


class TinyNet(nn.Module):
  recipe: object = None
  norms: bool | None = None  # RMSNorm before each linear; default: for BitNet

  @nn.compact
  def __call__(self, tokens):
    bitnet = isinstance(self.recipe, BitNet) if self.norms is None else self.norms
    x = nn.Embed(VOCAB, EMBED)(tokens)  # [B, 4, 32]
    layers = (
        dict(features=(2, 64), axis=(-2, -1), name="dense_0"),  # K = 4*32, kernel [4, 32, 2, 64]
        dict(features=64, axis=(-2, -1), name="dense_1"),  # kernel [2, 64, 64]: 2 % 4 != 0, replicated
        dict(features=CLASSES, name="dense_2"),  # kernel [64, 16]
    )
    for i, kwargs in enumerate(layers):
      if bitnet:
        x = nn.RMSNorm()(x)  # BitNet model surgery: a norm before each linear
      x = jaxlowbit.dense_for(self.recipe, **kwargs)(x)
      x = nn.gelu(x) if i < len(layers) - 1 else x
    return x


def data(key, steps: int):
  """``steps`` batches of tokens ``[B, 4]`` and labels ``[B]`` = first token mod 16 (learnable)."""
  tokens = jax.random.randint(key, (steps, BATCH, SEQ), 0, VOCAB)
  return tokens, tokens[..., 0] % CLASSES


@functools.partial(jax.jit, static_argnums=2)
def _init(key, tokens, norms: bool):
  # Every recipe has the same parameter tree: one compiled init (per norms) serves all tests.
  return TinyNet(None, norms=norms).init(key, tokens)["params"]


def setup(recipe, mesh, config: fsdp.FsdpConfig, example_tokens, init_key, chunks: int = 1):
  """``(plan, step, params, opt_state, scales, place_batch)`` of TinyNet under FSDP over ``mesh``.

  ``mesh=None`` is the unsharded plan; ``chunks`` then splits each batch into that many
  slices whose mean loss is the objective, so per-tensor and per-column (over tokens)
  activation scales see the same tokens as each device of a sharded run does.
  """
  model = TinyNet(recipe)
  params = _init(init_key, example_tokens, isinstance(recipe, BitNet))
  plan = fsdp.plan_for_model(model, params, example_tokens, mesh=mesh, config=config)
  optimizer = optax.sgd(BITNET_LEARNING_RATE if isinstance(recipe, BitNet) else LEARNING_RATE, momentum=MOMENTUM)
  if mesh is not None:
    params = fsdp.shard_params(params, plan)
  opt_state = fsdp.init_optimizer(optimizer, params, plan)
  scales = jax.jit(lambda p: fsdp.precompute_scales(p, plan))(params)

  def slice_loss(params, scales, x, y):
    logits = fsdp.apply(model, params, x, plan=plan, scales=scales)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def loss_fn(params, scales, batch):
    x, y = batch
    if chunks == 1:
      return slice_loss(params, scales, x, y)
    split = lambda a: a.reshape(chunks, a.shape[0] // chunks, *a.shape[1:])
    # lax.map, not vmap: each slice computes with the shapes a device has, so XLA reduces
    # (e.g. RMSNorm's mean) in the same order and int8/ternary roundings tie-break the same way.
    return jax.lax.map(lambda xy: slice_loss(params, scales, *xy), (split(x), split(y))).mean()

  place = (lambda b: b) if mesh is None else (lambda b: fsdp.shard_batch(b, plan))
  return plan, fsdp.train_step(loss_fn, optimizer, plan), params, opt_state, scales, place


def train(recipe, mesh, config: fsdp.FsdpConfig, tokens, labels, init_key) -> np.ndarray:
  """Losses of ``len(tokens)`` SGD steps of TinyNet under FSDP over ``mesh``."""
  _, step, params, opt_state, scales, place = setup(recipe, mesh, config, tokens[0], init_key)
  losses = []
  for batch in zip(tokens, labels):
    params, opt_state, scales, loss = step(params, opt_state, scales, place(batch))
    losses.append(float(loss))
  return np.asarray(losses)


def _rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def sharded_and_unsharded(recipe, mesh, config: fsdp.FsdpConfig, tokens, labels, init_key) -> dict:
  """The same steps sharded over ``mesh`` and unsharded (the batch in ``mesh.size`` slices).

  Returns losses of the sharded run, of a free-running unsharded run, and of unsharded steps
  taken in lockstep from the sharded run's state (parameters, optimizer state, scales)
  before each step, plus the largest relative difference between the lockstep step's
  updated parameters and the sharded step's, and between the scales the unsharded plan
  computes from the sharded run's parameters and the sharded run's own.
  """
  chunks = mesh.size
  _, s_step, s_params, s_opt, s_scales, place = setup(recipe, mesh, config, tokens[0], init_key)
  u_plan, u_step, u_params, u_opt, u_scales, _ = setup(recipe, None, config, tokens[0], init_key, chunks=chunks)
  u_scales_of = jax.jit(lambda p: fsdp.precompute_scales(p, u_plan))
  out = {"sharded": [], "unsharded": [], "lockstep": [], "param_rel_err": 0.0, "scales_rel_err": 0.0}
  for x, y in zip(tokens, labels):
    host_params, host_opt, host_scales = jax.device_get((s_params, s_opt, s_scales))
    for path, scale in u_scales_of(host_params).items():
      out["scales_rel_err"] = max(out["scales_rel_err"], _rel_err(scale, host_scales[path]))
    l_params, _, _, l_loss = u_step(host_params, host_opt, host_scales, (x, y))
    s_params, s_opt, s_scales, s_loss = s_step(s_params, s_opt, s_scales, place((x, y)))
    u_params, u_opt, u_scales, u_loss = u_step(u_params, u_opt, u_scales, (x, y))
    for name, value in (("sharded", s_loss), ("unsharded", u_loss), ("lockstep", l_loss)):
      out[name].append(float(value))
    # All parameters as one vector: a zero-initialized bias's first update is a sum with heavy
    # cancellation, whose own relative rounding error says nothing about the model.
    flat = lambda tree: np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in jax.tree.leaves(tree)])
    out["param_rel_err"] = max(out["param_rel_err"], _rel_err(flat(jax.device_get(s_params)), flat(l_params)))
  return {k: np.asarray(v) if isinstance(v, list) else v for k, v in out.items()}
