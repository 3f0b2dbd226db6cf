"""The FP8 recipes (their matmuls: :class:`Float8`).

Scale (a multiplier): ``fmax / max(amax, 1e-12)`` in float32; casts saturate (clip to +-fmax
first). e4m3fn max 448, e5m2 max 57344.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxlowbit.recipes.base import TENSOR_CORE_MULTIPLE, rowwise_worth_quantizing
from jaxlowbit.recipes.scaled import OperandPlan, ScaledRecipe
from jaxlowbit.scaling import WeightScaling
from jaxlowbit_numerics.formats import QuantSpec

FLOAT8_SCALINGS = ("tensorwise", "rowwise", "rowwise_gw_hp")
E4M3_ROWS_POW2 = QuantSpec("float8_e4m3fn", power_of_two=True)
E4M3_TENSOR = QuantSpec("float8_e4m3fn", per_tensor=True)
E5M2_TENSOR = QuantSpec("float8_e5m2", per_tensor=True)
# torchao's tensorwise auto-filter (H100): one scale per tensor is cheap, so only layers with
# N <= 4096 and K <= 1024 are too small to gain.
TENSORWISE_SMALL_K = 1024
TENSORWISE_SMALL_N = 4096


@dataclasses.dataclass(frozen=True)
class Float8(ScaledRecipe):
  """FP8 training (torchao / torchtitan float8 recipes), dynamic scaling.

  Attributes:
    scaling: ``"tensorwise"``: x and W e4m3fn, g e5m2, one float32 scale per tensor.
      ``"rowwise"``: every operand e4m3fn with axis-wise power-of-two scales.
      ``"rowwise_gw_hp"``: as rowwise, with grad_weight in high precision.
  """

  scaling: Literal["tensorwise", "rowwise", "rowwise_gw_hp"] = "tensorwise"

  def __post_init__(self):
    if self.scaling not in FLOAT8_SCALINGS:
      raise ValueError(f"Float8.scaling must be one of {FLOAT8_SCALINGS}, got {self.scaling!r}")

  @property
  def rowwise(self) -> bool:
    return self.scaling != "tensorwise"

  @property
  def grad_weight(self) -> bool:
    """Whether grad_weight runs in FP8."""
    return self.scaling != "rowwise_gw_hp"

  @property
  def plan(self) -> OperandPlan:
    if self.rowwise:
      pair = (E4M3_ROWS_POW2, E4M3_ROWS_POW2)
      return OperandPlan(pair, pair, pair if self.grad_weight else None)
    # tensorwise: activations and weights e4m3, gradients e5m2 (more range, less precision).
    return OperandPlan(
        output=(E4M3_TENSOR, E4M3_TENSOR),
        grad_input=(E5M2_TENSOR, E4M3_TENSOR),
        grad_weight=(E4M3_TENSOR, E5M2_TENSOR),
    )

  def weight_scaling(self, int8_weight_scaling: str = "row") -> WeightScaling:
    """e4m3 with one global scale per output channel (rowwise) or per tensor."""
    del int8_weight_scaling
    return WeightScaling.FP8_CHANNEL if self.rowwise else WeightScaling.FP8_TENSOR

  def worth_quantizing(self, k: int, n: int) -> bool:
    if self.rowwise:
      return rowwise_worth_quantizing(k, n)
    if k % TENSOR_CORE_MULTIPLE or n % TENSOR_CORE_MULTIPLE:
      return False
    return not (k <= TENSORWISE_SMALL_K and n <= TENSORWISE_SMALL_N)


Float8.presets = {
    "fp8_tensorwise": Float8("tensorwise"),
    "fp8_rowwise": Float8("rowwise"),
    "fp8_rowwise_gw_hp": Float8("rowwise_gw_hp"),
}
