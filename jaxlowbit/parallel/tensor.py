"""Tensor parallelism over a ``tensor`` mesh axis, with 8-bit activation gathers.

Inside ``jax.shard_map`` with ``n`` devices on the tensor axis (Megatron-style TP with a
token-parallel residual stream, as torchtitan's float8 TP does it):

==========================  ==========================================================================
piece                       what each device holds and does
==========================  ==========================================================================
residual stream, norms,     its ``M / n`` contiguous rows of the flattened ``[B T]`` tokens
embedding, LM head, loss    (:meth:`TensorParallel.local_tokens`); weights not split over ``tensor``
column-parallel linear      ``W [K, N]`` split along N (q, k, v, gate, up: its heads / hidden units);
                            reads the WHOLE sequence: :func:`gather_activation` quantizes its rows as the
                            recipe reads them and all-gathers them 8-bit (one collective)
row-parallel linear         ``W`` split along K (attention output, down); its partial ``[M, N]``
                            is reduce-scattered over the tokens in the compute dtype (:class:`RowParallel`)
==========================  ==========================================================================

Gradients mirror it: the gradient of a gather is a reduce-scatter of ``dx`` in the compute dtype
(the sum of the column-parallel linears' partial ``dx``), and a row-parallel linear gathers its
output gradient ``g`` 8-bit where the recipe quantizes it anyway
(``recipe.gradient_quantization()``), in the compute dtype otherwise. Reductions stay in high
precision.

Scales are those of the whole, unsplit operands (``pallas_kernels.dispatch.DispatchOptions.split``):
an activation quantized on its rows (per token: local; per input feature over all tokens, or one
per tensor: the amax is ``pmax``-ed over ``tensor`` first) and a row-parallel input quantized on
its features (per token over all K: ``pmax``) give the codes the unsplit matrix would get. So a
tensor-parallel step computes what the same tokens compute on one device, up to the order of
floating-point sums (and, for BitNet, the abs-mean weight scale summed over shards).

What travels in one activation gather (per device, ``M / n`` rows of ``K``):

=====================  ======================================  =======================
recipe                 message                                 bytes per element
=====================  ======================================  =======================
FP8 tensorwise         e4m3 rows (one scale: reduced first)    1 (x^T transposed after)
BitNet                 int8 rows + per-token scales            1 (x^T: the rows' codes)
INT8, FP8 rowwise      per-token rows + scales, and x^T per     2 (two quantizations)
                       input feature (pmax-ed column scales)
high precision         the compute dtype                       2 (bf16)
=====================  ======================================  =======================

:func:`jaxlowbit.parallel.apply` hands the model its :class:`TensorParallel` explicitly: a model
that declares an ``execution`` field runs as ``model.clone(execution=...)`` with
``execution.tensor_parallel`` set (``jaxlowbit.ExecutionOptions``), so it reads its device's tokens
and gathers before its column-parallel groups (``train/model.py``); ``apply`` runs the linears the
plan marks :data:`COLUMN` / :data:`ROW` with :class:`ColumnParallel` / :class:`RowParallel`.
Nothing is global: a model sees the context only through that field (:func:`tensor_parallel` reads it).
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxlowbit.execution import ExecutionOptions, resolve
from jaxlowbit.parallel import wire
from jaxlowbit.operand import LowBitOperand, QuantizedMatrix, carrier_like, is_low_bit
from jaxlowbit.recipes import OperandQuantization, Recipe
from jaxlowbit.recipes.base import quantize_operand
from jaxlowbit_numerics.stats import Split


class TensorSplit(enum.Enum):
  """How a parameter is split over the tensor axis (``FsdpPlan`` rules name them per module)."""

  COLUMN = "column"  # a linear's kernel [K, N] along N (and its bias); the linear reads the whole sequence
  ROW = "row"  # a linear's kernel along K; its output is reduce-scattered over the tokens
  FEATURES = "features"  # a parameter's last dim: the features a row-parallel linear reads (a norm before it)


COLUMN, ROW, FEATURES = TensorSplit.COLUMN, TensorSplit.ROW, TensorSplit.FEATURES


def _rows_slice(a: jax.Array, axis_name: str) -> jax.Array:
  """This device's ``[M / n, ...]`` contiguous rows of ``a [M, ...]``."""
  n = lax.axis_size(axis_name)
  if a.shape[0] % n:
    raise ValueError(f"tensor parallelism: {a.shape[0]} token rows do not split over {n} devices on {axis_name!r}; "
                     "make batch x sequence length per data-parallel group a multiple of the tensor size")
  m = a.shape[0] // n
  return lax.dynamic_slice_in_dim(a, lax.axis_index(axis_name) * m, m, axis=0)


# ---------------------------------------------------------------------------------------------
# The activation gather: this device's rows -> the whole sequence, low-bit.


@dataclasses.dataclass(frozen=True)
class _GatherLayout:
  """Static description of one gather (a custom_vjp nondiff argument)."""

  axis_name: str
  how: OperandQuantization | None  # None: the rows travel in their own (high-precision) dtype
  low_bit_input: bool  # the rows arrive quantized (a fused producer's operand)
  options: ExecutionOptions = ExecutionOptions()  # resolved: the backend the rows are quantized on

  @property
  def derived_transposed(self) -> bool:
    """Whether the transposed layout is the gathered rows' codes transposed (so it does not travel):
    BitNet's rows' codes, or one scale per tensor in both layouts (FP8 tensorwise)."""
    how = self.how
    if how.transposed_from_rows:
      return True
    return how.transposed is not None and how.transposed == how.rows and how.rows.per_tensor


def _gather_quantized(rows: QuantizedMatrix | None, transposed: QuantizedMatrix | None, layout: _GatherLayout,
                      carrier: jax.Array) -> LowBitOperand:
  """One all-gather of this device's quantized rows (and x^T where it cannot be derived) -> the whole operand.

  ``carrier``: this device's ``[M / n, K]`` carrier or array (dtype, varying axes of the result's carrier).
  """
  axis, how = layout.axis_name, layout.how
  m, k = carrier.shape
  parts, layouts = [], []
  if rows is not None:
    parts.append(rows.data)
    layouts.append(((m, k), rows.data.dtype))
    if not rows.per_tensor:  # per-token scales differ per device; reduced ones are the same everywhere
      parts.append(rows.scale)
      layouts.append(((m, 1), jnp.float32))
  send_transposed = transposed is not None and not layout.derived_transposed
  if send_transposed:
    parts.append(transposed.data)
    layouts.append(((k, m), transposed.data.dtype))
  messages = lax.all_gather(wire.pack(parts), axis, axis=0, tiled=False)  # [n, L]: the one collective
  n = messages.shape[0]
  unpacked = iter(wire.unpack(messages, layouts))
  whole_rows = whole_t = None
  if rows is not None:
    data = next(unpacked).reshape(n * m, k)
    scale = rows.scale if rows.per_tensor else next(unpacked).reshape(n * m, 1)
    whole_rows = QuantizedMatrix(data, scale, rows.spec)
  if send_transposed:
    data = jnp.transpose(next(unpacked), (1, 0, 2)).reshape(k, n * m)  # [n, K, M/n] -> [K, M]
    whole_t = QuantizedMatrix(data, transposed.scale, transposed.spec)  # per input feature: reduced, the same
  elif transposed is not None:
    # The rows' codes transposed (BitNet: scales per token; FP8 tensorwise: the one scale).
    scale = whole_rows.scale if whole_rows.per_tensor else whole_rows.scale.reshape(1, -1)
    whole_t = QuantizedMatrix(whole_rows.data.T, scale, transposed.spec)
  return LowBitOperand(whole_rows, whole_t, carrier_like((n * m, k), carrier.dtype, carrier))


def _gather_rows(x, layout: _GatherLayout):
  """The forward of :func:`gather` (also the row-parallel backward's gather of ``g``)."""
  if layout.low_bit_input:
    return _gather_quantized(x.rows, x.transposed, layout, x.carrier)
  if layout.how is None:
    return lax.all_gather(x, layout.axis_name, axis=0, tiled=True)
  # Amaxes over tokens reduce over all devices' tokens: the scales of the whole sequence.
  rows, transposed = quantize_operand(x, layout.how, layout.options.dispatch(Split(rows=(layout.axis_name,))))
  return _gather_quantized(rows, transposed, layout, x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather(x, layout: _GatherLayout):
  return _gather_rows(x, layout)


def _gather_fwd(x, layout):
  return _gather_rows(x, layout), None


def _gather_bwd(layout, _, ct):
  # The whole sequence's dx (the column-parallel linears' partial sums, added by autodiff): summed
  # over the devices and scattered back to each device's rows, in the compute dtype.
  dx = ct if layout.how is None and not layout.low_bit_input else ct.carrier
  dx = lax.psum_scatter(dx, layout.axis_name, scatter_dimension=0, tiled=True)
  return (LowBitOperand(None, None, dx) if layout.low_bit_input else dx,)


_gather.defvjp(_gather_fwd, _gather_bwd)


def gather_activation(x, recipe: Recipe | None, axis_name: str, options: ExecutionOptions | None = None):
  """This device's rows ``[M / n, K]`` -> the whole ``[M, K]``, all-gathered over ``axis_name``.

  Args:
    x: this device's rows: a ``[M / n, K]`` array of the compute dtype, or a
      :class:`~jaxlowbit.operand.LowBitOperand` a producer quantized with
      ``Split(rows=(axis_name,))`` (``jaxlowbit.fused.rms_norm_for(..., split=...)``).
    recipe: the recipe of the column-parallel linears that read the result (all of them); None
      (or a recipe that reads x in high precision) gathers the array in its dtype.
    axis_name: the tensor mesh axis.
    options: the backend the rows are quantized on (:class:`jaxlowbit.ExecutionOptions`; None: the defaults).

  Returns:
    A ``[M, K]`` low-bit operand quantized as ``recipe.input_quantization()`` says, with scales
    of the whole matrix, moved in ONE all-gather; or the gathered array. Its gradient (the sum
    of its readers' ``dx``) is reduce-scattered back to ``[M / n, K]`` in the compute dtype.
  """
  how = None if recipe is None else recipe.input_quantization()
  if is_low_bit(x):
    if how is None:
      raise ValueError(f"gather: x arrived quantized but {recipe!r} reads its input in high precision")
    if x.ndim != 2:
      raise ValueError(f"gather: a low-bit x must be [M / n, K], got shape {x.shape}")
  elif x.ndim != 2:
    raise ValueError(f"gather: x must be this device's rows [M / n, K], got shape {x.shape}")
  return _gather(x, _GatherLayout(axis_name, how, is_low_bit(x), resolve(options)))


# ---------------------------------------------------------------------------------------------
# The linears' collectives (jaxlowbit.matmul.Collective).


@dataclasses.dataclass(frozen=True)
class ColumnParallel:
  """A linear whose kernel ``[K, N]`` is split along N over ``axis_name``; it reads the whole sequence.

  Nothing moves: the forward's operands are whole (x gathered, W's columns whole along K).
  The backward's ``g [M, N / n]`` and ``W [K, N / n]`` are split along N, so grad_input's
  per-row scales (per token of g, per input channel of W) and per-tensor ones are reduced over
  the axis (a ``pmax`` of ``[M]`` or ``[K]`` amaxes); the partial ``dx`` reaches :func:`gather_activation`'s
  reduce-scatter through autodiff.
  """

  axis_name: str

  @property
  def forward_split(self) -> None:
    return None

  @property
  def backward_split(self) -> Split:
    return Split(cols=(self.axis_name,))

  def scatter(self, y: jax.Array) -> jax.Array:
    return y

  def gather_gradient(self, g: jax.Array, recipe: Recipe, options: ExecutionOptions) -> jax.Array:
    del recipe, options
    return g

  def local_columns(self, a: jax.Array) -> jax.Array:
    """This device's ``[..., N / n]`` of a per-output-channel ``a [..., N]`` (weight scales)."""
    n = lax.axis_size(self.axis_name)
    width = a.shape[-1] // n
    return lax.dynamic_slice_in_dim(a, lax.axis_index(self.axis_name) * width, width, axis=a.ndim - 1)


@dataclasses.dataclass(frozen=True)
class RowParallel:
  """A linear whose kernel ``[K, N]`` is split along K over ``axis_name``: ``x [M, K / n]`` -> ``[M / n, N]``.

  forward: x is split along K (per-token and per-tensor scales reduced over the axis); the
  partial product ``[M, N]`` is reduce-scattered over the tokens in x's dtype.
  backward: this device's ``g [M / n, N]`` is quantized as ``recipe.gradient_quantization()``
  says (amaxes over tokens reduced over the axis) and all-gathered 8-bit in one collective, or
  gathered in its dtype when the recipe reads g in high precision; then the recipe's backward
  runs on the whole ``[M, N]`` gradient.
  """

  axis_name: str

  @property
  def forward_split(self) -> Split:
    return Split(cols=(self.axis_name,))

  @property
  def backward_split(self) -> None:
    return None

  def scatter(self, y: jax.Array) -> jax.Array:
    return lax.psum_scatter(y, self.axis_name, scatter_dimension=0, tiled=True)

  def gather_gradient(self, g: jax.Array, recipe: Recipe, options: ExecutionOptions):
    return _gather_rows(g, _GatherLayout(self.axis_name, recipe.gradient_quantization(), False, resolve(options)))


# ---------------------------------------------------------------------------------------------
# What a model sees while jaxlowbit.parallel.apply runs it tensor-parallel.


@dataclasses.dataclass(frozen=True)
class TensorParallel:
  """The tensor axis a model runs over (inside ``shard_map``; :func:`tensor_parallel` gives it).

  Attributes:
    axis_name: the tensor mesh axis.
    size: devices on it.
  """

  axis_name: str
  size: int

  @property
  def token_split(self) -> Split:
    """How this device's rows of an activation are split: pass it to producers quantizing them."""
    return Split(rows=(self.axis_name,))

  @property
  def feature_split(self) -> Split:
    """How a row-parallel linear's input ``[M, K / n]`` is split (its norm and quantizer reduce over it)."""
    return Split(cols=(self.axis_name,))

  def local_tokens(self, tokens: jax.Array) -> jax.Array:
    """This device's ``[B T / n, ...]`` rows of ``tokens [B, T, ...]`` (flattened, in order).

    ValueError unless ``B T`` divides by the tensor size.
    """
    return _rows_slice(tokens.reshape(tokens.shape[0] * tokens.shape[1], *tokens.shape[2:]), self.axis_name)

  def gather(self, x, recipe: Recipe | None, options: ExecutionOptions | None = None):
    """:func:`gather_activation` over this axis: this device's rows -> the whole sequence (8-bit where
    ``recipe`` reads it so)."""
    return gather_activation(x, recipe, self.axis_name, options)

  def column(self) -> ColumnParallel:
    return ColumnParallel(self.axis_name)

  def row(self) -> RowParallel:
    return RowParallel(self.axis_name)


def tensor_parallel(execution: ExecutionOptions | None) -> TensorParallel | None:
  """The :class:`TensorParallel` a model's ``execution`` options carry (``jaxlowbit.parallel.apply`` sets
  it on a mesh with a tensor axis), or None. It reads the argument, nothing global: a model takes an
  ``execution`` field and passes it here (``train/model.py``)."""
  return None if execution is None else execution.tensor_parallel


__all__ = [
    "COLUMN",
    "FEATURES",
    "ROW",
    "ColumnParallel",
    "RowParallel",
    "TensorParallel",
    "TensorSplit",
    "gather_activation",
    "tensor_parallel",
]
