"""The single dispatch point: reference GEMM exactness, operand checks, backend selection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlowbit
from jaxlowbit_numerics.formats import QuantSpec
from pallas_kernels import dispatch, policy, reference
from pallas_kernels.dispatch import DispatchOptions
from helpers import fresh_key


def test_reference_int8_gemm_is_exact():
  k1, k2, k3, k4 = jax.random.split(fresh_key(), 4)
  a = jax.random.randint(k1, (96, 256), -127, 128).astype(jnp.int8)
  b = jax.random.randint(k2, (80, 256), -127, 128).astype(jnp.int8)
  sa = jax.random.uniform(k3, (96, 1), minval=0.5, maxval=2)
  sb = jax.random.uniform(k4, (80,), minval=0.5, maxval=2)
  out = reference.scaled_matmul_reference(a, sa, b, sb, jnp.float32)
  exact = np.asarray(a, np.int64) @ np.asarray(b, np.int64).T  # int64: no overflow possible
  np.testing.assert_allclose(out, exact * np.asarray(sa, np.float64) * np.asarray(sb, np.float64)[None], rtol=2e-7)
  one = jnp.ones((), jnp.float32)
  np.testing.assert_array_equal(reference.scaled_matmul_reference(a, one, b, one, jnp.int32), exact)


def test_reference_fp8_gemm_mixed_types():
  k1, k2 = jax.random.split(fresh_key())
  a = jax.random.normal(k1, (64, 128)).astype(jnp.float8_e4m3fn)
  b = jax.random.normal(k2, (32, 128)).astype(jnp.float8_e5m2)
  out = reference.scaled_matmul_reference(a, jnp.float32(0.5), b, jnp.float32(2.0), jnp.float32)
  exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64).T
  np.testing.assert_allclose(out, exact, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize(
    "a,b,sa,sb,err,match",
    [
        ((4, 8, jnp.int8), (3, 8, jnp.int8), (5,), (), ValueError, "a_scale"),
        ((4, 8, jnp.int8), (3, 9, jnp.int8), (), (), ValueError, "contraction"),
        ((4, 8, jnp.int8), (3, 8, jnp.float8_e4m3fn), (), (), TypeError, "int8 b"),
        ((4, 8, jnp.bfloat16), (3, 8, jnp.bfloat16), (), (), TypeError, "int8 or fp8"),
        ((4, 8, 2, jnp.int8), (3, 8, jnp.int8), (), (), ValueError, "2-D"),
    ],
)
def test_operand_errors(a, b, sa, sb, err, match):
  lhs = jnp.zeros(a[:-1], a[-1])
  rhs = jnp.zeros(b[:-1], b[-1])
  with pytest.raises(err, match=match):
    dispatch.scaled_matmul(lhs, jnp.ones(sa), rhs, jnp.ones(sb))


class _FakeGpu:
  platform = "gpu"
  device_kind = "fake GPU"

  def __init__(self, cc):
    self.compute_capability = cc


def _select(dtype, m: int, n: int, k: int, **kwargs) -> str:
  """``select_backend`` under the backend ``$JAXLOWBIT_BACKEND`` names (what a caller without options gets)."""
  return dispatch.select_backend(dtype, m, n, k, backend=dispatch.DispatchOptions.from_environment().backend, **kwargs)


@pytest.mark.parametrize(
    "env,device,dtype,expected",
    [
        (None, None, jnp.int8, "xla"),  # CPU
        ("pallas", None, jnp.int8, NotImplementedError),  # no Hopper here
        ("xla", _FakeGpu("9.0"), jnp.int8, "xla"),
        (None, _FakeGpu("9.0"), jnp.int8, "pallas"),
        ("auto", _FakeGpu("9.0"), jnp.int8, "pallas"),
        (None, _FakeGpu("9.0"), jnp.float8_e4m3fn, "pallas"),
        (None, _FakeGpu("8.0"), jnp.int8, "xla"),  # Ampere: XLA int8 path
        ("pallas", _FakeGpu("8.0"), jnp.int8, NotImplementedError),
        (None, _FakeGpu("8.0"), jnp.float8_e4m3fn, NotImplementedError),  # FP8 needs sm90
        ("cuda", None, jnp.int8, ValueError),
    ],
)
def test_backend_selection(monkeypatch, env, device, dtype, expected):
  if env is None:
    monkeypatch.delenv(policy.BACKEND_ENV, raising=False)
  else:
    monkeypatch.setenv(policy.BACKEND_ENV, env)
  if isinstance(expected, type):
    with pytest.raises(expected):
      _select(dtype, 256, 256, 256, device=device)
  else:
    assert _select(dtype, 256, 256, 256, device=device) == expected


def test_auto_backend_follows_the_measured_crossovers(monkeypatch):
  monkeypatch.delenv(policy.BACKEND_ENV, raising=False)
  hopper = _FakeGpu("9.0")
  assert _select(jnp.int8, 16, 4096, 4096, device=hopper) == "xla"  # mostly padding
  assert _select(jnp.float8_e4m3fn, 2048, 2048, 2048, device=hopper, per_tensor=True) == "xla"
  assert _select(jnp.float8_e4m3fn, 2048, 2048, 2048, device=hopper) == "pallas"
  assert _select(jnp.float8_e4m3fn, 8192, 8192, 8192, device=hopper, per_tensor=True) == "pallas"
  monkeypatch.setenv(policy.BACKEND_ENV, "pallas")
  assert _select(jnp.int8, 16, 4096, 4096, device=hopper) == "pallas"


def test_non_nvidia_gpu_falls_back_to_xla_with_a_warning(monkeypatch):
  monkeypatch.delenv(policy.BACKEND_ENV, raising=False)
  rocm = _FakeGpu("gfx942-unseen")  # a ROCm device reports its gfx target, not major.minor
  with pytest.warns(UserWarning, match="gfx942-unseen"):
    assert policy.compute_capability(rocm) is None
  assert _select(jnp.int8, 4096, 4096, 4096, device=rocm) == "xla"
  assert _select(jnp.float8_e4m3fn, 4096, 4096, 4096, device=rocm) == "xla"


def test_quantize_dispatch_matches_numerics():
  x = jax.random.normal(fresh_key(), (48, 80))
  spec = QuantSpec("int8")
  q, s = dispatch.quantize_rows(x, spec)
  q2, s2 = jaxlowbit.quantize_int8(x, axis=-1)
  np.testing.assert_array_equal(q, q2)
  np.testing.assert_array_equal(s, s2)
  qt, st = dispatch.quantize_cols_t(x, QuantSpec("float8_e4m3fn", power_of_two=True))
  q3, s3 = jaxlowbit.quantize_fp8(x, jnp.float8_e4m3fn, axis=0, power_of_two=True)
  assert qt.shape == (80, 48) and st.shape == (80, 1)
  np.testing.assert_array_equal(np.asarray(qt, np.float32), np.asarray(q3, np.float32).T)
  np.testing.assert_array_equal(st[:, 0], 1.0 / s3[0])


@pytest.mark.parametrize("m", [4, 16, 256])
@pytest.mark.parametrize("rows_t", [False, True], ids=["cols_t", "rows_t"])
def test_a_layers_rows_do_not_depend_on_the_transposed_request(m, rows_t, monkeypatch):
  """GPU dispatch (kernels in interpret mode): where the transposing kernel does not take the
  shape (M=4, 16) the rows still come from the rows kernel, as for a rows-only request, so a
  trained layer (rows + transposed copy) and its inference conversion (rows only) quantize alike."""
  from pallas_kernels import quantize as qk

  calls = []

  def recording(inputs, prologue, rows_spec, cols_spec, rows_t, split, maxima):  # dispatch's call of the kernel
    calls.append((rows_spec is not None, cols_spec is not None or rows_t))
    return qk.fused_quantize_kernel(inputs, prologue, rows_spec, cols_spec, rows_t, interpret=True, split=split,
                                    maxima=maxima)

  monkeypatch.setattr(policy, "quantize_on_kernel", lambda backend: True)
  monkeypatch.setattr(policy, "QUANTIZE_KERNEL_MIN_ROWS", 0)  # these few rows on the kernel too
  monkeypatch.setattr(dispatch, "_kernel", recording)
  spec = QuantSpec("int8", eps=1e-5) if rows_t else QuantSpec("int8")
  x = jax.random.normal(fresh_key(), (m, 1024)).astype(jnp.bfloat16)
  rows_only = dispatch.fused_quantize((x,), qk.Identity(), spec)[0]
  rows, transposed, _ = dispatch.fused_quantize((x,), qk.Identity(), spec, None if rows_t else spec, rows_t)
  np.testing.assert_array_equal(rows[0], rows_only[0])
  np.testing.assert_array_equal(rows[1], rows_only[1])
  want = qk.fused_quantize_reference((x,), qk.Identity(), spec, None if rows_t else spec, rows_t)[1]
  np.testing.assert_array_equal(transposed[0], want[0])
  np.testing.assert_array_equal(transposed[1], want[1])
  both = qk.supported(spec, m, 1024, transposed=True)
  assert calls == [(True, False), (True, both)], calls  # the rows kernel ran for both requests


@pytest.mark.parametrize("backend", ["auto", "pallas"])
def test_few_rows_are_quantized_by_xla_under_auto(monkeypatch, backend):
  """GPU dispatch (kernel in interpret mode): decode's 8 rows go to XLA under auto (the rows kernel would run one
  program), to the kernel when forced; 64 rows (policy.QUANTIZE_KERNEL_MIN_ROWS) to the kernel either way. The
  codes are the reference's in every case."""
  from pallas_kernels import quantize as qk

  calls = []

  def recording(inputs, prologue, rows_spec, cols_spec, rows_t, split, maxima):
    calls.append(inputs[0].shape[0])
    return qk.fused_quantize_kernel(inputs, prologue, rows_spec, cols_spec, rows_t, interpret=True, split=split,
                                    maxima=maxima)

  monkeypatch.setattr(policy, "quantize_on_kernel", lambda backend: True)
  monkeypatch.setattr(dispatch, "_kernel", recording)
  spec = QuantSpec("int8")
  for m in (8, policy.QUANTIZE_KERNEL_MIN_ROWS):
    x = jax.random.normal(jax.random.fold_in(fresh_key(), m), (m, 1024)).astype(jnp.bfloat16)
    q, s = dispatch.quantize_rows(x, spec, DispatchOptions(backend))
    want_q, want_s = qk.fused_quantize_reference((x,), qk.Identity(), spec)[0]
    np.testing.assert_array_equal(np.asarray(q), np.asarray(want_q))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(want_s))
  assert calls == ([policy.QUANTIZE_KERNEL_MIN_ROWS] if backend == "auto" else [8, policy.QUANTIZE_KERNEL_MIN_ROWS])


def test_prologue_values_use_the_kernel_where_it_tiles(monkeypatch):
  """GPU dispatch (kernel in interpret mode): SwiGLU's backward of ``[B, T, H]`` runs in the values
  kernel on ``[B*T, ...]`` and comes back in the input's leading shape; a shape it cannot tile
  (a half of 192 columns) gets the XLA reference."""
  from pallas_kernels import quantize as qk

  calls = []

  def recording(inputs, prologue):
    calls.append(tuple(a.shape for a in inputs))
    return qk.prologue_kernel(inputs, prologue, interpret=True)

  monkeypatch.setattr(policy, "quantize_on_kernel", lambda backend: True)
  monkeypatch.setattr(dispatch, "_values", recording)
  for h, tiles in ((256, True), (96, False)):
    kd, kg = jax.random.split(fresh_key())
    dh = jax.random.normal(kd, (2, 32, h)).astype(jnp.bfloat16)
    gate_up = jax.random.normal(kg, (2, 32, 2 * h)).astype(jnp.bfloat16)
    got = dispatch.prologue_values((dh, gate_up), qk.SwiGLUGrad())
    want = qk.SwiGLUGrad().reference((dh, gate_up))
    assert got.shape == (2, 32, 2 * h) and got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2.0**-7, atol=0)
    assert calls == ([((64, h), (64, 2 * h))] if tiles else []), calls
    calls.clear()


@pytest.mark.parametrize("backend, on_kernel", [("auto", False), ("auto", True), ("pallas", False)])
def test_ternary_weights_take_the_tile_kernel_where_the_policy_says(monkeypatch, backend, on_kernel):
  """GPU dispatch (kernel in interpret mode): BitNet's weight goes to the tile kernel under ``pallas`` or with
  policy.TERNARY_WEIGHTS_ON_KERNEL, to XLA under ``auto`` otherwise; the codes and the scale are quantize_ternary's
  either way, and a split weight (FSDP's global scale) never reaches the kernel."""
  from jaxlowbit_numerics.stats import Split
  from jaxlowbit_numerics.ternary import quantize_ternary
  from pallas_kernels import quantize as qk

  calls = []

  def recording(inputs, prologue, rows_spec, cols_spec, rows_t, split, maxima):
    calls.append(inputs[0].shape)
    return qk.fused_quantize_kernel(inputs, prologue, rows_spec, cols_spec, rows_t, interpret=True, split=split,
                                    maxima=maxima)

  monkeypatch.setattr(policy, "quantize_on_kernel", lambda backend: True)
  monkeypatch.setattr(policy, "TERNARY_WEIGHTS_ON_KERNEL", on_kernel)
  monkeypatch.setattr(dispatch, "_kernel", recording)
  spec = QuantSpec("int8", per_tensor=True, ternary=True)
  w = jax.random.normal(fresh_key(), (256, 512)) * 0.02
  qt, st = dispatch.quantize_cols_t(w, spec, DispatchOptions(backend))
  want_q, want_s = quantize_ternary(w)
  np.testing.assert_array_equal(np.asarray(qt), np.asarray(want_q.T))
  np.testing.assert_array_equal(np.asarray(st).reshape(()), np.asarray(want_s))
  assert calls == ([(256, 512)] if backend == "pallas" or on_kernel else [])
  with pytest.raises(NotImplementedError, match="global scale"):  # the reference refuses a split ternary weight
    dispatch.quantize_cols_t(w, spec, DispatchOptions(backend, split=Split(rows=("fsdp",))))
  assert len(calls) == (1 if backend == "pallas" or on_kernel else 0)


@pytest.mark.parametrize("backend", ["auto", "pallas", "xla"])
def test_ternary_weight_rows_only_where_the_kernel_runs(monkeypatch, backend):
  """quantize_ternary_weight asks for Wq's rows only where the tile kernel writes them in its pass: where the
  quantizers run on no kernel (no NVIDIA GPU, as here; the xla backend anywhere), TERNARY_WEIGHTS_ON_KERNEL does not
  matter and the backward transposes Wq^T as before."""
  from jaxlowbit_numerics.ternary import quantize_ternary

  monkeypatch.setattr(policy, "TERNARY_WEIGHTS_ON_KERNEL", True)
  monkeypatch.setattr(policy, "compute_capability", lambda device=None: None)  # no kernel device, on any runner
  w = jax.random.normal(fresh_key(), (128, 256)) * 0.02
  rows, (qt, st) = dispatch.quantize_ternary_weight(w, QuantSpec("int8", per_tensor=True, ternary=True),
                                                    DispatchOptions(backend))
  assert rows is None and not policy.ternary_weights_on_kernel(backend)
  want_q, want_s = quantize_ternary(w)
  np.testing.assert_array_equal(np.asarray(qt), np.asarray(want_q.T))
  np.testing.assert_array_equal(np.asarray(st).reshape(()), np.asarray(want_s))


def test_bitnet_weight_from_one_kernel_pass_keeps_the_xla_paths_numbers(monkeypatch):
  """With the ternary tile kernel on (interpret mode), BitNet's forward takes Wq^T and Wq from one pass and its
  backward reads Wq without transposing: output, dx and dW equal the XLA path's bit for bit. (Other quantizations go
  to their reference here, so only the weight's path differs.)"""
  from jaxlowbit import BitNet, quantized_matmul
  from pallas_kernels import quantize as qk

  kx, kw, kg = jax.random.split(fresh_key(), 3)
  x = jax.random.normal(kx, (64, 128)).astype(jnp.bfloat16)
  w = jax.random.normal(kw, (128, 256)) * 0.02
  g = jax.random.normal(kg, (64, 256)).astype(jnp.bfloat16)

  def run():
    y, vjp = jax.vjp(lambda x, w: quantized_matmul(x, w, BitNet.presets["bitnet"]), x, w)
    return (y, *vjp(g))

  want = jax.jit(lambda: run())()  # a new function object per trace: jit's cache must not hand back the first
  calls = []

  def recording(inputs, prologue, rows_spec, cols_spec, rows_t, split, maxima):
    spec = rows_spec or cols_spec
    if not spec.ternary:
      return qk.fused_quantize_reference(inputs, prologue, rows_spec, cols_spec, rows_t, split)
    calls.append((rows_spec is not None, cols_spec is not None))
    return qk.fused_quantize_kernel(inputs, prologue, rows_spec, cols_spec, rows_t, interpret=True, split=split,
                                    maxima=maxima)

  monkeypatch.setattr(policy, "quantize_on_kernel", lambda backend: True)
  monkeypatch.setattr(policy, "TERNARY_WEIGHTS_ON_KERNEL", True)
  monkeypatch.setattr(dispatch, "_kernel", recording)
  got = jax.jit(lambda: run())()
  assert calls == [(True, True)]  # one pass, both layouts
  for name, a, b in zip(("y", "dx", "dw"), got, want):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)
