"""The single dispatch point: reference GEMM exactness, operand checks, backend selection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch, reference
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


def test_backend_env(monkeypatch):
  a = jnp.zeros((4, 8), jnp.int8)
  monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)
  assert dispatch.requested_backend() == "auto"
  assert dispatch.select_backend(a, a) == "xla"
  monkeypatch.setenv(dispatch.BACKEND_ENV, "XLA")
  assert dispatch.select_backend(a, a) == "xla"
  monkeypatch.setenv(dispatch.BACKEND_ENV, "cuda")
  with pytest.raises(ValueError, match="JAXLOWBIT_BACKEND"):
    dispatch.requested_backend()
