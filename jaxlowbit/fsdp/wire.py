"""What one weight shard looks like on the wire: one flat ``uint8`` message per shard.

A quantized weight's shard travels as its low-bit payload followed by its float32
scales, both bit-cast to bytes, so payload and scales move in ONE ``all_gather``::

    message = [ payload bytes (int8 / e4m3 / 2-bit packed ternary) | scale bytes (float32 -> 4 x uint8) ]

Gathering stacks the ``n`` shards' messages into ``[n, L]``; :func:`decode` splits them
back into the payload of every shard and the scales. Every shard is quantized with the
same *global* scale, so every message carries the same scale bytes; the receiver uses the
first shard's (what travelled, not a copy it already had).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

WIRE_DTYPE = jnp.uint8
# float32 scales are bit-cast to this many wire bytes each.
SCALE_BYTES = 4


def payload_bytes(shape: tuple[int, ...], dtype) -> int:
  """Bytes of a payload of ``shape`` and an 8-bit ``dtype`` on the wire."""
  if jnp.dtype(dtype).itemsize != 1:
    raise TypeError(f"wire payloads are 8-bit (int8/uint8/fp8), got {jnp.dtype(dtype)}")
  return math.prod(shape)


def message_bytes(payload_shape: tuple[int, ...], payload_dtype, num_scales: int) -> int:
  """Length L of one shard's message: payload bytes plus ``4 * num_scales`` scale bytes."""
  return payload_bytes(payload_shape, payload_dtype) + SCALE_BYTES * num_scales


def encode(payload: jax.Array, scales: jax.Array) -> jax.Array:
  """One shard's message.

  Args:
    payload: 8-bit array (int8, uint8, float8_e4m3fn/e5m2) of any shape.
    scales: float32 array of any shape (flattened), e.g. ``()`` or ``[N]``.

  Returns:
    ``uint8 [payload.size + 4 * scales.size]``.
  """
  payload_bytes(payload.shape, payload.dtype)  # checks the width
  body = lax.bitcast_convert_type(payload, WIRE_DTYPE).reshape(-1)
  tail = lax.bitcast_convert_type(scales.astype(jnp.float32).reshape(-1), WIRE_DTYPE).reshape(-1)
  return jnp.concatenate([body, tail])


def gather(message: jax.Array, axis_name: str | None) -> jax.Array:
  """All shards' messages ``[n, L]`` in shard order: one ``all_gather`` over ``axis_name``.

  ``axis_name=None`` (an unsharded weight) returns ``message[None]`` without a collective.
  """
  if axis_name is None:
    return message[None]
  return lax.all_gather(message, axis_name, axis=0, tiled=False)


def decode(
    messages: jax.Array, payload_shape: tuple[int, ...], payload_dtype, num_scales: int
) -> tuple[jax.Array, jax.Array]:
  """Split gathered messages into payloads and scales.

  Args:
    messages: ``uint8 [n, L]`` from :func:`gather`.
    payload_shape, payload_dtype: one shard's payload.
    num_scales: float32 scales per message.

  Returns:
    ``(payloads, scales)``: ``payload_dtype [n, *payload_shape]`` in shard order, and the
    first message's float32 scales ``[num_scales]``.
  """
  n = messages.shape[0]
  size = payload_bytes(payload_shape, payload_dtype)
  if messages.shape[1] != size + SCALE_BYTES * num_scales:
    raise ValueError(
        f"decode: messages of {messages.shape[1]} bytes do not hold a {payload_shape} payload "
        f"({size} bytes) plus {num_scales} float32 scales"
    )
  payloads = lax.bitcast_convert_type(messages[:, :size], jnp.dtype(payload_dtype))
  tail = messages[0, size:].reshape(num_scales, SCALE_BYTES)
  scales = lax.bitcast_convert_type(tail, jnp.float32)
  return payloads.reshape(n, *payload_shape), scales


__all__ = ["SCALE_BYTES", "WIRE_DTYPE", "decode", "encode", "gather", "message_bytes", "payload_bytes"]
