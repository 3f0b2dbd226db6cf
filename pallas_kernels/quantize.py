"""Fused quantization kernels (Pallas, Triton backend): one read of a bf16/f32 tensor.

- :func:`quantize_rows_kernel`: ``x [R, C]`` -> int8/fp8 ``q [R, C]`` + one scale per row.
  Each program owns ``block_r`` rows: a first sweep over the row computes the abs-max (and,
  on request, per-column partial maxima of those rows), a second sweep, which re-reads the
  rows from L2, writes the quantized copy. DRAM sees one read and one 1-byte write.
- :func:`quantize_cols_t_kernel`: ``x [R, C]`` -> ``q^T [C, R]`` quantized per column,
  written transposed in tiles: the layout grad_weight's GEMM wants, with no transpose pass.
- :func:`quantize_rows_and_cols_t_kernel`: both of the above from two reads of ``x``
  (the row sweep also produces the column maxima the transposed copy needs).

Numerics are exactly :func:`jaxlowbit_numerics.formats.quantize` (the tests compare the two), up to
float division rounding: ``round(x / scale)`` may land on the other side of a .5 tie.
The Triton lowering has no round-half-even, so :func:`_round_half_even` builds it from
floor (exactly, with no float error: ``y - floor(y)`` is exact).
NaN or inf in a row (column) makes its amax inf, as in the reference (``stats.absmax``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxlowbit_numerics import fp8, int8
from jaxlowbit_numerics.formats import QuantSpec
from jaxlowbit_numerics.stats import absmax
from pallas_kernels import tuning
from pallas_kernels.vma import out_struct

TILE = 64  # square tile of the transposing kernel
TILE_WARPS = 4


def supported(spec: QuantSpec, r: int, c: int, transposed: bool) -> bool:
  """Whether a kernel takes this spec and shape (else callers use the reference).

  Per-tensor scales are taken by the transposing kernel only: a per-tensor row copy is a
  plain elementwise pass that XLA already runs at full speed.
  """
  if spec.ternary or (spec.per_tensor and not transposed):
    return False
  block_rows = tuning.quantize_rows_config(spec.jnp_dtype)[0]
  return r % TILE == 0 and c % TILE == 0 and r % block_rows == 0


def _col_chunk(c: int, chunk: int) -> int:
  while c % chunk:
    chunk //= 2
  return chunk


def _scales(amax: jax.Array, spec: QuantSpec) -> tuple[jax.Array, jax.Array]:
  """(what ``_apply`` takes, dequantization scale) for an amax, as float32.

  int8 divides by its scale and FP8 multiplies by its multiplier, as the reference does;
  folding either into the other form would round differently.
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


def _apply(x: jax.Array, param: jax.Array, spec: QuantSpec) -> jax.Array:
  # A NaN element becomes 0, so its slice (scale inf / multiplier 0) dequantizes to NaN
  # everywhere: Triton's clamp would otherwise turn it into a finite +-max code.
  x = jnp.where(x != x, 0.0, x)
  if spec.is_int8:
    y = _round_half_even(x / param)
    return jnp.clip(y, -int8.INT8_MAX, int8.INT8_MAX).astype(jnp.int8)
  fmax = fp8.fp8_max(spec.jnp_dtype)
  return jnp.clip(x * param, -fmax, fmax).astype(spec.jnp_dtype)


def _rows_kernel(x_ref, q_ref, s_ref, *colmax_ref, spec: QuantSpec, block_rows: int, chunk: int):
  i = pl.program_id(0)
  rows = pl.ds(i * block_rows, block_rows)
  n_chunks = x_ref.shape[1] // chunk

  def sweep_stats(j, amax):
    cols = pl.ds(j * chunk, chunk)
    x = x_ref[rows, cols].astype(jnp.float32)
    magnitude = jnp.where(x != x, jnp.inf, jnp.abs(x))  # NaN counts as inf (stats.absmax)
    if colmax_ref:
      colmax_ref[0][pl.ds(i, 1), cols] = jnp.max(magnitude, axis=0)[None, :]
    return jnp.maximum(amax, jnp.max(magnitude, axis=1))

  amax = lax.fori_loop(0, n_chunks, sweep_stats, jnp.zeros((block_rows,), jnp.float32))
  param, scale = _scales(amax, spec)

  def sweep_write(j, _):
    cols = pl.ds(j * chunk, chunk)
    q_ref[rows, cols] = _apply(x_ref[rows, cols].astype(jnp.float32), param[:, None], spec)
    return 0

  lax.fori_loop(0, n_chunks, sweep_write, 0)
  s_ref[rows] = scale


def _cols_t_kernel(x_ref, param_ref, q_ref, *, spec: QuantSpec):
  i, j = pl.program_id(0), pl.program_id(1)
  rows, cols = pl.ds(i * TILE, TILE), pl.ds(j * TILE, TILE)
  x = x_ref[rows, cols].astype(jnp.float32)
  q_ref[cols, rows] = _apply(x, param_ref[cols][None, :], spec).T


def _rows_call(x, spec: QuantSpec, with_colmax: bool, interpret: bool):
  r, c = x.shape
  block_rows, chunk, warps = tuning.quantize_rows_config(spec.jnp_dtype)
  outs = [out_struct((r, c), spec.jnp_dtype, x), out_struct((r,), jnp.float32, x)]
  if with_colmax:
    outs.append(out_struct((r // block_rows, c), jnp.float32, x))
  return pl.pallas_call(
      functools.partial(_rows_kernel, spec=spec, block_rows=block_rows, chunk=_col_chunk(c, chunk)),
      out_shape=tuple(outs),
      grid=(r // block_rows,),
      compiler_params=plt.CompilerParams(num_warps=warps, num_stages=2),
      interpret=interpret,
      name="jaxlowbit_quantize_rows",
  )(x)


def _cols_t_call(x, param, spec: QuantSpec, interpret: bool):
  r, c = x.shape
  return pl.pallas_call(
      functools.partial(_cols_t_kernel, spec=spec),
      out_shape=out_struct((c, r), spec.jnp_dtype, x, param),
      grid=(r // TILE, c // TILE),
      compiler_params=plt.CompilerParams(num_warps=TILE_WARPS, num_stages=2),
      interpret=interpret,
      name="jaxlowbit_quantize_cols_t",
  )(x, param)


def quantize_rows_kernel(x: jax.Array, spec: QuantSpec, interpret: bool = False):
  """``x [R, C]`` -> (``q [R, C]``, dequant scale ``[R, 1]``); see :func:`supported`."""
  q, scale, *_ = _rows_call(x, spec, False, interpret)
  return q, scale[:, None]


def quantize_cols_t_kernel(x: jax.Array, spec: QuantSpec, interpret: bool = False):
  """``x [R, C]`` -> (``q^T [C, R]`` quantized per column, dequant scale ``[C, 1]``)."""
  if spec.per_tensor:
    param, scale = _scales(absmax(x).reshape(()), spec)
    return _cols_t_call(x, jnp.broadcast_to(param, (x.shape[1],)), spec, interpret), scale.reshape(1, 1)
  param, scale = _scales(absmax(x, axis=0)[0], spec)  # one XLA read of x
  return _cols_t_call(x, param, spec, interpret), scale[:, None]


def quantize_rows_and_cols_t_kernel(x: jax.Array, spec: QuantSpec, interpret: bool = False):
  """Both quantizations of ``x [R, C]`` with ``spec``: ((q, [R, 1] scale), (q^T, [C, 1] scale))."""
  q, scale, partial_max = _rows_call(x, spec, True, interpret)
  param_t, scale_t = _scales(jnp.max(partial_max, axis=0), spec)
  return (q, scale[:, None]), (_cols_t_call(x, param_t, spec, interpret), scale_t[:, None])
