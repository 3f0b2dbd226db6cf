"""Producers that quantize a linear's input on the way: RMSNorm -> quantize, SwiGLU -> quantize.

A transformer feeds most of its linears from an elementwise op: an RMSNorm (the block's
pre-norms, BitNet's norm before every projection) or SwiGLU (the down projection). Quantizing
the op's bf16 output afterwards reads and writes it again; these producers compute the op and
its quantization in one pass and hand :func:`jaxlowbit.quantized_matmul` a
:class:`~jaxlowbit.operand.LowBitOperand` built to ``recipe.input_quantization()`` (rows for the
forward, the transpose grad_weight reads). The bf16 output is never written.

Each is a ``custom_vjp``: the operand's gradient (its carrier's cotangent: the linear's
``dx``, straight through the quantization) continues through the op's own backward, so
gradients are those of the unfused ``op -> quantized_matmul``.

Numerics equal the unfused path: the op is computed in float32 and rounded to the compute
dtype exactly as ``flax.linen.RMSNorm`` / ``nn.silu(gate) * up`` do, then quantized as
``pallas_kernels.dispatch`` quantizes (kernels on a GPU, XLA elsewhere).

Shapes: inputs ``[..., C]`` come back as a 2-D operand ``[M, C]`` (``M`` = the leading dims'
product); the consuming Dense's output is ``[M, N]``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp

from jaxlowbit.operand import LowBitOperand, QuantizedMatrix, carrier_like, vary_over, varying_axes
from jaxlowbit.recipes import OperandQuantization, Recipe
from pallas_kernels import dispatch
from pallas_kernels.quantize import RmsNorm, SwiGLU, SwiGLUGrad


# Off while a model converted for inference runs: its linears no longer run the training recipe.
_ENABLED = contextvars.ContextVar("jaxlowbit_fused_quantizers", default=True)


@contextlib.contextmanager
def unfused():
  """Within this context the producers return their op's high-precision output (never an operand)."""
  token = _ENABLED.set(False)
  try:
    yield
  finally:
    _ENABLED.reset(token)


def fused_quantization(recipe: Recipe | None) -> OperandQuantization | None:
  """What a producer delivers for ``recipe``'s linear, or None where it feeds it high precision."""
  if recipe is None or not _ENABLED.get():
    return None
  return recipe.input_quantization()


# ---------------------------------------------------------------------------------------------
# RMSNorm


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype) -> jax.Array:
  """``flax.linen.RMSNorm``'s output: ``x * (rsqrt(mean(x^2) + eps) * scale)`` in float32, cast to ``dtype``."""
  return RmsNorm(eps, jnp.dtype(dtype)).reference((x, scale))


def _rms_norm_backward(dy, x, scale, rstd):
  """``(dx, dscale)`` of ``y = x * rstd * scale`` with ``rstd = rsqrt(mean(x^2) + eps)``, in float32."""
  x, dy, scale = x.astype(jnp.float32), dy.astype(jnp.float32), scale.astype(jnp.float32)
  normed = x * rstd
  dscale = jnp.sum(dy * normed, axis=tuple(range(x.ndim - 1)))
  dnormed = dy * scale
  # d(x * rstd)/dx = rstd (I - normed normed^T / C) along the row.
  dx = rstd * (dnormed - normed * jnp.mean(dnormed * normed, axis=-1, keepdims=True))
  return dx, dscale


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _rms_norm_quantized(x, scale, eps: float, how: OperandQuantization, dtype) -> LowBitOperand:
  return _rms_norm_quantized_fwd(x, scale, eps, how, dtype)[0]


def _produce(inputs, prologue, how: OperandQuantization, dtype):
  """The prologue's output quantized as ``how`` says (one fused kernel on a GPU): ``(operand, row stat)``."""
  rows, transposed, stat = dispatch.fused_quantize(
      inputs, prologue, how.rows, None if how.transposed_from_rows else how.transposed, how.transposed_from_rows)
  as_matrix = lambda part, spec: None if part is None else QuantizedMatrix(*part, spec)  # noqa: E731
  shape = (inputs[0].shape[0], prologue.width(inputs))
  operand = LowBitOperand(as_matrix(rows, how.rows), as_matrix(transposed, how.transposed or how.rows),
                          carrier_like(shape, dtype, *inputs))
  return operand, stat


def _rms_norm_quantized_fwd(x, scale, eps, how, dtype):
  operand, rstd = _produce((x, scale), RmsNorm(eps, dtype), how, dtype)
  return operand, (x, scale, rstd[:, None])


def _rms_norm_quantized_bwd(eps, how, dtype, residuals, ct):
  del eps, how, dtype
  x, scale, rstd = residuals
  dx, dscale = _rms_norm_backward(ct.carrier, x, scale, rstd)
  return dx.astype(x.dtype), dscale.astype(scale.dtype)


_rms_norm_quantized.defvjp(_rms_norm_quantized_fwd, _rms_norm_quantized_bwd)


def rms_norm_for(x: jax.Array, scale: jax.Array, eps: float, recipe: Recipe | None, dtype) -> jax.Array | LowBitOperand:
  """RMSNorm of ``x [..., C]`` (``scale [C]``), quantized for the linear that reads it when ``recipe`` allows.

  Returns:
    a :class:`LowBitOperand` ``[M, C]`` when ``recipe.input_quantization()`` says how (the norm's
    output quantized in one pass, never written in ``dtype``), else the normed ``[..., C]`` array
    of ``dtype`` (what ``flax.linen.RMSNorm(dtype=dtype)`` computes).
  """
  how = fused_quantization(recipe)
  if how is None:
    return rms_norm(x, scale, eps, dtype)
  # Inside shard_map the scale's gradient varies with the tokens: autodiff of this cast sums it.
  scale = vary_over(scale, varying_axes(x))
  return _rms_norm_quantized(x.reshape(-1, x.shape[-1]), scale, eps, how, jnp.dtype(dtype))


# ---------------------------------------------------------------------------------------------
# SwiGLU


@jax.custom_vjp
def swiglu(gate_up: jax.Array) -> jax.Array:
  """``silu(gate) * up`` of ``gate_up [..., 2H]`` (``[gate | up]``) in float32, cast back: ``[..., H]``.

  Its gradient ``d gate_up [..., 2H]`` is one elementwise pass (:func:`_swiglu_backward`); autodiff
  of the split wrote the two halves' gradients and concatenated them in a separate copy (bf16 1B
  step on an H200: 13.5 ms per step for the two).
  """
  return SwiGLU().reference((gate_up,))


def _swiglu_fwd(gate_up):
  return swiglu(gate_up), gate_up


def _swiglu_bwd(gate_up, dh):
  return (_swiglu_backward(dh, gate_up),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def _swiglu_backward(dh, gate_up):
  """``d gate_up [..., 2H]`` of ``h = silu(gate) * up`` given ``dh [..., H]``, in ``gate_up``'s dtype.

  One pass on a GPU (the values kernel of :class:`SwiGLUGrad`): XLA wrote it as a concatenate
  fusion of the two halves' expressions that it did not fuse into the gradient GEMMs reading it (bf16
  1B step on an H200: 8.0 ms for the concatenate plus 4.3 ms converting its halves).
  """
  return dispatch.prologue_values((dh, gate_up), SwiGLUGrad())


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _swiglu_quantized(gate_up, how: OperandQuantization) -> LowBitOperand:
  return _swiglu_quantized_fwd(gate_up, how)[0]


def _swiglu_quantized_fwd(gate_up, how):
  return _produce((gate_up,), SwiGLU(), how, gate_up.dtype)[0], gate_up


def _swiglu_quantized_bwd(how, gate_up, ct):
  del how
  return (_swiglu_backward(ct.carrier, gate_up),)


_swiglu_quantized.defvjp(_swiglu_quantized_fwd, _swiglu_quantized_bwd)


def swiglu_for(gate_up: jax.Array, recipe: Recipe | None) -> jax.Array | LowBitOperand:
  """SwiGLU of ``gate_up [..., 2H]``, quantized for the linear that reads it when ``recipe`` allows.

  Returns a :class:`LowBitOperand` ``[M, H]`` or the ``[..., H]`` array (as :func:`swiglu`).
  """
  how = fused_quantization(recipe)
  if how is None:
    return swiglu(gate_up)
  return _swiglu_quantized(gate_up.reshape(-1, gate_up.shape[-1]), how)


__all__ = ["fused_quantization", "rms_norm", "rms_norm_for", "swiglu", "swiglu_for", "unfused"]
