"""Producers that quantize a linear's input on the way: RMSNorm -> quantize, SwiGLU -> quantize.

A transformer feeds most of its linears from an elementwise op: an RMSNorm (the block's
pre-norms, BitNet's norms) or the MLP's gated activation (SwiGLU or squared ReLU: the down
projection). Quantizing the op's bf16 output afterwards reads and writes it again; these producers compute the op and
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

How they run is explicit: ``options`` (:class:`jaxlowbit.ExecutionOptions`) gives the backend of
their kernels and ``fused_quantizers`` (off: the producers return the op's high-precision output,
as a model converted for inference needs).

Tensor parallelism (``jaxlowbit.parallel.tensor``): ``split`` says how this device's ``[M, C]`` is
split over mesh axes. ``Split(rows=...)``: the device holds some of the tokens (the residual
stream before a column-parallel gather); amaxes over tokens are reduced over the devices.
``Split(cols=...)``: it holds some of the features (a row-parallel linear's input); the RMSNorm's
mean square and every per-token amax are reduced over the devices, so the output and its codes
equal the unsplit op's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxlowbit.execution import ExecutionOptions, resolve
from jaxlowbit.operand import (LowBitOperand, MeasuredOutput, QuantizedMatrix, carrier_like, is_measured, vary_over,
                               varying_axes)
from jaxlowbit.recipes import OperandQuantization, Recipe
from jaxlowbit_numerics.formats import QuantSpec
from jaxlowbit_numerics.stats import NO_SPLIT, Split
from pallas_kernels import dispatch
from pallas_kernels.decode import Add
from pallas_kernels.dispatch import DispatchOptions
from pallas_kernels.quantize import (Identity, Prologue, RmsNorm, RmsNormApply, SwiGLU, SwiGLUGrad, amaxes,
                                     check_gate_activation, rms_norm_input_grad, round_to)


def fused_quantization(recipe: Recipe | None, options: ExecutionOptions | None = None,
                       split: Split = NO_SPLIT) -> OperandQuantization | None:
  """What a producer delivers for ``recipe``'s linear under ``options``, or None where it feeds it high precision.

  Rows split over the tensor axis (``options.tensor_parallel``; the producer feeds its gather): what
  the gather sends (``TensorParallel.sent_quantization``: x^T is made after the gather, as a rule).
  """
  options = options or ExecutionOptions()
  if recipe is None or not options.fused_quantizers:
    return None
  how = recipe.input_quantization()
  tp = options.tensor_parallel
  if tp is not None and tp.axis_name in split.rows:
    how = tp.sent_quantization(how)
  return how


# ---------------------------------------------------------------------------------------------
# RMSNorm


def _row_mean(a: jax.Array, split: Split) -> jax.Array:
  """float32 mean of ``a [..., C]`` over its last axis, whose columns may be split over mesh axes."""
  if not split.cols:
    return jnp.mean(a, axis=-1, keepdims=True)
  return split.psum(jnp.sum(a, axis=-1, keepdims=True)) / split.num_cols(a.shape[-1])


def _rms_norm_split(x: jax.Array, scale: jax.Array, eps: float, dtype, split: Split) -> tuple[jax.Array, jax.Array]:
  """``(y, rstd [..., 1])`` of an RMSNorm whose features are split over ``split.cols`` (mean square over all)."""
  x32 = x.astype(jnp.float32)
  rstd = jax.lax.rsqrt(_row_mean(x32 * x32, split) + eps)
  return round_to(x32 * (rstd * scale.astype(jnp.float32)), dtype), rstd


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype, split: Split = NO_SPLIT,
             options: DispatchOptions | None = None) -> jax.Array:
  """``flax.linen.RMSNorm``'s output: ``x * (rsqrt(mean(x^2) + eps) * scale)`` in float32, cast to ``dtype``.

  ``split.cols``: x holds this device's features ``[..., C / n]`` (``scale`` too); the mean runs over all C.
  A decode step's few rows run as one kernel on a GPU (:func:`pallas_kernels.dispatch.norm_rows`; ``options``: its
  backend), equal up to the order of the mean square's sum.
  """
  if split.cols:
    return _rms_norm_split(x, scale, eps, dtype, split)[0]
  return _norm_rows((x,), scale, Identity(), RmsNorm(eps, jnp.dtype(dtype)), options)


def _norm_rows(inputs: tuple[jax.Array, ...], scale: jax.Array, source: Prologue, norm: RmsNorm,
               options: DispatchOptions | None, write_source: bool = False, quantize: QuantSpec | None = None,
               keep_values: bool = False):
  """:func:`pallas_kernels.dispatch.norm_rows` of inputs ``[..., C_i]``, its outputs shaped ``[..., C]``; with
  ``quantize`` (:func:`decode_quantization`) the normed output is the :class:`LowBitOperand` ``[M, C]`` of its
  per-row codes instead (``keep_values``: with the normed ``[M, C]`` as its ``values``)."""
  lead = inputs[0].shape[:-1]
  flat = tuple(a.reshape(-1, a.shape[-1]) for a in inputs)
  out = dispatch.norm_rows(flat, scale, source, norm, write_source, options, quantize, keep_values)
  y, values = out if write_source else (out, None)
  if quantize is None:
    y = y.reshape(*lead, y.shape[-1])
  else:
    codes, code_scale, *kept = y
    carrier = carrier_like(codes.shape, norm.dtype, *inputs)
    y = LowBitOperand(QuantizedMatrix(codes, code_scale, quantize), None, carrier, kept[0] if kept else None)
  return (y, values.reshape(*lead, values.shape[-1])) if write_source else y


def decode_norm_runs(x: jax.Array, options: ExecutionOptions | None, recipe: Recipe | None = None,
                     split: Split | None = None) -> bool:
  """Whether a norm of ``x [..., C]`` runs as the one-launch decode kernel: nothing quantized or split, few rows."""
  split = split or NO_SPLIT
  return (fused_quantization(recipe, options, split) is None and not split.cols
          and dispatch.norm_rows_on_kernel(_rows(x), resolve(options).dispatch()))


def _rows(x: jax.Array) -> int:
  """The rows of ``x [..., C]``: the product of its leading dims."""
  return x.size // x.shape[-1]


def decode_quantization(recipe: Recipe | None, options: ExecutionOptions | None, rows: int,
                        linears: bool = False) -> QuantSpec | None:
  """The per-row spec in which a decode step's norm (where :func:`decode_norm_runs`) of ``rows`` rows hands the
  linear reading it its input, or None (the norm writes its output and the linear quantizes it).

  A model converted for inference says how its converted linears take a quantized input
  (``ExecutionOptions.decode_inputs``: ternary's and W8A8's per-token int8). The norm quantizes for a linear whose
  ``recipe`` quantizes its input rows that way (BitNet's), and, where the caller says that ``linears`` read its
  output, for linears of no recipe (a high-precision model converted for W8A8): those may have been left out of
  the conversion, so the norm then writes its output too (:func:`keeps_values`). The codes are those the linear's
  own quantizer makes of the norm's output, so only the launch that makes them moves: the norm's kernel writes them
  (one more sweep over a row it holds) and the linear reads int8 codes instead of quantizing bf16 rows. Up to
  ``ExecutionOptions.decode_input_rows`` rows, where the options set it.
  """
  options = resolve(options)
  spec = options.decode_inputs
  if spec is None or (options.decode_input_rows is not None and rows > options.decode_input_rows):
    return None
  if recipe is None:
    return spec if linears else None
  how = recipe.input_quantization()
  return spec if how is not None and how.rows == spec else None


def keeps_values(recipe: Recipe | None) -> bool:
  """Whether a decode norm handing codes (:func:`decode_quantization`) writes its output beside them: for readers of
  no recipe, which run in high precision where a conversion left them out."""
  return recipe is None


def add_rms_norm_for(x: jax.Array, delta: jax.Array, scale: jax.Array, eps: float, recipe: Recipe | None, dtype,
                     split: Split | None = None, *, options: ExecutionOptions | None = None, linears: bool = False):
  """``(rms_norm_for(x + delta, ...), x + delta)``: a pre-norm and the residual sum it reads.

  ``x``, ``delta [..., C]``: the residual stream and what a sublayer adds to it. Where the norm runs as the decode
  kernel (:func:`decode_norm_runs`) and both have one dtype, the sum is formed and normalized in the same launch
  (the sum in float32, rounded once to x's dtype, as XLA adds); else ``x + delta`` then :func:`rms_norm_for`.
  ``linears``: as :func:`rms_norm_for`.
  """
  if x.dtype == delta.dtype and decode_norm_runs(x, options, recipe, split):
    return _norm_rows((x, delta), scale, Add(), RmsNorm(eps, jnp.dtype(dtype)), resolve(options).dispatch(),
                      write_source=True, quantize=decode_quantization(recipe, options, _rows(x), linears),
                      keep_values=keeps_values(recipe))
  total = x + delta
  return rms_norm_for(total, scale, eps, recipe, dtype, split, options=options, linears=linears), total


def _norm_row_mean(dy, x, scale, rstd, split: Split = NO_SPLIT) -> jax.Array:
  """``mean(dy * scale * x * rstd)`` over each row ``[..., 1]`` (float32): the row term of the norm's input gradient."""
  return _row_mean((dy * scale) * (x * rstd), split)


def _rms_norm_backward(dy, x, scale, rstd, split: Split = NO_SPLIT):
  """``(dx, dscale)`` of ``y = x * rstd * scale`` with ``rstd = rsqrt(mean(x^2) + eps)``, in float32."""
  x, dy, scale = x.astype(jnp.float32), dy.astype(jnp.float32), scale.astype(jnp.float32)
  dscale = jnp.sum(dy * (x * rstd), axis=tuple(range(x.ndim - 1)))
  return rms_norm_input_grad(dy, x, scale, rstd, _norm_row_mean(dy, x, scale, rstd, split)), dscale


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _rms_norm_quantized(x, scale, eps: float, how: OperandQuantization, dtype,
                        options: DispatchOptions) -> LowBitOperand:
  return _rms_norm_quantized_fwd(x, scale, eps, how, dtype, options)[0]


def _produce(inputs, prologue, how: OperandQuantization, dtype, options: DispatchOptions, sources=None):
  """The prologue's output quantized as ``how`` says (one fused kernel on a GPU): ``(operand, row stat)``.

  ``options``: the backend and how the inputs are split; ``sources``: the arrays the operand's
  gradient reaches (default ``inputs``; their varying axes).
  """
  rows, transposed, stat = dispatch.fused_quantize(
      inputs, prologue, how.rows, None if how.transposed_from_rows else how.transposed, how.transposed_from_rows,
      options)
  as_matrix = lambda part, spec: None if part is None else QuantizedMatrix(*part, spec)  # noqa: E731
  shape = (inputs[0].shape[0], prologue.width(inputs))
  operand = LowBitOperand(as_matrix(rows, how.rows), as_matrix(transposed, how.transposed or how.rows),
                          carrier_like(shape, dtype, *(sources or inputs)))
  return operand, stat


def _rms_norm_quantized_fwd(x, scale, eps, how, dtype, options):
  if options.split.cols:  # the norm over all devices' features first (XLA), then its output quantized
    y, rstd = _rms_norm_split(x, scale, eps, dtype, options.split)
    operand, _ = _produce((y,), Identity(), how, dtype, options, (x, scale))
    return operand, (x, scale, rstd)
  operand, rstd = _produce((x, scale), RmsNorm(eps, dtype), how, dtype, options)
  return operand, (x, scale, rstd[:, None])


def _rms_norm_quantized_bwd(eps, how, dtype, options, residuals, ct):
  del eps, how, dtype
  x, scale, rstd = residuals
  dx, dscale = _rms_norm_backward(ct.carrier, x, scale, rstd, options.split)
  return dx.astype(x.dtype), dscale.astype(scale.dtype)


_rms_norm_quantized.defvjp(_rms_norm_quantized_fwd, _rms_norm_quantized_bwd)


def rms_norm_for(x: jax.Array, scale: jax.Array, eps: float, recipe: Recipe | None, dtype,
                 split: Split | None = None, *, options: ExecutionOptions | None = None,
                 linears: bool = False) -> jax.Array | LowBitOperand:
  """RMSNorm of ``x [..., C]`` (``scale [C]``), quantized for the linear that reads it when ``recipe`` allows.

  ``split`` (tensor parallelism, inside ``shard_map``): how this device's x is split (module
  docstring); with ``Split(cols=...)``, x and scale hold this device's ``C / n`` features.
  ``options``: the kernels' backend, ``fused_quantizers`` (off: the normed array) and ``decode_inputs`` (a
  decode step's per-row codes for a converted linear: :func:`decode_quantization`).
  ``linears``: only linear layers (Dense) read the output, none through a norm of its own: a decode step may then
  hand codes to linears of no recipe too (:func:`decode_quantization`).

  Returns:
    a :class:`LowBitOperand` ``[M, C]`` when ``recipe.input_quantization()`` says how (the norm's
    output quantized in one pass, never written in ``dtype``), else the normed ``[..., C]`` array
    of ``dtype`` (what ``flax.linen.RMSNorm(dtype=dtype)`` computes).
  """
  split = split or NO_SPLIT
  spec = decode_quantization(recipe, options, _rows(x), linears)
  if spec is not None and decode_norm_runs(x, options, recipe, split):
    return _norm_rows((x,), scale, Identity(), RmsNorm(eps, jnp.dtype(dtype)), resolve(options).dispatch(),
                      quantize=spec, keep_values=keeps_values(recipe))
  how = fused_quantization(recipe, options, split)
  if how is None:
    return rms_norm(x, scale, eps, dtype, split, resolve(options).dispatch())
  # Inside shard_map the scale's gradient varies with the tokens: autodiff of this cast sums it.
  scale = vary_over(scale, varying_axes(x))
  return _rms_norm_quantized(x.reshape(-1, x.shape[-1]), scale, eps, how, jnp.dtype(dtype),
                             resolve(options).dispatch(split))


# ---------------------------------------------------------------------------------------------
# SwiGLU (and the other gated activations: ``activation`` names one of GATE_ACTIVATIONS)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def swiglu(gate_up: jax.Array, activation: str = "silu", options: DispatchOptions | None = None) -> jax.Array:
  """``act(gate) * up`` of ``gate_up [..., 2H]`` (``[gate | up]``) in float32, cast back: ``[..., H]``.

  ``activation``: ``"silu"`` (SwiGLU) or ``"relu2"`` (squared ReLU ``max(gate, 0)^2``, BitNet b1.58
  2B4T); :data:`pallas_kernels.quantize.GATE_ACTIVATIONS`. ``options``: the backend of its backward
  (None: the environment's).

  Its gradient ``d gate_up [..., 2H]`` is one elementwise pass (:func:`_swiglu_backward`); autodiff
  of the split wrote the two halves' gradients and concatenated them in a separate copy (bf16 1B
  step on an H200: 13.5 ms per step for the two).
  """
  return SwiGLU(activation).reference((gate_up,))


def _swiglu_fwd(gate_up, activation, options):
  return swiglu(gate_up, activation, options), gate_up


def _swiglu_bwd(activation, options, gate_up, dh):
  return (_swiglu_backward(dh, gate_up, activation, options),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def _swiglu_backward(dh, gate_up, activation: str, options: DispatchOptions | None):
  """``d gate_up [..., 2H]`` of ``h = act(gate) * up`` given ``dh [..., H]``, in ``gate_up``'s dtype.

  One pass on a GPU (the values kernel of :class:`SwiGLUGrad`): XLA wrote it as a concatenate
  fusion of the two halves' expressions that it did not fuse into the gradient GEMMs reading it (bf16
  1B step on an H200: 8.0 ms for the concatenate plus 4.3 ms converting its halves).
  """
  return dispatch.prologue_values((dh, gate_up), SwiGLUGrad(activation), options)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _swiglu_quantized(gate_up, how: OperandQuantization, options: DispatchOptions, activation: str) -> LowBitOperand:
  return _swiglu_quantized_fwd(gate_up, how, options, activation)[0]


def _swiglu_quantized_fwd(gate_up, how, options, activation):
  return _produce((gate_up,), SwiGLU(activation), how, gate_up.dtype, options)[0], gate_up


def _swiglu_quantized_bwd(how, options, activation, gate_up, ct):
  del how
  return (_swiglu_backward(ct.carrier, gate_up, activation, options.splitting(None)),)


_swiglu_quantized.defvjp(_swiglu_quantized_fwd, _swiglu_quantized_bwd)


def swiglu_for(gate_up: jax.Array, recipe: Recipe | None, split: Split | None = None,
               activation: str = "silu", *, options: ExecutionOptions | None = None) -> jax.Array | LowBitOperand:
  """``act(gate) * up`` of ``gate_up [..., 2H]``, quantized for the linear that reads it when ``recipe`` allows.

  ``split``: how this device's values are split (tensor parallelism: ``Split(cols=...)`` when it
  holds ``H / n`` hidden units, ``[gate | up]`` of its own; the per-token amaxes span all of H).
  ``activation``: ``"silu"`` (SwiGLU, the default) or ``"relu2"`` (:func:`swiglu`).
  ``options``: as for :func:`rms_norm_for`.

  Returns a :class:`LowBitOperand` ``[M, H]`` or the ``[..., H]`` array (as :func:`swiglu`).
  """
  check_gate_activation(activation)
  how = fused_quantization(recipe, options)
  if how is None:
    return swiglu(gate_up, activation, resolve(options).dispatch())
  return _swiglu_quantized(gate_up.reshape(-1, gate_up.shape[-1]), how, resolve(options).dispatch(split), activation)


# ---------------------------------------------------------------------------------------------
# A linear's measured output (jaxlowbit.operand.MeasuredOutput)


@jax.custom_vjp
def _measured(values: jax.Array, maxima: jax.Array) -> jax.Array:
  return values


def _measured_fwd(values, maxima):
  del maxima
  return values, None


def _measured_bwd(_, g):
  rowmax, colmax = amaxes(g)
  return g, jnp.concatenate([rowmax, colmax])


_measured.defvjp(_measured_fwd, _measured_bwd)


def measured_values(y: jax.Array | MeasuredOutput) -> jax.Array:
  """The values ``[M, N]`` of a linear's :class:`~jaxlowbit.operand.MeasuredOutput` for any consumer, whose backward
  then measures the gradient's amaxes in XLA (one more pass over it; a consumer that measures them as it writes
  the gradient, :func:`swiglu_rms_norm_for`, saves that pass). An array comes back as it is."""
  return _measured(y.values, y.maxima) if is_measured(y) else y


# ---------------------------------------------------------------------------------------------
# RMSNorm of the gated activation (BitNet's ffn_sub_norm before the down projection)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _swiglu_rms_norm_quantized(gate_up, maxima, scale, eps: float, how: OperandQuantization, dtype,
                               options: DispatchOptions, activation: str) -> LowBitOperand:
  return _swiglu_rms_norm_quantized_fwd(gate_up, maxima, scale, eps, how, dtype, options, activation)[0]


def _swiglu_rms_norm_quantized_fwd(gate_up, maxima, scale, eps, how, dtype, options, activation):
  # h and the norm's statistic by XLA (its elementwise pass beats recomputing h in the kernels), then the norm's
  # output quantized by the tiled passes.
  h = SwiGLU(activation).reference((gate_up,))
  rstd = RmsNorm(eps, dtype).reference_stat((h, scale))
  operand, _ = _produce((h, scale, rstd), RmsNormApply(dtype), how, dtype, options, (gate_up, scale))
  return operand, (h, gate_up, scale, rstd, maxima)  # maxima: None, or the linear's slot (zeros, [M + 2H])


def _swiglu_rms_norm_quantized_bwd(eps, how, dtype, options, activation, residuals, ct):
  del eps, how, dtype
  h, gate_up, scale, rstd, maxima = residuals
  measure = maxima is not None
  # Without the barrier XLA folds the exact bf16 -> float32 cast into the forward's float32 h and writes that too.
  h = jax.lax.optimization_barrier(h)
  dy = ct.carrier
  row_mean = _norm_row_mean(dy.astype(jnp.float32), h.astype(jnp.float32), scale.astype(jnp.float32), rstd[:, None])
  d_gate_up, dscale, *measured = dispatch.swiglu_norm_grad(dy, h, gate_up, scale, rstd, row_mean[:, 0], activation,
                                                           options, maxima=measure)
  return d_gate_up, jnp.concatenate(measured[0]) if measure else None, dscale.astype(scale.dtype)


_swiglu_rms_norm_quantized.defvjp(_swiglu_rms_norm_quantized_fwd, _swiglu_rms_norm_quantized_bwd)


def swiglu_rms_norm_for(gate_up: jax.Array | MeasuredOutput, scale: jax.Array, eps: float, recipe: Recipe | None,
                        dtype, split: Split | None = None, activation: str = "silu", *,
                        options: ExecutionOptions | None = None) -> jax.Array | LowBitOperand:
  """RMSNorm of ``act(gate) * up`` (``gate_up [..., 2H]``, ``scale [H]``), quantized for the linear that reads it
  when ``recipe`` allows: BitNet's ``ffn_sub_norm`` before the down projection.

  The same numbers as :func:`swiglu` followed by :func:`rms_norm_for`. Where the norm's output is
  quantized on one device's whole rows, its backward and SwiGLU's run as one pass
  (``pallas_kernels.dispatch.swiglu_norm_grad``: ``d gate_up`` and ``d scale`` from the norm's
  output gradient, without writing the norm's input gradient ``[..., H]`` in between).

  ``gate_up`` may be the gate_up linear's :class:`~jaxlowbit.operand.MeasuredOutput` (``[M, 2H]``): the one pass
  then also measures ``d gate_up``'s amaxes for that linear's backward, which quantizes ``d gate_up`` without
  reading it for them first (elsewhere :func:`measured_values` measures them in XLA).

  ``split``: how this device's hidden units are split (tensor parallelism, a row-parallel down
  projection: ``Split(cols=...)``; the norm's mean square spans the devices, so the two producers run
  in turn). ``activation``, ``options``: as for :func:`swiglu_for` and :func:`rms_norm_for`.

  Returns:
    a :class:`LowBitOperand` ``[M, H]`` (``M``: the leading dims' product), or the normed ``[..., H]``
    array of ``dtype`` where nothing is quantized (as :func:`rms_norm_for`).
  """
  check_gate_activation(activation)
  split = split or NO_SPLIT
  how = fused_quantization(recipe, options, split)
  if not is_measured(gate_up) and decode_norm_runs(gate_up, options, recipe, split):
    return _norm_rows((gate_up,), scale, SwiGLU(activation), RmsNorm(eps, jnp.dtype(dtype)),
                      resolve(options).dispatch(), quantize=decode_quantization(recipe, options, _rows(gate_up)))
  if how is None or split.cols:
    h = swiglu(measured_values(gate_up), activation, resolve(options).dispatch())
    return rms_norm_for(h, scale, eps, recipe, dtype, split, options=options)
  gate_up, maxima = (gate_up.values, gate_up.maxima) if is_measured(gate_up) else (gate_up, None)
  scale = vary_over(scale, varying_axes(gate_up))
  return _swiglu_rms_norm_quantized(gate_up.reshape(-1, gate_up.shape[-1]), maxima, scale, eps, how,
                                    jnp.dtype(dtype), resolve(options).dispatch(split), activation)


__all__ = ["add_rms_norm_for", "decode_norm_runs", "decode_quantization", "fused_quantization", "keeps_values",
           "measured_values", "rms_norm", "rms_norm_for", "swiglu", "swiglu_for", "swiglu_rms_norm_for"]
