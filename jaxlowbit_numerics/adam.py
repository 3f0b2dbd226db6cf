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
    "COEFFICIENT_NAMES", "AdamCoefficients", "adam_coefficients", "adam_moments", "apply_update", "coefficient_vector",
]
