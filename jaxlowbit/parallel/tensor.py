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

What travels in one activation gather (per device, ``M / n`` rows of ``K``): the rows the forward
GEMM reads, once, 1 byte per element plus a float32 scale per row. Where the recipe's grad_weight
reads x^T with scales of its own (per input feature: INT8, FP8 rowwise), each device makes it after
the gather from the gathered codes (:data:`REQUANTIZE`, the default): the rows dequantized to the
compute dtype and quantized per column over the whole sequence, one more rounding than the unsplit
step's quantization of x (grad_weight only; the forward and grad_input are unchanged). :data:`SEND`
keeps the unsplit step's numbers exactly by quantizing x^T before the gather and sending it too
(2 bytes per element):

=====================  ========================================  ===================================
recipe                 message                                   bytes per element (REQUANTIZE/SEND)
=====================  ========================================  ===================================
FP8 tensorwise         e4m3 rows (one scale: reduced first)      1 / 1 (x^T: the rows' codes)
BitNet, bf16 grad_wt   int8 rows + per-token scales              1 / 1 (x^T: the rows' codes)
INT8, FP8 rowwise,     per-token rows + scales                   1 / 2 (SEND: and x^T per input
BitNet (int8 grad_wt)                                            feature, column scales pmax-ed)
high precision         the compute dtype                         2 / 2 (bf16)
=====================  ========================================  ===================================

The row-parallel backward's gather of ``g`` travels the same way (INT8's g per output feature for
grad_weight is requantized from the gathered per-token codes under :data:`REQUANTIZE`).

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


@dataclasses.dataclass(frozen=True)
class ColumnGroups:
  """A column-parallel rule for a fused kernel ``[K, N]`` whose output is groups side by side
  (``[q | k | v]``, ``[gate | up]``): ``widths`` of them, summing to N, each split over the devices.

  The kernel is stored as a COLUMN one (contiguous ``N / n`` blocks, the same parameter on every
  mesh); each linear call all-gathers it over the tensor axis and keeps this device's slice of every
  group (:meth:`ColumnParallel.regroup`), so device ``d`` computes ``[q_d | k_d | v_d]`` (its heads)
  or ``[gate_d | up_d]`` (its hidden units, each gate next to its up).
  """

  widths: tuple[int, ...]

  def __post_init__(self):
    if not self.widths or any(w <= 0 for w in self.widths):
      raise ValueError(f"ColumnGroups: widths must be positive, got {self.widths!r}")

# How a gathered operand's transposed copy (x^T for grad_weight) is made where the recipe quantizes
# it with scales of its own (module docstring). REQUANTIZE: after the gather, from the gathered rows'
# codes (1 byte per element crosses the axis); SEND: quantized before the gather and sent with the
# rows (2 bytes per element, the unsplit step's numbers exactly).
REQUANTIZE, SEND = "requantize", "send"
TRANSPOSED_MODES = (REQUANTIZE, SEND)


def check_transposed_mode(mode: str, who: str = "tensor parallelism") -> None:
  if mode not in TRANSPOSED_MODES:
    raise ValueError(f"{who}: transposed={mode!r}; choose one of {TRANSPOSED_MODES} (jaxlowbit.parallel.tensor)")


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
  transposed: str = REQUANTIZE  # how a transposed copy with scales of its own is made (TRANSPOSED_MODES)

  @property
  def derived_transposed(self) -> bool:
    """Whether the transposed layout is the gathered rows' codes transposed (so it does not travel):
    BitNet's rows' codes, or one scale per tensor in both layouts (FP8 tensorwise)."""
    return derives_transposed(self.how)

  @property
  def sends_transposed(self) -> bool:
    """Whether x^T is quantized before the gather and travels beside the rows (SEND)."""
    return self.how.transposed is not None and not self.derived_transposed and self.transposed == SEND

  @property
  def sent(self) -> OperandQuantization:
    """What this device quantizes before the gather: the rows, and x^T only where it travels."""
    return self.how if self.sends_transposed else OperandQuantization(self.how.rows)


def derives_transposed(how: OperandQuantization) -> bool:
  """Whether ``how``'s transposed layout is its rows' codes transposed, so a gather derives it exactly:
  BitNet's (``transposed_from_rows``), or one scale per tensor in both layouts (FP8 tensorwise)."""
  if how.transposed_from_rows:
    return True
  return how.transposed is not None and how.transposed == how.rows and how.rows.per_tensor


def sent_quantization(how: OperandQuantization | None, transposed: str = REQUANTIZE) -> OperandQuantization | None:
  """What the producer of a gathered activation quantizes (``how``: what its readers read): the rows
  alone, unless ``transposed`` is :data:`SEND` and x^T has scales of its own (then ``how``)."""
  if how is None or (transposed == SEND and how.transposed is not None and not derives_transposed(how)):
    return how
  return OperandQuantization(how.rows)


def _gather_quantized(rows: QuantizedMatrix, transposed: QuantizedMatrix | None, layout: _GatherLayout,
                      carrier: jax.Array) -> LowBitOperand:
  """One all-gather of this device's quantized rows (and x^T under SEND) -> the whole operand.

  ``carrier``: this device's ``[M / n, K]`` carrier or array (dtype, varying axes of the result's carrier).
  ``transposed``: this device's x^T ``[K, M / n]``, read only where it travels (``layout.sends_transposed``).
  """
  axis, how = layout.axis_name, layout.how
  m, k = carrier.shape
  parts, layouts = [rows.data], [((m, k), rows.data.dtype)]
  if not rows.per_tensor:  # per-token scales differ per device; reduced ones are the same everywhere
    parts.append(rows.scale)
    layouts.append(((m, 1), jnp.float32))
  if layout.sends_transposed:
    if transposed is None:
      raise ValueError(f"gather: transposed={SEND!r} but the rows arrived without their x^T; quantize them with "
                       "sent_quantization(how, SEND)")
    parts.append(transposed.data)
    layouts.append(((k, m), transposed.data.dtype))
  messages = lax.all_gather(wire.pack(parts), axis, axis=0, tiled=False)  # [n, L]: the one collective
  n = messages.shape[0]
  unpacked = iter(wire.unpack(messages, layouts))
  data = next(unpacked).reshape(n * m, k)
  scale = rows.scale if rows.per_tensor else next(unpacked).reshape(n * m, 1)
  whole_rows = QuantizedMatrix(data, scale, rows.spec)
  whole_t = None
  if layout.sends_transposed:
    data = jnp.transpose(next(unpacked), (1, 0, 2)).reshape(k, n * m)  # [n, K, M/n] -> [K, M]
    whole_t = QuantizedMatrix(data, transposed.scale, transposed.spec)  # per input feature: reduced, the same
  elif layout.derived_transposed:
    # The rows' codes transposed (BitNet: scales per token; FP8 tensorwise: the one scale).
    t_scale = whole_rows.scale if whole_rows.per_tensor else whole_rows.scale.reshape(1, -1)
    whole_t = QuantizedMatrix(whole_rows.data.T, t_scale, how.transposed or how.rows)
  elif how.transposed is not None:
    # REQUANTIZE: x^T per input feature over the whole sequence, from the gathered codes (all local now).
    values = whole_rows.dequantize(carrier.dtype)
    _, whole_t = quantize_operand(values, OperandQuantization(None, how.transposed), layout.options.dispatch())
  return LowBitOperand(whole_rows, whole_t, carrier_like((n * m, k), carrier.dtype, carrier))


def _gather_rows(x, layout: _GatherLayout):
  """The forward of :func:`gather` (also the row-parallel backward's gather of ``g``)."""
  if layout.low_bit_input:
    return _gather_quantized(x.rows, x.transposed, layout, x.carrier)
  if layout.how is None:
    return lax.all_gather(x, layout.axis_name, axis=0, tiled=True)
  # Amaxes over tokens reduce over all devices' tokens: the scales of the whole sequence.
  rows, transposed = quantize_operand(x, layout.sent, layout.options.dispatch(Split(rows=(layout.axis_name,))))
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


def gather_activation(x, recipe: Recipe | None, axis_name: str, options: ExecutionOptions | None = None,
                      transposed: str = REQUANTIZE):
  """This device's rows ``[M / n, K]`` -> the whole ``[M, K]``, all-gathered over ``axis_name``.

  Args:
    x: this device's rows: a ``[M / n, K]`` array of the compute dtype, or a
      :class:`~jaxlowbit.operand.LowBitOperand` a producer quantized with
      ``Split(rows=(axis_name,))`` (``jaxlowbit.fused.rms_norm_for(..., split=...)``).
    recipe: the recipe of the column-parallel linears that read the result (all of them); None
      (or a recipe that reads x in high precision) gathers the array in its dtype.
    axis_name: the tensor mesh axis.
    options: the backend the rows are quantized on (:class:`jaxlowbit.ExecutionOptions`; None: the defaults).
    transposed: how x^T is made where it has scales of its own (:data:`REQUANTIZE`: from the gathered
      codes; :data:`SEND`: quantized here and sent too). A low-bit x must carry what
      :func:`sent_quantization` says for it (x^T only under SEND).

  Returns:
    A ``[M, K]`` low-bit operand quantized as ``recipe.input_quantization()`` says, with scales
    of the whole matrix (x^T: as ``transposed`` says), moved in ONE all-gather; or the gathered
    array. Its gradient (the sum of its readers' ``dx``) is reduce-scattered back to ``[M / n, K]``
    in the compute dtype.
  """
  check_transposed_mode(transposed, "gather")
  how = None if recipe is None else recipe.input_quantization()
  if is_low_bit(x):
    if how is None:
      raise ValueError(f"gather: x arrived quantized but {recipe!r} reads its input in high precision")
    if x.ndim != 2:
      raise ValueError(f"gather: a low-bit x must be [M / n, K], got shape {x.shape}")
  elif x.ndim != 2:
    raise ValueError(f"gather: x must be this device's rows [M / n, K], got shape {x.shape}")
  return _gather(x, _GatherLayout(axis_name, how, is_low_bit(x), resolve(options), transposed))


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
  groups: tuple[int, ...] = ()  # a fused kernel's output groups (ColumnGroups.widths); () one group

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
    """This device's ``[..., N / n]`` of a per-output-channel ``a [..., N]`` (weight scales): its
    slice of every output group, in group order."""
    n, index = lax.axis_size(self.axis_name), lax.axis_index(self.axis_name)
    parts, offset = [], 0
    for group in self.groups or (a.shape[-1],):
      width = group // n
      parts.append(lax.dynamic_slice_in_dim(a, offset + index * width, width, axis=a.ndim - 1))
      offset += group
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)

  def regroup(self, a: jax.Array, travel_dtype=None, grad_reduce_dtype=None) -> jax.Array:
    """A grouped kernel's stored ``[..., N / n]`` block (or bias) -> this device's slice of every group.

    One all-gather over the axis, in ``travel_dtype`` (None: ``a``'s; a high-precision kernel's compute dtype,
    since the linear casts it to that anyway), then :meth:`local_columns`; the result is in ``a``'s dtype. The
    gradient is reduce-scattered in ``grad_reduce_dtype`` (None: ``a``'s dtype): each of its elements is one
    device's value plus zeros, since every column belongs to one device's groups. A no-op without groups.
    """
    from jaxlowbit.parallel.fsdp.gather import gather_param  # noqa: PLC0415 (the fsdp package imports this module)

    if not self.groups:
      return a
    if sum(self.groups) != a.shape[-1] * lax.axis_size(self.axis_name):
      raise ValueError(f"ColumnParallel: groups {self.groups} do not add up to the kernel's "
                       f"{a.shape[-1]} x {lax.axis_size(self.axis_name)} output columns")
    gathered = gather_param(a, self.axis_name, a.ndim - 1, grad_reduce_dtype or a.dtype, travel_dtype)
    return self.local_columns(gathered)


@dataclasses.dataclass(frozen=True)
class RowParallel:
  """A linear whose kernel ``[K, N]`` is split along K over ``axis_name``: ``x [M, K / n]`` -> ``[M / n, N]``.

  forward: x is split along K (per-token and per-tensor scales reduced over the axis); the
  partial product ``[M, N]`` is reduce-scattered over the tokens in x's dtype.
  backward: this device's ``g [M / n, N]`` is quantized as ``recipe.gradient_quantization()``
  says (amaxes over tokens reduced over the axis) and all-gathered 8-bit in one collective, or
  gathered in its dtype when the recipe reads g in high precision; then the recipe's backward
  runs on the whole ``[M, N]`` gradient. ``transposed``: how g's per-output-feature copy for
  grad_weight is made where it has scales of its own (:data:`TRANSPOSED_MODES`).
  """

  axis_name: str
  transposed: str = REQUANTIZE

  @property
  def forward_split(self) -> Split:
    return Split(cols=(self.axis_name,))

  @property
  def backward_split(self) -> None:
    return None

  def scatter(self, y: jax.Array) -> jax.Array:
    return lax.psum_scatter(y, self.axis_name, scatter_dimension=0, tiled=True)

  def gather_gradient(self, g: jax.Array, recipe: Recipe, options: ExecutionOptions):
    layout = _GatherLayout(self.axis_name, recipe.gradient_quantization(), False, resolve(options), self.transposed)
    return _gather_rows(g, layout)


# ---------------------------------------------------------------------------------------------
# What a model sees while jaxlowbit.parallel.apply runs it tensor-parallel.


@dataclasses.dataclass(frozen=True)
class TensorParallel:
  """The tensor axis a model runs over (inside ``shard_map``; :func:`tensor_parallel` gives it).

  Attributes:
    axis_name: the tensor mesh axis.
    size: devices on it.
    transposed: how a gathered operand's transposed copy with scales of its own is made:
      :data:`REQUANTIZE` (default; 1 byte per element crosses the axis) or :data:`SEND` (2 bytes, the
      unsplit step's numbers exactly); module docstring.
  """

  axis_name: str
  size: int
  transposed: str = REQUANTIZE

  def __post_init__(self):
    check_transposed_mode(self.transposed, "TensorParallel")

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
    return gather_activation(x, recipe, self.axis_name, options, self.transposed)

  def sent_quantization(self, how: OperandQuantization | None) -> OperandQuantization | None:
    """What a producer of this device's rows quantizes for a gather whose readers read ``how``
    (:func:`sent_quantization`): the rows, and x^T only where it travels."""
    return sent_quantization(how, self.transposed)

  def column(self, groups: tuple[int, ...] = ()) -> ColumnParallel:
    return ColumnParallel(self.axis_name, tuple(groups))

  def row(self) -> RowParallel:
    return RowParallel(self.axis_name, self.transposed)


def tensor_parallel(execution: ExecutionOptions | None) -> TensorParallel | None:
  """The :class:`TensorParallel` a model's ``execution`` options carry (``jaxlowbit.parallel.apply`` sets
  it on a mesh with a tensor axis), or None. It reads the argument, nothing global: a model takes an
  ``execution`` field and passes it here (``train/model.py``)."""
  return None if execution is None else execution.tensor_parallel


__all__ = [
    "COLUMN",
    "FEATURES",
    "ColumnGroups",
    "ROW",
    "ColumnParallel",
    "RowParallel",
    "TensorParallel",
    "REQUANTIZE",
    "SEND",
    "TRANSPOSED_MODES",
    "TensorSplit",
    "derives_transposed",
    "gather_activation",
    "check_transposed_mode",
    "sent_quantization",
    "tensor_parallel",
]
