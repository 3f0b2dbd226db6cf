"""Stochastic rounding: unbiased rounding to bfloat16 or int8 (``E[round(x)] = x``).

Used where many small updates must survive a coarse format: bf16 weights without an fp32
master copy, and int8 weights in quantized training (issue "low-bit optimizers").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlowbit_numerics.int8 import INT8_MAX
from jaxlowbit_numerics.random import round_bf16_with_bits
from jaxlowbit_numerics.stats import check_floating


def _to_bf16(x: jax.Array, key: jax.Array) -> jax.Array:
  return round_bf16_with_bits(x, jax.random.bits(key, x.shape, jnp.uint32))


def _to_int8(x: jax.Array, key: jax.Array) -> jax.Array:
  u = jax.random.uniform(key, x.shape, jnp.float32)
  return jnp.clip(jnp.floor(x.astype(jnp.float32) + u), -INT8_MAX, INT8_MAX).astype(jnp.int8)


def stochastic_round(x: jax.Array, key: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
  """Round ``x`` to ``dtype`` stochastically.

  Args:
    x: floating array (float32 or wider precision than ``dtype``) of shape ``S``.
    key: a ``jax.random`` key; the same key gives the same rounding.
    dtype: ``jnp.bfloat16`` (probability of rounding up = the dropped mantissa fraction) or
      ``jnp.int8`` (``floor(x + U[0, 1))``, clipped to [-127, 127]).

  Returns:
    array of ``dtype`` and shape ``S``. Non-finite bf16 inputs pass through unchanged.
  """
  check_floating(x, "stochastic_round")
  dtype = jnp.dtype(dtype)
  if dtype == jnp.bfloat16:
    return _to_bf16(x, key)
  if dtype == jnp.int8:
    return _to_int8(x, key)
  raise TypeError(f"stochastic_round: unsupported target dtype {dtype}; use bfloat16 or int8")
