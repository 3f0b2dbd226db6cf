"""The optimizer: AdamW (or a drop-in with its signature) with warmup + cosine and clipping.

``config.optimizer`` names the AdamW variant, one of :data:`OPTIMIZERS` (``jaxlowbit.optim.OPTIMIZERS``:
``adamw`` is ``optax.adamw``; ``adamw_8bit``, ``adamw_4bit``, ``adamw_fp8``, ``adamw_fp8_o2`` take its
arguments). Other functions of ``jaxlowbit.optim`` (``chain``, ``stochastic_rounding``) are not optimizers
and are refused. To add one, put it in :data:`OPTIMIZERS`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax

from jaxlowbit import optim

# The closed list of config.optimizer names: jaxlowbit.optim's AdamW registry (optax.adamw and the low-bit ones).
OPTIMIZERS: dict[str, Callable[..., optax.GradientTransformation]] = dict(optim.OPTIMIZERS)
# Parameters that get weight decay: matmul kernels and embedding tables, not norm scales or biases.
DECAYED_PARAM_NAMES = ("kernel", "embedding")


def learning_rate_schedule(config) -> optax.Schedule:
  """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio`` at ``steps``.

  The first step already moves (``lr / warmup_steps``): warming up from exactly 0 wastes it.
  A run that warms up over all its steps (``warmup_steps == steps``) has no decay phase.
  """
  if config.warmup_steps == config.steps:  # optax's cosine phase needs at least one step
    return optax.linear_schedule(config.lr / config.warmup_steps, config.lr, config.warmup_steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=config.lr / max(config.warmup_steps, 1),
      peak_value=config.lr,
      warmup_steps=config.warmup_steps,
      decay_steps=config.steps,
      end_value=config.lr * config.min_lr_ratio,
  )


def weight_decay_mask(params) -> object:
  """A pytree of bools: True for leaves whose name is in :data:`DECAYED_PARAM_NAMES`."""

  def decayed(path, _):
    return getattr(path[-1], "key", None) in DECAYED_PARAM_NAMES

  return jax.tree_util.tree_map_with_path(decayed, params)


def adamw_factory(name: str) -> Callable[..., optax.GradientTransformation]:
  """The AdamW called ``name`` in :data:`OPTIMIZERS` (ValueError naming the choices)."""
  if name not in OPTIMIZERS:
    raise ValueError(f"config.optimizer={name!r} is not an optimizer; choose one of {', '.join(OPTIMIZERS)}")
  return OPTIMIZERS[name]


def make_optimizer(config) -> optax.GradientTransformation:
  """``clip_by_global_norm(grad_clip)`` then AdamW named by ``config.optimizer`` on the schedule."""
  adamw = adamw_factory(config.optimizer)(
      learning_rate=learning_rate_schedule(config),
      b1=config.b1,
      b2=config.b2,
      eps=config.eps,
      weight_decay=config.weight_decay,
      mask=weight_decay_mask,
  )
  if config.grad_clip > 0:  # optim.chain: optax.chain that keeps the low-bit AdamW's fused step
    return optim.chain(optax.clip_by_global_norm(config.grad_clip), adamw)
  return adamw
