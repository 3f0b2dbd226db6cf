"""Counter-based random bits and bf16 stochastic rounding from given bits.

Stochastic rounding inside a kernel needs random bits that the kernel can make itself, from an
element's index and a seed, with the same integer operations XLA runs (so the fused update and
its XLA reference round alike). :func:`hash_bits` is such a generator: a 32-bit integer hash
(multiply-xorshift, Wellons' "lowbias32" constants) of ``index ^ seed``. It is not a
cryptographic or a ``jax.random``-quality stream; it only has to make the dropped fraction of
each rounding uniform and unrelated to the value rounded, which a full-avalanche hash does.

:func:`round_bf16_with_bits` is the rounding itself, shared with ``jaxlowbit.rounding`` (which
feeds it ``jax.random.bits``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# float32 -> bfloat16 drops the low 16 bits of the float32 pattern.
BF16_DROPPED_BITS = 16


def hash_bits(index: jax.Array, seed: jax.Array) -> jax.Array:
  """uint32 pseudo-random bits of ``index ^ seed`` (uint32 arrays, broadcast together).

  Every output bit depends on every input bit; distinct inputs give distinct outputs (each
  step of the hash is a bijection of uint32).
  """
  x = jnp.asarray(index, jnp.uint32) ^ jnp.asarray(seed, jnp.uint32)
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def flat_index_bits(shape: tuple[int, ...], seed: jax.Array) -> jax.Array:
  """:func:`hash_bits` of every element's row-major flat index in an array of ``shape``: the bits
  the fused Adam step draws for a tensor (its kernel computes the same indices per block)."""
  return hash_bits(jnp.arange(math.prod(shape), dtype=jnp.uint32).reshape(shape), seed)


def round_bf16_with_bits(x: jax.Array, bits: jax.Array) -> jax.Array:
  """Round float ``x`` to bfloat16 stochastically, with uint32 random ``bits`` (same shape).

  Adds the top 16 bits of ``bits`` below bf16's kept mantissa bits and truncates: the magnitude
  rounds up with probability equal to the dropped fraction, so ``E[result] = x`` (sign-magnitude
  makes that hold for negative ``x`` too). Non-finite ``x`` passes through unchanged (a carry
  could turn an inf or NaN pattern into another value).
  """
  x = x.astype(jnp.float32)
  pattern = jax.lax.bitcast_convert_type(x, jnp.uint32)
  noise = bits.astype(jnp.uint32) >> (32 - BF16_DROPPED_BITS)
  rounded = (pattern + noise) & jnp.uint32(0xFFFF0000)
  out = jax.lax.bitcast_convert_type(rounded, jnp.float32).astype(jnp.bfloat16)
  return jnp.where(jnp.isfinite(x), out, x.astype(jnp.bfloat16))


__all__ = ["BF16_DROPPED_BITS", "flat_index_bits", "hash_bits", "round_bf16_with_bits"]
