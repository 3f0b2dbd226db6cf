"""Bad inputs to the numerics API and the layers: one clear error each, or a well-defined result."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlowbit
from jaxlowbit import layers
from jaxlowbit import nnx as jnnx
from jaxlowbit import quantized_training as qt
from jaxlowbit_numerics import fp8, int8, ternary


@pytest.mark.parametrize("values", [[2, -2, 3, 1], [0, 0, 0, -128], [1, 1, 1, 127]])
def test_pack_2bit_refuses_values_two_bits_cannot_hold(values):
  for q in (jnp.array(values, jnp.int8), np.array(values, np.int8)):
    with pytest.raises(ValueError, match="pack_2bit: values must be -1, 0 or 1"):
      ternary.pack_2bit(q)


def test_pack_2bit_round_trips_ternary_values_eagerly_and_under_jit():
  q = jax.random.randint(jax.random.key(0), (8, 64), -1, 2).astype(jnp.int8)
  for pack in (ternary.pack_2bit, jax.jit(ternary.pack_2bit)):
    np.testing.assert_array_equal(ternary.unpack_2bit(pack(q)), q)


@pytest.mark.parametrize(
    "quantize, shape, axis",
    [(int8.quantize_int8, (0,), -1), (int8.quantize_int8, (4, 0), -1), (int8.quantize_int8, (0, 4), None),
     (fp8.quantize_fp8, (0,), None), (fp8.quantize_fp8, (4, 0), -1), (ternary.quantize_ternary, (0, 8), None)],
)
def test_quantizing_an_empty_slice_is_a_clear_error(quantize, shape, axis):
  kwargs = {} if quantize is ternary.quantize_ternary else {"axis": axis}
  with pytest.raises(ValueError, match=rf"{quantize.__name__}: x of shape \(.*size 0 along axis .*no scale"):
    quantize(jnp.zeros(shape), **kwargs)


@pytest.mark.parametrize("quantize", [int8.quantize_int8, lambda x, axis: fp8.quantize_fp8(x, axis=axis)])
def test_no_slices_give_an_empty_result(quantize):
  """Rows of K elements, none of them: nothing to scale, an empty result of the right shapes."""
  q, scale = quantize(jnp.zeros((0, 16)), axis=-1)
  assert q.shape == (0, 16) and scale.shape == (0, 1) and scale.dtype == jnp.float32


LINEN = [jaxlowbit.Int8Dense, jaxlowbit.Fp8Dense, jaxlowbit.BitNetDense, layers.LowBitDense, qt.Int8WeightOnlyDense]


@pytest.mark.parametrize("features", [0, -1, (4, 0), 2.5, True])
@pytest.mark.parametrize("cls", LINEN)
def test_linen_layers_refuse_nonpositive_features(cls, features):
  got = re.escape(repr(features))
  with pytest.raises(ValueError, match=rf"{cls.__name__}: features must be a positive int.*got {got}"):
    cls(features)


@pytest.mark.parametrize("sizes", [(0, 4), (4, 0), (-1, 4), (4, -3)])
@pytest.mark.parametrize("cls", [jnnx.Int8Dense, jnnx.Fp8Dense, jnnx.BitNetDense])
def test_nnx_layers_refuse_nonpositive_sizes(cls, sizes):
  which = "in_features" if sizes[0] < 1 else "out_features"
  with pytest.raises(ValueError, match=rf"{cls.__name__}: {which} must be a positive int"):
    cls(*sizes, rngs=nnx.Rngs(0))
