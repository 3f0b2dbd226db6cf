"""Recipes: what a quantized linear does in its three matmuls, one recipe per file.

Each boolean or option of a recipe names one matmul of a linear ``y = x @ W``:

- ``output``       forward ``y = x @ W``
- ``grad_input``   ``dx = g @ W^T``
- ``grad_weight``  ``dW = x^T @ g``

:mod:`~jaxlowbit.recipes.base` says what a recipe owns; :mod:`~jaxlowbit.recipes.scaled` is the
shared implementation of recipes that quantize both operands of each matmul with a scale.
"""

from jaxlowbit.recipes.base import OperandQuantization, Recipe, check_recipe, named_recipes, registered
from jaxlowbit.recipes.int8_mixed_precision import Int8MixedPrecision  # noqa: I001  (the order recipes are listed in)
from jaxlowbit.recipes.float8 import FLOAT8_SCALINGS, Float8
from jaxlowbit.recipes.bitnet import BitNet

__all__ = [
    "FLOAT8_SCALINGS",
    "BitNet",
    "Float8",
    "Int8MixedPrecision",
    "OperandQuantization",
    "Recipe",
    "check_recipe",
    "named_recipes",
    "registered",
]
