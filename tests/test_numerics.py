"""Round trips and contracts of the int8, fp8, ternary, packing and rounding numerics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlowbit import rounding
from jaxlowbit_numerics import fp8, int8, ternary
from helpers import fresh_key

SHAPE = (64, 96)


@pytest.mark.parametrize("axis", [-1, 0, None, (0, 1)])
def test_int8_round_trip_is_exact(axis):
  k1, k2 = jax.random.split(fresh_key())
  q = jax.random.randint(k1, SHAPE, -127, 128).astype(jnp.int8)
  q = q.at[0, 0].set(127).at[:, 0].set(127).at[0, :].set(-127)  # every slice reaches amax
  exponent = jax.random.randint(k2, int8.absmax(q.astype(jnp.float32), axis).shape, -20, 5)
  scale = jnp.exp2(exponent.astype(jnp.float32))  # powers of two: x = q * scale is exact
  x = int8.dequantize_int8(q, scale)
  q2, scale2 = int8.quantize_int8(x, axis=axis)
  np.testing.assert_array_equal(q2, q)
  np.testing.assert_array_equal(scale2, scale)


@pytest.mark.parametrize("axis", [-1, 0, None])
def test_int8_matches_numpy_contract(axis):
  x = jax.random.normal(fresh_key(), SHAPE) * 3
  q, scale = int8.quantize_int8(x, axis=axis)
  xn = np.asarray(x, np.float32)
  amax = np.max(np.abs(xn), axis=axis, keepdims=True)
  ref_scale = np.maximum(amax, 1e-12) * np.float32(1 / 127)
  ref_q = np.clip(np.round(xn / ref_scale), -127, 127).astype(np.int8)  # np.round is half-even
  assert q.dtype == jnp.int8 and scale.dtype == jnp.float32 and scale.shape == ref_scale.shape
  np.testing.assert_array_equal(scale, ref_scale)
  # Equal codes, except where x / scale lies within float32 rounding of a .5 tie (XLA's vectorized
  # division may round the quotient differently from numpy's: one seed in ~100 hit one).
  ratio = xn / ref_scale
  differs = np.asarray(q, np.int32) != ref_q
  near_tie = np.abs(np.abs(ratio - np.trunc(ratio)) - 0.5) <= 1e-5 * np.maximum(np.abs(ratio), 1)
  assert np.all(np.abs(np.asarray(q, np.int32) - ref_q) <= 1) and np.all(near_tie[differs]), ratio[differs]
  # half a step, up to float32 rounding of x / scale and of q * scale
  assert np.all(np.abs(int8.dequantize_int8(q, scale) - xn) <= ref_scale / 2 * (1 + 1e-5))


def test_int8_rounds_half_to_even():
  x = jnp.array([[0.5, 1.5, 2.5, -0.5, -2.5, 127.0]])  # amax 127 -> scale 1
  q, scale = int8.quantize_int8(x)
  assert float(scale[0, 0]) == 1.0
  np.testing.assert_array_equal(q, [[0, 2, 2, 0, -2, 127]])


def test_int8_zero_and_nan():
  q, scale = int8.quantize_int8(jnp.zeros((4, 8)))
  assert np.all(np.asarray(q) == 0) and np.all(np.isfinite(scale))
  x = jnp.ones((2, 8)).at[1, 3].set(jnp.nan)
  q, scale = int8.quantize_int8(x)
  deq = int8.dequantize_int8(q, scale)
  assert np.all(np.isfinite(deq[0])) and np.all(np.isnan(deq[1])), "NaN must survive quantization"


def test_int8_rejects_bad_input():
  with pytest.raises(TypeError, match="floating-point"):
    int8.quantize_int8(jnp.ones((2, 2), jnp.int32))
  with pytest.raises(ValueError, match="out of range"):
    int8.quantize_int8(jnp.ones((2, 2)), axis=2)


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
@pytest.mark.parametrize("axis", [None, -1, 0])
def test_fp8_round_trip_is_exact(dtype, axis):
  k1, k2 = jax.random.split(fresh_key())
  fmax = fp8.fp8_max(dtype)
  q = jax.random.uniform(k1, SHAPE, minval=-fmax, maxval=fmax).astype(dtype)
  q = q.at[0, :].set(fmax).at[:, 0].set(-fmax)  # every slice reaches fmax
  exponent = jax.random.randint(k2, fp8.absmax(q, axis).shape, -10, 10)
  scale = jnp.exp2(exponent.astype(jnp.float32))
  x = fp8.dequantize_fp8(q, scale)
  q2, scale2 = fp8.quantize_fp8(x, dtype, axis=axis, power_of_two=True)
  np.testing.assert_array_equal(np.asarray(q2, np.float32), np.asarray(q, np.float32))
  np.testing.assert_array_equal(scale2, scale)


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
def test_fp8_scale_and_saturation(dtype):
  x = jax.random.normal(fresh_key(), SHAPE) * 50
  fmax = fp8.fp8_max(dtype)
  q, scale = fp8.quantize_fp8(x, dtype)
  amax = float(jnp.max(jnp.abs(x)))
  assert scale.shape == (1, 1) and scale.dtype == jnp.float32
  np.testing.assert_allclose(float(scale[0, 0]), fmax / amax, rtol=1e-6)
  assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) <= fmax
  # a value past fmax after scaling saturates instead of becoming inf/NaN
  big = fp8.cast_to_fp8(jnp.array([1e9, -1e9, 3.0]), jnp.float32(1.0), dtype)
  np.testing.assert_array_equal(np.asarray(big, np.float32), [fmax, -fmax, 3.0])
  rel = np.linalg.norm(fp8.dequantize_fp8(q, scale) - x) / np.linalg.norm(x)
  assert rel < {fp8.E4M3: 0.04, fp8.E5M2: 0.08}[dtype]


def test_fp8_power_of_two_scales():
  x = jax.random.normal(fresh_key(), SHAPE) * jnp.exp2(jnp.arange(SHAPE[0]) % 17 - 8.0)[:, None]
  _, scale = fp8.quantize_fp8(x, fp8.E4M3, axis=-1, power_of_two=True)
  log2 = np.log2(np.asarray(scale))
  np.testing.assert_array_equal(log2, np.round(log2))
  exact = 448.0 / np.max(np.abs(np.asarray(x)), axis=-1, keepdims=True)
  assert np.all(scale <= exact) and np.all(exact < 2 * scale)


def test_fp8_rejects_unknown_dtype():
  with pytest.raises(TypeError, match="unsupported FP8"):
    fp8.quantize_fp8(jnp.ones((2, 2)), jnp.bfloat16)


def _ternary_reference(w):
  w = np.asarray(w, np.float64)
  s = max(np.mean(np.abs(w)), 1e-5)
  return np.clip(np.round(w / s), -1, 1).astype(np.int8), s


def test_ternary_matches_reference_and_is_idempotent():
  w = jax.random.normal(fresh_key(), SHAPE) * 0.02
  q, scale = ternary.quantize_ternary(w)
  ref_q, ref_s = _ternary_reference(w)
  assert q.dtype == jnp.int8 and scale.shape == ()
  np.testing.assert_allclose(float(scale), ref_s, rtol=1e-6)
  assert np.mean(np.asarray(q) != ref_q) < 1e-3  # float32 vs float64 ties only
  assert set(np.unique(np.asarray(q))) <= {-1, 0, 1}
  q2, _ = ternary.quantize_ternary(ternary.dequantize_ternary(q, scale))
  np.testing.assert_array_equal(q2, q)


def test_ternary_zero_weight_is_finite():
  q, scale = ternary.quantize_ternary(jnp.zeros((8, 8)))
  assert float(scale) == pytest.approx(1e-5) and not np.any(np.asarray(q))


@pytest.mark.parametrize("shape,axis", [((16,), -1), ((8, 12), -1), ((8, 12), 0), ((3, 8, 5), 1)])
def test_pack_2bit_round_trip(shape, axis):
  q = jax.random.randint(fresh_key(), shape, -1, 2).astype(jnp.int8)
  packed = ternary.pack_2bit(q, axis)
  expected = list(shape)
  expected[axis] //= 4
  assert packed.dtype == jnp.int8 and packed.shape == tuple(expected)
  np.testing.assert_array_equal(ternary.unpack_2bit(packed, axis), q)


def test_pack_2bit_layout_most_significant_first():
  packed = ternary.pack_2bit(jnp.array([1, 0, -1, 1, 0, 0, 0, -1], jnp.int8))
  # [1, 0, -1, 1] -> 01 00 11 01 ; [0, 0, 0, -1] -> 00 00 00 11
  np.testing.assert_array_equal(np.asarray(packed).view(np.uint8), [0b01001101, 0b00000011])


def test_pack_2bit_rejects_bad_input():
  with pytest.raises(ValueError, match="multiple of 4"):
    ternary.pack_2bit(jnp.zeros((6,), jnp.int8))
  with pytest.raises(TypeError, match="int8"):
    ternary.pack_2bit(jnp.zeros((8,), jnp.float32))
  with pytest.raises(TypeError, match="int8"):
    ternary.unpack_2bit(jnp.zeros((8,), jnp.uint8))


def test_stochastic_round_bf16_is_unbiased():
  key1, key2 = jax.random.split(fresh_key())
  x = jax.random.uniform(key1, (64,), minval=-4, maxval=4)
  draws = jax.vmap(lambda k: rounding.stochastic_round(x, k).astype(jnp.float32))(jax.random.split(key2, 20000))
  values = np.asarray(draws)
  assert draws.dtype == jnp.float32
  # each draw is one of the two bf16 neighbours of x
  lo = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32))
  assert np.all(np.abs(values - np.asarray(x)[None]) <= np.abs(lo - np.asarray(x)) + np.abs(x) * 2**-7)
  # Unbiased: the mean of N draws is within 6 standard deviations of x (one draw's is at most half the bf16 spacing
  # at x: a fail on 64 elements is ~1e-7 of runs).
  spacing = 2.0 ** (np.floor(np.log2(np.abs(np.asarray(x, np.float64)))) - 7)
  assert np.all(np.abs(values.mean(0, dtype=np.float64) - np.asarray(x)) <= 6 * 0.5 * spacing / np.sqrt(len(values)))


def test_stochastic_round_int8_is_unbiased_and_deterministic():
  key = fresh_key()
  x = jnp.full((400000,), 2.3)
  r = rounding.stochastic_round(x, key, jnp.int8)
  assert r.dtype == jnp.int8 and set(np.unique(np.asarray(r))) == {2, 3}
  up = 0.3  # each draw is 3 with this probability: the mean of N is within 6 standard deviations of 2.3
  np.testing.assert_allclose(np.asarray(r, np.float64).mean(), 2.3, rtol=0, atol=6 * np.sqrt(up * (1 - up) / x.size))
  np.testing.assert_array_equal(rounding.stochastic_round(x, key, jnp.int8), r)


def test_stochastic_round_special_values_and_errors():
  out = rounding.stochastic_round(jnp.array([jnp.inf, -jnp.inf, jnp.nan, 0.0]), fresh_key())
  assert np.isposinf(out[0]) and np.isneginf(out[1]) and np.isnan(out[2]) and out[3] == 0
  with pytest.raises(TypeError, match="unsupported target"):
    rounding.stochastic_round(jnp.ones(3), fresh_key(), jnp.float16)
