"""The INT8 mixed-precision recipe (its matmuls: :class:`Int8MixedPrecision`).

int8 quantization: ``scale = amax / 127`` (amax >= 1e-12), ``q = clip(round_half_even(x / scale), -127, 127)``.
"""

from __future__ import annotations

import dataclasses

from jaxlowbit.recipes.base import check_bools
from jaxlowbit.recipes.scaled import OperandPlan, ScaledRecipe
from jaxlowbit.scaling import INT8_WEIGHT_SCALINGS, WeightScaling
from jaxlowbit_numerics.formats import QuantSpec

INT8_ROWS = QuantSpec("int8")


@dataclasses.dataclass(frozen=True)
class Int8MixedPrecision(ScaledRecipe):
  """INT8 mixed-precision training (torchao ``int8_mixed_precision``); weights stay high precision.

  - forward: x int8 per row (token), W int8 per output channel; int32 accumulation.
  - grad_input: g int8 per row, W re-quantized per input channel.
  - grad_weight: x int8 per input feature, g int8 per output feature (both over tokens).

  Attributes:
    output, grad_input, grad_weight: run that matmul in INT8 (True) or high precision.
  """

  output: bool = True
  grad_input: bool = True
  grad_weight: bool = True

  def __post_init__(self):
    check_bools(self, ("output", "grad_input", "grad_weight"))

  @property
  def plan(self) -> OperandPlan:
    pair = (INT8_ROWS, INT8_ROWS)
    return OperandPlan(
        output=pair if self.output else None,
        grad_input=pair if self.grad_input else None,
        grad_weight=pair if self.grad_weight else None,
    )

  def weight_scaling(self, int8_weight_scaling: str = "row") -> WeightScaling:
    """int8 with one global scale per output channel (``"row"``) or per tensor; high precision
    when the forward is (the weight then travels in the compute dtype)."""
    if int8_weight_scaling not in INT8_WEIGHT_SCALINGS:
      raise ValueError(f"int8_weight_scaling must be one of {INT8_WEIGHT_SCALINGS}, got {int8_weight_scaling!r}")
    if not self.output:
      return WeightScaling.HIGH_PRECISION
    return WeightScaling.INT8_TENSOR if int8_weight_scaling == "tensor" else WeightScaling.INT8_CHANNEL


Int8MixedPrecision.presets = {"int8": Int8MixedPrecision()}
