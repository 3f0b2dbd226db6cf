"""Recipes: what a quantized linear does in its three matmuls.

A recipe is a small frozen (hashable) dataclass, so it can be a static argument of ``jit``
and of ``custom_vjp``. Each boolean names one matmul of a linear ``y = x @ W``:

- ``output``       forward ``y = x @ W``
- ``grad_input``   ``dx = g @ W^T``
- ``grad_weight``  ``dW = x^T @ g``

``True`` runs that matmul in low precision, ``False`` in the input's high precision.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Union


def _check_bools(recipe: object, names: tuple[str, ...]) -> None:
  for name in names:
    value = getattr(recipe, name)
    if not isinstance(value, bool):
      raise TypeError(
          f"{type(recipe).__name__}.{name} must be a bool, got {value!r} ({type(value).__name__})"
      )


@dataclasses.dataclass(frozen=True)
class Int8MixedPrecision:
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
    _check_bools(self, ("output", "grad_input", "grad_weight"))


FLOAT8_SCALINGS = ("tensorwise", "rowwise", "rowwise_gw_hp")


@dataclasses.dataclass(frozen=True)
class Float8:
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


@dataclasses.dataclass(frozen=True)
class BitNet:
  """BitNet b1.58: ternary absmean weights, int8 per-token activations (torchao ``bitnet``).

  The forward always runs ternary x int8 on int8 tensor cores. The backward is
  straight-through (quantization acts as identity for the gradient): by default it runs
  in high precision against the quantized operands, exactly like the BitNet fake-quant
  reference. The flags move a backward matmul onto int8 tensor cores as well, at the
  cost of quantizing g per row (``grad_input``) or per output feature (``grad_weight``).

  Attributes:
    grad_input: ``dx = g @ (s * Wq)^T`` with g in int8 (Wq is exact in int8).
    grad_weight: ``dW = xq^T @ (sx * g)`` with xq exact int8 and ``sx * g`` in int8.
  """

  grad_input: bool = False
  grad_weight: bool = False

  def __post_init__(self):
    _check_bools(self, ("grad_input", "grad_weight"))


Recipe = Union[Int8MixedPrecision, Float8, BitNet]
RECIPE_TYPES = (Int8MixedPrecision, Float8, BitNet)


def check_recipe(recipe: object, who: str = "recipe") -> None:
  """TypeError unless ``recipe`` is None or one of the recipe dataclasses."""
  if recipe is not None and not isinstance(recipe, RECIPE_TYPES):
    names = ", ".join(t.__name__ for t in RECIPE_TYPES)
    raise TypeError(f"{who}: recipe must be None or one of {names}, got {recipe!r}")
