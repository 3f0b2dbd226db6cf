"""What one shard looks like on the wire: one flat ``uint8`` message per shard.

A message is several arrays bit-cast to bytes and concatenated (:func:`pack`), so they all
move in ONE ``all_gather``; :func:`unpack` splits the gathered ``[n, L]`` messages back into
every shard's arrays.

A quantized weight's shard (FSDP) travels as its low-bit payload followed by its float32
scales (:func:`encode` / :func:`decode`)::

    message = [ payload bytes (int8 / e4m3 / 2-bit packed ternary) | scale bytes (float32 -> 4 x uint8) ]

Every shard is quantized with the same *global* scale, so every message carries the same scale
bytes; the receiver uses the first shard's (what travelled, not a copy it already had).
A quantized activation's shard (tensor parallelism, ``jaxlowbit.parallel.tensor``) travels as its
per-token payload, its per-token float32 scales and, where the recipe reads one, its transposed
payload (``[ rows payload | row scales | transposed payload ]``).
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


def _as_bytes(a: jax.Array) -> jax.Array:
  """``a`` bit-cast to a flat ``uint8`` vector (``a.size * itemsize`` bytes)."""
  return lax.bitcast_convert_type(a, WIRE_DTYPE).reshape(-1)


def pack(parts) -> jax.Array:
  """One message: every array of ``parts`` bit-cast to bytes, concatenated in order.

  Args:
    parts: arrays of any shape and dtype (int8, uint8, float8, bfloat16, float32 ...).

  Returns:
    ``uint8 [sum of the parts' byte sizes]``.
  """
  return jnp.concatenate([_as_bytes(a) for a in parts])


def unpack(messages: jax.Array, layouts) -> list[jax.Array]:
  """The parts of gathered messages: ``[n, L]`` -> one ``[n, *shape]`` array per ``(shape, dtype)`` layout.

  ValueError when the layouts' bytes do not add up to ``L``.
  """
  n = messages.shape[0]
  sizes = [math.prod(shape) * jnp.dtype(dtype).itemsize for shape, dtype in layouts]
  if sum(sizes) != messages.shape[1]:
    raise ValueError(f"unpack: messages of {messages.shape[1]} bytes do not hold parts {list(layouts)} "
                     f"({sum(sizes)} bytes)")
  parts, offset = [], 0
  for (shape, dtype), size in zip(layouts, sizes):
    dtype = jnp.dtype(dtype)
    chunk = messages[:, offset : offset + size]
    offset += size
    if dtype.itemsize > 1:
      chunk = chunk.reshape(n, size // dtype.itemsize, dtype.itemsize)
    parts.append(lax.bitcast_convert_type(chunk, dtype).reshape(n, *shape))
  return parts


def encode(payload: jax.Array, scales: jax.Array) -> jax.Array:
  """One shard's message.

  Args:
    payload: 8-bit array (int8, uint8, float8_e4m3fn/e5m2) of any shape.
    scales: float32 array of any shape (flattened), e.g. ``()`` or ``[N]``.

  Returns:
    ``uint8 [payload.size + 4 * scales.size]``.
  """
  payload_bytes(payload.shape, payload.dtype)  # checks the width
  return pack([payload, scales.astype(jnp.float32).reshape(-1)])


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
  size = payload_bytes(payload_shape, payload_dtype)
  if messages.shape[1] != size + SCALE_BYTES * num_scales:
    raise ValueError(
        f"decode: messages of {messages.shape[1]} bytes do not hold a {payload_shape} payload "
        f"({size} bytes) plus {num_scales} float32 scales"
    )
  payloads, scales = unpack(messages, [(tuple(payload_shape), payload_dtype), ((num_scales,), jnp.float32)])
  return payloads, scales[0]


__all__ = [
    "SCALE_BYTES", "WIRE_DTYPE", "decode", "encode", "gather", "message_bytes", "pack", "payload_bytes", "unpack",
]
