"""Pallas kernels on the GPU (marker ``gpu``; skipped on CPU): exactness and tolerances."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlowbit import BitNet, Float8, Int8MixedPrecision, quantized_matmul
from jaxlowbit_numerics.formats import QuantSpec
from pallas_kernels import policy
from pallas_kernels.reference import quantize_cols_t_reference, quantize_rows_reference, scaled_matmul_reference
from helpers import (bf16_values_close, fresh_key, quantized_close, record_measured_quantizations, rel_err,
                     sqnr_db)

pytestmark = pytest.mark.gpu


def _hopper():
  return policy.compute_capability() is not None and policy.compute_capability() >= 9


needs_hopper = pytest.mark.skipif(not _hopper() if jax.devices()[0].platform == "gpu" else False,
                                  reason="needs a Hopper GPU")


def _int8(key, shape):
  return jax.random.randint(key, shape, -127, 128, jnp.int32).astype(jnp.int8)


@needs_hopper
@pytest.mark.parametrize("m,n,k", [(256, 256, 128), (512, 768, 1024), (1024, 256, 384), (200, 300, 100), (8, 64, 256)])
def test_int8_gemm_exact_int32(m, n, k):
  from pallas_kernels.hopper_gemm import scaled_matmul_hopper

  ka, kb = jax.random.split(fresh_key())
  a, b = _int8(ka, (m, k)), _int8(kb, (n, k))
  one = jnp.ones((), jnp.float32)
  # float32 output with unit scales: every int32 sum below 2**24 is represented exactly.
  got = scaled_matmul_hopper(a, one, b, one, jnp.float32)
  want = np.asarray(a, np.int64) @ np.asarray(b, np.int64).T
  assert np.max(np.abs(want)) < 2**24
  np.testing.assert_array_equal(np.asarray(got, np.int64), want)


@needs_hopper
@pytest.mark.parametrize("dtypes", [(jnp.int8, jnp.int8), (jnp.float8_e4m3fn, jnp.float8_e4m3fn),
                                    (jnp.float8_e4m3fn, jnp.float8_e5m2)], ids=str)
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32], ids=str)
@pytest.mark.parametrize("per_tensor", [False, True])
def test_scaled_gemm_matches_reference(dtypes, out_dtype, per_tensor):
  from pallas_kernels.hopper_gemm import scaled_matmul_hopper

  ka, kb, ks, kt = jax.random.split(fresh_key(), 4)
  m, n, k = 512, 384, 640
  if dtypes[0] == jnp.int8:
    a, b = _int8(ka, (m, k)), _int8(kb, (n, k))
  else:
    a = jax.random.normal(ka, (m, k)).astype(dtypes[0])
    b = jax.random.normal(kb, (n, k)).astype(dtypes[1])
  sa = jax.random.uniform(ks, () if per_tensor else (m, 1), minval=0.5, maxval=2.0)
  sb = jax.random.uniform(kt, () if per_tensor else (n, 1), minval=0.5, maxval=2.0)
  got = scaled_matmul_hopper(a, sa, b, sb, out_dtype)
  want = scaled_matmul_reference(a, sa, b, sb, jnp.float32)
  assert got.dtype == out_dtype and got.shape == (m, n)
  # bf16 output rounds each element once (2**-9). int8 sums are exact; Hopper's FP8 wgmma
  # accumulates with fewer than 23 mantissa bits, so FP8 float32 outputs differ at ~4e-4.
  if out_dtype == jnp.bfloat16:
    tol = 4e-3
  else:
    tol = 1e-6 if dtypes[0] == jnp.int8 else 2e-3
  assert rel_err(got, want) <= tol


@needs_hopper
@pytest.mark.parametrize("spec", [QuantSpec("int8"), QuantSpec("float8_e4m3fn", power_of_two=True),
                                  QuantSpec("float8_e5m2")], ids=str)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=str)
def test_quantize_kernels_match_reference(spec, dtype):
  from pallas_kernels import quantize as qk

  x = (jax.random.normal(fresh_key(), (256, 1536)) * 3).astype(dtype)
  (q, s), (qt, st) = qk.quantize_rows_and_cols_t_kernel(x, spec)
  rq, rs = quantize_rows_reference(x, spec)
  cq, cs = quantize_cols_t_reference(x, spec)
  for got, want in ((q, rq), (qt, cq)):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    # Division rounding may flip an exact .5 tie; never more than one step, and rarely.
    assert np.mean(got != want) < 1e-4
  np.testing.assert_allclose(s, rs, rtol=1e-6)
  np.testing.assert_allclose(st, cs, rtol=1e-6)
  q1, s1 = qk.quantize_rows_kernel(x, spec)
  np.testing.assert_array_equal(np.asarray(q1, np.float32), np.asarray(q, np.float32))
  qt1, _ = qk.quantize_cols_t_kernel(x, spec)
  np.testing.assert_array_equal(np.asarray(qt1, np.float32), np.asarray(qt, np.float32))


@needs_hopper
def test_quantize_kernel_nan_rows():
  from pallas_kernels import quantize as qk

  x = jax.random.normal(fresh_key(), (64, 256)).at[3, 17].set(jnp.nan)
  for spec in (QuantSpec("int8"), QuantSpec("float8_e4m3fn", power_of_two=True)):
    q, s = qk.quantize_rows_kernel(x, spec)
    with np.errstate(invalid="ignore", divide="ignore"):
      deq = np.asarray(q, np.float32) * np.asarray(s)
    assert np.all(np.isnan(deq[3])) and np.all(np.isfinite(np.delete(deq, 3, axis=0))), spec


RECIPES = [Int8MixedPrecision(), Float8("tensorwise"), Float8("rowwise"), Float8("rowwise_gw_hp"), BitNet(),
           BitNet(True, True)]


@needs_hopper
@pytest.mark.parametrize("recipe", RECIPES, ids=str)
@pytest.mark.parametrize("shape", [(512, 1024, 768), (300, 200, 136)], ids=str)
def test_all_three_matmuls_pallas_vs_xla(recipe, shape, monkeypatch):
  m, k, n = shape
  kx, kw, kg = jax.random.split(fresh_key(), 3)
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)
  g = jax.random.normal(kg, (m, n), jnp.bfloat16)

  def run(backend):
    monkeypatch.setenv(policy.BACKEND_ENV, backend)
    y, vjp = jax.vjp(lambda x, w: quantized_matmul(x, w, recipe), x, w)
    return (y, *vjp(g))

  if shape == (300, 200, 136):  # K = 200: no quantize kernel tiles x; forcing the kernels must say so
    with pytest.raises(ValueError, match="backend pallas: the .* quantize kernel cannot take"):
      run("pallas")
    pallas = jax.block_until_ready(run("auto"))  # the GEMM kernel where it wins, XLA's quantizers
  else:
    pallas = jax.block_until_ready(run("pallas"))
  xla = run("xla")
  for name, p, r in zip(("output", "grad_input", "grad_weight"), pallas, xla):
    # same quantization on both paths; only accumulation order and bf16 rounding differ
    assert sqnr_db(p, r) > 35, name


@needs_hopper
def test_vmap_and_jit_of_kernel_path(monkeypatch):
  monkeypatch.setenv(policy.BACKEND_ENV, "pallas")
  kx, kw = jax.random.split(fresh_key())
  xs = jax.random.normal(kx, (2, 256, 512), jnp.bfloat16)
  w = jax.random.normal(kw, (512, 256), jnp.float32) / 20
  f = jax.jit(jax.vmap(lambda x: quantized_matmul(x, w, Int8MixedPrecision())))
  assert "mosaic_gpu" in f.lower(xs).as_text(), "the Pallas GEMM runs under vmap"
  ys = f(xs)
  monkeypatch.setenv(policy.BACKEND_ENV, "xla")  # the reference: XLA, one problem at a time
  for i in range(2):
    want = jax.jit(lambda x: quantized_matmul(x, w, Int8MixedPrecision()))(xs[i])
    assert sqnr_db(ys[i], want) > 40


@needs_hopper
@pytest.mark.parametrize("recipe", [Int8MixedPrecision(), Float8("rowwise"), BitNet(True, True)], ids=str)
def test_kernel_path_under_shard_map(recipe, monkeypatch):
  """All three matmuls on the Pallas path inside shard_map (check_vma on, as in jaxlowbit.fsdp) match XLA."""
  from jax.sharding import PartitionSpec as P

  monkeypatch.setenv(policy.BACKEND_ENV, "pallas")
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("b",))
  kx, kw, kg = jax.random.split(fresh_key(), 3)
  rows = jax.sharding.NamedSharding(mesh, P("b"))
  x = jax.device_put(jax.random.normal(kx, (512 * len(devices), 1024), jnp.bfloat16), rows)
  w = jax.random.normal(kw, (1024, 768), jnp.float32) / 32
  g = jax.device_put(jax.random.normal(kg, (512 * len(devices), 768), jnp.bfloat16), rows)

  def local(x, w, g):
    y, vjp = jax.vjp(lambda x, w: quantized_matmul(x, w, recipe), x, w)
    dx, dw = vjp(g)
    return y, dx, jax.lax.psum(dw, "b")

  def run():  # traced afresh for each backend (the environment variable is read at trace time)
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P("b"), P(), P("b")), out_specs=(P("b"), P("b"), P()))
    return jax.block_until_ready(jax.jit(sharded)(x, w, g))

  pallas = run()
  monkeypatch.setenv(policy.BACKEND_ENV, "xla")
  xla = run()
  for name, p, r in zip(("output", "grad_input", "grad_weight"), pallas, xla):
    assert sqnr_db(p, r) > 35, name  # same quantization on both paths, as in test_all_three_matmuls_pallas_vs_xla


@needs_hopper
@pytest.mark.parametrize("op", ["rmsnorm", "swiglu"])
@pytest.mark.parametrize("layout", ["int8", "fp8_rowwise", "fp8_tensorwise", "bitnet"])
def test_fused_quantize_kernels_match_reference_at_1b_shapes(op, layout):
  from pallas_kernels import quantize as qk

  kx, kg = jax.random.split(fresh_key())
  specs = {"int8": (QuantSpec("int8"), QuantSpec("int8"), False),
           "fp8_rowwise": (QuantSpec("float8_e4m3fn", power_of_two=True),) * 2 + (False,),
           "fp8_tensorwise": (QuantSpec("float8_e4m3fn", per_tensor=True),) * 2 + (False,),
           "bitnet": (QuantSpec("int8", eps=1e-5), None, True)}[layout]
  if op == "rmsnorm":
    inputs = (jax.random.normal(kx, (16384, 2048), jnp.bfloat16), 1 + 0.1 * jax.random.normal(kg, (2048,)))
    prologue = qk.RmsNorm(1e-5, jnp.dtype(jnp.bfloat16))
  else:
    inputs, prologue = (jax.random.normal(kx, (16384, 4096), jnp.bfloat16),), qk.SwiGLU()
  got = jax.jit(lambda *a: qk.fused_quantize_kernel(a, prologue, *specs))(*inputs)
  want = jax.jit(lambda *a: qk.fused_quantize_reference(a, prologue, *specs))(*inputs)
  y = jax.jit(prologue.reference)(inputs)
  for g, w, spec, oriented in zip(got[:2], want[:2], (specs[0], specs[1] or specs[0]), (y, y.T)):
    assert (g is None) == (w is None)
    if g is not None:  # rounding boundaries moved by the norm's sum order / exp's ulps
      quantized_close(g, w, oriented, spec, max_fraction=1e-3)


@needs_hopper
def test_swiglu_backward_values_kernel_matches_reference_at_1b_shapes():
  from pallas_kernels import quantize as qk

  kd, kg = jax.random.split(fresh_key())
  inputs = (jax.random.normal(kd, (16384, 8192), jnp.bfloat16), 2 * jax.random.normal(kg, (16384, 16384), jnp.bfloat16))
  got = jax.jit(lambda a: qk.prologue_kernel(a, qk.SwiGLUGrad()))(inputs)
  bf16_values_close(got, jax.jit(qk.SwiGLUGrad().reference)(inputs))


@needs_hopper
def test_swiglu_norm_grad_kernel_matches_reference_at_1b_shapes():
  """BitNet's ffn_sub_norm + SwiGLU backward on the 1B model's [16384, 5632] hidden activation."""
  from jaxlowbit import fused
  from pallas_kernels import quantize as qk

  kd, kg, ks = jax.random.split(fresh_key(), 3)
  dy = jax.random.normal(kd, (16384, 5632), jnp.bfloat16)
  gate_up = 2 * jax.random.normal(kg, (16384, 11264), jnp.bfloat16)
  gamma = 1 + 0.1 * jax.random.normal(ks, (5632,))
  h = qk.SwiGLU().reference((gate_up,))
  rstd = qk.RmsNorm(1e-5, jnp.dtype(jnp.bfloat16)).reference_stat((h, gamma))
  row_mean = fused._norm_row_mean(dy.astype(jnp.float32), h.astype(jnp.float32), gamma, rstd[:, None])[:, 0]
  inputs = (dy, h, gate_up, gamma, rstd, row_mean)
  got, partials = jax.jit(lambda a: qk.prologue_kernel(a, qk.SwiGLUNormGrad()))(inputs)
  want, dgamma = jax.jit(qk.SwiGLUNormGrad().reference)(inputs)
  bf16_values_close(got, want, steps=2)  # dh is rounded to bf16, then d gate_up: a moved first rounding carries
  atol = 1e-4 * float(jnp.max(jnp.abs(dgamma)))
  np.testing.assert_allclose(jnp.sum(partials, axis=0), dgamma[0], rtol=1e-4, atol=atol)
  # With its maxima (the gate_up linear's measured gradient): d gate_up as the plain kernel writes it up to a moved
  # rounding (two programs), the maxima exactly the amaxes of what it wrote, and the int8 quantization of those
  # values with them the statistics pass's, bit for bit.
  measured, _, rowmax, colmax = jax.jit(lambda a: qk.prologue_kernel(a, qk.SwiGLUNormGrad(maxima=True)))(inputs)
  bf16_values_close(measured, got, steps=2)
  maxima = (jnp.max(rowmax, axis=0), jnp.max(colmax, axis=0))
  for a, b in zip(maxima, jax.jit(qk.amaxes)(measured)):
    np.testing.assert_array_equal(a, b)
  spec = QuantSpec("int8")
  quantize = jax.jit(lambda g, m: qk.fused_quantize_kernel((g,), qk.Identity(), spec, spec, maxima=m))
  own = jax.jit(lambda g: qk.fused_quantize_kernel((g,), qk.Identity(), spec, spec))(measured)
  for a, b in zip(jax.tree.leaves(quantize(measured, maxima)), jax.tree.leaves(own)):
    np.testing.assert_array_equal(a, b)


def test_measured_gate_up_gradient_on_the_kernels_changes_nothing(monkeypatch):
  """BitNet's gate_up linear with its output gradient's amaxes measured by the fused ffn_sub_norm backward (the
  values kernel's maxima) against the statistics pass (policy off): loss and every gradient bit for bit, at a shape
  every kernel takes."""
  from jaxlowbit import fused

  kx, kg, ks, kd = jax.random.split(fresh_key(), 4)
  x = jax.random.normal(kx, (4096, 2048), jnp.bfloat16)
  w_gate_up = jax.random.normal(kg, (2048, 2 * 2048)) / 45
  scale = 1 + 0.1 * jax.random.normal(ks, (2048,))
  w_down = jax.random.normal(kd, (2048, 2048)) / 45
  recipe = BitNet.presets["bitnet"]
  given = record_measured_quantizations(monkeypatch)

  def loss(measured):
    def f(x, w_gate_up, scale, w_down):
      y = quantized_matmul(x, w_gate_up, recipe, measured=measured)
      h = fused.swiglu_rms_norm_for(y, scale, 1e-5, recipe, jnp.bfloat16)
      return jnp.sum(quantized_matmul(h, w_down, recipe).astype(jnp.float32) ** 2)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))

  args = (x, w_gate_up, scale, w_down)
  got = loss(True)(*args)
  assert any(given)
  want = loss(False)(*args)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)


@needs_hopper
@pytest.mark.parametrize("split_dim", ["rows", "cols"])
@pytest.mark.parametrize("layout", ["int8", "fp8_tensorwise"])
def test_fused_quantize_kernel_with_a_split_matrix_under_shard_map(layout, split_dim):
  """Tensor parallelism's quantization of a matrix split over devices, on the kernel: rows split (token rows:
  per-column and per-tensor amaxes) or columns split (features: per-row and per-tensor amaxes, the rows then
  written by the tiled pass); the amaxes are reduced over every GPU between its passes, so all devices' codes
  are those of the whole matrix (one GPU: the collective spans one device; the CPU suite checks 4 in interpret
  mode, tests/test_tensor_parallel.py)."""
  from jax.sharding import PartitionSpec as P

  from jaxlowbit_numerics.stats import Split
  from pallas_kernels import quantize as qk

  spec = {"int8": QuantSpec("int8"), "fp8_tensorwise": QuantSpec("float8_e4m3fn", per_tensor=True)}[layout]
  devices = jax.devices()
  mesh = jax.sharding.Mesh(np.asarray(devices), ("t",))
  x = jax.random.normal(fresh_key(), (1024 * len(devices), 2048), jnp.bfloat16) * jnp.linspace(0.1, 10, 2048)
  x = x.astype(jnp.bfloat16)
  split = Split(rows=("t",)) if split_dim == "rows" else Split(cols=("t",))
  if split_dim == "cols":
    x = x.T  # [2048, 1024 n]: the features split

  def local(t):
    (q, s), (qt, st), _ = qk.fused_quantize_kernel((t,), qk.Identity(), spec, spec, split=split)
    if split_dim == "cols":  # the reduced row scales and per-tensor ones: every device's copy
      return q, s[None], qt, st[None] if spec.per_tensor else st
    return q, s[None] if spec.per_tensor else s, qt, st[None]  # reduced scales: every device's copy

  if split_dim == "rows":
    rows_scale = P("t") if spec.per_tensor else P("t", None)
    out_specs = (P("t", None), rows_scale, P(None, "t"), P("t"))
  else:
    out_specs = (P(None, "t"), P("t"), P("t", None), P("t") if spec.per_tensor else P("t", None))
  f = jax.shard_map(local, mesh=mesh, in_specs=P("t", None) if split_dim == "rows" else P(None, "t"),
                    out_specs=out_specs)
  q, s, qt, st = jax.block_until_ready(jax.jit(f)(x))
  (q_w, s_w), (qt_w, st_w), _ = jax.jit(lambda a: qk.fused_quantize_reference((a,), qk.Identity(), spec, spec))(x)
  for got, want in ((q, q_w), (qt, qt_w)):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert (got != want).mean() <= 1e-3 and np.all(np.abs(got - want) <= np.maximum(1.0, 0.13 * np.abs(want)))
  reduced, local_scales = (s, st) if split_dim == "cols" else (st, s)
  reduced_w, local_w = (s_w, st_w) if split_dim == "cols" else (st_w, s_w)
  for copy in reduced:
    np.testing.assert_allclose(copy, reduced_w, rtol=1e-5)
  for copy in local_scales if spec.per_tensor else (local_scales,):
    np.testing.assert_allclose(copy, local_w, rtol=1e-5)



@needs_hopper
@pytest.mark.parametrize("rows_t", [False, True])
def test_fused_quantize_kernel_rows_only_over_split_columns(rows_t):
  """A row-parallel linear's input (columns split): the rows alone, or BitNet's rows with their transposed codes,
  from the measuring rows kernel and the tiled pass without the per-column copy; codes and scales those of the
  whole matrix, up to rounding ties."""
  from jax.sharding import PartitionSpec as P

  from jaxlowbit_numerics.stats import Split
  from pallas_kernels import quantize as qk

  spec = QuantSpec("int8", eps=1e-5) if rows_t else QuantSpec("int8")
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("t",))
  x = (jax.random.normal(fresh_key(), (2048, 1024 * len(jax.devices()))) * jnp.linspace(0.1, 10, 2048)[:, None])
  x = x.astype(jnp.bfloat16)

  def local(t):
    rows, transposed, _ = qk.fused_quantize_kernel((t,), qk.Identity(), spec, rows_t=rows_t, split=Split(cols=("t",)))
    return (rows[0], rows[1][None]) + ((transposed[0],) if rows_t else ())

  out_specs = (P(None, "t"), P("t")) + ((P("t", None),) if rows_t else ())
  got = jax.block_until_ready(jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(None, "t"), out_specs=out_specs))(x))
  (q_w, s_w), transposed_w, _ = jax.jit(lambda a: qk.fused_quantize_reference((a,), qk.Identity(), spec,
                                                                               rows_t=rows_t))(x)
  codes = [(got[0], q_w)] + ([(got[2], transposed_w[0])] if rows_t else [])
  for g, w in codes:
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert (g != w).mean() <= 1e-3 and np.all(np.abs(g - w) <= 1.0)
  for copy in got[1]:
    np.testing.assert_allclose(copy, s_w, rtol=1e-5)

@pytest.mark.parametrize("k,n", [(2048, 16384), (8192, 2048), (2048, 3072)])
def test_ternary_weight_tile_kernel_is_quantize_ternary_on_gpu(k, n):
  """BitNet's float32 weight at the 1B model's shapes: the tile kernel (PTX rounding, the scale's reciprocal) writes
  exactly quantize_ternary's codes in both layouts, with its scale (XLA rewrites the reference's division by the
  scale into the same multiplication)."""
  from jaxlowbit_numerics.ternary import quantize_ternary
  from pallas_kernels import quantize as qk

  spec = QuantSpec("int8", per_tensor=True, ternary=True)
  w = jax.random.normal(fresh_key(), (k, n), jnp.float32) * 0.02
  (q, s), (qt, st) = jax.jit(lambda w: qk.quantize_rows_and_cols_t_kernel(w, spec))(w)
  want_q, want_s = jax.jit(quantize_ternary)(w)
  np.testing.assert_array_equal(np.asarray(q), np.asarray(want_q))
  np.testing.assert_array_equal(np.asarray(qt), np.asarray(want_q).T)
  np.testing.assert_array_equal(np.asarray(s).reshape(()), np.asarray(want_s))
  np.testing.assert_array_equal(np.asarray(st).reshape(()), np.asarray(want_s))
