"""llama.cpp's ternary GGUF tensor types, TQ2_0 and TQ1_0: ternary codes -> their block bytes.

A GGUF tensor of ``rows x K`` ternary values is stored row by row, each row as ``K / 256``
blocks of :data:`BLOCK_VALUES` values (ggml's ``QK_K``; so K must be a multiple of 256). Every
block ends with its scale ``d`` as a little-endian float16; a value ``v`` in {-1, 0, 1} decodes
as ``v * d``. Codes are stored as ``c = v + 1`` in {0, 1, 2}.

TQ2_0 (66 bytes per block: 64 bytes of codes, then ``d``): 2 bits per code. Value ``p`` of a
block (``p = 128 h + 32 f + b``: half ``h``, field ``f``, byte ``b``) sits in bits ``2f, 2f + 1``
of byte ``32 h + b``.

TQ1_0 (54 bytes per block: 48 + 4 bytes of codes, then ``d``): 1.6 bits per code, five codes
per byte as one base-3 number ``n = 81 c0 + 27 c1 + 9 c2 + 3 c3 + c4`` in [0, 242], stored as
the fixed-point fraction ``ceil(256 n / 243)``. The reader gets code ``c_j`` back as the top
base-3 digit of ``byte * 3^j`` (mod 256), i.e. ``((byte * 3^j mod 256) * 3) >> 8``; rounding up
keeps every digit exact. The block's 256 values are split as

- values 0-159: 32 bytes, code ``c_j`` of byte ``b`` is value ``32 j + b``;
- values 160-239: 16 bytes, value ``160 + 16 j + b``;
- values 240-255: 4 bytes of four codes each (``c4 = 0``), value ``240 + 4 j + b``.

These are the layouts of ``block_tq2_0`` / ``block_tq1_0`` in ggml (``ggml-common.h``), which
``gguf.quants.dequantize`` (llama.cpp's gguf-py) decodes; the tests check our bytes with it.
"""

from __future__ import annotations

import numpy as np

BLOCK_VALUES = 256  # values per block (ggml's QK_K)
QTYPES = ("tq1_0", "tq2_0")
BLOCK_BYTES = {"tq2_0": BLOCK_VALUES // 4 + 2, "tq1_0": (BLOCK_VALUES - 16) // 5 + 4 + 2}
_SCALE_DTYPE = np.dtype("<f2")  # the block scale d: float16, little-endian like all of GGUF
_TRITS_PER_BYTE = 5
_BASE3_RANGE = 3**_TRITS_PER_BYTE  # 243 five-digit base-3 numbers


def _codes(codes: np.ndarray, who: str) -> tuple[np.ndarray, int, int]:
  """``codes + 1`` as uint16 ``[rows, blocks, 256]``; ValueError for a bad shape or value."""
  codes = np.asarray(codes)
  if codes.ndim != 2:
    raise ValueError(f"{who}: expected ternary codes [rows, K], got shape {codes.shape}")
  rows, k = codes.shape
  if k % BLOCK_VALUES:
    raise ValueError(f"{who}: rows of {k} values are not a multiple of the {BLOCK_VALUES}-value block")
  if codes.size and (codes.min() < -1 or codes.max() > 1):
    raise ValueError(f"{who}: codes must lie in {{-1, 0, 1}}, got [{codes.min()}, {codes.max()}]")
  return (codes.astype(np.int16) + 1).astype(np.uint16).reshape(rows, k // BLOCK_VALUES, BLOCK_VALUES), rows, k


def _scales(rows: int, blocks: int, block_scale: float) -> np.ndarray:
  """uint8 ``[rows, blocks, 2]``: every block's ``d``."""
  return np.full((rows, blocks, 1), block_scale, _SCALE_DTYPE).view(np.uint8)


def tq2_0_blocks(codes: np.ndarray, block_scale: float = 1.0) -> np.ndarray:
  """TQ2_0 bytes of ternary codes.

  Args:
    codes: integer ``[rows, K]`` with values in {-1, 0, 1}; K a multiple of 256.
    block_scale: every block's ``d`` (stored as float16).

  Returns:
    uint8 ``[rows, K / 256 * 66]``, ready for ``GGUFWriter.add_tensor(..., raw_dtype=TQ2_0)``.
  """
  c, rows, k = _codes(codes, "tq2_0_blocks")
  fields = c.reshape(rows, k // BLOCK_VALUES, 2, 4, 32)  # [row, block, half h, field f, byte b]
  packed = fields[..., 0, :] | fields[..., 1, :] << 2 | fields[..., 2, :] << 4 | fields[..., 3, :] << 6
  packed = packed.astype(np.uint8).reshape(rows, k // BLOCK_VALUES, BLOCK_VALUES // 4)
  return np.concatenate([packed, _scales(rows, k // BLOCK_VALUES, block_scale)], axis=-1).reshape(rows, -1)


def _base3_bytes(digits: np.ndarray) -> np.ndarray:
  """uint8 ``[..., width]`` from codes ``[..., n_digits, width]`` (most significant first, padded to 5 digits)."""
  weights = 3 ** np.arange(_TRITS_PER_BYTE - 1, _TRITS_PER_BYTE - 1 - digits.shape[-2], -1, dtype=np.uint16)
  number = (digits * weights[:, None]).sum(axis=-2, dtype=np.uint32)  # in [0, 242]
  return ((number * 256 + _BASE3_RANGE - 1) // _BASE3_RANGE).astype(np.uint8)  # ceil(256 n / 243)


def tq1_0_blocks(codes: np.ndarray, block_scale: float = 1.0) -> np.ndarray:
  """TQ1_0 bytes of ternary codes (arguments as :func:`tq2_0_blocks`).

  Returns:
    uint8 ``[rows, K / 256 * 54]``, ready for ``GGUFWriter.add_tensor(..., raw_dtype=TQ1_0)``.
  """
  c, rows, k = _codes(codes, "tq1_0_blocks")
  blocks = k // BLOCK_VALUES
  parts = [
      _base3_bytes(c[..., :160].reshape(rows, blocks, 5, 32)),
      _base3_bytes(c[..., 160:240].reshape(rows, blocks, 5, 16)),
      _base3_bytes(c[..., 240:].reshape(rows, blocks, 4, 4)),
      _scales(rows, blocks, block_scale),
  ]
  return np.concatenate(parts, axis=-1).reshape(rows, -1)


def encode(codes: np.ndarray, qtype: str, block_scale: float = 1.0) -> np.ndarray:
  """:func:`tq1_0_blocks` or :func:`tq2_0_blocks` by name (``"tq1_0"`` / ``"tq2_0"``)."""
  if qtype not in QTYPES:
    raise ValueError(f"gguf_ternary.encode: qtype must be one of {QTYPES}, got {qtype!r}")
  return (tq1_0_blocks if qtype == "tq1_0" else tq2_0_blocks)(codes, block_scale)


__all__ = ["BLOCK_BYTES", "BLOCK_VALUES", "QTYPES", "encode", "tq1_0_blocks", "tq2_0_blocks"]
