"""Training steps over an :class:`FsdpPlan`: loss and gradients in ``shard_map``, the update outside.

The loss function is written for ONE device: it gets the local parameter shards, the
step's scales, the local slice of the batch and any replicated extras (e.g. a dropout
key), and returns the mean loss over that slice (it calls :func:`jaxlowbit.parallel.apply` to
run the model; under tensor parallelism, over this device's tokens of the slice, which
``TensorParallel.local_tokens`` picks). :func:`value_and_grad` wraps it in ``shard_map``: the
loss is averaged over the batch axes (and the tensor axis), sharded parameters get their
reduce-scattered gradient shard and replicated ones the all-reduced gradient. :func:`train_step` adds the optimizer update
(plain ``jit`` over the sharded arrays: element-wise optimizers stay local, global norms
get their collectives from XLA) and the next step's :func:`precompute_scales`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxlowbit.parallel.fsdp.plan import FsdpPlan
from jaxlowbit.parallel.fsdp.scales import Scales, precompute_scales
from jaxlowbit.optim import apply_step, state_shardings

# loss_fn(params, scales, batch, *extras) -> float32 scalar: mean loss over this device's slice.
LossFn = Callable[..., jax.Array]


def _per_device(local: Callable, plan: FsdpPlan, num_extras: int, out_specs) -> Callable:
  """``shard_map`` of ``local(params, scales, batch, *extras)`` with the plan's in_specs."""
  in_specs = (plan.specs(), P(), plan.batch_spec(), *[P()] * num_extras)
  return jax.shard_map(local, mesh=plan.mesh, in_specs=in_specs, out_specs=out_specs)


def value_and_grad(loss_fn: LossFn, plan: FsdpPlan) -> Callable:
  """``f(params, scales, batch, *extras) -> (loss, grads)`` over the plan's mesh.

  Args:
    loss_fn: ``loss_fn(params, scales, batch, *extras)`` for one device (module docstring).
    plan: the :class:`FsdpPlan`; ``params`` are sharded per it, every leaf of ``batch`` has
      its leading dimension sharded over ``plan.batch_axes``, ``extras`` are replicated.

  Returns:
    A function of global arrays giving the mean loss over the whole batch (replicated)
    and its gradient, sharded like ``params``. With an unsharded plan it is
    ``jax.value_and_grad(loss_fn)``.
  """
  if plan.mesh is None:
    return jax.value_and_grad(loss_fn)
  axes = plan.loss_axes

  def f(params, scales, batch, *extras):
    def local(params, scales, batch, *extras):
      mean_loss = lambda p: lax.pmean(loss_fn(p, scales, batch, *extras), axes)
      return jax.value_and_grad(mean_loss)(params)

    return _per_device(local, plan, len(extras), (P(), plan.specs()))(params, scales, batch, *extras)

  return f


def evaluate(loss_fn: LossFn, plan: FsdpPlan) -> Callable:
  """``f(params, scales, batch, *extras) -> loss`` averaged over the batch axes, without gradients."""
  if plan.mesh is None:
    return loss_fn
  axes = plan.loss_axes

  def f(params, scales, batch, *extras):
    local = lambda *a: lax.pmean(loss_fn(*a), axes)
    return _per_device(local, plan, len(extras), P())(params, scales, batch, *extras)

  return f


def _constrain(tree, plan: FsdpPlan):
  if plan.mesh is None:
    return tree
  return jax.lax.with_sharding_constraint(tree, plan.shardings())


def init_optimizer(optimizer: optax.GradientTransformation, params, plan: FsdpPlan):
  """``optimizer.init(params)`` with every parameter-shaped state leaf sharded like its parameter
  (:func:`jaxlowbit.optim.state_shardings`: optax's moments and the low-bit optimizers' codes and
  block scales alike), the rest replicated."""

  def init(params):
    state = optimizer.init(params)
    if plan.mesh is None:
      return state
    return jax.lax.with_sharding_constraint(state, state_shardings(optimizer, state, plan.shardings()))

  return jax.jit(init)(params)


def apply_update(optimizer: optax.GradientTransformation, grads, opt_state, params, plan: FsdpPlan):
  """One optimizer update of sharded ``params``: ``(params, opt_state, next step's scales)``.

  Element-wise optimizers stay local to each shard; global norms get their collectives from
  XLA. The new parameters keep the plan's shardings, and every quantized weight's scale for
  the next step comes from one all-reduce (:func:`precompute_scales`). Call it under ``jit``.
  """
  params, opt_state = apply_step(optimizer, grads, opt_state, params)  # fused where the optimizer has it
  params = _constrain(params, plan)
  return params, opt_state, precompute_scales(params, plan)


def train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, plan: FsdpPlan, donate: bool = True):
  """A jitted ``step(params, opt_state, scales, batch, *extras) -> (params, opt_state, scales, loss)``.

  ``scales`` are this step's (``precompute_scales(params, plan)`` before the first step);
  the step returns the next step's, computed after the update in one collective.
  ``donate`` donates ``params`` and ``opt_state``.
  """
  grad_fn = value_and_grad(loss_fn, plan)

  def step(params, opt_state, scales: Scales, batch, *extras):
    loss, grads = grad_fn(params, scales, batch, *extras)
    return *apply_update(optimizer, grads, opt_state, params, plan), loss

  return jax.jit(step, donate_argnums=(0, 1) if donate else ())


__all__ = ["apply_update", "evaluate", "init_optimizer", "train_step", "value_and_grad"]
