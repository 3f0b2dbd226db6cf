"""Low-bit operands: a matmul operand that arrives already quantized.

:func:`jaxlowbit.quantized_matmul` takes, for ``x`` or for ``w``, either a high-precision array
(it quantizes it as the recipe says) or a :class:`LowBitOperand` made by a *producer* that
quantized it on the way: a fused RMSNorm -> quantize or SwiGLU -> quantize kernel (``x``),
or FSDP's low-bit all-gather of a weight (``w``). One recipe path then serves every runtime:
the producer only decides where the quantized bytes come from.

A :class:`QuantizedMatrix` is one 2-D quantization in the layout a GEMM reads::

    values ~= data * scale      data [R, C] int8/fp8, scale float32 [R, 1] (per row), [1, C] (per column)
                                or [1, 1] (per tensor), always a dequantization multiplier

A :class:`LowBitOperand` holds the operand in the two layouts the recipe's matmuls read
(8-bit tensor cores want the contraction dimension last in both operands):

==========  ===============================================  ==============================================
operand     ``rows``: the operand ``[R, C]`` as it is        ``transposed``: its transpose ``[C, R]``
==========  ===============================================  ==============================================
x [M, K]    per token: the forward's left operand            x^T per input feature (or the rows' codes
                                                             transposed): grad_weight's left operand
w [K, N]    W: grad_input's right operand (None: the recipe  W^T per output channel: the forward's right
            derives it from ``transposed``)                  operand
g [M, N]    per token: grad_input's left operand             g^T per output feature: grad_weight's right
==========  ===============================================  ==============================================

Either may be None where the recipe does not read it.

Gradients: quantization is straight-through (identity for the gradient), so an operand's
gradient is the gradient with respect to the real values it stands for. JAX cannot
differentiate int8 arrays, so the operand carries ``carrier``: an array of the operand's
logical shape and dtype whose *value is never read* (zeros, which XLA removes) and whose
cotangent is that gradient. The producer's ``custom_vjp`` receives it and continues the chain
(the RMSNorm backward, or FSDP's ``psum_scatter`` of dW).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxlowbit_numerics.formats import QuantSpec


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedMatrix:
  """``data [R, C]`` (int8 / float8) with a float32 dequantization ``scale`` broadcastable to it.

  Attributes:
    data: the payload, in the layout a GEMM reads (the contraction dimension last).
    scale: float32 ``[R, 1]`` (one per row), ``[1, C]`` (one per column) or ``[1, 1]``.
    spec: how it was quantized (static).
  """

  data: jax.Array
  scale: jax.Array
  spec: QuantSpec = dataclasses.field(metadata={"static": True})

  @property
  def shape(self) -> tuple[int, ...]:
    return self.data.shape

  @property
  def per_tensor(self) -> bool:
    return self.scale.size == 1

  @property
  def per_row(self) -> bool:
    """One scale per row (or one in all): what a GEMM epilogue can apply."""
    return self.per_tensor or self.scale.shape == (self.data.shape[0], 1)

  def serves(self, spec: QuantSpec) -> bool:
    """Whether this quantization can stand in for quantizing the same values per row with ``spec``.

    The same spec per row does; so does any per-tensor quantization of the same dtype (a GEMM
    applies one scale as well as one per row: FSDP's per-tensor gathered weights serve the
    recipe's per-row grad_input this way).
    """
    if self.data.dtype != spec.jnp_dtype or self.spec.ternary != spec.ternary:
      return False
    return self.per_tensor or (self.per_row and self.spec == spec)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """``data * scale`` in ``dtype``, computed in float32."""
    return (self.data.astype(jnp.float32) * self.scale).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LowBitOperand:
  """An operand of ``quantized_matmul`` delivered already quantized (see the module docstring).

  Attributes:
    rows: the operand ``[R, C]`` quantized (x per token, W for grad_input), or None.
    transposed: its transpose ``[C, R]`` quantized (x^T for grad_weight, W^T for the forward), or None.
    carrier: ``[R, C]`` array of the operand's dtype, never read; its cotangent is the operand's
      gradient (make it with :func:`carrier_like`).
    values: ``[R, C]``, the operand itself in its dtype where its producer wrote it too, or None. A decode
      norm writes it beside the codes for linears a conversion may have left in high precision
      (``jaxlowbit.fused.decode_quantization``); no gradient reaches it.
  """

  rows: QuantizedMatrix | None
  transposed: QuantizedMatrix | None
  carrier: jax.Array
  values: jax.Array | None = None

  @property
  def shape(self) -> tuple[int, ...]:
    """The logical operand's shape (``[M, K]`` for x, ``[K, N]`` for w)."""
    return self.carrier.shape

  @property
  def dtype(self):
    return self.carrier.dtype

  @property
  def ndim(self) -> int:
    return self.carrier.ndim


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MeasuredOutput:
  """A linear's output whose one consumer measures the output's gradient for the linear's backward.

  The backward of a linear quantizes its output gradient ``g [M, N]`` per row and per column, which
  needs ``g``'s row and column amaxes first: a pass over ``g`` of its own. A consumer that writes
  ``g`` in its own backward can measure them on the way (BitNet's ``ffn_sub_norm``,
  ``jaxlowbit.fused.swiglu_rms_norm_for``). JAX carries nothing backward but cotangents, so the
  linear returns this pair and the consumer's backward returns the amaxes as ``maxima``'s cotangent.

  Attributes:
    values: the output ``[M, N]``.
    maxima: float32 ``[M + N]`` zeros, never read (as a :class:`LowBitOperand`'s carrier). Its
      cotangent is ``g``'s amaxes ``[row amaxes [M] | column amaxes [N]]`` (``|g|`` as float32 with
      NaN as inf, of ``g`` as the consumer returns it): a consumer must return exactly these
      (:func:`jaxlowbit.fused.measured_values` does it in XLA for any consumer).
  """

  values: jax.Array
  maxima: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    return self.values.shape

  @property
  def dtype(self):
    return self.values.dtype


def is_measured(a) -> bool:
  return isinstance(a, MeasuredOutput)


def varying_axes(a: jax.Array) -> frozenset:
  """Mesh axes ``a`` varies over inside ``shard_map`` (empty outside)."""
  aval = jax.typeof(a)
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()))


def vary_over(a: jax.Array, axes: frozenset) -> jax.Array:
  """``a`` marked varying over ``axes`` as well (inside ``shard_map``; a no-op outside)."""
  missing = tuple(sorted(axes - varying_axes(a)))
  return lax.pcast(a, missing, to="varying") if missing else a


def carrier_like(shape: tuple[int, ...], dtype, *operands: jax.Array) -> jax.Array:
  """A gradient carrier: zeros of ``shape`` and ``dtype`` varying like ``operands`` inside shard_map.

  Its cotangent must have the same varying axes as the value, and a gradient computed from
  the operands varies wherever they do.
  """
  axes = frozenset().union(*(varying_axes(o) for o in operands))
  return vary_over(jnp.zeros(shape, dtype), axes)


def is_low_bit(a) -> bool:
  return isinstance(a, LowBitOperand)


__all__ = ["LowBitOperand", "MeasuredOutput", "QuantizedMatrix", "carrier_like", "is_low_bit", "is_measured",
           "vary_over", "varying_axes"]
