"""The CUDA-core ternary GEMV (pallas_kernels/ternary_gemv.py) on CPU: Pallas interpreter and CUDA lowering.

Numerics: int32 sums are exact and the float32 epilogue runs the reference's operations in its order, so the
kernel is bit-identical to ``int8_gemv.a8w2_matmul_reference`` on fresh random operands, with and without
split-K, for every M it takes (1..4).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from jaxlowbit_numerics.ternary import pack_2bit
from pallas_kernels import inference_dispatch, int8_gemv, policy, ternary_gemv
from helpers import fresh_key

H100 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                                                  platform="gpu"))


def _operands(key, m, n, k):
  kx, kw, ks = jax.random.split(key, 3)
  xq = jax.random.randint(kx, (m, k), -127, 128, jnp.int32).astype(jnp.int8)
  w = jax.random.randint(kw, (n, k), -1, 2, jnp.int32).astype(jnp.int8)
  x_scale = jax.random.uniform(ks, (m, 1), minval=1e-3, maxval=1e-2)
  return xq, x_scale, pack_2bit(w, axis=-1), jnp.float32(0.037)


@pytest.mark.parametrize("m,n,k,split", [(1, 64, 512, 1), (2, 128, 2048, 4), (3, 64, 1024, 2), (4, 32, 256, 1)])
def test_gemv_interpret_is_bit_identical_to_the_reference(m, n, k, split):
  xq, x_scale, w_packed, w_scale = _operands(fresh_key(), m, n, k)
  config = dataclasses.replace(ternary_gemv.config_for(n, k // 4, sms=4), split_k=split)
  for out_dtype in (jnp.bfloat16, jnp.float32):
    got = ternary_gemv.a8w2_gemv_kernel(xq, x_scale, w_packed, w_scale, out_dtype, config=config, interpret=True)
    want = int8_gemv.a8w2_matmul_reference(xq, x_scale, w_packed, w_scale, out_dtype)
    assert got.dtype == want.dtype and got.shape == (m, n)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("k,n", [(4096, 14336), (14336, 4096)])
def test_gemv_lowers_for_cuda(m, k, n):
  """Pallas -> Triton IR for an H100 at the Llama-3-8B MLP shapes."""
  f = jax.ShapeDtypeStruct
  shapes = (f((m, k), jnp.int8), f((m, 1), jnp.float32), f((n, k // 4), jnp.int8), f((), jnp.float32))
  with jax.sharding.use_abstract_mesh(H100):
    text = jax.jit(ternary_gemv.a8w2_gemv_kernel).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text


def test_gemv_refuses_more_rows_than_it_keeps_sums_for():
  xq, x_scale, w_packed, w_scale = _operands(fresh_key(), ternary_gemv.MAX_M + 1, 64, 512)
  with pytest.raises(ValueError, match="at most 4"):
    ternary_gemv.a8w2_gemv_kernel(xq, x_scale, w_packed, w_scale, interpret=True)


def test_dispatch_leaves_the_gemv_off_until_measured():
  """The dispatch takes the GEMV only for M <= policy.TERNARY_GEMV_MAX_M, 0 until a GPU run says otherwise."""
  assert policy.TERNARY_GEMV_MAX_M == 0
  assert not inference_dispatch.ternary_gemv_wanted(1, 14336, 1024)
