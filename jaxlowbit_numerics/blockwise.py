"""Block-wise quantized tensors: the storage format of low-bit optimizer states.

A float32 tensor ``x`` of shape ``S`` is cut into blocks of ``B`` consecutive elements; each
block keeps one float32 scale and ``B`` low-bit codes:

    scale[b] = max|x[b]| (a code map) or max|x[b]| / fmax (a float format)
    codes[b] = encode(x[b] / scale[b])           x[b] ~= decode(codes[b]) * scale[b]

Which elements form a block (the sharding rule). Blocks run along the *last* axis: a tensor of
shape ``S = lead + (N,)`` is stored as

    codes  [*lead, N]              (4-bit maps: [*lead, N / 2], two codes per byte)
    scale  [*lead, ceil(N / B)]    float32, one per block; a row's last block may be shorter

so both keep the tensor's rank and leading shape: any sharding of the tensor's leading axes (a
``PartitionSpec``, Flax logical axis names, FSDP's dim 0) applies to ``codes`` and ``scale``
unchanged, and a sharded last axis keeps blocks whole when each shard holds a multiple of ``B``
elements. :func:`stored_shapes` gives both shapes.

Formats (:class:`BlockFormat`):

- ``dynamic``: the dynamic tree map (Dettmers 2016, "8-bit approximations for parallelism in
  deep learning"; bitsandbytes' 8-bit optimizers): a code is a sign bit (signed maps), then
  ``E`` zero bits giving the decade ``10^-E``, a one bit, and ``F`` bits of a linear fraction
  in ``[0.1, 1]``. Values near the block maximum get many fraction bits, tiny values few. The
  stored code is the value's index in the sorted table (:func:`dynamic_map`); the bit layout
  defines the values, and encode/decode compute the index arithmetically (the fused kernel
  decodes by gathering the table entry instead).
- ``linear``: ``(j + 1) / 2^bits`` for ``j = 0 .. 2^bits - 1``, zero excluded (the 4-bit
  second moment of Li et al. 2023, "Memory efficient optimizers with 4-bit states": a second
  moment quantized to zero would make ``m / sqrt(v)`` explode).
- ``e4m3`` / ``e5m2`` / ``fp16``: float8_e4m3fn, float8_e5m2 or float16 values, block scale
  ``amax / fmax``, saturating cast (the FP8 optimizer of torchao and MS-AMP's O2 second moment).

Any format may store a tensor's signed square root (``BlockFormat(..., sqrt=True)``): the codes
hold ``y = sign(x) sqrt(|x|)``, the scale is that of ``y`` (``sqrt(amax) / fmax``), and decoding
gives ``y |y|``. For Adam's second moment, whose update reads ``sqrt(v)``, this halves the
exponent range the codes must span and puts the format's relative error on ``sqrt(v)`` itself.

4-bit codes are packed two per uint8, code ``2i`` in the high nibble of byte ``i`` (blocks are
even, so a byte never holds codes of two blocks).

The tensor functions (:func:`quantize_blockwise`, :func:`dequantize_blockwise`) are built from
elementwise block pieces, :func:`block_scales`, :func:`encode_values`, :func:`decode_values`
and :func:`pack_nibbles`, which the fused optimizer kernel (``pallas_kernels.adam``) calls on
its slices of a block: one definition of every code for XLA and the kernel. (Here in
``jaxlowbit_numerics`` for that reason; ``jaxlowbit.qstate`` is the public name.)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxlowbit_numerics import fp8, stats

Kind = Literal["dynamic", "linear", "e4m3", "e5m2", "fp16"]

# Floor for a block's amax before dividing by it: far below any meaningful Adam moment
# (g^2 for |g| ~ 1e-15), and keeps fmax / amax finite for fmax <= 65504 (float16's max).
AMAX_FLOOR = 1e-30
FP16_MAX = 65504.0  # largest finite float16
_FLOAT_DTYPES = {"e4m3": fp8.E4M3, "e5m2": fp8.E5M2, "fp16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class BlockFormat:
  """How a tensor is stored block-wise (hashable: usable as a static argument).

  Attributes:
    kind: ``"dynamic"`` (tree map), ``"linear"`` (unsigned, zero excluded), ``"e4m3"``, ``"e5m2"``
      or ``"fp16"`` (float codes with a block scale ``amax / fmax``).
    bits: code width of ``dynamic``/``linear`` maps, 8 or 4 (ignored for float kinds).
    signed: whether the map covers negative values (``dynamic`` only; ``linear`` is unsigned,
      float kinds are always signed).
    block: elements per block (one float32 scale each); even, so 4-bit pairs never straddle.
    nonzero: positive values never round to zero; they take at least the smallest positive code
      (for second moments: a ``v`` rounded to zero turns Adam's ``m / sqrt(v)`` into ``m / eps``).
    sqrt: the codes hold ``sign(x) sqrt(|x|)`` and decode to its square times the sign (see the
      module doc); block scales are those of the square roots.
  """

  kind: Kind
  bits: int = 8
  signed: bool = True
  block: int = 256
  nonzero: bool = False
  sqrt: bool = False

  def __post_init__(self):
    if self.kind not in ("dynamic", "linear", "e4m3", "e5m2", "fp16"):
      raise ValueError(f"BlockFormat: unknown kind {self.kind!r}; use 'dynamic', 'linear', 'e4m3', 'e5m2' or 'fp16'")
    if self.kind in ("dynamic", "linear") and self.bits not in (4, 8):
      raise ValueError(f"BlockFormat: {self.kind} maps have 4 or 8 bits, got bits={self.bits}")
    if self.kind == "linear" and self.signed:
      raise ValueError("BlockFormat: the linear map is unsigned (for second moments); pass signed=False")
    if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block < 2 or self.block % 2:
      raise ValueError(f"BlockFormat: block must be an even int >= 2, got {self.block!r}")

  @property
  def storage_bits(self) -> int:
    """Bits stored per element (the scale excluded)."""
    return {"e4m3": 8, "e5m2": 8, "fp16": 16}.get(self.kind, self.bits)

  @property
  def code_dtype(self):
    """dtype of the stored codes: uint8 for maps (4-bit packed in pairs), else the float dtype."""
    return _FLOAT_DTYPES.get(self.kind, jnp.uint8)

  @property
  def fmax(self) -> float:
    """Largest code magnitude: 1 for maps (normalized by the block amax), else the dtype's max."""
    return {"e4m3": fp8.fp8_max(fp8.E4M3), "e5m2": fp8.fp8_max(fp8.E5M2), "fp16": FP16_MAX}.get(self.kind, 1.0)


class BlockQuantized(NamedTuple):
  """A block-wise quantized tensor of logical shape ``[*lead, N]`` (see the module doc).

  Attributes:
    codes: ``[*lead, N]`` uint8 (8-bit maps), float8_e4m3fn, float8_e5m2 or float16, or ``[*lead, N / 2]``
      uint8 (4-bit maps, two codes per byte).
    scale: ``[*lead, ceil(N / block)]`` float32 dequantization multiplier per block.
  """

  codes: jax.Array
  scale: jax.Array


# ----------------------------------------------------------------------------- code maps


@functools.cache
def dynamic_map(bits: int, signed: bool) -> np.ndarray:
  """Sorted float32 table of the dynamic tree map (``2^bits`` entries, 0 and 1 included).

  Magnitudes use ``n = bits - signed`` bits: decade ``d`` (``E = d`` leading zeros) holds
  ``2^(n-1-d)`` values, the centres of equal bins of ``[0.1, 1] * 10^-d``. Signed maps use
  decades ``0 .. n-1``; their spare code (the would-be ``-0``) is ``+1``. Unsigned maps use
  decades ``0 .. n-2``; the single-value decade ``n-1`` is traded for ``1``.
  """
  n = bits - 1 if signed else bits
  decades = n if signed else n - 1
  mags = []
  for d in range(decades):
    k = 2 ** (n - 1 - d)
    mags.append(10.0**-d * (0.1 + 0.9 * (np.arange(k) + 0.5) / k))
  mags = np.sort(np.concatenate(mags))
  neg = -mags[::-1] if signed else np.zeros(0)
  table = np.concatenate([neg, [0.0], mags, [1.0]]).astype(np.float32)
  assert table.size == 2**bits and np.all(np.diff(table) > 0)
  return table


@functools.cache
def linear_map(bits: int) -> np.ndarray:
  """Sorted float32 table ``(j + 1) / 2^bits``, ``j = 0 .. 2^bits - 1`` (no zero)."""
  return ((np.arange(2**bits) + 1) / 2**bits).astype(np.float32)


def code_table(fmt: BlockFormat) -> np.ndarray:
  """The sorted table of a map format; a code is an index into it."""
  if fmt.kind == "dynamic":
    return dynamic_map(fmt.bits, fmt.signed)
  if fmt.kind == "linear":
    return linear_map(fmt.bits)
  raise ValueError(f"code_table: {fmt.kind} is a float format, not a code map")


def _midpoints(table: np.ndarray) -> np.ndarray:
  return ((table[1:].astype(np.float64) + table[:-1]) / 2).astype(np.float32)


def encode_reference(y: jax.Array, fmt: BlockFormat) -> jax.Array:
  """Nearest code of normalized ``y`` by ``searchsorted`` over the table's midpoints (uint8)."""
  mids = jnp.asarray(_midpoints(code_table(fmt)))
  return jnp.searchsorted(mids, y.astype(jnp.float32), side="left", method="compare_all").astype(jnp.uint8)


def _select(index: jax.Array, values: list[float]) -> jax.Array:
  """``values[index]`` for a short constant list, as a chain of selects (no gather)."""
  out = jnp.full(index.shape, values[0], jnp.float32)
  for i, value in enumerate(values[1:], 1):
    out = jnp.where(index == i, jnp.float32(value), out)
  return out


def _exp2(k: jax.Array) -> jax.Array:
  """Exact float32 ``2^k`` for int32 ``k`` in [-126, 127], built from the exponent bits."""
  return jax.lax.bitcast_convert_type(jnp.left_shift(k + 127, 23), jnp.float32)


@functools.cache
def _dynamic_thresholds(bits: int, signed: bool) -> tuple[tuple[float, ...], float, float]:
  """``(edges, bottom, top)``: the float32 midpoints of :func:`dynamic_map` where the nearest code
  changes decade. ``edges[d - 1]`` lies between decade ``d``'s last code and decade ``d - 1``'s
  first (``d = 1 .. decades - 1``, descending); ``bottom`` between 0 and the smallest code;
  ``top`` between decade 0's last code and 1."""
  n = bits - 1 if signed else bits
  decades = n if signed else n - 1
  mids = _midpoints(dynamic_map(bits, signed))
  zero = 2**n - 1 if signed else 0  # table index of 0
  # Table index of decade d's first code: 2^(n-1-d) above the zero (unsigned maps: one lower).
  first = [zero + 2 ** (n - 1 - d) - (0 if signed else 1) for d in range(decades)]
  edges = tuple(float(mids[first[d] - 1]) for d in range(decades - 1))
  return edges, float(mids[zero]), float(mids[first[0] + 2 ** (n - 1) - 1])


def _encode_dynamic(y: jax.Array, bits: int, signed: bool) -> jax.Array:
  """Nearest dynamic-map code of ``y`` (normalized to [-1, 1]), computed arithmetically.

  The decade of the nearest code comes from comparing ``|y|`` with the table midpoints between
  decades (``decades - 1`` comparisons, :func:`_dynamic_thresholds`); within decade ``d`` the
  codes are the centres of ``2^k`` equal bins of ``[0.1, 1] * 10^-d``, so the number of
  midpoints below ``|y|`` is ``ceil(x) - 1``, ``x = (|y| 10^d - 0.1) 2^k / 0.9``, clipped to the
  decade. Ties (a value on a midpoint) go to the smaller code, as searchsorted's do. No table
  lookup, no search, no division, no transcendental: a few compares and selects per element,
  elementwise, so it fuses into XLA's update and runs inside the fused kernel. Agrees with
  :func:`encode_reference` except within float rounding of a midpoint (a tie).
  """
  n = bits - 1 if signed else bits
  decades = n if signed else n - 1
  edges, bottom, top = _dynamic_thresholds(bits, signed)
  a = jnp.abs(y)
  inv_unit = jnp.full(a.shape, 1.0, jnp.float32)  # 10^d: exact in float32 for d <= 10
  bins = jnp.full(a.shape, 2.0 ** (n - 1), jnp.float32)  # 2^k codes in decade d, k = n - 1 - d
  for d in range(1, decades):  # the edges descend: the last one at or above |y| wins
    below = a <= edges[d - 1]
    inv_unit = jnp.where(below, 10.0**d, inv_unit)
    bins = jnp.where(below, 2.0 ** (n - 1 - d), bins)
  x = (a * inv_unit - 0.1) * (bins * (1 / 0.9))
  j = jnp.clip(jnp.ceil(x) - 1.0, 0.0, bins - 1.0)
  # Decade d's first code is the 2^k-th magnitude (signed: rank above the zero; unsigned: table
  # index, one lower); 0 and 1 sit beyond the first and last decade.
  rank = j + (bins if signed else bins - 1.0)
  rank = jnp.where(a <= bottom, 0.0, rank)
  rank = jnp.where(a > top, 2.0**n - (0 if signed else 1), rank)
  if not signed:
    return rank.astype(jnp.uint8)
  zero = 2**n - 1  # index of 0 in the signed table; 1 is at 2^(n+1) - 1, -1 is not in the map
  return jnp.where(y < 0, zero - jnp.minimum(rank, zero), zero + rank).astype(jnp.uint8)


def _decode_dynamic(codes: jax.Array, bits: int, signed: bool) -> jax.Array:
  """Dynamic-map values of ``codes``, computed arithmetically (inverse of the ranks above)."""
  n = bits - 1 if signed else bits
  decades = n if signed else n - 1
  c = codes.astype(jnp.int32)
  zero = 2**n - 1 if signed else 0
  # Rank among the magnitudes, shifted so that decade d starts at 2^(n-1-d) in both map kinds.
  rank = jnp.abs(c - zero) if signed else c + 1
  k = 31 - jax.lax.clz(jnp.maximum(rank, 1))  # floor(log2(rank)): the decade's fraction bits
  d = jnp.clip(n - 1 - k, 0, decades - 1)
  unit = _select(d, [10.0**-i for i in range(decades)])
  j = (rank - jnp.left_shift(1, k)).astype(jnp.float32)
  mag = unit * (0.1 + (0.9 * _exp2(-k)) * (j + 0.5))
  mag = jnp.where(rank >= 2**n, 1.0, mag)  # the top code is 1
  mag = jnp.where(c == zero, 0.0, mag)
  return jnp.where(c < zero, -mag, mag) if signed else mag


def encode(y: jax.Array, fmt: BlockFormat, method: Literal["arithmetic", "searchsorted"] = "arithmetic") -> jax.Array:
  """Nearest code (uint8, unpacked) of ``y`` normalized to the map's range ([-1, 1] or [0, 1]).

  ``method="searchsorted"`` is :func:`encode_reference`; ``"arithmetic"`` computes the index
  (what the optimizers use: elementwise, no search). The two differ only on ties, inputs within
  float rounding of the midpoint of two codes, and on NaN.
  """
  y = y.astype(jnp.float32)
  if method == "searchsorted":
    return encode_reference(y, fmt)
  if method != "arithmetic":
    raise ValueError(f"encode: method must be 'arithmetic' or 'searchsorted', got {method!r}")
  if fmt.kind == "dynamic":
    return _encode_dynamic(y, fmt.bits, fmt.signed)
  if fmt.kind == "linear":
    levels = 2**fmt.bits
    # ceil(y * levels - 1/2) - 1 is the nearest code, ties to the smaller one (as searchsorted).
    return jnp.clip(jnp.ceil(y * levels - 0.5) - 1, 0, levels - 1).astype(jnp.uint8)
  raise ValueError(f"encode: {fmt.kind} is a float format, not a code map")


def decode(codes: jax.Array, fmt: BlockFormat, table=None) -> jax.Array:
  """float32 values of uint8 (unpacked) ``codes`` of a ``dynamic`` or ``linear`` map (any shape).

  Linear maps compute ``(c + 1) / 2^bits``, exactly the table. A dynamic map's value is computed
  arithmetically when ``table`` is None (XLA: elementwise, no gather; within float32 rounding of
  :func:`code_table`, 3e-7 relative), else gathered from ``table``: the map's code table as
  anything an int32 array indexes (the fused kernel's operand, a Pallas ref), exact. Each is the
  faster one where it runs: XLA's GPU gather of the table made its 8-bit update 2.2x slower, while
  in the kernel one cached load replaces the decade compares and selects.
  """
  if fmt.kind == "linear":
    return (codes.astype(jnp.float32) + 1) * (1.0 / 2**fmt.bits)
  if fmt.kind != "dynamic":
    raise ValueError(f"decode: {fmt.kind} is a float format, not a code map")
  if table is None:
    return _decode_dynamic(codes, fmt.bits, fmt.signed)
  return table[codes.astype(jnp.int32)]


def pack_nibbles(high: jax.Array, low: jax.Array) -> jax.Array:
  """One byte per pair of 4-bit codes (uint8 < 16 each, same shape): ``high`` in bits 7..4, ``low``
  in bits 3..0. The packed layout's definition: byte ``i`` holds codes ``2i`` (high) and ``2i + 1``."""
  return jnp.left_shift(high, jnp.uint8(4)) | low


def unpack_nibbles(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Inverse of :func:`pack_nibbles`: uint8 bytes -> ``(high, low)`` uint8 codes."""
  return jnp.right_shift(packed, jnp.uint8(4)), packed & jnp.uint8(0xF)


def pack_4bit(codes: jax.Array) -> jax.Array:
  """``[..., 2h]`` uint8 codes < 16 -> ``[..., h]`` uint8: byte ``i`` is ``pack_nibbles(code 2i, code 2i + 1)``.

  Adjacent pairs are read as one little-endian uint16 (a bitcast: code ``2i`` is the low
  byte), which keeps the packing elementwise, so it fuses and vectorizes.
  """
  pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
  word = jax.lax.bitcast_convert_type(pairs, jnp.uint16)
  return ((word << 4) | (word >> 8)).astype(jnp.uint8)


def unpack_4bit(packed: jax.Array) -> jax.Array:
  """Inverse of :func:`pack_4bit`: ``[..., h]`` uint8 -> ``[..., 2h]`` codes."""
  p = packed.astype(jnp.uint16)
  pairs = jax.lax.bitcast_convert_type((p >> 4) | ((p & 0xF) << 8), jnp.uint8)  # [..., h, 2]
  return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


# ----------------------------------------------------------------------------- tensors


def blockable(shape: tuple[int, ...], fmt: BlockFormat) -> bool:
  """Whether a tensor of ``shape`` can be stored in ``fmt``: rank >= 1, not empty, and an even
  last axis for 4-bit codes (a byte holds two codes of one row)."""
  return len(shape) >= 1 and math.prod(shape) > 0 and (fmt.storage_bits != 4 or shape[-1] % 2 == 0)


def stored_shapes(shape: tuple[int, ...], fmt: BlockFormat) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """``(codes shape, scale shape)`` of a tensor of ``shape`` (see the module doc); ValueError if
  :func:`blockable` says no."""
  shape = tuple(shape)
  if not blockable(shape, fmt):
    raise ValueError(
        f"shape {shape} cannot be stored block-wise in {fmt}: it needs rank >= 1, at least one element and, "
        "for 4-bit codes, an even last axis; keep such tensors in float32 (the optimizers do)"
    )
  *lead, n = shape
  codes_n = n // 2 if fmt.storage_bits == 4 else n
  return (*lead, codes_n), (*lead, -(-n // fmt.block))


def _to_blocks(x: jax.Array, block: int) -> jax.Array:
  """``[*lead, N]`` -> ``[*lead, ceil(N / block), block]``, the last block zero-padded."""
  n = x.shape[-1]
  pad = -n % block
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  return x.reshape(*x.shape[:-1], (n + pad) // block, block)


def _from_blocks(blocks: jax.Array, n: int) -> jax.Array:
  """Inverse of :func:`_to_blocks`: ``[*lead, nb, B']`` -> ``[*lead, N']``, the padding cut off."""
  flat = blocks.reshape(*blocks.shape[:-2], -1)
  return flat[..., :n] if flat.shape[-1] != n else flat


def _smallest_positive(dtype) -> float:
  return float(jnp.finfo(dtype).smallest_subnormal)


def block_scales(amax: jax.Array, fmt: BlockFormat) -> tuple[jax.Array, jax.Array]:
  """``(inv, scale)`` of blocks whose float32 abs-max is ``amax`` (any shape: one value per block).

  ``inv`` (float32) multiplies a block's values into the code range, ``fmax / amax``; ``scale``
  (float32) is what is stored, the dequantization multiplier: ``amax`` for maps, ``amax / fmax``
  for float kinds. With ``fmt.sqrt`` both are those of the square roots (``amax`` -> ``sqrt(amax)``).
  A non-finite ``amax`` (NaN or inf in the block: :func:`stats.absmax` counts NaN as inf) gives a
  NaN scale, so the block dequantizes to NaN, and a unit ``inv``.
  """
  if fmt.sqrt:
    amax = jnp.sqrt(amax)
  finite = jnp.isfinite(amax)
  safe = jnp.where(finite, jnp.maximum(amax, AMAX_FLOOR), 1.0)
  inv = fmt.fmax / safe
  scale = safe * (1.0 / fmt.fmax) if fmt.kind in _FLOAT_DTYPES else amax
  return inv, jnp.where(finite, scale, jnp.nan)


def encode_values(x: jax.Array, inv: jax.Array, fmt: BlockFormat, method: str = "arithmetic") -> jax.Array:
  """Unpacked codes of float32 values ``x`` whose block multiplier is ``inv`` (broadcast against ``x``).

  Elementwise, so it runs inside a kernel on any slice of a block: uint8 codes for maps (one per
  byte, 4-bit ones not yet packed), else ``fmt.code_dtype`` values. Float kinds saturate at
  ``+-fmax``; with ``fmt.nonzero`` a positive value keeps at least the smallest positive code.
  With ``fmt.sqrt`` the codes are those of ``sign(x) sqrt(|x|)`` (``inv`` from :func:`block_scales`).
  """
  y = (jnp.sign(x) * jnp.sqrt(jnp.abs(x)) if fmt.sqrt else x) * inv
  if fmt.kind in _FLOAT_DTYPES:
    y = jnp.clip(y, -fmt.fmax, fmt.fmax)
    if fmt.nonzero:
      y = jnp.where(x > 0, jnp.maximum(y, _smallest_positive(fmt.code_dtype)), y)
    return y.astype(fmt.code_dtype)
  codes = encode(y, fmt, method)
  if fmt.nonzero and fmt.kind == "dynamic":  # linear maps have no zero code
    zero = 2 ** (fmt.bits - 1) - 1 if fmt.signed else 0  # the code of 0
    codes = jnp.where((x > 0) & (codes == zero), jnp.uint8(zero + 1), codes)
  return codes


def decode_values(codes: jax.Array, scale: jax.Array, fmt: BlockFormat, table=None) -> jax.Array:
  """float32 values of unpacked ``codes`` times their block's ``scale`` (broadcast against them);
  with ``fmt.sqrt``, that product ``y`` is a square root and the value is ``y |y|``. ``table``:
  a dynamic map's code table, as :func:`decode` takes it."""
  values = codes.astype(jnp.float32) if fmt.kind in _FLOAT_DTYPES else decode(codes, fmt, table)
  y = values * scale
  return y * jnp.abs(y) if fmt.sqrt else y


def quantize_blockwise(x: jax.Array, fmt: BlockFormat, method: str = "arithmetic") -> BlockQuantized:
  """Quantize ``x`` (floating, shape ``[*lead, N]``) block-wise; see the module doc for the layout.

  NaN or inf in a block makes its scale NaN, so the whole block dequantizes to NaN (never to a
  finite value, on every backend). With ``fmt.nonzero``, positive elements keep at least the
  smallest positive code.
  """
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"quantize_blockwise: expected a floating-point array, got dtype {x.dtype}")
  codes_shape, _ = stored_shapes(x.shape, fmt)
  blocks = _to_blocks(x.astype(jnp.float32), fmt.block)
  amax = stats.absmax(blocks, axis=-1)[..., 0]  # NaN and inf count as inf
  inv, scale = block_scales(amax, fmt)
  codes = encode_values(blocks, inv[..., None], fmt, method)
  if fmt.storage_bits == 4:
    codes = pack_4bit(codes)  # within each block: a block's bytes stay together
  return BlockQuantized(_from_blocks(codes, codes_shape[-1]), scale)


def dequantize_blockwise(q: BlockQuantized, fmt: BlockFormat, shape: tuple[int, ...]) -> jax.Array:
  """float32 tensor of ``shape`` from :func:`quantize_blockwise`'s output."""
  codes = _to_blocks(unpack_4bit(q.codes) if fmt.storage_bits == 4 else q.codes, fmt.block)
  return _from_blocks(decode_values(codes, q.scale[..., None], fmt), shape[-1]).reshape(shape)


def zeros_blockwise(shape: tuple[int, ...], fmt: BlockFormat) -> BlockQuantized:
  """A block-wise tensor of zeros: zero scales (any code times a zero scale is 0). No compute,
  so optimizer ``init`` stays cheap eagerly and under ``jax.eval_shape``."""
  codes_shape, scale_shape = stored_shapes(tuple(shape), fmt)
  return BlockQuantized(jnp.zeros(codes_shape, fmt.code_dtype), jnp.zeros(scale_shape, jnp.float32))


def nbytes(tree) -> int:
  """Total bytes of the array leaves of ``tree`` (works on ``jax.eval_shape`` outputs)."""
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


__all__ = [
    "AMAX_FLOOR",
    "BlockFormat",
    "BlockQuantized",
    "block_scales",
    "code_table",
    "decode",
    "decode_values",
    "dequantize_blockwise",
    "dynamic_map",
    "encode",
    "encode_reference",
    "encode_values",
    "blockable",
    "linear_map",
    "nbytes",
    "pack_4bit",
    "pack_nibbles",
    "quantize_blockwise",
    "stored_shapes",
    "unpack_4bit",
    "unpack_nibbles",
    "zeros_blockwise",
]
