"""Block-wise quantized tensors (jaxlowbit.qstate): code maps, encode/decode, layout, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlowbit import qstate
from jaxlowbit.qstate import BlockFormat
from helpers import fresh_key

MAPS = [(8, True), (8, False), (4, True), (4, False)]
# Jitted once per format: eager dispatch of the many small ops would dominate the test time.
quantize = jax.jit(qstate.quantize_blockwise, static_argnums=(1, 2))
dequantize = jax.jit(qstate.dequantize_blockwise, static_argnums=(1, 2))


@pytest.mark.parametrize("bits,signed", MAPS)
def test_dynamic_map_follows_its_definition(bits, signed):
  table = qstate.dynamic_map(bits, signed)
  n = bits - 1 if signed else bits
  assert table.size == 2**bits and table.dtype == np.float32
  assert np.all(np.diff(table) > 0), "sorted, no duplicates"
  assert table[-1] == 1.0 and 0.0 in table
  assert (table.min() < 0) == signed
  mags = table[table > 0][:-1]  # without the 1
  decades = n if signed else n - 1
  for d in range(decades):  # decade d holds 2^(n-1-d) bin centres of [0.1, 1] * 10^-d
    k = 2 ** (n - 1 - d)
    centres = 10.0**-d * (0.1 + 0.9 * (np.arange(k) + 0.5) / k)
    assert np.all(np.isin(centres.astype(np.float32), mags)), f"decade {d}"


def _random_normalized(key, n, signed):
  k1, k2 = jax.random.split(key)
  y = jax.random.uniform(k1, (n,), minval=-1.0 if signed else 0.0, maxval=1.0)
  return y * 10.0 ** jax.random.uniform(k2, (n,), minval=-9, maxval=0)  # all decades and below


@pytest.mark.parametrize("bits,signed", MAPS)
def test_arithmetic_encode_is_nearest_code(bits, signed):
  fmt = BlockFormat("dynamic", bits, signed, 256)
  table = qstate.dynamic_map(bits, signed)
  y = _random_normalized(fresh_key(), 1 << 18, signed)
  y = jnp.concatenate([y, jnp.asarray(table), jnp.array([0.0, 1.0, 0.999, 1e-30])])
  if signed:
    y = jnp.concatenate([y, jnp.array([-1.0, -0.9999])])
  fast = np.asarray(jax.jit(qstate.encode, static_argnums=1)(y, fmt))
  ref = np.asarray(qstate.encode_reference(y, fmt))
  yy, t = np.asarray(y, np.float64), table.astype(np.float64)
  # Where the two disagree, both codes must be equally near (a tie up to float32 rounding).
  gap = np.abs(np.abs(yy - t[fast]) - np.abs(yy - t[ref]))
  assert np.all((fast == ref) | (gap <= 1e-6 * np.abs(yy))), yy[(fast != ref) & (gap > 1e-6 * np.abs(yy))][:5]
  assert np.mean(fast != ref) < 1e-4
  np.testing.assert_array_equal(fast[1 << 18 : (1 << 18) + table.size], np.arange(table.size))  # table values


@pytest.mark.parametrize("bits,signed", MAPS)
def test_decode_arithmetic_and_from_the_table(bits, signed):
  """XLA computes a dynamic map's values (to float32 rounding of the table); given the table (the
  fused kernel's operand), decode gathers its entries exactly."""
  fmt = BlockFormat("dynamic", bits, signed, 256)
  codes = jax.random.randint(fresh_key(), (64, 32), 0, 2**bits).astype(jnp.uint8)
  table = qstate.dynamic_map(bits, signed)
  everything = jnp.arange(2**bits, dtype=jnp.uint8)
  np.testing.assert_allclose(jax.jit(qstate.decode, static_argnums=1)(everything, fmt), table, rtol=3e-7, atol=0)
  assert float(qstate.decode(jnp.uint8(2**bits - 1), fmt)) == 1.0
  np.testing.assert_array_equal(qstate.decode(codes, fmt, jnp.asarray(table)), table[np.asarray(codes)])
  np.testing.assert_array_equal(qstate.decode(codes, fmt, jnp.arange(2.0**bits)), np.asarray(codes, np.float32))


def test_linear_map_excludes_zero():
  fmt = BlockFormat("linear", 4, False, 128)
  np.testing.assert_array_equal(qstate.linear_map(4), (np.arange(16) + 1) / 16)
  y = jax.random.uniform(fresh_key(), (4096,))
  np.testing.assert_array_equal(qstate.encode(y, fmt), qstate.encode_reference(y, fmt))
  assert float(qstate.decode(qstate.encode(jnp.zeros(()), fmt), fmt)) == 1 / 16


def test_pack_4bit_round_trip_and_layout():
  codes = jax.random.randint(fresh_key(), (3, 5, 64), 0, 16).astype(jnp.uint8)
  packed = qstate.pack_4bit(codes)
  assert packed.shape == (3, 5, 32) and packed.dtype == jnp.uint8
  np.testing.assert_array_equal(packed, np.asarray(codes[..., 0::2]) * 16 + np.asarray(codes[..., 1::2]))
  np.testing.assert_array_equal(qstate.unpack_4bit(packed), codes)
  # The elementwise form the fused optimizer kernel writes: one definition of the byte layout.
  np.testing.assert_array_equal(qstate.pack_nibbles(codes[..., 0::2], codes[..., 1::2]), packed)
  high, low = qstate.unpack_nibbles(packed)
  np.testing.assert_array_equal(high, codes[..., 0::2])
  np.testing.assert_array_equal(low, codes[..., 1::2])


@pytest.mark.parametrize(
    "shape, fmt, codes, scale",
    [
        ((512, 1024), BlockFormat("dynamic", 8, True, 256), (512, 1024), (512, 4)),
        ((512, 8, 128), BlockFormat("dynamic", 8, True, 256), (512, 8, 128), (512, 8, 1)),  # a short row: one block
        ((7, 1000), BlockFormat("e4m3", block=256), (7, 1000), (7, 4)),  # the last block of a row holds 232
        ((4096,), BlockFormat("dynamic", 4, True, 128), (2048,), (32,)),
        ((3, 5, 8), BlockFormat("linear", 4, False, 128), (3, 5, 4), (3, 5, 1)),
    ],
)
def test_stored_shapes_keep_the_rank_and_leading_shape(shape, fmt, codes, scale):
  assert qstate.stored_shapes(shape, fmt) == (codes, scale)
  q = quantize(jnp.ones(shape), fmt)
  assert (q.codes.shape, q.scale.shape) == (codes, scale)


@pytest.mark.parametrize("shape, fmt", [((), BlockFormat("dynamic")), ((5, 7), BlockFormat("dynamic", 4, True, 128)),
                                        ((4, 0), BlockFormat("dynamic"))])
def test_unblockable_shapes_are_refused(shape, fmt):
  assert not qstate.blockable(shape, fmt)
  with pytest.raises(ValueError, match="cannot be stored block-wise"):
    qstate.stored_shapes(shape, fmt)


# (format, max error relative to the block amax): half the widest gap between codes.
FORMATS = [
    (BlockFormat("dynamic", 8, True, 256), 0.45 / 64 * 1.01),
    (BlockFormat("dynamic", 8, False, 256), 0.45 / 128 * 1.01),
    (BlockFormat("dynamic", 4, True, 128), 0.45 / 4 * 1.01),
    (BlockFormat("linear", 4, False, 128), 1 / 16),  # [0, 1/16) rounds up to 1/16
    (BlockFormat("e4m3", block=256), 2.0**-4),  # 3 mantissa bits: half an ulp is 2^-4 relative
    (BlockFormat("e5m2", block=256), 2.0**-3),
    (BlockFormat("e5m2", block=256, sqrt=True), (1 + 2.0**-3) ** 2 - 1),  # the square of sqrt(x) (1 +- 2^-3)
    (BlockFormat("fp16", block=256), 2.0**-11),
]


def _format_id(fmt):
  return getattr(fmt, "kind", None) and f"{fmt.kind}{fmt.bits}{'_sqrt' if fmt.sqrt else ''}"


@pytest.mark.parametrize("fmt,tol", FORMATS, ids=_format_id)
def test_quantize_blockwise_round_trip(fmt, tol):
  shape = (16, 8, 512)
  x = jax.random.normal(fresh_key(), shape) * jnp.logspace(-3, 3, 16)[:, None, None]  # blocks of any scale
  signed = fmt.signed and fmt.kind != "linear"
  if not signed:
    x = jnp.abs(x)
  q = quantize(x, fmt)
  codes_shape, scale_shape = qstate.stored_shapes(shape, fmt)
  assert q.codes.shape == codes_shape and q.scale.shape == scale_shape == (16, 8, 512 // fmt.block)
  assert q.codes.dtype == fmt.code_dtype and q.scale.dtype == jnp.float32
  back = dequantize(q, fmt, shape)
  assert back.shape == shape and back.dtype == jnp.float32
  amax = np.max(np.abs(np.asarray(x).reshape(16, -1, fmt.block)), -1, keepdims=True)
  err = np.abs(np.asarray(back - x)).reshape(16, -1, fmt.block) / amax
  if fmt.code_dtype != jnp.uint8:  # float kinds: relative to the element for normal values
    magnitude = np.maximum(np.abs(np.asarray(x)).reshape(err.shape), amax * 2**-6)  # subnormals: absolute
    err = np.abs(np.asarray(back - x)).reshape(err.shape) / magnitude
  assert err.max() <= tol, err.max()
  searched = quantize(x, fmt, "searchsorted") if fmt.kind in ("dynamic", "linear") else q
  assert np.mean(np.asarray(searched.codes) != np.asarray(q.codes)) < 1e-3


@pytest.mark.parametrize("fmt", [f for f, _ in FORMATS], ids=_format_id)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_zero_and_nonfinite_blocks(fmt, bad):
  """A block holding NaN or inf dequantizes to NaN, whatever the position (vectorized CPU max
  reductions drop NaN: the scale must not come from a plain max)."""
  n = 2 * fmt.block + 36  # two whole blocks and a short one per row
  x = jnp.zeros((3, n)).at[1, 300 % n].set(1.0)
  rng = np.random.default_rng()
  rows = []
  for block in range(3):
    start, width = block * fmt.block, min(fmt.block, n - block * fmt.block)
    rows.append(start + int(rng.integers(width)))
  x = x.at[2, np.array(rows)].set(bad)
  if not (fmt.signed and fmt.kind != "linear"):
    x = jnp.abs(x)
  back = np.asarray(dequantize(quantize(x, fmt), fmt, x.shape))
  assert np.all(back[0] == 0), "an all-zero block stays zero"
  assert np.all(np.isnan(back[2])), "NaN/inf turns its blocks NaN"
  assert np.isfinite(back[1]).all() and back[1, 300 % n] == pytest.approx(1.0, rel=0.07)


@pytest.mark.parametrize(
    "kind,bits,sqrt", [("dynamic", 8, False), ("linear", 4, False), ("e4m3", 8, False), ("e5m2", 8, False),
                       ("e5m2", 8, True), ("fp16", 16, False)])
def test_nonzero_keeps_positive_values_positive(kind, bits, sqrt):
  fmt = BlockFormat(kind, min(bits, 8), False, 256, nonzero=True, sqrt=sqrt)
  x = jnp.zeros((256,)).at[0].set(1.0).at[1].set(1e-30).at[2].set(1e-12)  # far below any code
  back = np.asarray(dequantize(quantize(x, fmt), fmt, x.shape))
  assert back[1] > 0 and back[2] > 0
  if kind != "linear":
    assert back[3] == 0, "exact zeros stay zero"
    plain = BlockFormat(kind, min(bits, 8), False, 256, sqrt=sqrt)
    assert np.asarray(dequantize(quantize(x, plain), plain, x.shape))[1] == 0


def test_errors_say_what_to_do():
  with pytest.raises(ValueError, match="even int"):
    BlockFormat("dynamic", block=255)
  with pytest.raises(ValueError, match="even int"):
    BlockFormat("dynamic", block=0)
  with pytest.raises(ValueError, match="4 or 8 bits"):
    BlockFormat("dynamic", bits=6)
  with pytest.raises(ValueError, match="unknown kind"):
    BlockFormat("int8")
  with pytest.raises(ValueError, match="unsigned"):
    BlockFormat("linear", 4, True)
  with pytest.raises(ValueError, match="even last axis.*keep such tensors in float32"):
    qstate.quantize_blockwise(jnp.ones((3, 101)), BlockFormat("dynamic", 4, True, 128))
  with pytest.raises(TypeError, match="floating-point"):
    qstate.quantize_blockwise(jnp.ones((256,), jnp.int32), BlockFormat("dynamic"))
