"""The Adam step's elementwise arithmetic: one definition for the XLA update and the fused kernel.

``jaxlowbit.optim.scale_by_adam_quantized`` runs it on whole tensors in XLA; the fused Pallas
update (``pallas_kernels.adam``) runs it on the slices of blocks it holds in registers. It is
``optax.scale_by_adam``'s arithmetic operation for operation (tensors kept in float32 follow
``optax.adamw`` bit for bit), written over an :class:`AdamCoefficients` so that both callers see
the same float32 constants: ``1 - b1`` is computed once, where ``b1`` is given (in Python double
precision for a float, in float32 for a traced hyperparameter), never again inside a kernel.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxlowbit_numerics.random import round_bf16_with_bits

# Largest second moment a low-bit state stores (2^110 ~ 1.3e33). A larger or overflowed ``v`` is
# brought down with its ``m`` by :func:`fit_moments`. The 2^18 of headroom below float32's max keeps
# Adam's bias-corrected ``v / (1 - b2^t)`` finite for ``1 - b2 >= 4e-6`` (b2 up to 0.999996) and the
# decoded values finite (``code * scale`` and square-root storage's square round up by ulps).
MOMENT_MAX = 2.0**110
# The coefficients in the order the fused kernel reads them from its float32 operand.
COEFFICIENT_NAMES = ("b1", "one_minus_b1", "b2", "one_minus_b2", "bc1", "bc2", "bc1_next", "eps", "eps_root")


class AdamCoefficients(NamedTuple):
  """The scalars of one Adam step (Python floats, or float32 scalars under ``inject_hyperparams``).

  Attributes:
    b1, b2: the moments' decay rates; ``one_minus_b1``, ``one_minus_b2``: ``1 - b1``, ``1 - b2``.
    bc1, bc2: float32 bias corrections ``1 - b1^t``, ``1 - b2^t`` of this step ``t``;
      ``bc1_next``: ``1 - b1^(t+1)`` (Nesterov).
    eps, eps_root: as in ``optax.scale_by_adam``.
  """

  b1: Any
  one_minus_b1: Any
  b2: Any
  one_minus_b2: Any
  bc1: jax.Array
  bc2: jax.Array
  bc1_next: jax.Array
  eps: Any
  eps_root: Any


def adam_coefficients(b1, b2, eps, eps_root, count: jax.Array, count_next: jax.Array) -> AdamCoefficients:
  """The coefficients of the step whose int32 count (after incrementing) is ``count``.

  Bias corrections as optax computes them: ``decay ** count`` in float32. ``count_next`` is
  ``optax.safe_increment(count)``, for Nesterov's look-ahead correction.
  """
  return AdamCoefficients(b1, 1 - b1, b2, 1 - b2, 1 - b1**count, 1 - b2**count, 1 - b1**count_next, eps, eps_root)


def adam_moments(g: jax.Array, m: jax.Array, v: jax.Array, c: AdamCoefficients, nesterov: bool = False):
  """One Adam step on moments ``m``, ``v`` and gradient ``g`` (same shape; any float dtypes).

  Returns:
    ``(u, m_new, v_new)``: the update ``m_hat / (sqrt(v_hat + eps_root) + eps)`` (Nesterov's
    ``m_hat`` if asked) and the new moments ``b1 m + (1 - b1) g``, ``b2 v + (1 - b2) g^2``.
  """
  m_new = c.one_minus_b1 * g + c.b1 * m
  v_new = c.one_minus_b2 * (g * g) + c.b2 * v
  if nesterov:
    m_hat = c.b1 * (m_new / c.bc1_next.astype(m_new.dtype)) + c.one_minus_b1 * (g / c.bc1.astype(g.dtype))
  else:
    m_hat = m_new / c.bc1.astype(m_new.dtype)
  v_hat = v_new / c.bc2.astype(v_new.dtype)
  return m_hat / (jnp.sqrt(v_hat + c.eps_root) + c.eps), m_new, v_new


def fit_moments(g: jax.Array, m: jax.Array, v: jax.Array, m_new: jax.Array, v_new: jax.Array,
                c: AdamCoefficients) -> tuple[jax.Array, jax.Array]:
  """The new moments of :func:`adam_moments` made storable in a block-wise state: float32 ``(m, v)``.

  A finite gradient of more than ~1.8e19 overflows ``g * g`` (optax's ``v`` then holds inf and its
  update is 0 there; from ~1e18 the bias-corrected ``v`` of early steps does). A block-wise state
  cannot hold inf without losing the whole block (its scale is the block's max), so where ``v_new``
  exceeds :data:`MOMENT_MAX` and ``g`` is finite, the element's pair is scaled by
  ``k = sqrt(MOMENT_MAX) / sqrt(v_true)``: ``v = MOMENT_MAX``, ``m = k m_true``. ``m / sqrt(v)``,
  all that Adam's update reads, is then the exact one (optax's overflowed state says 0 instead),
  and both stay finite. ``sqrt(v_true)`` is computed scaled by
  ``s = max(|g|, sqrt(v))``, so nothing overflows. Elsewhere ``m_new`` and ``v_new`` pass
  unchanged; a NaN or inf gradient keeps its NaN/inf moments (the block's state turns NaN).

  Args:
    g, m, v: the step's float32 gradient and old moments (same shape); m_new, v_new: from
      :func:`adam_moments`; c: the step's coefficients.
  """
  over = (v_new > MOMENT_MAX) & jnp.isfinite(g)
  s = jnp.maximum(jnp.abs(g), jnp.sqrt(v))
  s = jnp.where(over, s, 1.0)  # > 0 wherever over: v_new > 0 needs g or v nonzero
  gs, rs = g / s, jnp.sqrt(v) / s
  root = s * jnp.sqrt(c.one_minus_b2 * (gs * gs) + c.b2 * (rs * rs))  # sqrt of the exact v_new
  k = jnp.minimum(jnp.float32(MOMENT_MAX**0.5) / root, 1.0)
  m_fit = c.one_minus_b1 * (g * k) + c.b1 * (m * k)  # k scales each term: no overflow on the way
  return jnp.where(over, m_fit, m_new), jnp.where(over, jnp.float32(MOMENT_MAX), v_new)


def apply_update(p: jax.Array, u: jax.Array, neg_lr, weight_decay, bits: jax.Array | None = None) -> jax.Array:
  """The parameter after one AdamW step: ``p + neg_lr * (u + weight_decay * p)``, in ``p``'s dtype.

  The arithmetic of ``optax.chain(add_decayed_weights, scale_by_learning_rate)`` then
  ``optax.apply_updates`` on a float32 ``p``, operation for operation, written once for the
  fused step's kernel and its XLA reference.

  Args:
    p: parameter (float32 or bfloat16, any shape); u: its float32 Adam update (same shape).
    neg_lr: ``-learning_rate`` of this step; weight_decay: this parameter's decay (0 when masked).
    bits: uint32 random bits shaped like ``p``: a bfloat16 ``p`` is then rounded stochastically
      (:func:`jaxlowbit_numerics.random.round_bf16_with_bits`); None: to nearest.
  """
  p32 = p.astype(jnp.float32)
  new = p32 + neg_lr * (u + weight_decay * p32)
  if bits is not None and jnp.dtype(p.dtype) == jnp.bfloat16:
    return round_bf16_with_bits(new, bits)
  return new.astype(p.dtype)


def coefficient_vector(c: AdamCoefficients) -> jax.Array:
  """``c`` as one float32 ``[len(COEFFICIENT_NAMES)]`` array (a kernel operand). Each value is
  rounded to float32 once, as XLA rounds a Python float constant that meets a float32 array."""
  return jnp.stack([jnp.asarray(getattr(c, name), jnp.float32) for name in COEFFICIENT_NAMES])


__all__ = [
    "COEFFICIENT_NAMES", "MOMENT_MAX", "AdamCoefficients", "adam_coefficients", "adam_moments", "apply_update",
    "coefficient_vector", "fit_moments",
]
