"""``quantized_matmul``: a linear ``y = x @ W`` whose three matmuls follow a recipe.

Each recipe is a ``jax.custom_vjp``: the forward quantizes x and W dynamically, the
backward quantizes g (and re-quantizes W) for ``grad_input`` and ``grad_weight``, and every
low-bit product goes through the one dispatch point, :func:`pallas_kernels.scaled_matmul`
(``[M, K] x [N, K]``, both operands K-major, scales applied in the epilogue), as does every
quantization (``quantize_rows``; ``quantize_cols_t``, which writes the transposed copy).

Operand layouts per matmul (for 2-D ``x [M, K]``, ``W [K, N]``, ``g [M, N]``):

=============  ==================  =====================  ======================
matmul         left ``[rows, K']``  right ``[cols, K']``   scales
=============  ==================  =====================  ======================
output         x   ``[M, K]``       W^T ``[N, K]``         per token x per out channel
grad_input     g   ``[M, N]``       W   ``[K, N]``         per token x per in channel
grad_weight    x^T ``[K, M]``       g^T ``[N, M]``         per in feature x per out feature
=============  ==================  =====================  ======================

Only what the backward needs is saved: the quantized ``x^T`` (int8/fp8, half or a quarter
of the bytes of x) when grad_weight is low-bit, x itself otherwise, and W, which is a
parameter and alive anyway; W's backward quantization is recomputed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxlowbit_numerics import ternary
from jaxlowbit_numerics.formats import QuantSpec
from jaxlowbit.recipes import BitNet, Float8, Int8MixedPrecision, Recipe, check_recipe
from pallas_kernels import dispatch

# How each operand of each matmul is quantized (see the table in the module docstring).
# These specs and the helpers below are public because jaxlowbit.fsdp runs the same recipes
# on gathered weights; keep the two in step by sharing them, not by copying.
INT8_ROWS = QuantSpec("int8")
E4M3_ROWS_POW2 = QuantSpec("float8_e4m3fn", power_of_two=True)
E4M3_TENSOR = QuantSpec("float8_e4m3fn", per_tensor=True)
E5M2_TENSOR = QuantSpec("float8_e5m2", per_tensor=True)
BITNET_ACTIVATIONS = QuantSpec("int8", eps=ternary.ACTIVATION_EPS)
TERNARY = QuantSpec("int8", per_tensor=True, ternary=True)


@dataclasses.dataclass(frozen=True)
class OperandPlan:
  """(left, right) operand specs of each matmul; None runs that matmul in high precision."""

  output: tuple[QuantSpec, QuantSpec] | None
  grad_input: tuple[QuantSpec, QuantSpec] | None
  grad_weight: tuple[QuantSpec, QuantSpec] | None


def operand_plan(recipe: Int8MixedPrecision | Float8) -> OperandPlan:
  if isinstance(recipe, Int8MixedPrecision):
    pair = (INT8_ROWS, INT8_ROWS)
    return OperandPlan(
        output=pair if recipe.output else None,
        grad_input=pair if recipe.grad_input else None,
        grad_weight=pair if recipe.grad_weight else None,
    )
  if recipe.rowwise:
    pair = (E4M3_ROWS_POW2, E4M3_ROWS_POW2)
    return OperandPlan(pair, pair, pair if recipe.grad_weight else None)
  # tensorwise: activations and weights e4m3, gradients e5m2 (more range, less precision).
  return OperandPlan(
      output=(E4M3_TENSOR, E4M3_TENSOR),
      grad_input=(E5M2_TENSOR, E4M3_TENSOR),
      grad_weight=(E4M3_TENSOR, E5M2_TENSOR),
  )


# Named scopes of the three matmuls (profiles attribute GEMMs and quantizations by them).
OUTPUT_SCOPE = "jaxlowbit_output"
GRAD_INPUT_SCOPE = "jaxlowbit_grad_input"
GRAD_WEIGHT_SCOPE = "jaxlowbit_grad_weight"


def hp_dot(a: jax.Array, b: jax.Array, out_dtype) -> jax.Array:
  """High-precision ``a @ b`` with float32 accumulation, computed in ``a``'s dtype."""
  return jnp.matmul(a, b.astype(a.dtype), preferred_element_type=jnp.float32).astype(out_dtype)


# ---------------------------------------------------------------------------------------------
# INT8 mixed precision and FP8: one custom_vjp, the recipe picks the quantizers.


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _scaled_linear(x: jax.Array, w: jax.Array, recipe: Int8MixedPrecision | Float8) -> jax.Array:
  return _scaled_linear_fwd(x, w, recipe)[0]


def rows_and_cols_t(t: jax.Array, rows_spec: QuantSpec | None, cols_spec: QuantSpec | None):
  """``t`` quantized per row and/or per column (transposed), from one fused pass when both."""
  if rows_spec is not None and rows_spec == cols_spec:
    return dispatch.quantize_rows_and_cols_t(t, rows_spec)
  rows = dispatch.quantize_rows(t, rows_spec) if rows_spec else None
  cols_t = dispatch.quantize_cols_t(t, cols_spec) if cols_spec else None
  return rows, cols_t


def _scaled_linear_fwd(x, w, recipe):
  with jax.named_scope(OUTPUT_SCOPE):
    return _scaled_linear_output(x, w, recipe)


def _scaled_linear_output(x, w, recipe):
  plan = operand_plan(recipe)
  # x per token for the forward and, for grad_weight, per input feature (transposed).
  x_rows, x_cols_t = rows_and_cols_t(
      x, plan.output[0] if plan.output else None, plan.grad_weight[0] if plan.grad_weight else None
  )
  if plan.output:
    qwt, swt = dispatch.quantize_cols_t(w, plan.output[1])  # W^T [N, K], per output channel
    y = dispatch.scaled_matmul(*x_rows, qwt, swt, x.dtype)
  else:
    y = hp_dot(x, w, x.dtype)
  # Keep only x's quantized transpose when grad_weight is low-bit.
  return y, (x_cols_t if plan.grad_weight else x, w)


def _scaled_linear_bwd(recipe, residuals, g):
  saved_x, w = residuals
  plan = operand_plan(recipe)
  # g per token for grad_input and, for grad_weight, per output feature (transposed).
  g_rows, g_cols_t = rows_and_cols_t(
      g, plan.grad_input[0] if plan.grad_input else None, plan.grad_weight[1] if plan.grad_weight else None
  )
  with jax.named_scope(GRAD_INPUT_SCOPE):
    if plan.grad_input:
      qw, sw = dispatch.quantize_rows(w, plan.grad_input[1])  # W [K, N], per input channel
      dx = dispatch.scaled_matmul(*g_rows, qw, sw, g.dtype)
    else:
      dx = hp_dot(g, w.T, g.dtype)
  with jax.named_scope(GRAD_WEIGHT_SCOPE):
    if plan.grad_weight:
      qxt, sxt = saved_x  # x^T [K, M], per input feature
      dw = dispatch.scaled_matmul(qxt, sxt, *g_cols_t, w.dtype)
    else:
      dw = hp_dot(saved_x.T, g, w.dtype)
  return dx, dw


_scaled_linear.defvjp(_scaled_linear_fwd, _scaled_linear_bwd)


# ---------------------------------------------------------------------------------------------
# BitNet b1.58: ternary W x int8 x forward, straight-through backward.


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _bitnet_linear(x: jax.Array, w: jax.Array, recipe: BitNet) -> jax.Array:
  return _bitnet_linear_fwd(x, w, recipe)[0]


def _bitnet_linear_fwd(x, w, recipe):
  with jax.named_scope(OUTPUT_SCOPE):
    return _bitnet_linear_output(x, w, recipe)


def _bitnet_linear_output(x, w, recipe):
  del recipe
  xq, sx = dispatch.quantize_rows(x, BITNET_ACTIVATIONS)
  wqt, s = dispatch.quantize_cols_t(w, TERNARY)  # Wq^T [N, K], one scale
  y = dispatch.scaled_matmul(xq, sx, wqt, s, x.dtype)
  # The straight-through grad_weight multiplies by the quantized x: int8 + one scale per row.
  return y, (xq, sx, w)


def _bitnet_linear_bwd(recipe, residuals, g):
  xq, sx, w = residuals
  with jax.named_scope(GRAD_INPUT_SCOPE):
    wq, s = dispatch.quantize_rows(w, TERNARY)
    if recipe.grad_input:
      gq, sg = dispatch.quantize_rows(g, INT8_ROWS)
      dx = dispatch.scaled_matmul(gq, sg, wq, s, g.dtype)  # Wq is exact in int8
    else:
      w_fake = (wq.astype(jnp.float32) * s).astype(g.dtype)  # weight-sized: cheap
      dx = hp_dot(g, w_fake.T, g.dtype)
  with jax.named_scope(GRAD_WEIGHT_SCOPE):
    dw = _bitnet_grad_weight(xq, sx, g, w.dtype, recipe)
  return dx, dw


def _bitnet_grad_weight(xq, sx, g, dtype, recipe):
  # Both forms below run in g's dtype (bf16 in training): the straight-through reference's
  # fake-quantized x, and sx * g, are exact enough there and an f32 GEMM would be ~3x slower.
  if recipe.grad_weight:
    # dW[k, n] = sum_m xq[m, k] * (sx[m] g[m, n]): xq stays exact, sx*g is quantized per n.
    scaled_g = (g.astype(jnp.float32) * sx).astype(g.dtype)
    qgt, sgt = dispatch.quantize_cols_t(scaled_g, INT8_ROWS)
    return dispatch.scaled_matmul(xq.T, jnp.ones((), jnp.float32), qgt, sgt, dtype)
  x_fake = (xq.astype(jnp.float32) * sx).astype(g.dtype)
  return hp_dot(x_fake.T, g, dtype)


_bitnet_linear.defvjp(_bitnet_linear_fwd, _bitnet_linear_bwd)


# ---------------------------------------------------------------------------------------------
# Public entry points.


def check_linear_operands(x, w, who: str) -> None:
  """TypeError/ValueError for ``x [..., K]``, ``w [K, N]`` that a quantized linear cannot take."""
  for name, arr in (("x", x), ("w", w)):
    if not hasattr(arr, "dtype") or not hasattr(arr, "shape"):
      raise TypeError(f"{who}: {name} must be an array, got {type(arr).__name__}")
    if not jnp.issubdtype(arr.dtype, jnp.floating):
      raise TypeError(f"{who}: {name} must be floating point (float32/bfloat16/float16), got {arr.dtype}")
  if w.ndim != 2:
    raise ValueError(f"{who}: w must be 2-D [K, N], got shape {w.shape}")
  if x.ndim < 1:
    raise ValueError(f"{who}: x must have at least one dimension [..., K], got a scalar")
  if x.shape[-1] != w.shape[0]:
    raise ValueError(
        f"{who}: x's last dimension ({x.shape[-1]}) must equal w's first (K={w.shape[0]}); "
        f"got x {x.shape}, w {w.shape}"
    )


def _vma(a: jax.Array) -> frozenset:
  """Mesh axes ``a`` varies over inside shard_map (empty outside; the field moved in jax 0.10)."""
  aval = jax.typeof(a)
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()))


def match_varying_axes(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Inside ``shard_map``, mark both operands varying over the union of their mesh axes.

  A custom_vjp must return cotangents of its inputs' exact type. When x varies over
  ``data`` and w is replicated, dW computed from x varies too; casting w to varying
  *outside* the custom_vjp lets autodiff of that cast insert the psum that makes dW
  replicated again, as it would for a plain matmul.
  """
  x_axes, w_axes = _vma(x), _vma(w)
  if x_axes == w_axes:
    return x, w
  if w_axes - x_axes:
    x = jax.lax.pcast(x, tuple(sorted(w_axes - x_axes)), to="varying")
  if x_axes - w_axes:
    w = jax.lax.pcast(w, tuple(sorted(x_axes - w_axes)), to="varying")
  return x, w


def quantized_matmul(x: jax.Array, w: jax.Array, recipe: Recipe | None = None) -> jax.Array:
  """Linear ``x @ w`` whose forward and backward matmuls follow ``recipe``.

  Args:
    x: ``[..., K]`` float32, bfloat16 or float16 activations.
    w: ``[K, N]`` floating weights (usually float32 master weights).
    recipe: :class:`Int8MixedPrecision`, :class:`Float8`, :class:`BitNet`, or None for the
      plain high-precision matmul.

  Returns:
    ``[..., N]`` in ``x``'s dtype. Differentiable with respect to both arguments (``dx`` in
    x's dtype, ``dw`` in w's dtype); works under jit, grad, vmap, remat, scan and shard_map.

  Raises:
    TypeError: non-floating x or w, or an unknown recipe.
    ValueError: w not 2-D or the contraction sizes disagree.
  """
  check_recipe(recipe, "quantized_matmul")
  check_linear_operands(x, w, "quantized_matmul")
  if recipe is None:
    return jnp.matmul(x, w.astype(x.dtype))
  x, w = match_varying_axes(x, w)
  batch_shape, k = x.shape[:-1], x.shape[-1]
  x2 = x.reshape(math.prod(batch_shape), k)
  if isinstance(recipe, BitNet):
    y = _bitnet_linear(x2, w, recipe)
  else:
    y = _scaled_linear(x2, w, recipe)
  return y.reshape(*batch_shape, w.shape[1])


def _normalize(axes: Sequence[int], ndim: int) -> tuple[int, ...]:
  return tuple(a % ndim for a in axes)


def quantized_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    *,
    recipe: Recipe | None,
) -> jax.Array:
  """Drop-in for ``lax.dot_general`` where ``rhs`` is a weight: runs ``quantized_matmul``.

  Contracting dimensions are flattened into K and free dimensions into M (lhs) and N
  (rhs); batch dimensions are mapped with ``vmap``. The output layout is dot_general's:
  ``batch + lhs free + rhs free``. Pass it as a Flax ``dot_general=`` with
  ``functools.partial(quantized_dot_general, recipe=...)``.
  ``precision`` applies to the high-precision path only.
  """
  (lc, rc), (lb, rb) = dimension_numbers
  lc, lb = _normalize(lc, lhs.ndim), _normalize(lb, lhs.ndim)
  rc, rb = _normalize(rc, rhs.ndim), _normalize(rb, rhs.ndim)
  if recipe is None:
    return lax.dot_general(
        lhs, rhs, ((lc, rc), (lb, rb)), precision=precision, preferred_element_type=preferred_element_type
    )
  if [lhs.shape[a] for a in lc] != [rhs.shape[a] for a in rc]:
    raise ValueError(f"quantized_dot_general: contracting dims differ: lhs {lhs.shape}{lc} vs rhs {rhs.shape}{rc}")
  lf = tuple(a for a in range(lhs.ndim) if a not in lc + lb)
  rf = tuple(a for a in range(rhs.ndim) if a not in rc + rb)
  batch_shape = tuple(lhs.shape[a] for a in lb)
  lf_shape = tuple(lhs.shape[a] for a in lf)
  rf_shape = tuple(rhs.shape[a] for a in rf)
  k = math.prod(lhs.shape[a] for a in lc)
  left = jnp.transpose(lhs, lb + lf + lc).reshape(*batch_shape, math.prod(lf_shape), k)
  right = jnp.transpose(rhs, rb + rc + rf).reshape(*batch_shape, k, math.prod(rf_shape))
  fn = functools.partial(quantized_matmul, recipe=recipe)
  for _ in batch_shape:
    fn = jax.vmap(fn)
  out = fn(left, right)
  if preferred_element_type is not None:
    out = out.astype(preferred_element_type)
  return out.reshape(*batch_shape, *lf_shape, *rf_shape)
