"""The pieces of tensor parallelism (``jaxlowbit.parallel.tensor``) against their unsplit references.

Inside ``shard_map`` over 4 virtual CPU devices on one axis, each holding a tile of a matrix:

- ``formats.quantize`` with a :class:`Split` gives every tile the codes and scales the whole matrix
  gets (rows split: per-column and per-tensor amaxes reduced; columns split: per-row ones);
- the Pallas quantization kernel (interpret mode) reduces its amaxes between its passes alike;
- ``gather_activation`` delivers the whole matrix quantized as the recipe reads it, from one
  all-gather, and its gradient is the sum of the readers' ``dx``, reduce-scattered;
- the RMSNorm over features split across devices equals the whole row's norm.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from helpers import fresh_key
from jaxlowbit import BitNet, Float8, Int8MixedPrecision, fused
from jaxlowbit.fsdp import gather_activation
from jaxlowbit.operand import QuantizedMatrix
from jaxlowbit.parallel.tensor import REQUANTIZE, TRANSPOSED_MODES, derives_transposed
from jaxlowbit.recipes.base import quantize_operand
from jaxlowbit_numerics.formats import QuantSpec, quantize
from jaxlowbit_numerics.stats import Split
from pallas_kernels import quantize as qk

AXIS, N = "t", 4
ROWS, COLS = Split(rows=(AXIS,)), Split(cols=(AXIS,))


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.asarray(jax.devices()[:N]), (AXIS,))


def _tiles(mesh, f, split: Split, *arrays, out_specs=P(), check_vma: bool = True):
  """``f(*tiles)`` on every device; arrays are split along dim 0 (``split.rows``) or their last dim."""
  spec = P(AXIS, None) if split.rows else P(None, AXIS)
  f = jax.shard_map(f, mesh=mesh, in_specs=tuple(spec for _ in arrays), out_specs=out_specs, check_vma=check_vma)
  return jax.jit(f)(*arrays)


# (spec, axis the amax reduces over, how the matrix is split): every statistic that crosses tiles.
QUANTIZE_CASES = [
    (QuantSpec("int8"), 0, ROWS),  # per column over tokens split across devices (grad_weight's x)
    (QuantSpec("float8_e4m3fn", per_tensor=True), None, ROWS),  # FP8 tensorwise
    (QuantSpec("float8_e4m3fn", power_of_two=True), 0, ROWS),  # FP8 rowwise's x^T
    (QuantSpec("int8"), -1, COLS),  # per token over features split across devices (row-parallel input)
    (QuantSpec("float8_e5m2", per_tensor=True), None, COLS),
]


@pytest.mark.parametrize("spec, axis, split", QUANTIZE_CASES, ids=str)
def test_split_quantize_equals_the_whole_matrix(spec, axis, split, mesh):
  x = jax.random.normal(fresh_key(), (64, 128)) * jnp.linspace(0.1, 10, 128)
  q_whole, s_whole = quantize(x, spec, axis)
  spec_out = P(AXIS, None) if split.rows else P(None, AXIS)
  # Scales of a split dim come back per tile (concatenated), others once (replicated).
  scale_spec = spec_out if (axis == -1 and split.rows) or (axis == 0 and split.cols) else P()
  q, s = _tiles(mesh, lambda t: quantize(t, spec, axis, split=split), split, x, out_specs=(spec_out, scale_spec))
  np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(q_whole, np.float32))
  np.testing.assert_allclose(s, s_whole, rtol=1e-6)  # jit vs eager: FP8's 1 / scale may round apart by an ulp
  if split.rows and axis is not None:  # and the local quantization would have differed
    assert not np.array_equal(np.asarray(quantize(x[:16], spec, axis)[1]), np.asarray(s_whole))


@pytest.mark.parametrize("spec", [QuantSpec("int8"), QuantSpec("float8_e4m3fn", per_tensor=True)], ids=str)
def test_kernel_with_split_rows_equals_the_reference(spec, mesh):
  """The fused quantizer kernel (interpret mode) on each device's 64 rows == the reference on all 256."""
  x = jax.random.normal(fresh_key(), (N * 64, 128), jnp.float32) * jnp.linspace(0.1, 10, 128)
  rows_w, cols_w, _ = qk.fused_quantize_reference((x,), qk.Identity(), spec, spec)
  kernel = functools.partial(qk.fused_quantize_kernel, prologue=qk.Identity(), rows_spec=spec, cols_spec=spec,
                             interpret=True, split=ROWS)

  def quantized(t):
    (q, s), (qt, st), _ = kernel((t,))
    return q, s if not spec.per_tensor else s[None], qt, st[None]  # reduced scales: every device's copy

  # Pallas's interpreter (jax 0.10) mixes varying and unvarying operands in its dynamic slices.
  rows_scale = P(AXIS) if spec.per_tensor else P(AXIS, None)
  q, s, qt, st = _tiles(mesh, quantized, ROWS, x, check_vma=False,
                        out_specs=(P(AXIS, None), rows_scale, P(None, AXIS), P(AXIS)))
  np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(rows_w[0], np.float32))
  np.testing.assert_array_equal(np.asarray(qt, np.float32), np.asarray(cols_w[0], np.float32))
  for copy in st:
    np.testing.assert_allclose(copy, cols_w[1], rtol=1e-6)
  for copy in s if spec.per_tensor else (s,):
    np.testing.assert_allclose(copy, rows_w[1], rtol=1e-6)


# (rows spec, cols spec, rows_t, prologue) with the features split: a row-parallel linear's input (rows only,
# BitNet's transposed codes, SwiGLU's output for the down projection) and a column-parallel linear's gradient
# (rows for grad_input, the transposed copy for grad_weight; FP8 tensorwise's one amax).
_INT8, _E4M3_TENSOR = QuantSpec("int8"), QuantSpec("float8_e4m3fn", per_tensor=True)
_E4M3_ROWS = QuantSpec("float8_e4m3fn", power_of_two=True)  # FP8 rowwise: per-row power-of-two scales
SPLIT_COLS_CASES = [(_INT8, None, False, "Identity"), (_INT8, None, True, "Identity"),
                    (_INT8, _INT8, False, "Identity"), (_E4M3_TENSOR, _E4M3_TENSOR, False, "Identity"),
                    (_E4M3_ROWS, _E4M3_ROWS, False, "Identity"), (_INT8, None, False, "SwiGLU"),
                    (None, _INT8, False, "Identity")]


@pytest.mark.parametrize("rows_spec, cols_spec, rows_t, prologue", SPLIT_COLS_CASES, ids=str)
def test_kernel_with_split_cols_equals_the_reference(rows_spec, cols_spec, rows_t, prologue, mesh):
  """The fused quantizer kernel (interpret mode) on each device's 128 features == the reference on all 512: row
  amaxes reduced over the devices before the tiled pass writes the rows (and every other layout asked for)."""
  r, c = 64, 128  # per device
  key = fresh_key()
  x = jax.random.normal(key, (r, N * c), jnp.float32) * jnp.exp(jax.random.uniform(key, (r, 1), minval=-2, maxval=2))
  pro = qk.Identity() if prologue == "Identity" else qk.SwiGLU("silu")
  if prologue == "SwiGLU":  # each device holds [gate | up] of its hidden units (ColumnParallel.regroup's layout)
    x = x.astype(jnp.bfloat16)
    up = jax.random.normal(jax.random.fold_in(key, 1), (r, N * c), jnp.bfloat16)
    tiles = jnp.concatenate([jnp.concatenate([x[:, i * c:(i + 1) * c], up[:, i * c:(i + 1) * c]], axis=1)
                             for i in range(N)], axis=1)  # [r, N * 2c]: device i's [gate_i | up_i]
    values = jnp.concatenate([pro.reference((tiles[:, 2 * i * c:2 * (i + 1) * c],)) for i in range(N)], axis=1)
  else:
    tiles = values = x
  rows_w, cols_w, _ = qk.fused_quantize_reference((values,), qk.Identity(), rows_spec, cols_spec, rows_t)
  kernel = functools.partial(qk.fused_quantize_kernel, prologue=pro, rows_spec=rows_spec, cols_spec=cols_spec,
                             rows_t=rows_t, interpret=True, split=COLS)
  per_tensor = (rows_spec or cols_spec).per_tensor

  def quantized(t):
    rows, transposed, _ = kernel((t,))
    out = []
    if rows is not None:
      out += [rows[0], rows[1][None] if per_tensor else rows[1]]
    if transposed is not None:
      out += [transposed[0], transposed[1][None] if per_tensor or rows_t else transposed[1]]
    return tuple(out)

  specs = []
  if rows_w is not None:
    specs += [P(None, AXIS), P(AXIS) if per_tensor else P()]
  if cols_w is not None:
    specs += [P(AXIS, None), P(AXIS) if per_tensor or rows_t else P(AXIS, None)]
  got = _tiles(mesh, quantized, COLS, tiles, check_vma=False, out_specs=tuple(specs))
  want = [part for layout in (rows_w, cols_w) if layout is not None for part in layout]
  for i in range(0, len(want), 2):
    np.testing.assert_array_equal(np.asarray(got[i], np.float32), np.asarray(want[i], np.float32))
    scales = np.asarray(got[i + 1])
    if per_tensor or (rows_t and i == 2):  # one copy per device, each the whole matrix's
      for copy in scales:
        np.testing.assert_allclose(copy.reshape(np.shape(want[i + 1])), want[i + 1], rtol=1e-6)
    else:
      np.testing.assert_allclose(scales, want[i + 1], rtol=1e-6)
  assert not np.array_equal(  # and the local amaxes would have given other scales
      np.asarray(qk.fused_quantize_reference((values[:, :c],), qk.Identity(), _INT8)[0][1]),
      np.asarray(qk.fused_quantize_reference((values,), qk.Identity(), _INT8)[0][1]))


RECIPES = [Int8MixedPrecision(), Float8("tensorwise"), Float8("rowwise"), BitNet(), BitNet(True, True)]


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
@pytest.mark.parametrize("transposed", TRANSPOSED_MODES)
def test_gather_activation_is_the_whole_operand(recipe, transposed, mesh):
  """The rows as the whole matrix's quantization; x^T too where it is the rows' codes or it was sent
  (SEND), else (REQUANTIZE) the gathered codes' values quantized per column, within half a step of
  each quantization of x."""
  x = jax.random.normal(fresh_key(), (N * 8, 64), jnp.float32) * jnp.linspace(0.1, 10, 64)
  how = recipe.input_quantization()
  want_rows, want_t = quantize_operand(x, how)
  requantized = transposed == REQUANTIZE and not derives_transposed(how)
  if requantized:
    codes, scale = quantize(want_rows.dequantize(x.dtype), how.transposed, 0)  # per column, over all rows
    want_t = QuantizedMatrix(codes.T, scale.reshape(-1, 1), how.transposed)

  def gathered(t):  # every device's copy of the whole operand, stacked
    operand = gather_activation(t, recipe, AXIS, transposed=transposed)
    parts = (operand.rows.data, operand.rows.scale, operand.transposed.data, operand.transposed.scale)
    return tuple(a[None] for a in parts)

  got = _tiles(mesh, gathered, ROWS, x, out_specs=P(AXIS))
  want = (want_rows.data, want_rows.scale, want_t.data, want_t.scale)
  for i, (copies, w) in enumerate(zip(got, want)):
    assert copies.shape == (N, *w.shape) and copies.dtype == w.dtype, (copies.shape, w.shape)
    for copy in copies:  # codes exactly; scales up to jit-vs-eager rounding of FP8's 1 / scale
      np.testing.assert_allclose(np.asarray(copy, np.float32), np.asarray(w, np.float32), rtol=1e-6 if i % 2 else 0)
  if requantized and how.transposed.is_int8:  # two roundings of x: half a step of each scale at most
    x_t = np.asarray(got[2][0], np.float32) * np.asarray(got[3][0])
    bound = 0.5 * np.asarray(want_rows.scale).T + 0.5 * np.asarray(got[3][0])
    assert np.all(np.abs(x_t - np.asarray(x).T) <= bound * (1 + 1e-5)), np.max(np.abs(x_t - np.asarray(x).T) / bound)


# Float32 roundings (2^-24 each) of the magnitude sum that bound two orders of dx's sum; 61 seeds measured at most
# 0.13 of the bound (2 roundings).
GATHER_GRADIENT_ROUNDINGS = 16


def test_gather_gradient_is_the_summed_dx_reduce_scattered(mesh):
  """Each device reads the whole gathered x with its own weights; dx of its rows sums every reader's."""
  kx, kw = jax.random.split(fresh_key())
  x, w = jax.random.normal(kx, (N * 8, 16)), jax.random.normal(kw, (N, 16, 16))  # one [16, 16] per device

  def loss(t, w_local):
    return jax.lax.psum(jnp.sum(jnp.tanh(gather_activation(t, None, AXIS) @ w_local[0])), AXIS)

  grad = jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(P(AXIS, None), P(AXIS)), out_specs=P(AXIS, None)))
  want = jax.grad(lambda x: sum(jnp.sum(jnp.tanh(x @ w[d])) for d in range(N)))(x)
  # Two float32 programs (one jitted under shard_map, one not) compute dx[m, k] = sum_d,j (1 - tanh^2) w_d[k, j]:
  # their products and sums round in other orders, within a few roundings of sum_d,j |w_d[k, j]| (each factor
  # 1 - tanh^2 is at most 1). A reader left out would move dx by a whole term (~0.1-5).
  magnitude = np.abs(np.asarray(w)).sum(axis=(0, 2))  # [K]
  err = np.abs(np.asarray(grad(x, w)) - np.asarray(want))
  bound = GATHER_GRADIENT_ROUNDINGS * 2.0**-24 * magnitude[None, :]
  assert np.all(err <= bound), np.max(err / bound)


def test_rms_norm_over_split_features_equals_the_whole_row(mesh):
  kx, ks = jax.random.split(fresh_key())
  x, scale = jax.random.normal(kx, (16, 64)), 1 + 0.1 * jax.random.normal(ks, (64,))
  want = fused.rms_norm(x, scale, 1e-5, jnp.float32)
  norm = lambda t, s: fused.rms_norm(t, s, 1e-5, jnp.float32, split=COLS)  # noqa: E731
  got = jax.jit(jax.shard_map(norm, mesh=mesh, in_specs=(P(None, AXIS), P(AXIS)), out_specs=P(None, AXIS)))(x, scale)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
