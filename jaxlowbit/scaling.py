"""How a weight is quantized with a *global* scale (FSDP's gathers), and the statistic that scale needs.

A weight ``W [K, N]`` (input features K, output features N) sharded along K is quantized shard by
shard with one scale computed from a statistic over the whole tensor. Each recipe says which
scaling its weight travels in (``Recipe.weight_scaling``):

==================  ==========================  ==================  ==========================
scaling             recipe                      statistic           scale
==================  ==========================  ==================  ==========================
``INT8_TENSOR``     INT8, ``int8_weight_scaling  amax (one)          ``int8_scale(amax)``
                    ="tensor"``
``INT8_CHANNEL``    INT8, ``="row"``            amax per out channel ``int8_scale(amax[N])``
``FP8_TENSOR``      Float8 tensorwise           amax (one)          ``fp8_scale(amax)``
``FP8_CHANNEL``     Float8 rowwise(_gw_hp)      amax per out channel ``fp8_scale(amax[N], pow2)``
``TERNARY``         BitNet                      sum of abs (one)    ``ternary_scale(sum / K N)``
``HIGH_PRECISION``  None, INT8 ``output=False``  none                (gathered in compute dtype)
==================  ==========================  ==================  ==========================

A *statistic* is reduced over shards with MAX (amax: exact in any order, so every sharding
gives the bits of the unsharded value) or SUM (abs-sum: float32 sums round differently for
every sharding, as they do for different XLA fusions of one array, so BitNet's scale can
differ from the unsharded one in the last bit). A *scale* is what the quantizer takes, in the convention of its format (int8 and ternary: dequantization scale;
FP8: multiplier, ``x_fp8 = x * scale``). :meth:`WeightScaling.dequantization` gives the
float32 multiplier ``scaled_matmul`` wants in every case.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np

from jaxlowbit_numerics import fp8, int8, ternary
from jaxlowbit_numerics.formats import QuantSpec
from jaxlowbit_numerics.stats import absmax

INT8_WEIGHT_SCALINGS = ("tensor", "row")


class Reduction(enum.Enum):
  MAX = "max"
  SUM = "sum"


class WeightScaling(enum.Enum):
  INT8_TENSOR = "int8_tensor"
  INT8_CHANNEL = "int8_channel"
  FP8_TENSOR = "fp8_tensor"
  FP8_CHANNEL = "fp8_channel"
  TERNARY = "ternary"
  HIGH_PRECISION = "high_precision"

  @property
  def quantized(self) -> bool:
    return self is not WeightScaling.HIGH_PRECISION

  @property
  def per_channel(self) -> bool:
    return self in (WeightScaling.INT8_CHANNEL, WeightScaling.FP8_CHANNEL)

  @property
  def reduction(self) -> Reduction:
    return Reduction.SUM if self is WeightScaling.TERNARY else Reduction.MAX

  @property
  def payload_dtype(self):
    """dtype of the quantized weight (ternary: int8 in {-1, 0, 1} before packing)."""
    if self in (WeightScaling.FP8_TENSOR, WeightScaling.FP8_CHANNEL):
      return jnp.dtype(fp8.E4M3)
    if self is WeightScaling.HIGH_PRECISION:
      raise ValueError("a high-precision weight has no low-bit payload")
    return jnp.dtype(jnp.int8)

  @property
  def spec(self) -> QuantSpec:
    """The payload's quantization as a ``QuantSpec`` (what a recipe checks a gathered weight against)."""
    specs = {
        WeightScaling.INT8_TENSOR: QuantSpec("int8", per_tensor=True),
        WeightScaling.INT8_CHANNEL: QuantSpec("int8"),
        WeightScaling.FP8_TENSOR: QuantSpec(jnp.dtype(fp8.E4M3).name, per_tensor=True),
        WeightScaling.FP8_CHANNEL: QuantSpec(jnp.dtype(fp8.E4M3).name, power_of_two=True),
        WeightScaling.TERNARY: QuantSpec("int8", per_tensor=True, ternary=True),
    }
    if self not in specs:
      raise ValueError("a high-precision weight has no low-bit payload")
    return specs[self]

  def num_scales(self, n: int) -> int:
    """Scales of a ``[K, N]`` weight: N per channel, else one."""
    return n if self.per_channel else 1

  def statistic(self, w: jax.Array) -> jax.Array:
    """float32 statistic of a (local) ``[..., K', N]`` weight: amax ``[..., N]`` or ``[..., 1]``,
    abs-sum ``[..., 1]`` (leading dims: layers stacked by ``nn.scan``)."""
    if self.per_channel:
      return absmax(w, axis=-2)[..., 0, :]
    if self is WeightScaling.TERNARY:
      return jnp.sum(jnp.abs(w.astype(jnp.float32)), axis=(-2, -1))[..., None]
    return absmax(w, axis=(-2, -1))[..., 0]

  def scale(self, statistic: jax.Array, count: int) -> jax.Array:
    """The quantizer's scale ``[..., N]`` or ``[...]`` from the global statistic ``[..., S]``.

    ``count`` is K * N, for the abs-mean. A SUM statistic may come as ``[..., n]`` per-shard
    sums; they are added here, in order.
    """
    if self in (WeightScaling.INT8_TENSOR, WeightScaling.INT8_CHANNEL):
      s = int8.int8_scale(statistic)
    elif self in (WeightScaling.FP8_TENSOR, WeightScaling.FP8_CHANNEL):
      s = fp8.fp8_scale(statistic, fp8.E4M3, power_of_two=self.per_channel)
    elif self is WeightScaling.TERNARY:
      s = ternary.ternary_scale(jnp.sum(statistic, axis=-1, keepdims=True) / np.float32(count))  # a literal, as in jnp.mean
    else:
      raise ValueError("a high-precision weight has no scale")
    return s if self.per_channel else s[..., 0]

  def quantize(self, w: jax.Array, scale: jax.Array) -> jax.Array:
    """``[K', N]`` payload of a (local) weight quantized with the global ``scale``."""
    if self is WeightScaling.INT8_TENSOR or self is WeightScaling.INT8_CHANNEL:
      return int8.quantize_int8_with_scale(w, scale)
    if self is WeightScaling.FP8_TENSOR or self is WeightScaling.FP8_CHANNEL:
      return fp8.cast_to_fp8(w, scale, fp8.E4M3)
    if self is WeightScaling.TERNARY:
      return ternary.quantize_ternary_with_scale(w, scale)
    raise ValueError("a high-precision weight is not quantized")

  def dequantization(self, scale: jax.Array) -> jax.Array:
    """float32 multiplier that takes the payload back to real values (``scaled_matmul``'s scale)."""
    if self in (WeightScaling.FP8_TENSOR, WeightScaling.FP8_CHANNEL):
      return 1.0 / scale
    return scale


__all__ = ["INT8_WEIGHT_SCALINGS", "Reduction", "WeightScaling"]
