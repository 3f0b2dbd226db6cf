"""``quantized_matmul``: a linear ``y = x @ W`` whose three matmuls follow a recipe.

One ``jax.custom_vjp`` serves every recipe and every runtime: its forward and backward are the
recipe's own (:meth:`Recipe.forward`, :meth:`Recipe.backward`, in ``jaxlowbit/recipes/``), and
every low-bit product and quantization they run goes through the one dispatch point,
``pallas_kernels.dispatch``. Either operand may be a high-precision array, which the recipe
quantizes, or a :class:`~jaxlowbit.operand.LowBitOperand` that a producer quantized on the way
(a fused RMSNorm/SwiGLU quantizer for x, FSDP's low-bit gather for W); the gradient of such an
operand reaches its producer (straight through the quantization).

``quantized_dot_general`` is the same for ``lax.dot_general``'s interface (Flax's
``dot_general=`` hook).

Tensor parallelism (``jaxlowbit.parallel.tensor``) runs the same custom_vjp with a *collective*: a
static object that says how the linear's operands are split over a mesh axis and moves data
around the recipe's matmuls (a row-parallel linear reduce-scatters its output, and gathers its
output gradient before the backward). The recipe's forward and backward run unchanged, with
dispatch options that say how their operands are split, so that their quantizations see the
whole split matrix (:class:`Collective`).

How the kernels run is the ``options`` argument (:class:`jaxlowbit.ExecutionOptions`: the
backend), resolved once here and handed to the recipe, which hands it to every quantization and
GEMM (``pallas_kernels.dispatch.DispatchOptions``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from jaxlowbit.execution import ExecutionOptions, resolve
from jaxlowbit.operand import LowBitOperand, MeasuredOutput, carrier_like, is_low_bit, vary_over, varying_axes
from jaxlowbit.recipes import Recipe, check_recipe
from jaxlowbit_numerics.stats import Split
from pallas_kernels import policy


class Collective(Protocol):
  """What a linear whose operands are split over a mesh axis does around the recipe (static, hashable).

  Attributes:
    forward_split: how the forward's operands are split (the recipe's quantizations reduce their
      amaxes over it), or None.
    backward_split: the same for the backward's operands.
  """

  forward_split: Split | None
  backward_split: Split | None

  def scatter(self, y: jax.Array) -> jax.Array:
    """The forward's output ``[M, N]`` as this device keeps it (e.g. reduce-scattered rows)."""

  def gather_gradient(self, g: jax.Array, recipe: Recipe, options: ExecutionOptions) -> Any:
    """This device's output gradient -> the ``g`` the recipe's backward reads (array or low-bit operand)."""


def _check_array(a, name: str, who: str) -> None:
  if not hasattr(a, "dtype") or not hasattr(a, "shape"):
    raise TypeError(f"{who}: {name} must be an array, got {type(a).__name__}")
  if not jnp.issubdtype(a.dtype, jnp.floating):
    raise TypeError(f"{who}: {name} must be floating point (float32/bfloat16/float16), got {a.dtype}")


def check_linear_operands(x, w, who: str) -> None:
  """TypeError/ValueError for ``x [..., K]``, ``w [K, N]`` that a quantized linear cannot take."""
  for name, arr in (("x", x), ("w", w)):
    _check_array(arr, name, who)  # a LowBitOperand has its logical shape and dtype
  if w.ndim != 2:
    raise ValueError(f"{who}: w must be 2-D [K, N], got shape {w.shape}")
  if x.ndim < 1:
    raise ValueError(f"{who}: x must have at least one dimension [..., K], got a scalar")
  if is_low_bit(x) and x.ndim != 2:
    raise ValueError(f"{who}: a low-bit x must be 2-D [M, K], got shape {x.shape}")
  if x.shape[-1] != w.shape[0]:
    raise ValueError(
        f"{who}: x's last dimension ({x.shape[-1]}) must equal w's first (K={w.shape[0]}); "
        f"got x {x.shape}, w {w.shape}"
    )


def match_varying_axes(x, w):
  """Inside ``shard_map``, mark both array operands varying over the union of their mesh axes.

  A custom_vjp must return cotangents of its inputs' exact type. When x varies over
  ``data`` and w is replicated, dW computed from x varies too; casting w to varying
  *outside* the custom_vjp lets autodiff of that cast insert the psum that makes dW
  replicated again, as it would for a plain matmul. A low-bit operand was made varying by
  its producer (its carrier).
  """
  axes = [varying_axes(a.carrier if is_low_bit(a) else a) for a in (x, w)]
  union = axes[0] | axes[1]
  x, w = (a if is_low_bit(a) or axes_a == union else vary_over(a, union) for a, axes_a in zip((x, w), axes))
  return x, w


@dataclasses.dataclass(frozen=True)
class _Operands:
  """What the backward must know of the primal operands (static: a custom_vjp nondiff argument)."""

  x_low_bit: bool
  w_low_bit: bool
  w_dtype: jnp.dtype  # dW comes back in the weight's dtype (a low-bit weight's: its carrier's)
  collective: Collective | None = None
  options: ExecutionOptions = ExecutionOptions()  # resolved: a concrete backend
  measured: bool = False  # the output is a MeasuredOutput: its consumer measures g for the backward

  def dispatch(self, forward: bool):
    """The dispatch options of the forward's (or backward's) operands: the backend, and their split."""
    collective = self.collective
    if collective is None:
      return self.options.dispatch()
    return self.options.dispatch(collective.forward_split if forward else collective.backward_split)

  def cotangents(self, dx: jax.Array, dw: jax.Array):
    """The gradients as the primal operands' types: a low-bit operand's reaches its carrier."""
    return (LowBitOperand(None, None, dx) if self.x_low_bit else dx,
            LowBitOperand(None, None, dw) if self.w_low_bit else dw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _linear(x, w, recipe: Recipe, operands: _Operands) -> jax.Array:
  return _linear_fwd(x, w, recipe, operands)[0]


def _linear_fwd(x, w, recipe, operands):
  y, residuals = recipe.forward(x, w, operands.dispatch(forward=True))
  collective = operands.collective
  y = y if collective is None else collective.scatter(y)
  if operands.measured:
    y = MeasuredOutput(y, carrier_like((sum(y.shape),), jnp.float32, y))
  return y, residuals


def _linear_bwd(recipe, operands, residuals, g):
  collective = operands.collective
  g_maxima = None
  if operands.measured:  # [row amaxes | column amaxes] of g, from the consumer's backward
    g, maxima = g.values, g.maxima
    g_maxima = (maxima[:g.shape[0]], maxima[g.shape[0]:])
  if collective is not None:
    g = collective.gather_gradient(g, recipe, operands.options)
  return operands.cotangents(*recipe.backward(residuals, g, operands.w_dtype, operands.dispatch(forward=False),
                                              g_maxima))


# optimize_remat: under jax.checkpoint the residuals are recomputed by running the forward rule
# again where the policy does not save them (FSDP's regather), instead of always being saved.
_linear.defvjp(_linear_fwd, _linear_bwd, optimize_remat=True)


def quantized_matmul(x, w, recipe: Recipe | None = None, collective: Collective | None = None, *,
                     options: ExecutionOptions | None = None, measured: bool = False) -> jax.Array | MeasuredOutput:
  """Linear ``x @ w`` whose forward and backward matmuls follow ``recipe``.

  Args:
    x: ``[..., K]`` float32, bfloat16 or float16 activations, or a ``[M, K]``
      :class:`~jaxlowbit.operand.LowBitOperand` quantized as ``recipe.input_quantization()`` says.
    w: ``[K, N]`` floating weights (usually float32 master weights), or a low-bit weight
      (``jaxlowbit.parallel.gather_weight``).
    recipe: a recipe (:class:`Int8MixedPrecision`, :class:`Float8`, :class:`BitNet`), or None for
      the plain high-precision matmul.
    collective: inside ``shard_map``, a tensor-parallel linear's :class:`Collective`
      (``jaxlowbit.parallel.tensor``); x must then be 2-D ``[M, K]``.
    options: how the kernels run (:class:`jaxlowbit.ExecutionOptions`; None: the defaults, the
      backend from ``$JAXLOWBIT_BACKEND``).
    measured: return a :class:`~jaxlowbit.operand.MeasuredOutput` ``(values [M, N], maxima)`` whose one
      consumer measures the output gradient's amaxes for this linear's backward
      (``jaxlowbit.fused.swiglu_rms_norm_for``, or any consumer through
      ``jaxlowbit.fused.measured_values``). Needs a recipe, no collective and a 2-D x (``[M, K]``).

  Returns:
    ``[..., N]`` in ``x``'s dtype (with a collective: what its ``scatter`` keeps, e.g. ``[M / n,
    N]``). Differentiable with respect to both arguments (``dx`` in x's dtype, ``dw`` in w's
    dtype); works under jit, grad, vmap, remat, scan and shard_map.
    Empty operands (M, K or N = 0) give what ``lax.dot_general`` gives (K = 0: zeros).

  Raises:
    TypeError: non-floating x or w, or an unknown recipe.
    ValueError: w not 2-D, the contraction sizes disagree, a low-bit operand quantized
      otherwise than the recipe reads it, or ``measured`` without a recipe, with a collective or a
      non-2-D x.
  """
  check_recipe(recipe, "quantized_matmul")
  check_linear_operands(x, w, "quantized_matmul")
  options = resolve(options)
  if collective is not None and x.ndim != 2:
    raise ValueError(f"quantized_matmul: a tensor-parallel linear takes x as [M, K], got shape {x.shape}")
  if measured and (recipe is None or collective is not None or x.ndim != 2 or 0 in x.shape or 0 in w.shape):
    raise ValueError(f"quantized_matmul: a measured output needs a recipe, no collective and a non-empty 2-D x "
                     f"[M, K]; got recipe {recipe!r}, collective {collective!r}, x {x.shape}, w {w.shape}")
  scatter = (lambda y: y) if collective is None else collective.scatter  # noqa: E731  (autodiff transposes it)
  if recipe is None:
    if is_low_bit(x) or is_low_bit(w):
      raise ValueError("quantized_matmul: low-bit operands need the recipe they were quantized for, got recipe=None")
    return scatter(jnp.matmul(x, w.astype(x.dtype)))
  if 0 in x.shape or 0 in w.shape:  # nothing to quantize: the empty (or, for K = 0, zero) product
    if is_low_bit(x) or is_low_bit(w):
      raise ValueError(f"quantized_matmul: empty low-bit operands (x {x.shape}, w {w.shape})")
    return scatter(jnp.matmul(x, w.astype(x.dtype)))
  x, w = match_varying_axes(x, w)
  batch_shape, k = x.shape[:-1], x.shape[-1]
  x2 = x if is_low_bit(x) else x.reshape(math.prod(batch_shape), k)
  y = _linear(x2, w, recipe, _Operands(is_low_bit(x), is_low_bit(w), jnp.dtype(w.dtype), collective, options,
                                       measured))
  return y if collective is not None or measured else y.reshape(*batch_shape, w.shape[1])


def _dimension_numbers(lhs_ndim: int, rhs_ndim: int, dimension_numbers) -> tuple[tuple[int, ...], ...]:
  """``(lc, rc, lb, rb)`` normalized, or a ValueError that says what is wrong (as ``lax.dot_general``)."""
  try:
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = (tuple(int(a) for a in axes) for axes in (lc, rc, lb, rb))
  except (TypeError, ValueError):
    raise ValueError(
        "quantized_dot_general: dimension_numbers must be ((lhs_contracting, rhs_contracting), (lhs_batch, "
        f"rhs_batch)), each a sequence of ints, got {dimension_numbers!r}"
    ) from None
  for name, axes, ndim in (("lhs", lc + lb, lhs_ndim), ("rhs", rc + rb, rhs_ndim)):
    for a in axes:
      if not 0 <= a < ndim:  # dot_general takes no negative axes either
        raise ValueError(f"quantized_dot_general: {name} axis {a} is out of range for rank {ndim}")
    if len(set(axes)) != len(axes):
      raise ValueError(f"quantized_dot_general: {name} axes {axes} repeat a dimension (contracting + batch)")
  if len(lc) != len(rc) or len(lb) != len(rb):
    raise ValueError(
        f"quantized_dot_general: lhs and rhs must name as many contracting ({len(lc)} vs {len(rc)}) and batch "
        f"({len(lb)} vs {len(rb)}) dimensions"
    )
  return lc, rc, lb, rb


def _high_precision_dot(lhs, rhs, lc, rc, lb, rb, rows: int, k: int, n: int, precision,
                        preferred_element_type) -> jax.Array:
  """``lax.dot_general`` of the given dimensions. A one-row product (decode at batch 1) on an NVIDIA GPU below
  XLA's matrix-vector size gets a zero second row, so that XLA keeps it a GEMM instead of a slower multiply +
  reduce (``pallas_kernels.policy.matvec_needs_second_row``); the result is the first row's. The rule sees traced
  shapes and the default device: under ``jax.vmap`` a rank-1 input is one row per example (the batched product
  then has 2B rows: the same values, twice the work). ``rows``, ``k``, ``n``: the product's free lhs, contracted
  and free rhs sizes."""
  if lb or rows != 1 or not policy.matvec_needs_second_row(k, n):
    return lax.dot_general(lhs, rhs, ((lc, rc), (lb, rb)), precision=precision,
                           preferred_element_type=preferred_element_type)
  rows = jnp.stack([lhs, jnp.zeros_like(lhs)])  # [2, *lhs.shape]: the output gains a leading axis of 2
  return lax.dot_general(rows, rhs, ((tuple(a + 1 for a in lc), rc), ((), ())), precision=precision,
                         preferred_element_type=preferred_element_type)[0]


def quantized_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    *,
    recipe: Recipe | None,
    options: ExecutionOptions | None = None,
) -> jax.Array:
  """Drop-in for ``lax.dot_general`` where ``rhs`` is a weight: runs ``quantized_matmul``.

  Contracting dimensions are flattened into K and free dimensions into M (lhs) and N
  (rhs); batch dimensions are mapped with ``vmap``. The output layout is dot_general's:
  ``batch + lhs free + rhs free``. Pass it as a Flax ``dot_general=`` with
  ``functools.partial(quantized_dot_general, recipe=...)``.
  ``precision`` applies to the high-precision path only; ``options`` as for ``quantized_matmul``.

  Raises:
    ValueError: malformed or out-of-range dimension numbers, repeated axes, or sizes of
      contracting or batch dimensions that differ between lhs and rhs.
  """
  lc, rc, lb, rb = _dimension_numbers(lhs.ndim, rhs.ndim, dimension_numbers)
  for kind, la, ra in (("contracting", lc, rc), ("batch", lb, rb)):
    if [lhs.shape[a] for a in la] != [rhs.shape[a] for a in ra]:
      raise ValueError(
          f"quantized_dot_general: {kind} dimensions differ in size: lhs {lhs.shape} axes {la} vs rhs {rhs.shape} "
          f"axes {ra}"
      )
  lf = tuple(a for a in range(lhs.ndim) if a not in lc + lb)
  rf = tuple(a for a in range(rhs.ndim) if a not in rc + rb)
  batch_shape = tuple(lhs.shape[a] for a in lb)
  lf_shape = tuple(lhs.shape[a] for a in lf)
  rf_shape = tuple(rhs.shape[a] for a in rf)
  k = math.prod(lhs.shape[a] for a in lc)
  if recipe is None:
    return _high_precision_dot(lhs, rhs, lc, rc, lb, rb, math.prod(lf_shape), k, math.prod(rf_shape), precision,
                               preferred_element_type)
  left = jnp.transpose(lhs, lb + lf + lc).reshape(*batch_shape, math.prod(lf_shape), k)
  right = jnp.transpose(rhs, rb + rc + rf).reshape(*batch_shape, k, math.prod(rf_shape))
  fn = functools.partial(quantized_matmul, recipe=recipe, options=options)
  for _ in batch_shape:
    fn = jax.vmap(fn)
  out = fn(left, right)
  if preferred_element_type is not None:
    out = out.astype(preferred_element_type)
  return out.reshape(*batch_shape, *lf_shape, *rf_shape)


# quantized_dot_general without a recipe: lax.dot_general, a one-row product given a zero second row where XLA on
# GPU would make it a slower multiply + reduce (_high_precision_dot). dense_for(None)'s DenseGeneral runs its dot
# with it, and jaxlowbit's interceptors take such a layer as a plain Dense (interception.is_dense).
HIGH_PRECISION_DOT_GENERAL = functools.partial(quantized_dot_general, recipe=None)


def is_high_precision_dot_general(fn: Any) -> bool:
  """Whether ``fn`` is :data:`HIGH_PRECISION_DOT_GENERAL` or a copy of it (a deep-copied or unpickled model's)."""
  return (isinstance(fn, functools.partial) and fn.func is quantized_dot_general and not fn.args
          and fn.keywords == {"recipe": None})
