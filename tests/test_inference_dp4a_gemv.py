"""The CUDA-core dp4a GEMV (pallas_kernels/dp4a_gemv.py) on CPU: Pallas interpreter and CUDA lowering.

Numerics: int32 sums are exact and the float32 epilogue runs the reference's operations in its order, so the
kernel is bit-identical to ``int8_gemv.a8w2_matmul_reference`` (ternary weights) and
``int8_gemv.a8w8_matmul_reference`` (int8 weights) on fresh random operands, with and without split-K, for every M
it takes (1..4). The kernel's dp4a step is checked alone here too (its interpreter form
against plain integer arithmetic); the GPU instruction is checked through the kernel on the GPU
(tests/test_inference_gpu.py).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlowbit.inference.weights import BITNET_TOKENS
from jaxlowbit_numerics.formats import QuantSpec
from jaxlowbit_numerics.ternary import pack_2bit
from pallas_kernels import dp4a_gemv, inference_dispatch, int8_gemv, policy, w8a16
from pallas_kernels.reference import quantize_rows_reference
from helpers import H100, check_quantizing_gemvs_on_non_finite_rows, fresh_key, tie_free_activations



def _operands(key, m, n, k):
  kx, kw, ks = jax.random.split(key, 3)
  xq = jax.random.randint(kx, (m, k), -127, 128, jnp.int32).astype(jnp.int8)
  w = jax.random.randint(kw, (n, k), -1, 2, jnp.int32).astype(jnp.int8)
  x_scale = jax.random.uniform(ks, (m, 1), minval=1e-3, maxval=1e-2)
  return xq, x_scale, pack_2bit(w, axis=-1), jnp.float32(0.037)


def _tiling(m, n, k, split, reduce_per_step, packed=True):
  """The default tiling for M rows, with ``split`` K parts (block_k shrunk to fit) and the reduction asked for."""
  config = dp4a_gemv.config_for(n, k // 4, sms=4, m=m, packed=packed)
  return dataclasses.replace(config, split_k=split, block_k=min(config.block_k, k // 4 // split),
                             reduce_per_step=reduce_per_step)


CASES = [(1, 64, 512, 1, False), (2, 128, 2048, 4, True), (3, 64, 1024, 2, False), (4, 32, 256, 1, True),
         (1, 32, 1024, 2, True)]  # (m, n, k, split_k, reduce_per_step)


def test_spread_codes_and_dp4a_are_the_byte_products():
  """Every packed byte of ternary weights spreads to 64 x its four weights; dp4a (interpreter form) adds the four
  signed byte products to its accumulator, for every int8 pair including -128 and 127."""
  key = fresh_key()
  weights = np.stack(np.meshgrid(*[np.array([-1, 0, 1])] * 4, indexing="ij"), -1).reshape(-1, 4)  # all 81 bytes
  packed = pack_2bit(jnp.asarray(weights, jnp.int8), axis=-1)[:, 0]
  spread = np.asarray(dp4a_gemv.spread_codes(packed)).astype(np.uint32)
  got = np.stack([(spread >> (8 * j) & 0xFF).astype(np.uint8).view(np.int8) for j in range(4)], -1)
  np.testing.assert_array_equal(got, 64 * weights)
  a, b = (jax.random.randint(jax.random.fold_in(key, i), (4096, 4), -128, 128, jnp.int32) for i in range(2))
  a, b = (jnp.concatenate([v, jnp.array([[-128] * 4, [127] * 4])]) for v in (a, b))
  word = lambda v: jax.lax.bitcast_convert_type(v.astype(jnp.int8), jnp.int32)  # noqa: E731  [R, 4] -> [R]
  c = jax.random.randint(jax.random.fold_in(key, 2), (a.shape[0],), -2**20, 2**20, jnp.int32)
  out = dp4a_gemv.dp4a(word(a), word(b), c, native=False)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(c) + np.sum(np.asarray(a) * np.asarray(b), axis=-1))


@pytest.mark.parametrize("m,n,k,split,reduce_per_step", CASES)
def test_gemv_interpret_is_bit_identical_to_the_reference(m, n, k, split, reduce_per_step):
  key = fresh_key()
  xq, x_scale, w_packed, tensor_scale = _operands(key, m, n, k)
  channel_scales = jax.random.uniform(jax.random.fold_in(key, 1), (n,), minval=0.01, maxval=0.1)
  config = _tiling(m, n, k, split, reduce_per_step)
  # One scale per tensor (BitNet's, kept one element in the kernel) and one per output channel.
  for out_dtype, w_scale in ((jnp.bfloat16, tensor_scale), (jnp.float32, tensor_scale), (jnp.float32, channel_scales)):
    got = dp4a_gemv.a8w2_gemv_kernel(xq, x_scale, w_packed, w_scale, out_dtype, config=config, interpret=True)
    want = int8_gemv.a8w2_matmul_reference(xq, x_scale, w_packed, w_scale, out_dtype)
    assert got.dtype == want.dtype and got.shape == (m, n)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("k,n", [(4096, 14336), (14336, 4096), (8192, 2048)])
def test_gemv_lowers_for_cuda(m, k, n):
  """Pallas -> Triton IR for an H100 at the Llama-3-8B MLP shapes and the 1B down projection (at M = 1 its codes
  tiling: 1024-byte steps on 8 warps)."""
  f = jax.ShapeDtypeStruct
  shapes = (f((m, k), jnp.int8), f((m, 1), jnp.float32), f((n, k // 4), jnp.int8), f((), jnp.float32))
  with jax.sharding.use_abstract_mesh(H100):
    text = jax.jit(dp4a_gemv.a8w2_gemv_kernel).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text


def test_gemv_refuses_more_rows_than_it_keeps_sums_for():
  xq, x_scale, w_packed, w_scale = _operands(fresh_key(), dp4a_gemv.MAX_M + 1, 64, 512)
  with pytest.raises(ValueError, match=f"at most {dp4a_gemv.MAX_M}"):
    dp4a_gemv.a8w2_gemv_kernel(xq, x_scale, w_packed, w_scale, interpret=True)


def test_dispatch_takes_the_gemv_exactly_where_the_policy_says(monkeypatch):
  """Float rows at M = 1..3 on the Llama shapes go to the GEMV (policy.TERNARY_GEMV_MAX_M = 3), a norm's codes at
  M = 1..2 (policy.TERNARY_CODES_GEMV_MAX_M = 2); M = 4 (codes: 3) and a weight it cannot tile do not, and 0 turns
  it off; int8 weights follow policy.W8A8_GEMV_MAX_M."""
  assert (policy.TERNARY_GEMV_MAX_M, policy.TERNARY_CODES_GEMV_MAX_M) == (3, 2)
  assert inference_dispatch.dp4a_gemv_wanted(1, 14336, 4096)
  assert inference_dispatch.dp4a_gemv_wanted(1, 4096, 14336)
  assert inference_dispatch.dp4a_gemv_wanted(3, 4096, 14336)
  assert not inference_dispatch.dp4a_gemv_wanted(4, 14336, 4096)
  assert inference_dispatch.dp4a_gemv_wanted(2, 4096, 14336, codes=True)
  assert not inference_dispatch.dp4a_gemv_wanted(3, 4096, 14336, codes=True)
  assert not inference_dispatch.dp4a_gemv_wanted(1, 12, 4096)
  monkeypatch.setattr(policy, "TERNARY_GEMV_MAX_M", 0)
  assert not inference_dispatch.dp4a_gemv_wanted(1, 14336, 4096)
  # W8A8's int8 weights: the same rule under W8A8_GEMV_MAX_M.
  assert inference_dispatch.dp4a_gemv_wanted(1, 14336, 4096, codes=True, packed=False)
  assert not inference_dispatch.dp4a_gemv_wanted(policy.W8A8_GEMV_MAX_M + 1, 14336, 4096, packed=False)
  monkeypatch.setattr(policy, "W8A8_GEMV_MAX_M", 0)
  assert not inference_dispatch.dp4a_gemv_wanted(1, 14336, 4096, codes=True, packed=False)



@pytest.mark.parametrize("n,k,m,split", [
    (2048, 8192, 1, 4),   # 1B down, quantizing tiling: 128 row blocks < 132 SMs -> split up to 4 per SM
    (4096, 4096, 1, 1),   # 256 row blocks fill the SMs: unsplit at M = 1 (9.1 us against 11.1 split)
    (4096, 14336, 1, 1),
    (16384, 2048, 1, 1),  # one block of K: nothing to split
    (4096, 4096, 4, 2),   # M > 1: up to ~4 programs per SM
])
def test_split_k_policy_on_132_sms(n, k, m, split):
  """Split-K at M = 1 only where the row blocks leave SMs idle (an H100's 132), as measured; the split divides K."""
  config = dp4a_gemv.config_for(n, k // 4, sms=132, m=m)
  assert config.split_k == split
  assert dp4a_gemv.supports(m, n, k // 4, config)


@pytest.mark.parametrize("n,k,tiling", [
    (2048, 8192, (8, 1024, 8)),  # 1B down: 256 row blocks of 8 fill 132 SMs, unsplit; 2048 bytes of K: long steps
    (4096, 14336, (8, 512, 4)),  # 3584 bytes of K: no 1024-byte step divides it
    (14336, 4096, (8, 512, 4)),
    (3072, 2048, (8, 512, 4)),
])
def test_codes_tiling_at_m1_on_132_sms(n, k, tiling):
  """At M = 1 on int8 codes the GEMV takes 8-row blocks (1024-byte steps on 8 warps where K has >= 2048 bytes that
  they divide), unsplit where the row blocks fill the SMs; the quantizing kernel keeps its 16-row blocks."""
  config = dp4a_gemv.config_for(n, k // 4, sms=132, m=1, codes=True)
  assert (config.block_n, config.block_k, config.num_warps, config.split_k) == (*tiling, 1)
  assert dp4a_gemv.supports(1, n, k // 4, config)
  assert inference_dispatch.dp4a_gemv_wanted(1, n, k, codes=True)
  assert dp4a_gemv.config_for(n, k // 4, sms=132, m=1).block_n == 16
  assert not inference_dispatch.dp4a_gemv_wanted(1, 12, 4096, codes=True)


def test_prequantized_gemv_default_codes_tiling_is_bit_identical(monkeypatch):
  """The pre-quantized GEMV on its default tiling (8-row blocks, unsplit, four 1024-byte steps of K) == the A8W2
  reference, bit for bit, with one weight scale and with one per output channel (loaded before the K loop)."""
  monkeypatch.setattr(w8a16, "num_sms", lambda: 8)  # 8 row blocks fill 8 SMs: no split-K (w8a16.SplitRule)
  key = fresh_key()
  m, n, k = 1, 64, 16384
  xq, x_scale, w_packed, w_scale = _operands(key, m, n, k)
  config = dp4a_gemv.config_for(n, k // 4, m=m, codes=True)
  assert (config.block_n, config.block_k, config.num_warps, config.split_k) == (8, 1024, 8, 1)
  per_channel = jax.random.uniform(jax.random.fold_in(key, 7), (n,), minval=0.01, maxval=0.05)
  for scale in (w_scale, per_channel):
    got = dp4a_gemv.a8w2_gemv_kernel(xq, x_scale, w_packed, scale, jnp.float32, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(
        int8_gemv.a8w2_matmul_reference(xq, x_scale, w_packed, scale, jnp.float32)))


@pytest.mark.parametrize("m,n,k,split,reduce_per_step", CASES)
def test_quantizing_gemv_interpret_is_bit_identical_to_quantize_then_reference(m, n, k, split, reduce_per_step):
  """x quantized inside the kernel (BitNet's per-token int8) == quantize_rows_reference, then the A8W2 reference."""
  key = fresh_key()
  x = tie_free_activations(key, m, k, BITNET_TOKENS)
  _, _, w_packed, w_scale = _operands(jax.random.fold_in(key, 1), m, n, k)
  config = _tiling(m, n, k, split, reduce_per_step)
  xq, x_scale = quantize_rows_reference(x, BITNET_TOKENS)
  for out_dtype in (jnp.bfloat16, jnp.float32):
    got = dp4a_gemv.quantize_a8w2_gemv_kernel(x, w_packed, w_scale, BITNET_TOKENS, out_dtype, config=config,
                                              interpret=True)
    want = int8_gemv.a8w2_matmul_reference(xq, x_scale, w_packed, w_scale, out_dtype)
    assert got.dtype == want.dtype and got.shape == (m, n)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("steps", [2, 3, 5])
def test_gemv_loop_is_bit_identical_over_several_steps(steps):
  """K in ``steps`` loop steps of 16 groups (unsplit and split in two; the other cases here take one step): the
  codes and quantizing kernels, ternary and int8, == their references bit for bit. Quantizing: bfloat16 rows
  (integer amax, words of two values) and float32 rows."""
  from jaxlowbit.inference.weights import INT8_TOKENS

  key = fresh_key()
  m, n = 2, 16
  for split in (1, 2):
    k = 4 * 16 * steps * split  # four values a group
    config = dp4a_gemv.Dp4aGemvConfig(block_n=8, block_k=16, split_k=split, num_warps=4)
    xq, x_scale, w_packed, w_scale = _operands(jax.random.fold_in(key, split), m, n, k)
    wq, channel = _int8_weight(jax.random.fold_in(key, 10 + split), n, k)
    np.testing.assert_array_equal(
        np.asarray(dp4a_gemv.a8w2_gemv_kernel(xq, x_scale, w_packed, w_scale, jnp.float32, config=config,
                                              interpret=True)),
        np.asarray(int8_gemv.a8w2_matmul_reference(xq, x_scale, w_packed, w_scale, jnp.float32)))
    np.testing.assert_array_equal(
        np.asarray(dp4a_gemv.a8w8_gemv_kernel(xq, x_scale, wq, channel, jnp.float32, config=config, interpret=True)),
        np.asarray(int8_gemv.a8w8_matmul_reference(xq, x_scale, wq, channel, jnp.float32)))
    x = tie_free_activations(jax.random.fold_in(key, 20 + split), m, k, BITNET_TOKENS)
    for dtype in (jnp.bfloat16, jnp.float32):
      for kernel, reference, spec, w, scale in (
          (dp4a_gemv.quantize_a8w2_gemv_kernel, int8_gemv.a8w2_matmul_reference, BITNET_TOKENS, w_packed, w_scale),
          (dp4a_gemv.quantize_a8w8_gemv_kernel, int8_gemv.a8w8_matmul_reference, INT8_TOKENS, wq, channel)):
        got = kernel(x.astype(dtype), w, scale, spec, jnp.float32, config=config, interpret=True)
        want = reference(*quantize_rows_reference(x.astype(dtype), spec), w, scale, jnp.float32)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"{kernel.__name__} {dtype}")


def test_amax_trips_visit_every_chunk_once():
  """``amax_trips``: full trips of ``per_trip`` chunks, then the rest, cover 1..200 chunks exactly, ``per_trip``
  within the values a thread may load (or one chunk where a chunk alone is more)."""
  for n_chunks in range(1, 201):
    for values_per_chunk in (64, 128, 1024, 2048, 8192, 32768):
      for warps in (2, 4, 8):
        per_trip, trips = dp4a_gemv.amax_trips(n_chunks, values_per_chunk, warps)
        assert 1 <= per_trip <= n_chunks and trips * per_trip <= n_chunks < (trips + 1) * per_trip
        assert per_trip == 1 or per_trip * values_per_chunk <= dp4a_gemv.AMAX_VALUES_PER_THREAD * 32 * warps


@pytest.mark.parametrize("values_per_thread,schedule", [(3, (3, 2)), (5, (5, 1)), (64, (8, 1))])
def test_quantizing_gemv_amax_pass_reads_every_chunk(monkeypatch, values_per_thread, schedule):
  """The amax pass at each shape of its schedule (``amax_trips`` on 4 warps, 64-value chunks of 2 rows, 8 chunks):
  a loop of two trips of three and a last trip of two; one trip of five and the three past it (no loop); one trip
  of eight. Each row's largest magnitude is moved by a swap into each chunk in turn (row 0 into chunk j, row 1 into
  chunk 7 - j; a swap keeps the row's values, so its scale and tie-free codes): both kernels (ternary, int8 weights)
  match quantize-then-reference bit for bit every time, which a chunk the pass skips breaks."""
  from jaxlowbit.inference.weights import INT8_TOKENS

  monkeypatch.setattr(dp4a_gemv, "AMAX_VALUES_PER_THREAD", values_per_thread)
  jax.clear_caches()  # the kernel's jit is keyed on its tiling, not on the constant
  assert dp4a_gemv.amax_trips(8, 2 * 64, 4) == schedule
  m, n, k, chunk = 2, 32, 512, 64
  key = fresh_key()
  x0 = np.array(tie_free_activations(key, m, k, BITNET_TOKENS))
  _, _, w_packed, w_scale = _operands(jax.random.fold_in(key, 1), m, n, k)
  wq, channel = _int8_weight(jax.random.fold_in(key, 2), n, k)
  kernels = ((dp4a_gemv.quantize_a8w2_gemv_kernel, BITNET_TOKENS, w_packed, w_scale, True,
              int8_gemv.a8w2_matmul_reference),
             (dp4a_gemv.quantize_a8w8_gemv_kernel, INT8_TOKENS, wq, channel, False, int8_gemv.a8w8_matmul_reference))
  for j in range(k // chunk):
    x = x0.copy()
    for row, at in ((0, j * chunk + 5), (1, (k // chunk - 1 - j) * chunk + 60)):
      peak = int(np.argmax(np.abs(x[row].astype(np.float32))))
      x[row, [peak, at]] = x[row, [at, peak]]
    x = jnp.asarray(x)
    for kernel, spec, w, scale, packed, reference in kernels:
      config = dataclasses.replace(_tiling(m, n, k, 1, False, packed=packed), block_k=chunk // 4, num_warps=4)
      got = kernel(x, w, scale, spec, jnp.float32, config=config, interpret=True)
      want = reference(*quantize_rows_reference(x, spec), w, scale, jnp.float32)
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"peaks in chunks {j}, {7 - j}")


@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("m,n,k,reduce_per_step", [(1, 64, 512, False), (2, 128, 1024, True), (4, 32, 256, False)])
def test_gated_gemv_writes_the_gated_activation_of_the_reference(m, n, k, reduce_per_step, activation):
  """``gated``: each program sums half a block of gate rows and the matching up rows, and writes ``act(gate) * up``
  ``[M, N / 2]`` (``inference_dispatch.gate`` of the reference, bit for bit) for all four entries: ternary and int8
  weights, codes and float x quantized in the kernel; per-tensor and per-channel weight scales."""
  key = fresh_key()
  xq, x_scale, w_packed, tensor_scale = _operands(key, m, n, k)
  wq = jax.random.randint(jax.random.fold_in(key, 2), (n, k), -127, 128, jnp.int32).astype(jnp.int8)
  channel = jax.random.uniform(jax.random.fold_in(key, 3), (n,), minval=0.01, maxval=0.1)
  x = tie_free_activations(jax.random.fold_in(key, 4), m, k, BITNET_TOKENS)
  xq_x, sx_x = quantize_rows_reference(x, BITNET_TOKENS)
  gate = lambda y: inference_dispatch.gate(y, activation)  # noqa: E731
  cases = [
      (dp4a_gemv.a8w2_gemv_kernel, (xq, x_scale, w_packed, tensor_scale),
       int8_gemv.a8w2_matmul_reference(xq, x_scale, w_packed, tensor_scale), True),
      (dp4a_gemv.a8w8_gemv_kernel, (xq, x_scale, wq, channel),
       int8_gemv.a8w8_matmul_reference(xq, x_scale, wq, channel), False),
      (lambda *a, **kw: dp4a_gemv.quantize_a8w2_gemv_kernel(*a, BITNET_TOKENS, **kw), (x, w_packed, tensor_scale),
       int8_gemv.a8w2_matmul_reference(xq_x, sx_x, w_packed, tensor_scale, x.dtype), True),
      (lambda *a, **kw: dp4a_gemv.quantize_a8w8_gemv_kernel(*a, BITNET_TOKENS, **kw), (x, wq, channel),
       int8_gemv.a8w8_matmul_reference(xq_x, sx_x, wq, channel, x.dtype), False)]
  for kernel, args, reference, packed in cases:
    config = _tiling(m, n, k, 1, reduce_per_step, packed=packed)
    got = kernel(*args, config=config, interpret=True, gated=activation)
    want = gate(reference)
    assert got.shape == (m, n // 2) and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_gated_gemv_needs_k_unsplit_and_the_dispatch_gates_after_a_split():
  """The kernel refuses ``gated`` on a split K with its error; the dispatch then runs the GEMV ungated and gates in
  XLA: the same numbers."""
  xq, x_scale, w_packed, w_scale = _operands(fresh_key(), 1, 64, 1024)
  split = _tiling(1, 64, 1024, 2, False)
  with pytest.raises(ValueError, match="gated: K unsplit"):
    dp4a_gemv.a8w2_gemv_kernel(xq, x_scale, w_packed, w_scale, config=split, interpret=True, gated="silu")
  assert not dp4a_gemv.supports(1, 64, 256, dataclasses.replace(split, block_n=1), gated=True)
  want = inference_dispatch.gate(int8_gemv.a8w2_matmul_reference(xq, x_scale, w_packed, w_scale), "silu")
  got = inference_dispatch.ternary_matmul(xq, x_scale, w_packed, w_scale, gated="silu")  # CPU: XLA, then the gate
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_quantizing_gemvs_turn_a_non_finite_row_into_nan_only_there(dtype):
  """A NaN, +inf or -inf in a row makes that row's amax inf (stats.absmax): its outputs are NaN in both quantizing
  kernels, as in the reference, and the finite row's are exact. bfloat16 rows take the kernels' integer amax (int32
  words of two values), float32 ones the float pass."""
  check_quantizing_gemvs_on_non_finite_rows(fresh_key(), dtype, interpret=True)


def test_bf16_integer_amax_is_stats_absmax():
  """quantize.bf16_magnitude_maxes / bf16_amax on int32 words of two bfloat16 values == stats.absmax (NaN as inf)
  of the same values, over random rows salted with zeros of both signs, subnormals, the largest finite values,
  infinities and NaNs of several payloads and signs."""
  from jaxlowbit_numerics.stats import absmax
  from pallas_kernels import quantize

  specials = np.array([0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81],
                      np.uint16)
  rng = np.random.default_rng(int(jax.random.randint(fresh_key(), (), 0, 2**31 - 1)))
  for _ in range(64):
    floats = rng.standard_normal(256) * 2.0 ** rng.uniform(-135, 126, 256)  # every exponent, subnormals too
    bits = np.asarray(jnp.asarray(floats, jnp.float32).astype(jnp.bfloat16)).view(np.uint16).copy()
    salt = rng.integers(0, 4)  # 0..3 specials placed at random
    bits[rng.integers(0, 256, salt)] = rng.choice(specials, salt)
    values = jnp.asarray(bits.view(jnp.bfloat16))
    words = jax.lax.bitcast_convert_type(values.reshape(-1, 2), jnp.int32)
    zeros = (jnp.zeros((64,), jnp.int32),) * 2
    maxes = quantize.bf16_magnitude_maxes(zeros, words[:64])
    maxes = quantize.bf16_magnitude_maxes(maxes, words[64:])  # two chunks met element-wise, as the kernel does
    want = absmax(values.astype(jnp.float32))
    assert np.asarray(quantize.bf16_amax(maxes)) == np.asarray(want).reshape(()), bits


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("k,n", [(4096, 14336), (14336, 4096)])
def test_quantizing_gemv_lowers_for_cuda(m, k, n):
  f = jax.ShapeDtypeStruct
  shapes = (f((m, k), jnp.bfloat16), f((n, k // 4), jnp.int8), f((), jnp.float32))
  with jax.sharding.use_abstract_mesh(H100):
    fn = jax.jit(lambda x, w, s: dp4a_gemv.quantize_a8w2_gemv_kernel(x, w, s, BITNET_TOKENS))
    text = fn.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text


def test_quantizing_gemv_refuses_codes_and_other_specs():
  _, _, w_packed, w_scale = _operands(fresh_key(), 1, 64, 512)
  with pytest.raises(ValueError, match="float"):
    dp4a_gemv.quantize_a8w2_gemv_kernel(jnp.ones((1, 512), jnp.int8), w_packed, w_scale, BITNET_TOKENS,
                                        interpret=True)
  with pytest.raises(ValueError, match="rows to int8"):
    dp4a_gemv.quantize_a8w2_gemv_kernel(jnp.ones((1, 512), jnp.bfloat16), w_packed, w_scale,
                                        QuantSpec("int8", per_tensor=True), interpret=True)


def _int8_weight(key, n, k):
  """W8A8's ``[N, K]`` int8 weight over the whole int8 range (-128 included) and per-channel scales."""
  wq = jax.random.randint(key, (n, k), -128, 128, jnp.int32).astype(jnp.int8)
  return wq, jax.random.uniform(jax.random.fold_in(key, 1), (n,), minval=1e-3, maxval=1e-2)


@pytest.mark.parametrize("m,n,k,split,reduce_per_step", CASES)
def test_a8w8_gemv_interpret_is_bit_identical_to_the_reference(m, n, k, split, reduce_per_step):
  """int8 weights read as int32 words of four: == a8w8_matmul_reference bit for bit, per-channel and per-tensor
  weight scales, bf16 and float32 outputs, with and without split-K."""
  key = fresh_key()
  xq, x_scale, _, _ = _operands(key, m, n, k)
  wq, channel_scales = _int8_weight(jax.random.fold_in(key, 1), n, k)
  config = _tiling(m, n, k, split, reduce_per_step, packed=False)
  for out_dtype, w_scale in ((jnp.bfloat16, channel_scales), (jnp.float32, channel_scales),
                             (jnp.float32, jnp.float32(0.004))):
    got = dp4a_gemv.a8w8_gemv_kernel(xq, x_scale, wq, w_scale, out_dtype, config=config, interpret=True)
    want = int8_gemv.a8w8_matmul_reference(xq, x_scale, wq, w_scale, out_dtype)
    assert got.dtype == want.dtype and got.shape == (m, n)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("m,n,k,split,reduce_per_step", CASES)
def test_quantizing_a8w8_gemv_interpret_is_bit_identical_to_quantize_then_reference(m, n, k, split,
                                                                                    reduce_per_step):
  """x quantized inside the kernel (W8A8's per-token int8) == quantize_rows_reference, then the A8W8 reference."""
  from jaxlowbit.inference.weights import INT8_TOKENS

  key = fresh_key()
  x = tie_free_activations(key, m, k, INT8_TOKENS)
  wq, w_scale = _int8_weight(jax.random.fold_in(key, 1), n, k)
  config = _tiling(m, n, k, split, reduce_per_step, packed=False)
  xq, x_scale = quantize_rows_reference(x, INT8_TOKENS)
  for out_dtype in (jnp.bfloat16, jnp.float32):
    got = dp4a_gemv.quantize_a8w8_gemv_kernel(x, wq, w_scale, INT8_TOKENS, out_dtype, config=config, interpret=True)
    want = int8_gemv.a8w8_matmul_reference(xq, x_scale, wq, w_scale, out_dtype)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("k,n", [(4096, 14336), (14336, 4096), (8192, 2048), (2048, 3072)])
def test_a8w8_gemv_lowers_for_cuda(m, k, n):
  """Pallas -> Triton IR for an H100, on codes and quantizing, at the Llama-3-8B MLP and 1B shapes."""
  from jaxlowbit.inference.weights import INT8_TOKENS

  f = jax.ShapeDtypeStruct
  with jax.sharding.use_abstract_mesh(H100):
    codes = jax.jit(dp4a_gemv.a8w8_gemv_kernel).trace(
        f((m, k), jnp.int8), f((m, 1), jnp.float32), f((n, k), jnp.int8), f((n,), jnp.float32))
    quantizing = jax.jit(lambda x, w, s: dp4a_gemv.quantize_a8w8_gemv_kernel(x, w, s, INT8_TOKENS)).trace(
        f((m, k), jnp.bfloat16), f((n, k), jnp.int8), f((n,), jnp.float32))
    for traced in (codes, quantizing):
      assert "__gpu$xla.gpu.triton" in traced.lower(lowering_platforms=("cuda",)).as_text()


def test_a8w8_gemv_refuses_what_it_cannot_take():
  """A K that no tiling divides, more rows than it keeps sums for, and a weight whose K is not x's: one clear error
  each."""
  key = fresh_key()
  xq, x_scale, _, _ = _operands(key, 1, 64, 512)
  wq, w_scale = _int8_weight(key, 64, 512)
  with pytest.raises(ValueError, match="K=512"):
    dp4a_gemv.a8w8_gemv_kernel(xq[:, :256], x_scale, wq, w_scale, interpret=True)
  many, many_scale, _, _ = _operands(key, dp4a_gemv.MAX_M + 1, 64, 512)
  with pytest.raises(ValueError, match=f"at most {dp4a_gemv.MAX_M}"):
    dp4a_gemv.a8w8_gemv_kernel(many, many_scale, wq, w_scale, interpret=True)
  odd, _ = _int8_weight(key, 64, 40)
  with pytest.raises(ValueError, match="groups of four"):
    dp4a_gemv.a8w8_gemv_kernel(xq[:, :40], x_scale, odd, w_scale, interpret=True)
