"""CPU guards for the Pallas kernels: quantizers in interpret mode, GEMM lowering for sm90.

The Hopper GEMM cannot execute on CPU (Mosaic GPU's interpreter does not take K-major
8-bit wgmma operands on jax 0.10.2), so CI lowers it for CUDA, which runs all of Mosaic
GPU's Python-side checks (layouts, transforms, shared-memory budget). Its numerics are
proven by tests/test_kernels_gpu.py on the GPU runner.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlowbit_numerics.formats import QuantSpec
from jaxlowbit_numerics.stats import Split
from jaxlowbit_numerics.ternary import quantize_ternary
from pallas_kernels import quantize as qk
from pallas_kernels import tuning
from pallas_kernels.reference import quantize_cols_t_reference, quantize_rows_reference
from helpers import bf16_values_close, fresh_key, quantized_close, rel_err

SPECS = [QuantSpec("int8"), QuantSpec("float8_e4m3fn", power_of_two=True), QuantSpec("float8_e5m2")]


@pytest.fixture(params=["rows", "tiles"])
def column_scales(request, monkeypatch):
  """Runs a test with per-column scales from the rows kernel's partials, then from the tiled statistics pass."""
  every = frozenset({"Identity", "RmsNorm", "SwiGLU"})
  monkeypatch.setattr(tuning, "QUANTIZE_STATS_FROM_TILES", every if request.param == "tiles" else frozenset())
  return request.param


def _same(got, want):
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=str)
def test_quantize_kernels_interpret_match_reference(spec, dtype, column_scales):
  x = (jax.random.normal(fresh_key(), (128, 256)) * 5).astype(dtype)
  (q, s), (qt, st) = qk.quantize_rows_and_cols_t_kernel(x, spec, interpret=True)
  rq, rs = quantize_rows_reference(x, spec)
  cq, cs = quantize_cols_t_reference(x, spec)
  _same(q, rq)
  _same(qt, cq)
  np.testing.assert_allclose(s, rs, rtol=1e-6)
  np.testing.assert_allclose(st, cs, rtol=1e-6)
  q1, _ = qk.quantize_rows_kernel(x, spec, interpret=True)
  _same(q1, q)


def test_quantize_cols_t_per_tensor_interpret():
  x = jax.random.normal(fresh_key(), (128, 128))
  spec = QuantSpec("float8_e5m2", per_tensor=True)
  qt, st = qk.quantize_cols_t_kernel(x, spec, interpret=True)
  rq, rs = quantize_cols_t_reference(x, spec)
  _same(qt, rq)
  np.testing.assert_allclose(st, rs, rtol=1e-6)


def test_round_half_even_in_kernel():
  # amax 127 -> scale 1: x/scale lands exactly on .5 ties.
  row = jnp.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.0] * 8, jnp.float32)
  x = jnp.tile(row, (64, 1))
  q, _ = qk.quantize_rows_kernel(x, QuantSpec("int8"), interpret=True)
  np.testing.assert_array_equal(np.asarray(q)[0, :8], [0, 2, 2, 0, -2, -2, 126, 127])


def test_quantize_kernel_nan_row_interpret():
  x = jax.random.normal(fresh_key(), (64, 128)).at[9, 3].set(jnp.nan)
  q, s = qk.quantize_rows_kernel(x, QuantSpec("int8"), interpret=True)
  with np.errstate(invalid="ignore"):
    deq = np.asarray(q, np.float32) * np.asarray(s)
  assert np.all(np.isnan(deq[9])) and np.all(np.isfinite(np.delete(deq, 9, axis=0)))


def test_supported_shapes():
  assert qk.supported(QuantSpec("int8"), 128, 256, transposed=False)
  assert not qk.supported(QuantSpec("int8"), 102, 256, transposed=False)  # rows per program
  assert not qk.supported(QuantSpec("int8"), 100, 256, transposed=True)  # transposing tiles
  assert not qk.supported(QuantSpec("int8", per_tensor=True), 128, 256, transposed=False)
  assert qk.supported(QuantSpec("int8", per_tensor=True), 128, 256, transposed=True)
  ternary = QuantSpec("int8", per_tensor=True, ternary=True)
  assert qk.supported(ternary, 128, 256, transposed=True)  # a weight: the tile pass after XLA's abs-mean
  assert not qk.supported(ternary, 128, 256, transposed=False)  # rows alone: XLA's elementwise pass
  assert not qk.supported(ternary, 100, 256, transposed=True)  # tiles
  assert not qk.supported(ternary, 128, 256, transposed=True, split=Split(rows=("fsdp",)))  # FSDP's global scale


TERNARY = QuantSpec("int8", per_tensor=True, ternary=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=str)
def test_ternary_weight_tile_kernel_interpret_is_quantize_ternary(dtype):
  """BitNet's weight quantized by the tile kernel (XLA's abs-mean, one tiled pass) == quantize_ternary, codes bit
  for bit in both layouts and the same scale: the kernel multiplies by the scale's reciprocal, which is what XLA
  computes for the reference's division (no tie needs bounding: both round the same float32 product)."""
  w = (jax.random.normal(fresh_key(), (256, 384)) * 0.02).astype(dtype)
  (q, s), (qt, st) = qk.quantize_rows_and_cols_t_kernel(w, TERNARY, interpret=True)
  want_q, want_s = quantize_ternary(w)
  _same(q, want_q)
  _same(qt, want_q.T)
  assert s.shape == st.shape == (1, 1)
  np.testing.assert_array_equal(np.asarray(s)[0, 0], np.asarray(want_s))
  np.testing.assert_array_equal(np.asarray(st)[0, 0], np.asarray(want_s))
  qt_only, _ = qk.quantize_cols_t_kernel(w, TERNARY, interpret=True)
  _same(qt_only, qt)
  assert set(np.unique(np.asarray(q))) <= {-1, 0, 1}


def test_ternary_weight_tile_kernel_rounds_ties_to_even_and_clips():
  """|w| / scale on exact ties: 0.5 -> 0, 1.5 -> 2 -> 1 (clipped), 2.5 -> 2 -> 1; 7 -> 1. The row's abs-mean is
  exactly 1 (16 / 16), so the scale is 1 and the ratios are the values themselves."""
  row = jnp.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 7.0] + [0.0] * 9, jnp.float32)
  w = jnp.tile(row, (32, 8))
  q, s = quantize_ternary(w)
  (kq, ks), _ = qk.quantize_rows_and_cols_t_kernel(w, TERNARY, interpret=True)
  assert float(ks[0, 0]) == float(s) == 1.0
  np.testing.assert_array_equal(np.asarray(kq)[0, :8], [0, 1, 1, 0, -1, -1, 1, 0])
  _same(kq, q)


def test_ternary_weight_tile_kernel_nan_weight_is_nan_everywhere():
  """A NaN weight makes the abs-mean scale NaN, as in the reference: the weight dequantizes to NaN, not to codes."""
  w = (jax.random.normal(fresh_key(), (64, 128)) * 0.02).at[5, 7].set(jnp.nan)
  (q, s), (qt, st) = qk.quantize_rows_and_cols_t_kernel(w, TERNARY, interpret=True)
  assert np.isnan(np.asarray(s)).all() and np.isnan(np.asarray(st)).all()
  _same(q, quantize_ternary(w)[0])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn], ids=str)
def test_hopper_gemm_lowers_for_sm90(dtype):
  from pallas_kernels import hopper_gemm

  a = jax.ShapeDtypeStruct((512, 256), dtype)
  b = jax.ShapeDtypeStruct((512, 256), dtype)
  scale = jax.ShapeDtypeStruct((512,), jnp.float32)
  fn = jax.jit(functools.partial(hopper_gemm.scaled_matmul_hopper, out_dtype=jnp.bfloat16, sms=132))
  text = fn.trace(a, scale, b, scale).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text



@pytest.mark.timeout(300)
def test_kernels_trace_and_lower_inside_shard_map():
  """Under shard_map (check_vma on, as jaxlowbit.fsdp runs the model) every kernel traces and lowers for sm90.

  pallas_call needs its outputs' varying mesh axes there (pallas_kernels/vma.py); the
  interpreter cannot run under check_vma in jax 0.10.2, so this lowers for CUDA instead.
  """
  from jax.sharding import NamedSharding, PartitionSpec as P

  from pallas_kernels import hopper_gemm, int8_gemv, w8a16

  if jax.default_backend() != "cpu":
    pytest.skip("lowers for CUDA from a CPU host; on a GPU tests/test_kernels_gpu.py runs the kernels under shard_map")
  mesh = jax.make_mesh((2,), ("x",))
  rows, replicated = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
  x = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16, sharding=rows)
  sx = jax.ShapeDtypeStruct((512,), jnp.float32, sharding=rows)
  wq = jax.ShapeDtypeStruct((256, 256), jnp.int8, sharding=replicated)  # [N, K]
  sw = jax.ShapeDtypeStruct((256,), jnp.float32, sharding=replicated)
  spec = QuantSpec("int8")

  def local(x, sx, wq, sw):
    (q, s), (qt, _) = qk.quantize_rows_and_cols_t_kernel(x, spec)
    q_rows, _ = qk.quantize_rows_kernel(x, spec)
    y16 = w8a16.w8a16_matmul_kernel(x, wq, sw, jnp.float32)
    y8 = int8_gemv.a8w8_matmul_kernel(q[:8], s[:8], wq, sw, jnp.float32)
    y = hopper_gemm.scaled_matmul_hopper(q, s, wq, sw, out_dtype=jnp.bfloat16, sms=132)
    for out in (q, s, qt, q_rows, y16, y8, y):  # a custom_vjp backward must match its varying primal inputs
      assert jax.typeof(out).mat.varying == {"x"}, jax.typeof(out)
    return q, qt.T, q_rows, y16, y8, y

  sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("x"), P("x"), P(), P()), out_specs=P("x")))
  text = sharded.trace(x, sx, wq, sw).lower(lowering_platforms=("cuda",)).as_text()
  kernels = ["jaxlowbit_quantize_rows", "jaxlowbit_quantize_cols_t", "jaxlowbit_w8a16_matmul", "jaxlowbit_a8w8_matmul",
             "mosaic_gpu"]
  if tuning.quantize_stats_from_tiles(qk.Identity()):
    kernels.append("jaxlowbit_quantize_stats")
  for kernel in kernels:
    assert kernel in text, kernel


# ---------------------------------------------------------------------------------------------
# Fused prologues (RMSNorm, SwiGLU) in interpret mode against their XLA reference.

INT8 = QuantSpec("int8")
E4M3_POW2 = QuantSpec("float8_e4m3fn", power_of_two=True)
E4M3_TENSOR = QuantSpec("float8_e4m3fn", per_tensor=True)
BITNET = QuantSpec("int8", eps=1e-5)
# (rows spec, cols spec, rows_t): INT8, FP8 rowwise, FP8 tensorwise, BitNet, a transposed copy only.
LAYOUTS = [(INT8, INT8, False), (E4M3_POW2, E4M3_POW2, False), (E4M3_TENSOR, E4M3_TENSOR, False),
           (BITNET, None, True), (None, INT8, False)]


def _check_fused(inputs, prologue, rows_spec, cols_spec, rows_t):
  got = qk.fused_quantize_kernel(inputs, prologue, rows_spec, cols_spec, rows_t, interpret=True)
  want = qk.fused_quantize_reference(inputs, prologue, rows_spec, cols_spec, rows_t)
  y = prologue.reference(inputs)
  for g, w, spec, oriented in zip(got[:2], want[:2], (rows_spec, cols_spec or rows_spec), (y, y.T)):
    assert (g is None) == (w is None)
    if g is not None:
      quantized_close(g, w, oriented, spec)
  if got[2] is not None:  # rstd: float32 sums of 256 squares in two orders (<= 256 ulps apart), halved by rsqrt
    np.testing.assert_allclose(got[2], want[2], rtol=256 * 2.0**-24)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rows_spec, cols_spec, rows_t", LAYOUTS, ids=str)
def test_fused_rms_norm_quantize_interpret_matches_reference(rows_spec, cols_spec, rows_t, column_scales):
  kx, kg = jax.random.split(fresh_key())
  x = (jax.random.normal(kx, (128, 256)) * 3).astype(jnp.bfloat16)
  gamma = 1 + 0.2 * jax.random.normal(kg, (256,))
  _check_fused((x, gamma), qk.RmsNorm(1e-5, jnp.dtype(jnp.bfloat16)), rows_spec, cols_spec, rows_t)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rows_spec, cols_spec, rows_t", LAYOUTS, ids=str)
def test_fused_swiglu_quantize_interpret_matches_reference(rows_spec, cols_spec, rows_t, column_scales):
  gate_up = (jax.random.normal(fresh_key(), (128, 256)) * 2).astype(jnp.bfloat16)
  _check_fused((gate_up,), qk.SwiGLU(), rows_spec, cols_spec, rows_t)


@pytest.mark.timeout(300)
def test_fused_relu2_quantize_interpret_matches_reference(column_scales):
  gate_up = (jax.random.normal(fresh_key(), (128, 256)) * 2).astype(jnp.bfloat16)
  _check_fused((gate_up,), qk.SwiGLU("relu2"), BITNET, None, True)  # the layout BitNet's down reads


def test_fused_kernel_nan_row_interpret(column_scales):
  x = jax.random.normal(fresh_key(), (64, 128)).at[5, 7].set(jnp.nan).astype(jnp.bfloat16)
  rows, cols, _ = qk.fused_quantize_kernel((x, jnp.ones(128)), qk.RmsNorm(1e-5, jnp.dtype(jnp.bfloat16)), INT8, INT8,
                                           interpret=True)
  with np.errstate(invalid="ignore"):
    deq = np.asarray(rows[0], np.float32) * np.asarray(rows[1])
  assert np.all(np.isnan(deq[5])) and np.all(np.isfinite(np.delete(deq, 5, axis=0)))


def test_quantize_nan_element_interpret(column_scales):
  """A NaN element makes its row (rows layout) and its column (transposed layout) dequantize to NaN, nothing else."""
  x = jax.random.normal(fresh_key(), (128, 256)).at[5, 7].set(jnp.nan).astype(jnp.bfloat16)
  (q, s), (qt, st) = qk.quantize_rows_and_cols_t_kernel(x, INT8, interpret=True)
  with np.errstate(invalid="ignore"):
    rows = np.asarray(q, np.float32) * np.asarray(s)
    cols = np.asarray(qt, np.float32) * np.asarray(st)
  assert np.all(np.isnan(rows[5])) and np.all(np.isfinite(np.delete(rows, 5, axis=0)))
  assert np.all(np.isnan(cols[7])) and np.all(np.isfinite(np.delete(cols, 7, axis=0)))


def _swiglu_grad_inputs(rows, h):
  kd, kg = jax.random.split(fresh_key())
  return (jax.random.normal(kd, (rows, h)).astype(jnp.bfloat16),
          (jax.random.normal(kg, (rows, 2 * h)) * 2).astype(jnp.bfloat16))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("activation", qk.GATE_ACTIVATIONS)
def test_swiglu_grad_values_interpret_match_reference(activation):
  inputs = _swiglu_grad_inputs(64, 256)
  got = qk.prologue_kernel(inputs, qk.SwiGLUGrad(activation), interpret=True)
  want = qk.SwiGLUGrad(activation).reference(inputs)
  assert got.shape == want.shape == (64, 512) and got.dtype == want.dtype == jnp.bfloat16
  bf16_values_close(got, want)
  # The reference is the autodiff gradient of the gated activation, rounded once.
  dh, gate_up = inputs
  forward = lambda g: qk.SwiGLU(activation).reference((g,)).astype(jnp.float32)  # noqa: E731
  exact = jax.vjp(forward, gate_up.astype(jnp.float32))[1](dh.astype(jnp.float32))[0]
  bf16_values_close(want, exact.astype(jnp.bfloat16))


def _swiglu_norm_grad_inputs(rows, h, activation, eps=1e-5):
  """The backward's inputs as the forward of RMSNorm(act(gate) * up) leaves them: h rounded, rstd, the row term."""
  dy, gate_up = _swiglu_grad_inputs(rows, h)
  gamma = 1 + 0.1 * jax.random.normal(fresh_key(), (h,))
  act = qk.SwiGLU(activation).reference((gate_up,))
  a32, dy32 = act.astype(jnp.float32), dy.astype(jnp.float32)
  rstd = jax.lax.rsqrt(jnp.mean(a32 * a32, axis=-1) + eps)
  row_mean = jnp.mean(dy32 * gamma * (a32 * rstd[:, None]), axis=-1)
  return dy, act, gate_up, gamma, rstd, row_mean


@pytest.mark.timeout(300)
@pytest.mark.parametrize("activation", qk.GATE_ACTIVATIONS)
def test_swiglu_norm_grad_interpret_matches_reference_and_autodiff(activation):
  """BitNet's ffn_sub_norm backward fused with SwiGLU's: the kernel against its XLA reference (bf16 values up to a
  moved rounding, d gamma's partial sums up to float32 order), and the reference against float32 autodiff of the
  unrounded RMSNorm(act(gate) * up) (the forward's h and the norm's dh are each rounded to bf16 once)."""
  eps = 1e-5
  inputs = _swiglu_norm_grad_inputs(64, 256, activation, eps)
  prologue = qk.SwiGLUNormGrad(activation)
  got, partials = qk.prologue_kernel(inputs, prologue, interpret=True)
  want, dgamma = prologue.reference(inputs)
  tile_rows = tuning.prologue_tile_config(prologue)[0]
  assert got.shape == want.shape == (64, 512) and got.dtype == want.dtype == jnp.bfloat16
  assert partials.shape == (64 // tile_rows, 256) and partials.dtype == jnp.float32
  bf16_values_close(got, want, steps=2)  # dh is rounded to bf16, then d gate_up: a moved first rounding carries
  np.testing.assert_allclose(partials.sum(axis=0), dgamma[0], rtol=1e-5, atol=1e-5 * np.abs(dgamma).max())
  dy, _, gate_up, gamma, _, _ = inputs

  def forward(gu, g):
    gate, up = jnp.split(gu, 2, axis=-1)
    a = qk.gate_activation(gate, activation) * up
    return a * jax.lax.rsqrt(jnp.mean(a * a, axis=-1, keepdims=True) + eps) * g

  exact_gu, exact_gamma = jax.vjp(forward, gate_up.astype(jnp.float32), gamma)[1](dy.astype(jnp.float32))
  assert rel_err(want, exact_gu) <= 2 * 2.0**-8
  assert rel_err(dgamma[0], exact_gamma) <= 2.0**-8


@pytest.mark.timeout(300)
def test_swiglu_norm_grad_maxima_are_the_written_gradients_amaxes():
  """With ``maxima`` the values kernel also writes per-tile amaxes of d gate_up: reduced, they equal the amaxes of
  the bf16 values it wrote (exactly: the same values), and quantizing those values with them gives the codes of the
  quantizer's own statistics pass, bit for bit (both layouts). Its values are the plain kernel's up to a moved
  rounding: the two programs compile apart (XLA:CPU here), and about one run in five a float32 ulp of dh lands on
  a bf16 rounding boundary in one and not the other (seen: 2 of 32768 values, one bf16 step)."""
  inputs = _swiglu_norm_grad_inputs(64, 256, "silu")
  d_gate_up, dgamma, rowmax, colmax = qk.prologue_kernel(inputs, qk.SwiGLUNormGrad("silu", maxima=True),
                                                          interpret=True)
  plain, plain_dgamma = qk.prologue_kernel(inputs, qk.SwiGLUNormGrad("silu"), interpret=True)
  bf16_values_close(d_gate_up, plain, steps=2)  # dh rounded to bf16, then d gate_up: a moved first rounding carries
  np.testing.assert_allclose(dgamma, plain_dgamma, rtol=1e-6, atol=1e-6 * np.abs(plain_dgamma).max())
  tile_c = tuning.prologue_tile_config(qk.SwiGLUNormGrad())[1]
  assert rowmax.shape == (256 // tile_c, 64) and colmax.shape[1] == 512
  maxima = (rowmax.max(axis=0), colmax.max(axis=0))
  for got, want in zip(maxima, qk.amaxes(d_gate_up)):
    np.testing.assert_array_equal(got, want)
  spec = QuantSpec("int8")
  measured = qk.fused_quantize_kernel((d_gate_up,), qk.Identity(), spec, spec, interpret=True, maxima=maxima)
  own = qk.fused_quantize_kernel((d_gate_up,), qk.Identity(), spec, spec, interpret=True)
  for got, want in zip(jax.tree.leaves(measured), jax.tree.leaves(own)):
    np.testing.assert_array_equal(got, want)
  wrong = qk.fused_quantize_kernel((d_gate_up,), qk.Identity(), spec, spec, interpret=True,
                                   maxima=(2 * maxima[0], 2 * maxima[1]))
  assert not np.array_equal(wrong[0][0], own[0][0])  # the given maxima are what the codes are scaled by


def test_swiglu_norm_grad_with_maxima_lowers_for_cuda():
  """The values kernel with its maxima outputs lowers to one Triton call."""
  shapes = [((2048, 1024), jnp.bfloat16), ((2048, 1024), jnp.bfloat16), ((2048, 2048), jnp.bfloat16),
            ((1024,), jnp.float32), ((2048,), jnp.float32), ((2048,), jnp.float32)]
  args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
  lowered = jax.jit(lambda *a: qk.prologue_kernel(a, qk.SwiGLUNormGrad(maxima=True))).trace(*args).lower(
      lowering_platforms=("cuda",))
  assert lowered.as_text().count("__gpu$xla.gpu.triton") == 1


def test_prologue_kernel_rejects_what_it_cannot_tile():
  with pytest.raises(ValueError, match="must divide by the tile"):
    qk.prologue_kernel(_swiglu_grad_inputs(64, 192), qk.SwiGLUGrad(), interpret=True)  # a half of 192 columns
  with pytest.raises(ValueError, match="by blocks"):
    qk.prologue_kernel((jnp.ones((64, 128)), jnp.ones(128)), qk.RmsNorm(1e-5, jnp.dtype(jnp.float32)), interpret=True)


def test_ternary_weight_tile_kernel_lowers_for_cuda():
  """The ternary tile pass (PTX rounding, clip to [-1, 1], int8 stores of both layouts) lowers to a Triton call."""
  w = jax.ShapeDtypeStruct((2048, 3072), jnp.float32)
  lowered = jax.jit(lambda w: qk.quantize_rows_and_cols_t_kernel(w, TERNARY)).trace(w).lower(
      lowering_platforms=("cuda",))
  assert "__gpu$xla.gpu.triton" in lowered.as_text()
