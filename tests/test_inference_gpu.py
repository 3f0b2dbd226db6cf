"""Inference kernels and converted models on the GPU (marker ``gpu``; skipped on CPU).

Exactness: the int8-activation kernels (A8W8, A8W2) are bit-identical to the XLA reference;
a BitNet layer converted to ternary reproduces its training forward bit for bit at decode M
(kernel) and large M (unpack + wgmma). W8A16 agrees with XLA within float32 summation order
plus one bf16 rounding.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlowbit
from jaxlowbit import BitNet, Int8MixedPrecision, inference
from jaxlowbit.inference.weights import BITNET_TOKENS
from jaxlowbit_numerics.ternary import pack_2bit
from pallas_kernels import dp4a_gemv, int8_gemv, policy, w8a16
from pallas_kernels.reference import quantize_rows_reference, scaled_matmul_reference
from helpers import (check_quantizing_gemvs_on_non_finite_rows, fresh_key, inference_kernel_table, rel_err,
                     tie_free_activations)

pytestmark = pytest.mark.gpu


def _sm80():
  return jax.devices()[0].platform == "gpu" and (policy.compute_capability() or 0) >= 8


needs_sm80 = pytest.mark.skipif(not _sm80() if jax.devices()[0].platform == "gpu" else False, reason="needs sm80+")


def _int8(key, shape):
  return jax.random.randint(key, shape, -127, 128, jnp.int32).astype(jnp.int8)


@needs_sm80
@pytest.mark.parametrize("m", [1, 2, 7, 16, 33, 64, 128, 300])
@pytest.mark.parametrize("k,n", [(4096, 1024), (1024, 4096), (4096, 4096)])  # the last: M = 1 on tensor cores
def test_w8a16_kernel_on_gpu(m, k, n):
  kx, kw, ks = jax.random.split(fresh_key(), 3)
  x = jax.random.normal(kx, (m, k)).astype(jnp.bfloat16)
  wq, scale = _int8(kw, (n, k)), jax.random.uniform(ks, (n,), minval=1e-3, maxval=2e-2)
  got = w8a16.w8a16_matmul_kernel(x, wq, scale, jnp.float32)
  want = np.asarray(x, np.float64) @ (np.asarray(wq, np.float64) * np.asarray(scale, np.float64)[:, None]).T
  bound = k * 2.0**-22 * (np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(wq, np.float64)).T) * np.asarray(scale)
  assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound)
  assert rel_err(w8a16.w8a16_matmul_kernel(x, wq, scale), want) < 2**-7


@needs_sm80
@pytest.mark.parametrize("m", [1, 3, 8, 16, 40, 64])
@pytest.mark.parametrize("k,n", [(4096, 1024), (1024, 4096), (2048, 16384)])  # the last: A8W2 with K unsplit
def test_int8_activation_kernels_bit_exact_on_gpu(m, k, n):
  kx, kw, kt, ks = jax.random.split(fresh_key(), 4)
  xq, sx = _int8(kx, (m, k)), jax.random.uniform(ks, (m, 1), minval=1e-3, maxval=1e-1)
  wq, sw = _int8(kw, (n, k)), jax.random.uniform(kt, (n,), minval=1e-3, maxval=1e-1)
  for out_dtype in (jnp.float32, jnp.bfloat16):
    np.testing.assert_array_equal(int8_gemv.a8w8_matmul_kernel(xq, sx, wq, sw, out_dtype),
                                  scaled_matmul_reference(xq, sx, wq, sw, out_dtype))
    wt = jax.random.randint(kt, (n, k), -1, 2, jnp.int32).astype(jnp.int8)
    for scale in (jnp.float32(0.02), sw):  # BitNet's one scale, and one per output row
      np.testing.assert_array_equal(int8_gemv.a8w2_matmul_kernel(xq, sx, pack_2bit(wt), scale, out_dtype),
                                    scaled_matmul_reference(xq, sx, wt, scale, out_dtype))


@needs_sm80
@pytest.mark.parametrize("m", [1, 3, 4, 16, 48, 256])
def test_dispatch_takes_the_kernels_where_the_table_says(m):

  for scheme, name, takes in inference_kernel_table(m):
    leaves = inference.quantize_weight(jax.random.normal(fresh_key(), (2048, 1024)), scheme)
    x = jnp.ones((m, 2048), jnp.bfloat16)
    hlo = jax.jit(lambda x: inference.quantized_linear(x, leaves, scheme)).lower(x).as_text()
    assert (name in hlo) == takes, (scheme, m)


@needs_sm80
@pytest.mark.parametrize("m", [1, 4, 16, 256])
def test_ternary_conversion_reproduces_bitnet_forward_on_gpu(m):
  kx, kp = jax.random.split(fresh_key())
  layer = jaxlowbit.BitNetDense(features=2048, use_bias=False, dtype=jnp.bfloat16)
  x = jax.random.normal(kx, (m, 1024))
  params = layer.init(kp, x)["params"]
  trained = jax.jit(layer.apply)({"params": params}, x)
  qparams = inference.quantize_params(params, "ternary", filter_fqns=())
  converted = jax.jit(inference.convert_for_inference(layer, "ternary").apply)({"params": qparams}, x)
  np.testing.assert_array_equal(converted, trained)
  int8_layer = jaxlowbit.Int8Dense(features=2048, use_bias=False, dtype=jnp.bfloat16)
  trained = jax.jit(int8_layer.apply)({"params": params}, x)
  qparams = inference.quantize_params(params, "w8a8", filter_fqns=())
  converted = jax.jit(inference.convert_for_inference(int8_layer, "w8a8").apply)({"params": qparams}, x)
  np.testing.assert_array_equal(converted, trained)


@needs_sm80
def test_forced_kernels_and_xla_agree_on_a_model(monkeypatch):
  """The forced GEMM kernels (A8W8, A8W2: exact int32 sums, the reference's epilogue) give XLA's logits bit for bit;
  W8A16 within its bound. The norms stay on XLA in both runs: the decode norm kernel, which a forced backend runs for
  up to 16 rows, sums the mean square in another order (``dispatch.norm_rows``: equal up to that order; its own tests
  bound it), and one norm value a rounding apart changes an int8 code and every logit of its row (79 of 6144 logits
  differed on an H200 for one draw of tokens)."""
  from train.model import ModelConfig, Transformer

  monkeypatch.setattr(policy, "DECODE_NORM_KERNEL", False)
  config = ModelConfig(vocab_size=384, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=768,
                       recipe=BitNet())
  tokens = jax.random.randint(fresh_key(), (2, 8), 0, 384)
  params = Transformer(config).init(jax.random.key(0), tokens)["params"]
  for scheme, tol in (("w8a16", 2e-2), ("w8a8", 0.0), ("ternary", 0.0)):
    qparams = inference.quantize_params(params, scheme)
    model = inference.convert_for_inference(Transformer(config), scheme)
    outs = {}
    for backend in ("xla", "pallas"):
      os.environ[policy.BACKEND_ENV] = backend
      try:
        outs[backend] = jax.jit(model.apply)({"params": qparams}, tokens)
      finally:
        os.environ.pop(policy.BACKEND_ENV)
    assert rel_err(outs["pallas"], outs["xla"]) <= tol, scheme


@needs_sm80
def test_decode_on_gpu_matches_full_forward():
  from train.generate import init_cache
  from train.model import ModelConfig, Transformer

  config = ModelConfig(vocab_size=384, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=768,
                       recipe=Int8MixedPrecision())
  tokens = jax.random.randint(fresh_key(), (1, 12), 0, 384)
  params = inference.quantize_params(Transformer(config).init(jax.random.key(0), tokens)["params"], "w8a8")
  full = inference.convert_for_inference(Transformer(config), "w8a8").apply({"params": params}, tokens)
  model = inference.convert_for_inference(Transformer(config, decode=True), "w8a8")
  step = jax.jit(lambda c, t: model.apply({"params": params, "cache": c}, t, mutable=["cache"]))
  logits, state = step(init_cache(model, 1, 16), tokens[:, :4])
  got = [logits]
  for t in range(4, 12):
    logits, state = step(state["cache"], tokens[:, t : t + 1])
    got.append(logits)
  # bf16 attention over the cache's (masked) 16 keys vs the causal 12: bf16-level differences.
  assert rel_err(jnp.concatenate(got, axis=1), full) < 2e-2


@needs_sm80
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("k,n", [(4096, 14336), (14336, 4096), (8192, 2048), (2048, 1024), (1024, 2048)])
def test_quantizing_ternary_gemv_matches_the_reference_on_gpu(k, n, m):
  """Decode's one launch per linear (the quantizer inside the dp4a GEMV) == quantize_rows_reference, then the A8W2
  reference, and == the pre-quantized GEMV, bit for bit, on activations without rounding ties, at M = 1 (decode)
  and 4 (the kernel's limit). 8192 x 2048 (the 1B down projection): the quantizing kernel splits K at M = 1 on
  an H100 or H200, the pre-quantized one runs its codes tiling unsplit."""
  key = fresh_key()
  x = tie_free_activations(key, m, k, BITNET_TOKENS)
  wt = jax.random.randint(jax.random.fold_in(key, 1), (n, k), -1, 2, jnp.int32).astype(jnp.int8)
  w_packed, w_scale = pack_2bit(wt), jnp.float32(0.02)
  fused = jax.jit(lambda x: dp4a_gemv.quantize_a8w2_gemv_kernel(x, w_packed, w_scale, BITNET_TOKENS))(x)
  xq, sx = quantize_rows_reference(x, BITNET_TOKENS)
  want = int8_gemv.a8w2_matmul_reference(xq, sx, w_packed, w_scale)
  np.testing.assert_array_equal(np.asarray(fused, np.float32), np.asarray(want, np.float32))
  prequantized = dp4a_gemv.a8w2_gemv_kernel(xq, sx, w_packed, w_scale)
  np.testing.assert_array_equal(np.asarray(prequantized, np.float32), np.asarray(want, np.float32))


@needs_sm80
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_quantizing_gemvs_turn_a_non_finite_row_into_nan_only_there_on_gpu(dtype):
  """The GPU's encoding (a NaN converts to code 0, no clamp) and integer amax of bfloat16 rows: rows holding a NaN,
  +inf or -inf come out NaN as in the reference, the finite row bit for bit, in both quantizing GEMVs."""
  check_quantizing_gemvs_on_non_finite_rows(fresh_key(), dtype, interpret=False)


@needs_sm80
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("k,n", [(4096, 14336), (14336, 4096), (8192, 2048), (2048, 3072), (2048, 16384)])
def test_a8w8_dp4a_gemv_matches_the_reference_on_gpu(k, n, m):
  """W8A8 on the dp4a GEMV (the int8 weight as int32 words) == the A8W8 reference (XLA's int8 dot), bit for bit,
  on codes with per-channel scales; its quantizing form == XLA's quantizer, then the reference, on activations
  without rounding ties."""
  from jaxlowbit.inference.weights import INT8_TOKENS

  key = fresh_key()
  x = tie_free_activations(key, m, k, INT8_TOKENS)
  wq = jax.random.randint(jax.random.fold_in(key, 1), (n, k), -127, 128, jnp.int32).astype(jnp.int8)
  w_scale = jax.random.uniform(jax.random.fold_in(key, 2), (n,), minval=1e-3, maxval=1e-2)
  xq, sx = quantize_rows_reference(x, INT8_TOKENS)
  want = np.asarray(int8_gemv.a8w8_matmul_reference(xq, sx, wq, w_scale), np.float32)
  got = jax.jit(dp4a_gemv.a8w8_gemv_kernel)(xq, sx, wq, w_scale)
  np.testing.assert_array_equal(np.asarray(got, np.float32), want)
  fused = jax.jit(lambda x: dp4a_gemv.quantize_a8w8_gemv_kernel(x, wq, w_scale, INT8_TOKENS))(x)
  np.testing.assert_array_equal(np.asarray(fused, np.float32), want)
