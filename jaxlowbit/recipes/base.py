"""What every recipe is: the base class, and the pieces all recipes share.

A recipe is a small frozen (hashable) dataclass, so it can be a static argument of ``jit`` and
of ``custom_vjp``. It owns its behaviour, so adding a recipe means adding its file (and, for a
new number format, its kernels), not editing tables elsewhere:

- the linear's three matmuls: :meth:`Recipe.forward` (``y = x @ W``, and what the backward
  keeps) and :meth:`Recipe.backward` (``dx = g @ W^T``, ``dW = x^T @ g``), on high-precision
  arrays or on :class:`~jaxlowbit.operand.LowBitOperand` s that producers quantized already;
- what those producers must deliver (:meth:`Recipe.input_quantization`,
  :meth:`Recipe.gradient_quantization`);
- how FSDP quantizes its weight for the all-gather (:meth:`Recipe.weight_scaling`);
- which layers are too small to gain (:meth:`Recipe.worth_quantizing`);
- whether the model puts an RMSNorm before each linear (:attr:`Recipe.norm_before_linear`);
- the names the trainer knows it by (``presets``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jaxlowbit.operand import LowBitOperand, QuantizedMatrix, is_low_bit
from jaxlowbit.scaling import WeightScaling
from jaxlowbit_numerics.formats import QuantSpec
from pallas_kernels import dispatch
from pallas_kernels.dispatch import DispatchOptions

# Named scopes of the three matmuls (profiles attribute GEMMs and quantizations by them).
OUTPUT_SCOPE = "jaxlowbit_output"
GRAD_INPUT_SCOPE = "jaxlowbit_grad_input"
GRAD_WEIGHT_SCOPE = "jaxlowbit_grad_weight"

# Every low-bit GEMM wants K and N multiples of this (tensor-core tiles).
TENSOR_CORE_MULTIPLE = 16
# Layers whose K (in features) or N (out features) are small gain nothing from low-bit GEMMs:
# the quantization passes cost more than the faster matmul saves. Starting points are torchao's
# float8 auto-filters measured on H100 (torchao names them by the weight's shape (out, in); here
# K is in and N is out). Recipes with axis-wise scales (INT8 row/column, FP8 rowwise, BitNet
# per-token) pay for scale passes: skip when K <= 2048, or N <= 1024, or (K <= 4096 and N <= 2048).
ROWWISE_MIN_K = 2048
ROWWISE_MIN_N = 1024
ROWWISE_MIN_K_FOR_SMALL_N = 4096
ROWWISE_SMALL_N = 2048


@dataclasses.dataclass(frozen=True)
class OperandQuantization:
  """How an operand is quantized for a recipe's matmuls: its rows and its transpose.

  Attributes:
    rows: spec of the operand's per-row quantization ``[R, C]`` (None: not read low-bit).
    transposed: spec of its transpose's per-row (the operand's per-column) quantization ``[C, R]``.
    transposed_from_rows: the transpose holds the *rows'* codes transposed, scales and all (BitNet
      reuses its exact int8 activations), not a quantization of its own.
  """

  rows: QuantSpec | None
  transposed: QuantSpec | None = None
  transposed_from_rows: bool = False


def quantize_operand(x: jax.Array, how: OperandQuantization, options: DispatchOptions | None = None,
                     maxima: tuple[jax.Array, jax.Array] | None = None
                     ) -> tuple[QuantizedMatrix | None, QuantizedMatrix | None]:
  """``(rows, transposed)`` of a 2-D ``x`` as ``how`` says, from one fused pass where a kernel can.

  ``rows [R, C]`` has one scale per row (or one in all); ``transposed [C, R]`` one per column of x.
  ``options``: the backend and how x is split (``pallas_kernels.dispatch.DispatchOptions``; a recipe
  passes its own, None is the environment's). ``maxima``: x's ``(row amaxes [R], column amaxes [C])`` where
  its producer measured them (:class:`~jaxlowbit.operand.MeasuredOutput`): a kernel writing both layouts
  then skips its statistics pass.
  """
  if how.transposed_from_rows:
    q, s = dispatch.quantize_rows(x, how.rows, options)
    return QuantizedMatrix(q, s, how.rows), QuantizedMatrix(q.T, s.reshape(1, -1), how.rows)
  if how.rows is not None and how.rows == how.transposed:
    (q, s), (qt, st) = dispatch.quantize_rows_and_cols_t(x, how.rows, options, maxima)
    return QuantizedMatrix(q, s, how.rows), QuantizedMatrix(qt, st, how.rows)
  rows = QuantizedMatrix(*dispatch.quantize_rows(x, how.rows, options), how.rows) if how.rows else None
  transposed = (QuantizedMatrix(*dispatch.quantize_cols_t(x, how.transposed, options), how.transposed)
                if how.transposed else None)
  return rows, transposed


def provided(operand: LowBitOperand, part: str, spec: QuantSpec | None, recipe: Any, who: str) -> QuantizedMatrix:
  """``operand.rows`` or ``operand.transposed``, checked against the spec ``recipe`` reads it with."""
  qm = getattr(operand, part)
  if qm is None or spec is None or not qm.serves(spec):
    got = "nothing" if qm is None else f"{qm.spec} ({qm.data.dtype}, scale {qm.scale.shape})"
    raise ValueError(
        f"{type(recipe).__name__}: the {who} arrived quantized with {got} in its {part!r} layout, but this recipe "
        f"reads it as {spec}; produce it with recipe.input_quantization() / gradient_quantization(), or pass "
        "the high-precision array"
    )
  return qm


def hp_dot(a: jax.Array, b: jax.Array, out_dtype) -> jax.Array:
  """High-precision ``a @ b`` with float32 accumulation, computed in ``a``'s dtype."""
  return jnp.matmul(a, b.astype(a.dtype), preferred_element_type=jnp.float32).astype(out_dtype)


def gemm(left: QuantizedMatrix, right: QuantizedMatrix, out_dtype, options: DispatchOptions) -> jax.Array:
  """``left [M, K] @ right [N, K]^T`` with both scales in the epilogue (the one low-bit GEMM), on ``options.backend``."""
  return dispatch.scaled_matmul(left.data, left.scale, right.data, right.scale, out_dtype, options)


def weight_values(w: jax.Array | LowBitOperand, dtype) -> jax.Array:
  """``W [K, N]`` in ``dtype`` for a high-precision matmul: the array, or a low-bit weight dequantized."""
  if not is_low_bit(w):
    return w
  if w.rows is not None:
    return w.rows.dequantize(dtype)
  return w.transposed.dequantize(dtype).T


def rowwise_worth_quantizing(k: int, n: int) -> bool:
  """The small-layer rule of recipes with axis-wise scales (see :data:`ROWWISE_MIN_K`)."""
  if k % TENSOR_CORE_MULTIPLE or n % TENSOR_CORE_MULTIPLE:
    return False
  if k <= ROWWISE_MIN_K or n <= ROWWISE_MIN_N:
    return False
  return not (k <= ROWWISE_MIN_K_FOR_SMALL_N and n <= ROWWISE_SMALL_N)


class Recipe:
  """Base class of the recipes (frozen dataclasses; see the module docstring for the contract).

  Subclasses implement :meth:`forward`, :meth:`backward`, :meth:`input_quantization`,
  :meth:`weight_scaling` and list their named ``presets``; the rest has defaults.
  """

  # Names the trainer (``--config.recipe=NAME``) knows instances of this recipe by.
  presets: ClassVar[dict[str, Recipe]] = {}
  # BitNet model surgery: the model puts an RMSNorm right before each linear of this recipe.
  norm_before_linear: ClassVar[bool] = False

  def forward(self, x: jax.Array | LowBitOperand, w: jax.Array | LowBitOperand,
              options: DispatchOptions) -> tuple[jax.Array, Any]:
    """``(y [M, N] in x's dtype, residuals for backward)`` for ``x [M, K]``, ``w [K, N]``.

    ``options``: the backend and operand split every quantization and GEMM of the forward runs
    with (pass it on to ``quantize_operand``, ``gemm`` and ``pallas_kernels.dispatch``).
    """
    raise NotImplementedError

  def backward(self, residuals: Any, g: jax.Array | LowBitOperand, w_dtype, options: DispatchOptions,
               g_maxima: tuple[jax.Array, jax.Array] | None = None) -> tuple[jax.Array, jax.Array]:
    """``(dx [M, K] in g's dtype, dW [K, N] in w_dtype)`` from the forward's residuals and ``g [M, N]``
    (``options`` as for :meth:`forward`, the backward's own: its operands may be split otherwise).
    ``g_maxima``: g's ``(row amaxes [M], column amaxes [N])`` where its consumer measured them
    (:class:`~jaxlowbit.operand.MeasuredOutput`), for :func:`quantize_operand`."""
    raise NotImplementedError

  def input_quantization(self) -> OperandQuantization | None:
    """What a producer of ``x`` must deliver (None: this recipe needs ``x`` in high precision)."""
    raise NotImplementedError

  def gradient_quantization(self) -> OperandQuantization | None:
    """What a producer of the output gradient ``g`` must deliver (None: high precision)."""
    return None

  def weight_scaling(self, int8_weight_scaling: str = "row") -> WeightScaling:
    """How FSDP quantizes this recipe's weight before its all-gather."""
    raise NotImplementedError

  def worth_quantizing(self, k: int, n: int) -> bool:
    """Whether a ``[K, N]`` linear is large enough for this recipe to speed it up."""
    return rowwise_worth_quantizing(k, n)


def registered() -> tuple[type[Recipe], ...]:
  """Every recipe class (the subclasses of :class:`Recipe` defined so far)."""
  def walk(cls: type) -> list[type[Recipe]]:
    found = []
    for sub in cls.__subclasses__():  # in definition order, depth first
      found += ([sub] if dataclasses.is_dataclass(sub) else []) + walk(sub)
    return found

  return tuple(walk(Recipe))


def check_recipe(recipe: object, who: str = "recipe") -> None:
  """TypeError unless ``recipe`` is None or a recipe instance."""
  if recipe is not None and not isinstance(recipe, Recipe):
    names = ", ".join(t.__name__ for t in registered())
    raise TypeError(f"{who}: recipe must be None or one of {names}, got {recipe!r}")


def check_bools(recipe: object, names: tuple[str, ...]) -> None:
  for name in names:
    value = getattr(recipe, name)
    if not isinstance(value, bool):
      raise TypeError(f"{type(recipe).__name__}.{name} must be a bool, got {value!r} ({type(value).__name__})")


def named_recipes() -> dict[str, Recipe]:
  """``{name: recipe}`` of every recipe class's presets (the trainer's ``config.recipe`` values)."""
  named: dict[str, Recipe] = {}
  for cls in registered():
    named.update(cls.presets)
  return named
