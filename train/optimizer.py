"""The optimizer: AdamW (or a drop-in with its signature) with warmup + cosine and clipping.

``spec.optimizer.name`` (``config.optimizer``) names the AdamW variant, one of :data:`OPTIMIZERS`, which
is ``jaxlowbit.optim.OPTIMIZERS`` itself: ``adamw`` is ``optax.adamw``; ``adamw_8bit``, ``adamw_4bit``,
``adamw_fp8``, ``adamw_fp8_o2`` take its arguments, and ``jaxlowbit.optim.make`` builds one by name.
Other functions of ``jaxlowbit.optim`` (``chain``, ``stochastic_rounding``) are not optimizers and are
refused. To add one, put it in ``jaxlowbit.optim.OPTIMIZERS``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax

from jaxlowbit import optim
from train.spec import RunSpec

# The closed list of config.optimizer names: jaxlowbit.optim's AdamW registry (optax.adamw and the low-bit ones).
OPTIMIZERS: dict[str, Callable[..., optax.GradientTransformation]] = optim.OPTIMIZERS
# Parameters that get weight decay: matmul kernels and embedding tables, not norm scales or biases.
DECAYED_PARAM_NAMES = ("kernel", "embedding")


def learning_rate_schedule(spec: RunSpec) -> optax.Schedule:
  """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio`` at ``steps``.

  The first step already moves (``lr / warmup_steps``): warming up from exactly 0 wastes it.
  A run that warms up over all its steps (``warmup_steps == steps``) has no decay phase.
  """
  opt = spec.optimizer
  if opt.warmup_steps == spec.steps:  # optax's cosine phase needs at least one step
    return optax.linear_schedule(opt.lr / opt.warmup_steps, opt.lr, opt.warmup_steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=opt.lr / max(opt.warmup_steps, 1),
      peak_value=opt.lr,
      warmup_steps=opt.warmup_steps,
      decay_steps=spec.steps,
      end_value=opt.lr * opt.min_lr_ratio,
  )


def weight_decay_mask(params) -> object:
  """A pytree of bools: True for leaves whose name is in :data:`DECAYED_PARAM_NAMES`."""

  def decayed(path, _):
    return getattr(path[-1], "key", None) in DECAYED_PARAM_NAMES

  return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(spec: RunSpec) -> optax.GradientTransformation:
  """``clip_by_global_norm(grad_clip)``, then AdamW ``spec.optimizer.name`` (``jaxlowbit.optim.make``) on the schedule.

  Raises:
    ValueError: a name not in :data:`OPTIMIZERS` (``train.config.check`` refuses it first).
  """
  opt = spec.optimizer
  adamw = optim.make(opt.name, learning_rate_schedule(spec), b1=opt.b1, b2=opt.b2, eps=opt.eps,
                     weight_decay=opt.weight_decay, mask=weight_decay_mask, execution=spec.execution)
  if opt.grad_clip > 0:  # optim.chain: optax.chain that keeps the low-bit AdamW's fused step
    return optim.chain(optax.clip_by_global_norm(opt.grad_clip), adamw)
  return adamw
