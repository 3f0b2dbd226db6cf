"""Quantization kernels (Pallas, Triton backend), optionally fused with the op that makes their input.

Each kernel quantizes the values of a *prologue* applied to its inputs, so that fused ops never
write their high-precision output:

- :class:`Identity`: ``x [R, C]`` itself;
- :class:`RmsNorm`: ``x [R, C]``, ``gamma [C]`` -> ``round(x * (rsqrt(mean(x^2) + eps) * gamma))``,
  as ``flax.linen.RMSNorm`` computes it (float32 statistics, rounded to the compute dtype);
  :class:`RmsNormApply` the same with ``rstd [R]`` given;
- :class:`SwiGLU`: ``gate_up [R, 2H]`` -> ``round(act(gate) * up)`` ``[R, H]``, ``act`` silu (SwiGLU)
  or squared ReLU (``activation="relu2"``, BitNet b1.58 2B4T's MLP).

:class:`SwiGLUGrad` (``dh [R, H]``, ``gate_up [R, 2H]`` -> SwiGLU's ``d gate_up [R, 2H]``) is
not quantized: the values kernel writes it.

Kernels:

- the *rows* kernel: each program owns ``block_rows`` rows; a statistics sweep (the norm's
  sum of squares), an abs-max sweep (and, on request, per-column partial maxima of those rows)
  and a write sweep (the per-row quantization), re-reading the rows from L2 between sweeps.
  It can also only measure (per-tensor scales need every row's amax before any write).
- the *tile* kernel: ``TILE x TILE`` tiles, written transposed (``[C, R]``: the layout
  grad_weight's GEMM wants) with per-column scales, or with the rows' own scales (BitNet
  reuses its exact int8 activations), and, for per-tensor and tiled per-column scales, the rows
  layout too;
- the *stats* kernel: every tile's row and column maxima (the scales of a rows + transposed
  request without the rows kernel's per-program partials);
- the *values* kernel: :class:`SwiGLUGrad` written in ``gate_up``'s dtype (SwiGLU's backward as
  one pass where XLA would concatenate its halves in a second one), or :class:`SwiGLUNormGrad` (the
  backward of an RMSNorm after the gated activation, BitNet's ``ffn_sub_norm``, and SwiGLU's, in one pass).

BitNet's ternary weights (``spec.ternary``) take the tile kernel alone: their one scale is the weight's abs-mean,
which XLA reduces (:func:`jaxlowbit_numerics.ternary.absmean_scale`, the reference's own arithmetic), and one tiled
pass writes ``clip(round(w * (1 / scale)), -1, 1)`` transposed (and, on request, in the rows layout).

Public entry points: :func:`quantize_rows_kernel`, :func:`quantize_cols_t_kernel`,
:func:`quantize_rows_and_cols_t_kernel` (identity prologue), :func:`fused_quantize_kernel`
(any prologue, any of the layouts) and :func:`prologue_kernel` (the values).
:func:`fused_quantize_reference` is the XLA definition of :func:`fused_quantize_kernel`: the
prologue in jnp, then the references of ``pallas_kernels.reference``.

Numerics are exactly those of the reference up to float rounding: int8 codes are ``round(x * (1 /
scale))``, as XLA computes the reference's ``round(x / scale)`` (:func:`encode`), but a prologue's values
may differ in the last bit (the norm's sum of squares is added in another order, so its rsqrt may
differ), which can move a rounded value by one step. The Triton
lowering has no round-half-even: on the GPU it is PTX's ``cvt.rni`` (one instruction), in interpret
mode :func:`_round_half_even` builds it from floor (exactly).
NaN or inf in a row (column) makes its amax inf, as in the reference (``stats.absmax``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxlowbit_numerics import fp8, int8, ternary
from jaxlowbit_numerics.formats import QuantSpec
from jaxlowbit_numerics.stats import NO_SPLIT, Split, absmax
from pallas_kernels import policy, tuning
from pallas_kernels.reference import quantize_cols_t_reference, quantize_rows_reference
from pallas_kernels.vma import out_struct



# ---------------------------------------------------------------------------------------------
# Prologues: the values a kernel quantizes, one [rows, cols] block of the output at a time.


def round_to(y: jax.Array, dtype) -> jax.Array:
  """``y`` rounded to ``dtype``, also where XLA would otherwise keep it in float32.

  XLA may drop a float32 -> bfloat16 -> float32 round trip inside a fusion (it allows excess
  precision by default), which would quantize other values than the kernels (and an unfused
  model, whose op writes its rounded output) do. ``reduce_precision`` is never dropped.
  """
  info = jnp.finfo(dtype)
  if info.bits < 32:
    y = lax.reduce_precision(y, exponent_bits=info.nexp, mantissa_bits=info.nmant)
  return y.astype(dtype)


def to_compute_dtype(x: jax.Array, dtype) -> jax.Array:
  """A layer's input ``x`` in its compute ``dtype``: unchanged when it already is, else :func:`round_to`.

  Every linear casts its input through this (``jaxlowbit.layers.dense_general``, the NNX layers), so a
  float32 input to a bfloat16 layer is quantized from the same rounded values whether XLA fuses the cast
  into its quantizer or a kernel reads the cast operand.
  """
  return x if x.dtype == jnp.dtype(dtype) else round_to(x, dtype)


@dataclasses.dataclass(frozen=True)
class Identity:
  """The input itself: ``x [R, C]``."""

  stats = False

  def width(self, inputs) -> int:
    return inputs[0].shape[1]

  def values(self, refs, rows, cols, stat):
    del stat
    return refs[0][rows, cols].astype(jnp.float32)

  def reference(self, inputs) -> jax.Array:
    return inputs[0]


def normed(x: jax.Array, rstd: jax.Array, gamma: jax.Array, dtype) -> jax.Array:
  """An RMSNorm's output block ``x * (rstd * gamma)`` in float32 (``x [rows, cols]`` float32, ``rstd [rows]``,
  ``gamma [cols]``), rounded to ``dtype`` and read back as float32: the one formula of every norm kernel."""
  return (x * (rstd[:, None] * gamma.astype(jnp.float32)[None, :])).astype(dtype).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class RmsNorm:
  """``x [R, C]``, ``gamma [C]`` -> ``x * (rsqrt(mean(x^2) + eps) * gamma)`` rounded to ``dtype``.

  The row statistic the kernels carry is ``rstd = rsqrt(mean(x^2) + eps)`` (float32, ``[R]``).
  """

  eps: float
  dtype: jnp.dtype

  stats = True

  def width(self, inputs) -> int:
    return inputs[0].shape[1]

  def partial_stat(self, refs, rows, cols):
    x = refs[0][rows, cols].astype(jnp.float32)
    return jnp.sum(x * x, axis=1)

  def finish_stat(self, total, width: int):
    return lax.rsqrt(total / width + self.eps)

  def values(self, refs, rows, cols, rstd):
    return normed(refs[0][rows, cols].astype(jnp.float32), rstd, refs[1][cols], self.dtype)

  def reference(self, inputs) -> jax.Array:
    x, gamma = inputs
    x = x.astype(jnp.float32)
    rstd = lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return round_to(x * (rstd * gamma.astype(jnp.float32)), self.dtype)

  def reference_stat(self, inputs) -> jax.Array:
    x = inputs[0].astype(jnp.float32)
    return lax.rsqrt(jnp.mean(x * x, axis=-1) + self.eps)


@dataclasses.dataclass(frozen=True)
class RmsNormApply:
  """``x [R, C]``, ``gamma [C]``, ``rstd [R]`` -> ``x * (rstd * gamma)`` rounded to ``dtype``: an RMSNorm whose
  statistic was computed before (by XLA, in the pass that wrote ``x``), so its quantization takes the tiled
  passes with no rows kernel in front. The same values as :class:`RmsNorm` given the same ``rstd``.
  """

  dtype: jnp.dtype

  stats = False

  def width(self, inputs) -> int:
    return inputs[0].shape[1]

  def values(self, refs, rows, cols, stat):
    del stat
    return normed(refs[0][rows, cols].astype(jnp.float32), refs[2][rows].astype(jnp.float32), refs[1][cols],
                  self.dtype)

  def reference(self, inputs) -> jax.Array:
    x, gamma, rstd = inputs
    return round_to(x.astype(jnp.float32) * (rstd[:, None] * gamma.astype(jnp.float32)), self.dtype)


# The gate activations of a gated MLP ``act(gate) * up`` (ModelConfig.mlp_activation): silu (SwiGLU)
# and squared ReLU ``max(gate, 0)^2`` (BitNet b1.58 2B4T; Hugging Face ``hidden_act="relu2"``).
GATE_ACTIVATIONS = ("silu", "relu2")


def check_gate_activation(activation: str) -> None:
  if activation not in GATE_ACTIVATIONS:
    raise ValueError(f"gate activation {activation!r} is not known; choose one of {GATE_ACTIVATIONS}")


def gate_activation(gate: jax.Array, activation: str) -> jax.Array:
  """``act(gate)`` of a float32 block (the kernels' and the references' one definition)."""
  if activation == "relu2":
    relu = jnp.maximum(gate, 0.0)
    return relu * relu
  return gate / (1.0 + jnp.exp(-gate))


def gated_epilogue(gate: jax.Array, up: jax.Array, activation: str) -> jax.Array:
  """``act(gate) * up`` in float32 of two same-shaped blocks, rounded to their dtype: a kernel's gated output from
  its gate and up columns, each already rounded to the output dtype as a ``[gate | up]`` output would hold them."""
  return (gate_activation(gate.astype(jnp.float32), activation) * up.astype(jnp.float32)).astype(gate.dtype)


def gated_fits(n: int, block_n: int, split_k: int) -> bool:
  """Whether a GEMV tiling of ``n`` outputs in programs of ``block_n`` columns can write the gated output instead: K
  unsplit, and each half of N a whole number of half-blocks (a program then sums ``block_n / 2`` gate columns and
  their up columns, :func:`gated_tiling`)."""
  half_block = block_n // 2
  return split_k == 1 and half_block > 0 and n % 2 == 0 and (n // 2) % half_block == 0


def gated_tiling(n: int, config, gated: str | None):
  """``(output width, config)`` of a GEMV of ``n`` outputs tiled by ``config`` (a dataclass with ``block_n``):
  ``(n, config)``, or with ``gated`` ``N / 2`` outputs in programs of ``block_n / 2`` columns of each half, which
  stream as many weight rows as a program without."""
  if gated is None:
    return n, config
  return n // 2, dataclasses.replace(config, block_n=config.block_n // 2)


def gated_rows(cols, i_n, block_n: int, half: int, gated: str | None) -> tuple:
  """Inside a GEMV program ``i_n``: the weight rows it sums, its output columns ``cols``, or with ``gated`` those
  gate columns and their up columns ``half`` further on (:func:`gated_tiling`'s ``block_n`` and width)."""
  if gated is None:
    return (cols,)
  return cols, pl.ds(pl.multiple_of(half + i_n * block_n, block_n), block_n)


@dataclasses.dataclass(frozen=True)
class SwiGLU:
  """``gate_up [R, 2H]`` (``[gate | up]``) -> ``act(gate) * up`` in float32, rounded to its dtype: ``[R, H]``.

  ``activation``: a name of :data:`GATE_ACTIVATIONS` (``"silu"``: SwiGLU; ``"relu2"``: squared ReLU).
  """

  activation: str = "silu"

  stats = False

  def __post_init__(self):
    check_gate_activation(self.activation)

  def width(self, inputs) -> int:
    return inputs[0].shape[1] // 2

  def values(self, refs, rows, cols, stat):
    del stat
    ref = refs[0]
    h = ref.shape[1] // 2
    return gated_epilogue(ref[rows, cols], ref[rows, pl.ds(cols.start + h, cols.size)],
                          self.activation).astype(jnp.float32)

  def reference(self, inputs) -> jax.Array:
    gate, up = jnp.split(inputs[0].astype(jnp.float32), 2, axis=-1)
    return round_to(gate_activation(gate, self.activation) * up, inputs[0].dtype)


@dataclasses.dataclass(frozen=True)
class SwiGLUGrad:
  """``dh [R, H]``, ``gate_up [R, 2H]`` -> ``d gate_up [R, 2H]`` of ``h = act(gate) * up``, in float32
  rounded to ``gate_up``'s dtype. silu: ``[dh * up * s * (1 + gate * (1 - s)) | dh * gate * s]`` with
  ``s = sigmoid(gate)``; relu2: ``[dh * up * 2 relu(gate) | dh * relu(gate)^2]``. A block of columns
  must lie within one half (``H`` divisible by it).

  The values kernel runs one program per block of ``H``'s columns and writes both halves' blocks
  (:meth:`write`): each input element is read once.
  """

  activation: str = "silu"

  stats = False

  def __post_init__(self):
    check_gate_activation(self.activation)

  def width(self, inputs) -> int:
    return inputs[1].shape[1]

  def value_columns(self, inputs) -> int:
    """Columns of the values kernel's grid: one program writes a block of each half."""
    return inputs[0].shape[1]

  def halves(self, dh, gate, up):
    """(d gate, d up) in float32 from float32 blocks of ``dh``, ``gate``, ``up``."""
    if self.activation == "relu2":
      relu = jnp.maximum(gate, 0.0)
      return dh * up * (2.0 * relu), dh * (relu * relu)
    sig = 1.0 / (1.0 + jnp.exp(-gate))
    return dh * up * sig * (1.0 + gate * (1.0 - sig)), dh * gate * sig

  @staticmethod
  def _load(refs, rows, cols):
    dh_ref, gate_up_ref = refs[0], refs[1]
    h = dh_ref.shape[1]
    return (dh_ref[rows, cols].astype(jnp.float32), gate_up_ref[rows, cols].astype(jnp.float32),
            gate_up_ref[rows, pl.ds(cols.start + h, cols.size)].astype(jnp.float32))

  def write(self, refs, out_refs, rows, cols):
    """Writes ``out[rows, cols]`` and ``out[rows, cols + H]`` for ``cols`` within ``[0, H)``."""
    (out_ref,) = out_refs
    d_gate, d_up = self.halves(*self._load(refs, rows, cols))
    out_ref[rows, cols] = d_gate.astype(out_ref.dtype)
    out_ref[rows, pl.ds(cols.start + refs[0].shape[1], cols.size)] = d_up.astype(out_ref.dtype)

  def reference(self, inputs) -> jax.Array:
    dh, gate_up = inputs
    gate, up = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
    return round_to(jnp.concatenate(self.halves(dh.astype(jnp.float32), gate, up), axis=-1), gate_up.dtype)

  def outputs(self, inputs, tile: tuple[int, int]) -> tuple[tuple[tuple[int, ...], jnp.dtype], ...]:
    """(shape, dtype) of each array the values kernel writes: ``d gate_up [R, 2H]``."""
    del tile
    return (((inputs[1].shape[0], self.width(inputs)), inputs[1].dtype),)


def rms_norm_input_grad(dy, x, gamma, rstd, row_mean):
  """``dx`` (float32) of ``y = x * rstd * gamma`` (an RMSNorm with ``rstd = rsqrt(mean(x^2) + eps)``).

  ``dy``, ``x`` ``[.., C]``, ``gamma`` ``[C]``, ``rstd`` and ``row_mean`` ``[.., 1]``, all float32, where
  ``row_mean = mean(dy * gamma * x * rstd)`` over the row's C features: ``d(x rstd)/dx = rstd (I - n n^T / C)``
  with ``n = x rstd``. The one definition of the norm's input gradient (``jaxlowbit.fused`` and the kernels).
  """
  return rstd * (dy * gamma - (x * rstd) * row_mean)


@dataclasses.dataclass(frozen=True)
class SwiGLUNormGrad:
  """The backward of ``RMSNorm(act(gate) * up)`` (BitNet's ``ffn_sub_norm`` after the gated activation) in one pass.

  Inputs: ``dy [R, H]`` (the norm's output gradient), ``h [R, H]`` (``act(gate) * up`` as the forward
  rounded it), ``gate_up [R, 2H]``, ``gamma [H]``, ``rstd [R]`` and ``row_mean [R]`` (float32:
  ``mean(dy * gamma * h * rstd)`` over each row, :func:`rms_norm_input_grad`). Outputs: ``d gate_up
  [R, 2H]`` in ``gate_up``'s dtype (the norm's ``dh`` rounded to ``h``'s dtype, as the unfused norm
  writes it, then :class:`SwiGLUGrad`), and per-tile partial sums of ``d gamma`` ``[R / tile rows, H]``
  float32 (their sum over the first axis is ``d gamma``). XLA wrote the norm's ``dh`` in a separate pass
  with a column reduction for ``d gamma`` (~10 ms of the 1B BitNet step on an H100), which the SwiGLU
  backward then read again.

  With ``maxima``, also the per-tile amaxes of ``d gate_up`` as written (``|v|`` float32, NaN as inf):
  row partials ``[H / tile columns, R]`` and column partials ``[R / tile rows, 2H]`` (their max over the
  first axis: the row amaxes ``[R]`` and column amaxes ``[2H]``), so that the gate_up linear's
  backward quantizes ``d gate_up`` without reading it once more for them
  (:class:`jaxlowbit.operand.MeasuredOutput`).
  """

  activation: str = "silu"
  maxima: bool = False

  stats = False

  def __post_init__(self):
    check_gate_activation(self.activation)

  def width(self, inputs) -> int:
    return inputs[2].shape[1]

  def value_columns(self, inputs) -> int:
    return inputs[0].shape[1]

  @staticmethod
  def _dh(dy, h, gamma, rstd, row_mean, dtype, rounding=lambda y, dtype: y.astype(dtype)):
    """The norm's input gradient rounded to ``h``'s dtype (as the unfused norm writes it), back in float32.
    ``rounding``: a cast in the kernel; :func:`round_to` in XLA, which may drop a bare cast's round trip."""
    return rounding(rms_norm_input_grad(dy, h, gamma, rstd, row_mean), dtype).astype(jnp.float32)

  def write(self, refs, out_refs, rows, cols):
    dy_ref, h_ref, gate_up_ref, gamma_ref, rstd_ref, mean_ref = refs
    out_ref, dgamma_ref = out_refs[:2]
    half = dy_ref.shape[1]
    dy, h = dy_ref[rows, cols].astype(jnp.float32), h_ref[rows, cols].astype(jnp.float32)
    rstd, row_mean = rstd_ref[rows][:, None], mean_ref[rows][:, None]
    gamma = gamma_ref[cols].astype(jnp.float32)[None, :]
    dh = self._dh(dy, h, gamma, rstd, row_mean, h_ref.dtype)
    gate = gate_up_ref[rows, cols].astype(jnp.float32)
    up = gate_up_ref[rows, pl.ds(cols.start + half, cols.size)].astype(jnp.float32)
    d_gate, d_up = SwiGLUGrad(self.activation).halves(dh, gate, up)
    d_gate, d_up = d_gate.astype(out_ref.dtype), d_up.astype(out_ref.dtype)
    out_ref[rows, cols] = d_gate
    out_ref[rows, pl.ds(cols.start + half, cols.size)] = d_up
    i, j = pl.program_id(0), pl.program_id(1)
    dgamma_ref[pl.ds(i, 1), cols] = jnp.sum(dy * (h * rstd), axis=0)[None, :]
    if self.maxima:
      rowmax_ref, colmax_ref = out_refs[2:]
      gate_mags, up_mags = magnitude(d_gate.astype(jnp.float32)), magnitude(d_up.astype(jnp.float32))
      rowmax_ref[pl.ds(j, 1), rows] = jnp.maximum(jnp.max(gate_mags, axis=1), jnp.max(up_mags, axis=1))[None, :]
      colmax_ref[pl.ds(i, 1), cols] = jnp.max(gate_mags, axis=0)[None, :]
      colmax_ref[pl.ds(i, 1), pl.ds(cols.start + half, cols.size)] = jnp.max(up_mags, axis=0)[None, :]

  def reference(self, inputs) -> tuple[jax.Array, ...]:
    """``(d gate_up [R, 2H], d gamma [1, H])`` in XLA (d gamma as one partial sum), and with ``maxima`` the amaxes
    ``[1, R]`` and ``[1, 2H]`` (one partial each)."""
    dy, h, gate_up, gamma, rstd, row_mean = inputs
    dy, h32 = dy.astype(jnp.float32), h.astype(jnp.float32)
    dh = self._dh(dy, h32, gamma.astype(jnp.float32), rstd[:, None], row_mean[:, None], h.dtype, round_to)
    dgamma = jnp.sum(dy * (h32 * rstd[:, None]), axis=0, keepdims=True)
    d_gate_up = SwiGLUGrad(self.activation).reference((dh, gate_up))
    if not self.maxima:
      return d_gate_up, dgamma
    rowmax, colmax = amaxes(d_gate_up)
    return d_gate_up, dgamma, rowmax[None, :], colmax[None, :]

  def outputs(self, inputs, tile: tuple[int, int]) -> tuple[tuple[tuple[int, ...], jnp.dtype], ...]:
    r, half = inputs[0].shape
    f32 = jnp.dtype(jnp.float32)
    outs = (((r, self.width(inputs)), inputs[2].dtype), ((r // tile[0], half), f32))
    if self.maxima:
      outs += (((half // tile[1], r), f32), ((r // tile[0], self.width(inputs)), f32))
    return outs


Prologue = Identity | RmsNorm | RmsNormApply | SwiGLU


# ---------------------------------------------------------------------------------------------
# Quantization arithmetic shared by the kernels.


def check_row_int8(spec: QuantSpec, who: str, name: str = "spec") -> None:
  """ValueError unless ``spec`` quantizes rows to int8, one scale per row (what a GEMV's activations take)."""
  if not spec.is_int8 or spec.per_tensor or spec.ternary:
    raise ValueError(f"{who}: {name} must quantize rows to int8, got {spec}")


def _col_chunk(c: int, chunk: int) -> int:
  while c % chunk:
    chunk //= 2
  return chunk


def code_scales(amax: jax.Array, spec: QuantSpec) -> tuple[jax.Array, jax.Array]:
  """(what ``encode`` takes, dequantization scale) for an amax, as float32.

  int8 takes its dequantization scale (:func:`encode` multiplies by its reciprocal, as XLA computes the
  reference's division) and FP8 its multiplier, as the reference does; folding either into the other form
  would round differently.
  """
  if spec.is_int8:
    scale = int8.int8_scale(amax, spec.eps)
    return scale, scale
  mult = fp8.fp8_scale(amax, spec.jnp_dtype, spec.power_of_two)
  return mult, 1.0 / mult


def _round_half_even(y: jax.Array) -> jax.Array:
  low = jnp.floor(y)
  frac = y - low
  low_is_odd = (low - 2.0 * jnp.floor(low * 0.5)) != 0.0
  return low + jnp.where((frac > 0.5) | ((frac == 0.5) & low_is_odd), 1.0, 0.0)


def _ptx_f32(instruction: str, *args: jax.Array) -> jax.Array:
  """One float32 PTX instruction ``instruction $0, $1[, $2]`` per element of the (broadcast) args."""
  shape = jnp.broadcast_shapes(*(jnp.shape(a) for a in args))
  args = [jnp.broadcast_to(jnp.asarray(a, jnp.float32), shape) for a in args]
  operands = ", ".join(f"${i + 1}" for i in range(len(args)))
  return plt.elementwise_inline_asm(f"{instruction} $0, {operands};", args=args,
                                    constraints=",".join(["=r"] + ["r"] * len(args)), pack=1,
                                    result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])[0]


def _rint(y: jax.Array, native: bool) -> jax.Array:
  """``y`` (float32) rounded half to even: one PTX ``cvt.rni`` on the GPU (the floor-based form costs
  ~8 ALU operations per element, which made the int8 quantizers slower than the FP8 ones), the
  floor-based :func:`_round_half_even` in interpret mode. Both are exact."""
  if not native:
    return _round_half_even(y)
  return _ptx_f32("cvt.rni.f32.f32", y)


def _divide_by_scale(x: jax.Array, scale: jax.Array, native: bool) -> jax.Array:
  """``x / scale`` in the form ``policy.INT8_DIVISION`` names (float32; on the GPU the PTX forms, in interpret mode
  XLA's division, which is the reference's)."""
  form = policy.INT8_DIVISION
  if form not in policy.INT8_DIVISIONS:
    raise ValueError(f"policy.INT8_DIVISION must be one of {policy.INT8_DIVISIONS}, got {form!r}")
  if form == "reciprocal" or not native:
    return x * (1.0 / scale)
  if jnp.ndim(scale) == 0:  # a program's one scale: a [1, ...] block for the inline PTX
    scale = jnp.reshape(scale, (1,) * jnp.ndim(x))
  if form == "rcp_rn":
    return x * _ptx_f32("rcp.rn.f32", scale)
  return _ptx_f32("div.rn.f32", x, scale)


def encode(x: jax.Array, param: jax.Array, spec: QuantSpec, native: bool) -> jax.Array:
  """Float32 ``x`` -> ``spec``'s codes with ``param`` from :func:`code_scales` (inside a kernel; ``native``:
  PTX rounding on the GPU, the exact floor-based form in interpret mode).

  int8 multiplies by the scale's reciprocal, ``x * (1 / scale)``, which is what XLA computes for the
  reference's ``x / scale`` (its algebraic simplifier turns a division by a broadcast into a multiplication by
  the reciprocal), one multiply per element instead of a division. On an H200 these codes were XLA's in every
  element measured (``policy.INT8_DIVISION``, whose other forms :func:`_divide_by_scale` keeps for that A/B).
  """
  # A NaN element becomes 0, so its slice (scale inf / multiplier 0) dequantizes to NaN
  # everywhere: Triton's clamp would otherwise turn it into a finite +-max code.
  x = jnp.where(x != x, 0.0, x)
  if spec.ternary:  # param: the weight's abs-mean scale (a NaN weight made it NaN: every code is then 0)
    return jnp.clip(_rint(x * (1.0 / param), native), -1.0, 1.0).astype(jnp.int8)
  if spec.is_int8:
    y = _rint(_divide_by_scale(x, param, native), native)
    return jnp.clip(y, -int8.INT8_MAX, int8.INT8_MAX).astype(jnp.int8)
  fmax = fp8.fp8_max(spec.jnp_dtype)
  return jnp.clip(x * param, -fmax, fmax).astype(spec.jnp_dtype)


BYTE_MASK, BYTE_BITS = 0xFF, 8  # an int8 code in an int32 word

# Four int8 codes to an int32 word (byte j the code of the j-th value), on the GPU: one round-to-nearest-even
# conversion a value, then two saturating packs (the first puts codes 3 and 2 in the low half of a register, the
# second codes 1 and 0 below them). A NaN converts to 0, as encode's select makes it.
_PACK_INT8_WORD = ("{ .reg .s32 c0, c1, c2, c3, high;"
                   " cvt.rni.s32.f32 c0, $1; cvt.rni.s32.f32 c1, $2; cvt.rni.s32.f32 c2, $3; cvt.rni.s32.f32 c3, $4;"
                   " cvt.pack.sat.s8.s32.b32 high, c3, c2, c3;"
                   " cvt.pack.sat.s8.s32.b32 $0, c1, c0, high; }")


def encode_words(xs: list[jax.Array], param: jax.Array, spec: QuantSpec, native: bool) -> jax.Array:
  """Four float32 arrays of one shape -> int32 words whose byte j is ``encode(xs[j])`` (the codes the dp4a GEMVs
  read, four to a word), for a row's ``param`` from :func:`code_scales`.

  int8 on the GPU takes 3.5 instructions a value instead of about 11 (the GEMVs that quantize inside issue these
  for every weight row they stream): ``x * (1 / scale)``, then ``_PACK_INT8_WORD``. Neither encode's NaN select
  nor its clamp is needed there: a NaN converts to 0, and ``|x| <= amax`` keeps ``|x / scale|`` within 127 by a
  few ulps (``scale = amax * float32(1/127)``), so the pack's saturation never acts on a finite row. In
  interpret mode, and for other formats, :func:`encode`'s codes shifted into place (the same bits).
  """
  if not (native and spec.is_int8):
    words = jnp.zeros(jnp.shape(xs[0]), jnp.int32)
    for j, x in enumerate(xs):
      code = encode(x, param, spec, native).astype(jnp.int32) & BYTE_MASK
      words = words | lax.shift_left(code, BYTE_BITS * j)
    return words
  ys = [_divide_by_scale(x, param, native) for x in xs]
  return plt.elementwise_inline_asm(_PACK_INT8_WORD, args=ys, constraints="=r,r,r,r,r", pack=1,
                                    result_shape_dtypes=[jax.ShapeDtypeStruct(jnp.shape(xs[0]), jnp.int32)])[0]


# bfloat16 rows read as int32 words of two values (x[2 i] in the low half; a bitcast view). A magnitude's bits (the
# sign cleared) order as the magnitudes do, and every NaN's lie above inf's, so integer maxima find the row's amax,
# NaN counted as inf (stats.absmax) once clamped to inf's bits: two masks and two integer maxima a word, where the
# float form takes about four instructions a value (convert, abs, NaN select, max).
BF16_MAGNITUDE, BF16_INF_BITS, BF16_HIGH = 0x7FFF, 0x7F80, -0x10000  # BF16_HIGH: 0xFFFF0000 as an int32


def bf16_halves(words: jax.Array) -> tuple[jax.Array, jax.Array]:
  """int32 words of two bfloat16 values -> (low values, high values) as float32 (exact)."""
  low = lax.bitcast_convert_type(lax.shift_left(words, 16), jnp.float32)
  return low, lax.bitcast_convert_type(words & BF16_HIGH, jnp.float32)


def bf16_magnitude_maxes(maxes: tuple[jax.Array, jax.Array], words: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Element-wise running maxima (low halves, high halves) of ``|x|``'s bits over int32 words of two bfloat16
  values; start from zeros, finish with :func:`bf16_amax`."""
  low, high = maxes
  return jnp.maximum(low, words & BF16_MAGNITUDE), jnp.maximum(high, words & (BF16_MAGNITUDE << 16))


def bf16_amax(maxes: tuple[jax.Array, jax.Array]) -> jax.Array:
  """float32 amax (NaN as inf) of what :func:`bf16_magnitude_maxes` met: one block reduction."""
  low, high = maxes
  bits = jnp.minimum(jnp.max(jnp.maximum(low, lax.shift_right_logical(high, 16))), BF16_INF_BITS)
  return lax.bitcast_convert_type(lax.shift_left(bits, 16), jnp.float32)


def magnitude(x: jax.Array) -> jax.Array:
  """``|x|`` with NaN as inf, the element-wise part of ``stats.absmax`` (inside a kernel)."""
  return jnp.where(x != x, jnp.inf, jnp.abs(x))  # NaN counts as inf (stats.absmax)


def amaxes(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(row amaxes [R], column amaxes [C])`` of ``x [R, C]`` in XLA (``stats.absmax``), what a quantizer's
  statistics pass measures."""
  return absmax(x, 1)[:, 0], absmax(x, 0)[0]


# ---------------------------------------------------------------------------------------------
# Kernels.


def _rows_kernel(*refs, prologue: Prologue, n_inputs: int, spec: QuantSpec, block_rows: int, chunk: int,
                 width: int, write: bool, with_colmax: bool, native: bool):
  """Outputs, in order: [q, scale] if ``write``, else [row amax]; [colmax] if asked; [stat] if the prologue has one."""
  inputs, outs = refs[:n_inputs], list(refs[n_inputs:])
  i = pl.program_id(0)
  rows = pl.ds(i * block_rows, block_rows)
  n_chunks = width // chunk
  stat = None
  if prologue.stats:
    total = lax.fori_loop(0, n_chunks,
                          lambda j, acc: acc + prologue.partial_stat(inputs, rows, pl.ds(j * chunk, chunk)),
                          jnp.zeros((block_rows,), jnp.float32))
    stat = prologue.finish_stat(total, width)
  colmax_ref = outs[1 if not write else 2] if with_colmax else None
  # A row block that fits in one chunk is loaded once and kept in registers for both sweeps.
  resident = prologue.values(inputs, rows, pl.ds(0, chunk), stat) if n_chunks == 1 else None

  def values(j):
    return resident if resident is not None else prologue.values(inputs, rows, pl.ds(j * chunk, chunk), stat)

  def sweep_amax(j, amax):
    mags = magnitude(values(j))
    if colmax_ref is not None:
      colmax_ref[pl.ds(i, 1), pl.ds(j * chunk, chunk)] = jnp.max(mags, axis=0)[None, :]
    return jnp.maximum(amax, jnp.max(mags, axis=1))

  amax = lax.fori_loop(0, n_chunks, sweep_amax, jnp.zeros((block_rows,), jnp.float32))
  if write:
    q_ref, s_ref = outs[0], outs[1]
    param, scale = code_scales(amax, spec)

    def sweep_write(j, _):
      q_ref[rows, pl.ds(j * chunk, chunk)] = encode(values(j), param[:, None], spec, native)
      return 0

    lax.fori_loop(0, n_chunks, sweep_write, 0)
    s_ref[rows] = scale
  else:
    outs[0][rows] = amax
  if prologue.stats:
    outs[-1][rows] = stat


def _tile_kernel(*refs, prologue: Prologue, n_inputs: int, spec: QuantSpec, per_row: bool, with_rows: bool,
                 tile: tuple[int, int], native: bool, with_t: bool = True):
  """Inputs, then [stat] (prologue statistics), the transposed layout's quantizer parameter ([C] per
  column, or [R] per row with ``per_row``; absent without ``with_t``) and, with ``with_rows``, the rows
  layout's ([R]); outputs: [q^T] (``with_t``) and, with ``with_rows``, [q] in the rows layout."""
  inputs = refs[:n_inputs]
  rest = list(refs[n_inputs:])
  stat_ref = rest.pop(0) if prologue.stats else None
  t_param_ref = rest.pop(0) if with_t else None
  r_param_ref = rest.pop(0) if with_rows else None
  qt_ref = rest.pop(0) if with_t else None
  i, j = pl.program_id(0), pl.program_id(1)
  tile_r, tile_c = tile
  rows, cols = pl.ds(i * tile_r, tile_r), pl.ds(j * tile_c, tile_c)
  stat = stat_ref[rows] if stat_ref is not None else None
  values = prologue.values(inputs, rows, cols, stat)
  if with_t:
    t_param = t_param_ref[rows][:, None] if per_row else t_param_ref[cols][None, :]
    qt_ref[cols, rows] = encode(values, t_param, spec, native).T
  if with_rows:
    rest[0][rows, cols] = encode(values, r_param_ref[rows][:, None], spec, native)


def _tile_stats_kernel(*refs, prologue: Prologue, n_inputs: int, tile: tuple[int, int]):
  """Inputs, then [stat]; outputs: the tile's row maxima ``[C/tc, R]`` and column maxima ``[R/tr, C]``
  of ``|values|`` (partials: every tile writes its own slot, so no program waits for another)."""
  inputs = refs[:n_inputs]
  stat_ref = refs[n_inputs] if prologue.stats else None
  rowmax_ref, colmax_ref = refs[-2], refs[-1]
  i, j = pl.program_id(0), pl.program_id(1)
  tile_r, tile_c = tile
  rows, cols = pl.ds(i * tile_r, tile_r), pl.ds(j * tile_c, tile_c)
  stat = stat_ref[rows] if stat_ref is not None else None
  mags = magnitude(prologue.values(inputs, rows, cols, stat))
  rowmax_ref[pl.ds(j, 1), rows] = jnp.max(mags, axis=1)[None, :]
  colmax_ref[pl.ds(i, 1), cols] = jnp.max(mags, axis=0)[None, :]


def _values_kernel(*refs, prologue: SwiGLUGrad | SwiGLUNormGrad, n_inputs: int, tile: tuple[int, int]):
  """Inputs; outputs: ``prologue.outputs`` (its values in the output's dtype, and what else it writes). One tile
  of the grid per program, over ``prologue.value_columns`` (the prologue writes the output blocks that tile's
  inputs make)."""
  i, j = pl.program_id(0), pl.program_id(1)
  prologue.write(refs[:n_inputs], refs[n_inputs:], pl.ds(i * tile[0], tile[0]), pl.ds(j * tile[1], tile[1]))


def _rows_call(inputs, prologue: Prologue, spec: QuantSpec, write: bool, with_colmax: bool, interpret: bool):
  r, c = inputs[0].shape[0], prologue.width(inputs)
  block_rows, chunk, warps = tuning.quantize_rows_config(spec.jnp_dtype, prologue)
  outs = [out_struct((r, c), spec.jnp_dtype, *inputs), out_struct((r,), jnp.float32, *inputs)] if write else [
      out_struct((r,), jnp.float32, *inputs)]
  if with_colmax:
    outs.append(out_struct((r // block_rows, c), jnp.float32, *inputs))
  if prologue.stats:
    outs.append(out_struct((r,), jnp.float32, *inputs))
  kernel = functools.partial(_rows_kernel, prologue=prologue, n_inputs=len(inputs), spec=spec, block_rows=block_rows,
                             chunk=_col_chunk(c, chunk), width=c, write=write, with_colmax=with_colmax,
                             native=not interpret)
  return pl.pallas_call(
      kernel,
      out_shape=tuple(outs),
      grid=(r // block_rows,),
      compiler_params=plt.CompilerParams(num_warps=warps, num_stages=2),
      interpret=interpret,
      name="jaxlowbit_quantize_rows",
  )(*inputs)


def _tile_call(inputs, prologue: Prologue, stat, t_param, spec: QuantSpec, per_row: bool, interpret: bool,
               r_param=None):
  """The tiled write pass: ``q^T`` quantized with ``t_param`` (None: not written) and, given ``r_param [R]``,
  the rows ``q``."""
  r, c = inputs[0].shape[0], prologue.width(inputs)
  with_rows, with_t = r_param is not None, t_param is not None
  operands = [*inputs, *([stat] if prologue.stats else []), *([t_param] if with_t else []),
              *([r_param] if with_rows else [])]
  outs = [out_struct((c, r), spec.jnp_dtype, *operands)] if with_t else []
  if with_rows:
    outs.append(out_struct((r, c), spec.jnp_dtype, *operands))
  tile_r, tile_c, warps = tuning.quantize_tile_config(prologue)
  return pl.pallas_call(
      functools.partial(_tile_kernel, prologue=prologue, n_inputs=len(inputs), spec=spec, per_row=per_row,
                        with_rows=with_rows, tile=(tile_r, tile_c), native=not interpret, with_t=with_t),
      out_shape=tuple(outs),
      grid=(r // tile_r, c // tile_c),
      compiler_params=plt.CompilerParams(num_warps=warps, num_stages=2),
      interpret=interpret,
      name="jaxlowbit_quantize_cols_t",
  )(*operands)


def _tile_stats_call(inputs, prologue: Prologue, stat, interpret: bool):
  """``(row amax [R], column amax [C])`` of the prologue's values from one tiled read."""
  r, c = inputs[0].shape[0], prologue.width(inputs)
  operands = [*inputs, *([stat] if prologue.stats else [])]
  tile_r, tile_c, warps = tuning.quantize_stats_tile_config(prologue)
  rowmax, colmax = pl.pallas_call(
      functools.partial(_tile_stats_kernel, prologue=prologue, n_inputs=len(inputs), tile=(tile_r, tile_c)),
      out_shape=(out_struct((c // tile_c, r), jnp.float32, *operands),
                 out_struct((r // tile_r, c), jnp.float32, *operands)),
      grid=(r // tile_r, c // tile_c),
      compiler_params=plt.CompilerParams(num_warps=warps, num_stages=2),
      interpret=interpret,
      name="jaxlowbit_quantize_stats",
  )(*operands)
  return jnp.max(rowmax, axis=0), jnp.max(colmax, axis=0)


# ---------------------------------------------------------------------------------------------
# Public entry points.


def supported(spec: QuantSpec, r: int, c: int, transposed: bool, prologue: Prologue = Identity(),
              split: Split = NO_SPLIT) -> bool:
  """Whether a kernel takes this spec and shape (else callers use the reference).

  Per-tensor scales are taken with the transposed layout (one kernel writes both layouts) or
  with a prologue; a bare per-tensor row copy is a plain elementwise pass that XLA already runs
  at full speed. Columns split over devices (``split.cols``): the rows are written by the tiled pass
  after their amaxes are reduced, so the tiles must divide; a prologue with a row statistic (RMSNorm)
  cannot take split columns (its caller computes the norm across devices).
  """
  if spec.ternary:  # a weight: one tile pass writing q^T (and the rows), never split (FSDP gathers packed codes)
    return (transposed and isinstance(prologue, Identity) and not split.rows and not split.cols
            and _tiles_divide(r, c, tuning.quantize_tile_config(prologue)))
  if spec.per_tensor and not transposed and isinstance(prologue, Identity):
    return False
  if c % 16:
    return False
  if split.cols and (prologue.stats or not _tiles_divide(r, c, tuning.quantize_tile_config(prologue))):
    return False
  if transposed and _stats_from_tiles(spec, prologue):
    return _tiles_divide(r, c, tuning.quantize_stats_tile_config(prologue)) and _tiles_divide(
        r, c, tuning.quantize_tile_config(prologue)) and (not prologue.stats or _rows_divide(r, spec, prologue))
  tiles = _tiles_divide(r, c, tuning.quantize_tile_config(prologue))
  return _rows_divide(r, spec, prologue) and (tiles or not (transposed or spec.per_tensor))


def _rows_divide(r: int, spec: QuantSpec, prologue: Prologue) -> bool:
  return r % tuning.quantize_rows_config(spec.jnp_dtype, prologue)[0] == 0


def _tiles_divide(r: int, c: int, tile) -> bool:
  return r % tile[0] == 0 and c % tile[1] == 0


def _halves_divide(c: int, block_c: int) -> bool:
  """:class:`SwiGLUGrad`'s blocks of columns lie within one half: the half must divide by the block."""
  return (c // 2) % block_c == 0


def _stats_from_tiles(spec: QuantSpec, prologue: Prologue) -> bool:
  """Whether per-column scales come from the tiled statistics pass (else from the rows kernel's partials)."""
  return not spec.per_tensor and tuning.quantize_stats_from_tiles(prologue)


def _pmax(amax: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """``amax`` reduced (max) over mesh ``axes`` (none: itself)."""
  return lax.pmax(amax, axes) if axes else amax


def _split_cols_quantize(inputs, prologue: Prologue, rows_spec, cols_spec, rows_t: bool, interpret: bool,
                         split: Split):
  """:func:`fused_quantize_kernel` for per-row scales over columns split across devices: the rows kernel measures
  (no write), the row amaxes are reduced over the devices, then one tiled pass writes every layout asked for."""
  spec = rows_spec or cols_spec
  outs = _rows_call(inputs, prologue, spec, write=False, with_colmax=cols_spec is not None, interpret=interpret)
  param_r, scale_r = code_scales(_pmax(outs[0], split.cols), spec) if rows_spec is not None else (None, None)
  if cols_spec is not None:
    param_t, scale_t = code_scales(_pmax(jnp.max(outs[1], axis=0), split.rows), spec)
    written = _tile_call(inputs, prologue, None, param_t, spec, per_row=False, interpret=interpret, r_param=param_r)
    rows = (written[1], scale_r[:, None]) if rows_spec is not None else None
    return rows, (written[0], scale_t[:, None]), None
  if rows_t:  # int8 takes its dequantization scale itself (see code_scales)
    qt, q = _tile_call(inputs, prologue, None, param_r, spec, per_row=True, interpret=interpret, r_param=param_r)
    return (q, scale_r[:, None]), (qt, scale_r[None, :]), None
  (q,) = _tile_call(inputs, prologue, None, None, spec, per_row=True, interpret=interpret, r_param=param_r)
  return (q, scale_r[:, None]), None, None


def fused_quantize_kernel(
    inputs: tuple[jax.Array, ...],
    prologue: Prologue,
    rows_spec: QuantSpec | None,
    cols_spec: QuantSpec | None = None,
    rows_t: bool = False,
    interpret: bool = False,
    split: Split = NO_SPLIT,
    maxima: tuple[jax.Array, jax.Array] | None = None,
):
  """``prologue(*inputs)`` quantized without writing it: ``(rows, transposed, stat)``.

  Args:
    inputs: the prologue's inputs (``x [R, C]``; ``x, gamma [C]``; ``gate_up [R, 2H]``).
    prologue: :class:`Identity`, :class:`RmsNorm` or :class:`SwiGLU`.
    rows_spec: quantize the values per row: ``(q [R, C'], scale [R, 1] or [1, 1])``; or None.
    cols_spec: also quantize them per column, written transposed: ``(q^T [C', R], scale [C', 1]
      or [1, 1])``; or None.
    rows_t: instead, write the rows' codes transposed (``q^T [C', R]`` with the rows' scales as
      ``[1, R]``): BitNet's exact activations for its grad_weight. Needs ``rows_spec``.
    interpret: run in Pallas interpret mode (CPU tests).
    split: the values are a tile of a matrix split over mesh axes (inside ``shard_map``). Rows split
      (``split.rows``): per-column and per-tensor amaxes are reduced over them between the measuring
      and the writing pass. Columns split (``split.cols``, a prologue without a row statistic): per-row
      and per-tensor amaxes are reduced over them, so the rows are measured in one pass and written by
      the tiled pass (a row-parallel linear's input, a column-parallel linear's gradient).
    maxima: the values' ``(row amaxes [R], column amaxes [C])`` (float32, :func:`amaxes`), measured by
      their producer: both layouts of an :class:`Identity` prologue are then written by the tiled pass
      alone (no statistics pass). Other requests ignore them (they measure as they write).

  Returns:
    ``(rows or None, transposed or None, stat or None)``: ``stat`` is the prologue's float32 row
    statistic ``[R]`` (RmsNorm: ``rstd``), None for prologues without one.
  """
  spec = rows_spec or cols_spec
  if cols_spec is not None and rows_spec is not None and cols_spec != rows_spec:
    raise ValueError(f"fused_quantize_kernel: one spec for both layouts, got {rows_spec} and {cols_spec}")
  if rows_t and (rows_spec is None or cols_spec is not None or not rows_spec.is_int8 or rows_spec.per_tensor):
    raise ValueError("fused_quantize_kernel: rows_t writes the rows' int8 codes transposed: give an int8 per-row "
                     "rows_spec only")
  # Column amaxes reduce over the devices holding other rows (split.rows), row amaxes over those holding other
  # columns (split.cols).
  r, c = inputs[0].shape[0], prologue.width(inputs)
  if not supported(spec, r, c, transposed=cols_spec is not None or rows_t, prologue=prologue, split=split):
    block_rows = tuning.quantize_rows_config(spec.jnp_dtype, prologue)[0]
    raise ValueError(f"fused_quantize_kernel: {type(prologue).__name__} of {[a.shape for a in inputs]} with {spec}: "
                     f"rows must divide by {block_rows} and the tiles {tuning.quantize_tile_config(prologue)[:2]}, "
                     f"{tuning.quantize_stats_tile_config(prologue)[:2]}"
                     f"{' (columns split: no row statistic, tiles divide)' if split.cols else ''}; use "
                     "pallas_kernels.dispatch.fused_quantize, which falls back to XLA")
  if spec.ternary:  # the abs-mean by XLA (exactly the reference's scale), then one tile pass writes the layouts
    scale = ternary.absmean_scale(inputs[0])
    r_param = jnp.broadcast_to(scale, (r,)) if rows_spec is not None else None
    outs = _tile_call(inputs, prologue, None, jnp.broadcast_to(scale, (c,)), spec, per_row=False,
                      interpret=interpret, r_param=r_param)
    rows = (outs[1], scale.reshape(1, 1)) if rows_spec is not None else None
    return rows, (outs[0], scale.reshape(1, 1)), None
  if spec.per_tensor:  # one amax over everything, then one tile pass writes both layouts
    amax, *stat = _rows_call(inputs, prologue, spec, write=False, with_colmax=False, interpret=interpret)
    param, scale = code_scales(_pmax(jnp.max(amax), split.rows + split.cols), spec)  # one all-reduce
    stat = stat[0] if stat else None
    r_param = jnp.broadcast_to(param, (r,)) if rows_spec is not None else None
    outs = _tile_call(inputs, prologue, stat, jnp.broadcast_to(param, (c,)), spec, per_row=False,
                      interpret=interpret, r_param=r_param)
    rows = (outs[1], scale.reshape(1, 1)) if rows_spec is not None else None
    transposed = (outs[0], scale.reshape(1, 1)) if cols_spec is not None or rows_t else None
    return rows, transposed, stat
  measured = maxima is not None and isinstance(prologue, Identity)
  if cols_spec is not None and (measured or _stats_from_tiles(spec, prologue)):
    # Two tiled reads: every tile's row and column maxima, then both layouts written from the same
    # tiles (no [R / rows-per-program, C] partials to write and reduce, as the rows kernel has);
    # one where the producer measured the maxima.
    stat = None
    if prologue.stats:
      stat = _rows_call(inputs, prologue, spec, write=False, with_colmax=False, interpret=interpret)[-1]
    rowmax, colmax = maxima if measured else _tile_stats_call(inputs, prologue, stat, interpret)
    param_t, scale_t = code_scales(_pmax(colmax, split.rows), spec)
    param_r, scale_r = code_scales(_pmax(rowmax, split.cols), spec) if rows_spec is not None else (None, None)
    outs = _tile_call(inputs, prologue, stat, param_t, spec, per_row=False, interpret=interpret, r_param=param_r)
    rows = (outs[1], scale_r[:, None]) if rows_spec is not None else None
    return rows, (outs[0], scale_t[:, None]), stat
  if split.cols:
    return _split_cols_quantize(inputs, prologue, rows_spec, cols_spec, rows_t, interpret, split)
  outs = _rows_call(inputs, prologue, spec, write=rows_spec is not None, with_colmax=cols_spec is not None,
                    interpret=interpret)
  stat = outs[-1] if prologue.stats else None
  rows = (outs[0], outs[1][:, None]) if rows_spec is not None else None
  if cols_spec is not None:
    colmax = outs[2 if rows_spec is not None else 1]
    param_t, scale_t = code_scales(_pmax(jnp.max(colmax, axis=0), split.rows), spec)
    qt = _tile_call(inputs, prologue, stat, param_t, spec, per_row=False, interpret=interpret)[0]
    return rows, (qt, scale_t[:, None]), stat
  if rows_t:  # int8 takes its dequantization scale itself (see code_scales)
    qt = _tile_call(inputs, prologue, stat, outs[1], spec, per_row=True, interpret=interpret)[0]
    return rows, (qt, outs[1][None, :]), stat
  return rows, None, stat


def prologue_supported(r: int, c: int, prologue: SwiGLUGrad | SwiGLUNormGrad) -> bool:
  """Whether :func:`prologue_kernel` takes a ``[R, C]`` output of ``prologue``."""
  tile_r, tile_c, _ = tuning.prologue_tile_config(prologue)
  return hasattr(prologue, "write") and _tiles_divide(r, c, (tile_r, tile_c)) and _halves_divide(c, tile_c)


def prologue_kernel(inputs: tuple[jax.Array, ...], prologue: SwiGLUGrad | SwiGLUNormGrad, interpret: bool = False):
  """``prologue(*inputs)`` written in its dtype, ``[R, C]``: one read of the inputs, one write.

  Args:
    inputs: the prologue's inputs (``dh [R, H], gate_up [R, 2H]`` for :class:`SwiGLUGrad`; those of
      :class:`SwiGLUNormGrad`).
    prologue: a prologue that writes its values by blocks (``write``: :class:`SwiGLUGrad`,
      :class:`SwiGLUNormGrad`).
    interpret: run in Pallas interpret mode (CPU tests).

  Returns:
    the values ``[R, C]``, or, for a prologue that writes more (:class:`SwiGLUNormGrad`'s partial sums), the
    tuple of its ``outputs``.
  """
  r, c = inputs[0].shape[0], prologue.width(inputs)
  if not prologue_supported(r, c, prologue):
    raise ValueError(f"prologue_kernel: {type(prologue).__name__} of {[a.shape for a in inputs]}: rows and columns "
                     f"must divide by the tile {tuning.prologue_tile_config(prologue)[:2]} (and a half of the columns "
                     "by its width), and the prologue must write its values by blocks (SwiGLUGrad, SwiGLUNormGrad); "
                     "use pallas_kernels.dispatch.prologue_values")
  tile_r, tile_c, warps = tuning.prologue_tile_config(prologue)
  outs = pl.pallas_call(
      functools.partial(_values_kernel, prologue=prologue, n_inputs=len(inputs), tile=(tile_r, tile_c)),
      out_shape=tuple(out_struct(shape, dtype, *inputs)
                      for shape, dtype in prologue.outputs(inputs, (tile_r, tile_c))),
      grid=(r // tile_r, prologue.value_columns(inputs) // tile_c),
      compiler_params=plt.CompilerParams(num_warps=warps, num_stages=2),
      interpret=interpret,
      name="jaxlowbit_prologue",
  )(*inputs)
  return outs[0] if len(outs) == 1 else outs


def fused_quantize_reference(inputs, prologue: Prologue, rows_spec, cols_spec=None, rows_t: bool = False,
                             split: Split = NO_SPLIT):
  """:func:`fused_quantize_kernel` in XLA: the prologue in jnp, then ``formats.quantize``.

  ``split``: the prologue's output is a tile of a matrix split over mesh axes (inside
  ``shard_map``); amaxes are reduced over the tiles. A prologue with a row statistic (RmsNorm)
  computes it over the tile's own columns, so ``split.cols`` is refused for it.
  """
  if split.cols and prologue.stats:
    raise ValueError(f"fused_quantize_reference: {type(prologue).__name__} over columns split over {split.cols}: "
                     "compute the op over the whole rows first (jaxlowbit.fused does) and quantize its output")
  y = prologue.reference(inputs)
  rows = quantize_rows_reference(y, rows_spec, split) if rows_spec is not None else None
  transposed = None
  if cols_spec is not None:
    transposed = quantize_cols_t_reference(y, cols_spec, split)
  elif rows_t:
    transposed = transposed_rows(rows)
  stat = prologue.reference_stat(inputs) if prologue.stats else None
  return rows, transposed, stat


def transposed_rows(rows):
  """The ``rows_t`` layout of per-row codes: ``(q [R, C], scale [R, 1])`` -> ``(q^T [C, R], scale [1, R])``."""
  return rows[0].T, rows[1].reshape(1, -1)


def quantize_rows_kernel(x: jax.Array, spec: QuantSpec, interpret: bool = False):
  """``x [R, C]`` -> (``q [R, C]``, dequant scale ``[R, 1]``); see :func:`supported`."""
  return fused_quantize_kernel((x,), Identity(), spec, interpret=interpret)[0]


def quantize_cols_t_kernel(x: jax.Array, spec: QuantSpec, interpret: bool = False):
  """``x [R, C]`` -> (``q^T [C, R]`` quantized per column, dequant scale ``[C, 1]`` or ``[1, 1]``)."""
  return fused_quantize_kernel((x,), Identity(), None, spec, interpret=interpret)[1]


def quantize_rows_and_cols_t_kernel(x: jax.Array, spec: QuantSpec, interpret: bool = False):
  """Both quantizations of ``x [R, C]`` with ``spec``: ((q, [R, 1] scale), (q^T, [C, 1] scale))."""
  rows, transposed, _ = fused_quantize_kernel((x,), Identity(), spec, spec, interpret=interpret)
  return rows, transposed
