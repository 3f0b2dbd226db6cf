"""Decode's one-launch kernels (pallas_kernels/decode.py): the RMSNorm of a few rows and the attention step.

On CPU they run in Pallas interpret mode against the XLA path they replace (train.model's norms, RoPE, cache write
and ``jax.nn.dot_product_attention``) and against float32/float64 references, on fresh random inputs:
- norm: the residual sum it writes equals XLA's ``x + delta`` exactly; the normed rows equal XLA's but where the
  mean square's summation order moves a bf16 rounding (each such value one bf16 step away), and sit within a bf16
  rounding plus one float32 ulp of rstd of the float64 norm;
- attention: the cache rows it writes equal the XLA path's (values exactly, rotated keys up to one rounding of the
  float32 trigonometry), no other row changes, and its output is at least as close to float32 attention as the
  XLA path's, less 2 dB;
- a tiny model decoding through both kernels (the dispatch pointed at the interpreter) gives the logits of the
  XLA decode within float32 sums' rounding (float32 model), and (bf16) logits as close to the float32 model's
  decode as the XLA decode's.
The ``gpu`` tests run the compiled kernels on the 1B model's shapes and a decode with them against one without.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import H100, bf16_values_close, fresh_key, rel_err, sqnr_db
from pallas_kernels import decode, dispatch, policy
from pallas_kernels.quantize import Identity, RmsNorm, SwiGLU
from pallas_kernels.reference import quantize_rows_reference
from train import generate, kv_cache
from train.model import ModelConfig, Transformer, rope, rope_frequencies

SOURCES = {"plain": (Identity(), 1, False), "residual": (decode.Add(), 2, True), "silu": (SwiGLU("silu"), 1, False),
           "relu2": (SwiGLU("relu2"), 1, False)}
# (rows, normed width): one resident chunk; several chunks of 512 (1536 = 3 x 512); the widest resident row (8192,
# the 1B model's ffn_sub_norm); two chunks of 8192.
NORM_SHAPES = [(1, 256), (3, 1536), (2, 8192), (1, 16384)]


def _norm_inputs(key, name: str, rows: int, width: int, dtype):
  source, n_inputs, _ = SOURCES[name]
  k = jax.random.split(key, 3)
  in_width = 2 * width if isinstance(source, SwiGLU) else width
  inputs = tuple(jax.random.normal(k[i], (rows, in_width), jnp.float32).astype(dtype) for i in range(n_inputs))
  gamma = (1.0 + 0.2 * jax.random.normal(k[2], (width,), jnp.float32)).astype(dtype)
  return inputs, gamma


def _steps(source) -> int:
  """bf16 steps between the kernel's normalized value and XLA's: one rounding; a gated source's own rounding of
  ``act(gate) * up`` (float32 products in another order, ``exp``'s ulps) may land on the other neighbour and carry."""
  return 2 if isinstance(source, SwiGLU) else 1


def _float64_norm(values, gamma, eps):
  v = np.asarray(values, np.float64)
  return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * np.asarray(gamma, np.float64)


@pytest.mark.parametrize("name", sorted(SOURCES))
@pytest.mark.parametrize("rows,width", NORM_SHAPES)
def test_norm_rows_kernel_equals_the_xla_norm(name, rows, width):
  source, _, write_source = SOURCES[name]
  inputs, gamma = _norm_inputs(fresh_key(), name, rows, width, jnp.bfloat16)
  norm = RmsNorm(1e-5, jnp.dtype(jnp.bfloat16))
  got = decode.norm_rows_kernel(inputs, gamma, source, norm, write_source, interpret=True)
  want = decode.norm_rows_reference(inputs, gamma, source, norm, write_source)
  if write_source:
    np.testing.assert_array_equal(got[1], want[1])  # the residual sum, as XLA adds
    np.testing.assert_array_equal(want[1], inputs[0] + inputs[1])
    got, want = got[0], want[0]
  assert got.shape == (rows, width) and got.dtype == jnp.bfloat16
  bf16_values_close(got, want, max_fraction=0.05, steps=_steps(source))
  exact = _float64_norm(source.reference(inputs), gamma, 1e-5)
  # One bf16 rounding (half a step, 2^-8 relative) plus the float32 mean square's error (a sum of up to 16384
  # squares: ~1e-5 relative, bounded by 1e-4); a gated source's own rounding of act(gate) * up may land on the
  # other neighbour of XLA's (float32 products in another order): one step more.
  bound = 2.0**-8 * (3 if isinstance(source, SwiGLU) else 1) + 1e-4
  np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - exact), bound * np.abs(exact) + 1e-30)


@pytest.mark.parametrize("name", sorted(SOURCES))
@pytest.mark.parametrize("rows,width", NORM_SHAPES[:3])
def test_norm_rows_kernel_hands_over_the_codes_the_linear_would_make(name, rows, width):
  """With ``quantize`` the norm writes its output's per-row int8 codes and scales instead of the output: exactly
  what the linear's quantizer (``quantize_rows_reference``, BitNet's eps) makes of the norm's own bf16 output."""
  from jaxlowbit.inference.weights import BITNET_TOKENS
  from pallas_kernels.reference import quantize_rows_reference

  source, _, write_source = SOURCES[name]
  inputs, gamma = _norm_inputs(fresh_key(), name, rows, width, jnp.bfloat16)
  norm = RmsNorm(1e-5, jnp.dtype(jnp.bfloat16))
  y = decode.norm_rows_kernel(inputs, gamma, source, norm, write_source, interpret=True)
  got = decode.norm_rows_kernel(inputs, gamma, source, norm, write_source, BITNET_TOKENS, interpret=True)
  if write_source:
    np.testing.assert_array_equal(got[1], y[1])
    got, y = got[0], y[0]
  codes, scale = got
  want_codes, want_scale = quantize_rows_reference(y, BITNET_TOKENS)
  assert codes.dtype == jnp.int8 and codes.shape == (rows, width) and scale.shape == (rows, 1)
  np.testing.assert_array_equal(codes, want_codes)
  np.testing.assert_array_equal(scale, want_scale)
  assert np.all(np.max(np.abs(np.asarray(codes, np.int32)), axis=1) == 127)  # each row's amax maps to 127


def test_norm_rows_kernel_refuses_a_scale_of_another_width():
  inputs, _ = _norm_inputs(fresh_key(), "plain", 2, 256, jnp.bfloat16)
  with pytest.raises(ValueError, match="gamma"):
    decode.norm_rows_kernel(inputs, jnp.ones((128,), jnp.bfloat16), Identity(), RmsNorm(1e-5, jnp.bfloat16),
                            interpret=True)


def _xla_attention_step(qkv, key, value, pos, n_heads, theta):
  """train.model's decode step on the XLA path: RoPE, kv_cache.update's write, kv_cache.attend."""
  h = key.shape[1]
  q, k, v = qkv[:, :n_heads], qkv[:, n_heads : n_heads + h], qkv[:, n_heads + h :]
  positions = jnp.array([pos], jnp.int32)
  q, k = rope(q[:, None], positions, theta), rope(k[:, None], positions, theta)  # [B, 1, heads, D]
  key = jax.lax.dynamic_update_slice(key, jnp.swapaxes(k, 1, 2), (0, 0, pos, 0))
  value = jax.lax.dynamic_update_slice(value, jnp.swapaxes(v[:, None], 1, 2), (0, 0, pos, 0))
  mask = (jnp.arange(key.shape[2])[None, :] <= positions[:, None])[None, None]
  out = kv_cache.attend(q, kv_cache.CachedKV(key, value, None, None, mask))[:, 0]
  exact = kv_cache.attend_reference(q, key, value, mask)[:, 0]
  return out, exact, key, value


def _xla_attention_step_int8(qkv, key, value, key_scale, value_scale, pos, n_heads, theta):
  """The same step over an int8 cache: kv_cache.update's quantized write, then kv_cache.attend_int8; ``exact`` is
  float32 attention over the cache it leaves, dequantized."""
  h = key.shape[1]
  q, k, v = qkv[:, :n_heads], qkv[:, n_heads : n_heads + h], qkv[:, n_heads + h :]
  positions = jnp.array([pos], jnp.int32)
  q, k = rope(q[:, None], positions, theta), rope(k[:, None], positions, theta)
  (kq, ks), (vq, vs) = kv_cache.quantize_heads(jnp.swapaxes(k, 1, 2)), kv_cache.quantize_heads(v[:, :, None])
  key, value = (jax.lax.dynamic_update_slice(c, x, (0, 0, pos, 0)) for c, x in ((key, kq), (value, vq)))
  key_scale, value_scale = (jax.lax.dynamic_update_slice(c, x, (0, 0, pos)) for c, x in ((key_scale, ks),
                                                                                         (value_scale, vs)))
  mask = (jnp.arange(key.shape[2])[None, :] <= positions[:, None])[None, None]
  out = kv_cache.attend(q, kv_cache.CachedKV(key, value, key_scale, value_scale, mask))[:, 0]
  return out, _exact_int8(q, (key, value, key_scale, value_scale), mask), (key, value, key_scale, value_scale)


def _exact_int8(q, caches, mask):
  """float32 attention of the rotated ``q [B, 1, N, D]`` over an int8 cache ``(key, value, key_scale,
  value_scale)``, dequantized."""
  key, value, key_scale, value_scale = caches
  return kv_cache.attend_reference(q, key * key_scale[..., None], value * value_scale[..., None], mask)[:, 0]


def _rotated_query(qkv, pos, n_heads, theta):
  return rope(qkv[:, None, :n_heads], jnp.array([pos], jnp.int32), theta)


# (batch, query heads, kv heads, head_dim, cache length, position, block, splits): the 1B model's heads; positions
# 0 and S - 1; a cache length that is no multiple of the block; one query head per kv head; the cache split over
# programs (7 blocks of 16 in runs of 3, 3 and 1; a position that leaves the later splits empty; 4 blocks of 32 in 2).
ATTENTION_CASES = [(1, 32, 8, 64, 81, 70, 128, None), (2, 4, 2, 32, 37, 0, 128, None), (2, 4, 2, 32, 37, 36, 128, None),
                   (1, 8, 8, 64, 200, 130, 128, None), (2, 4, 2, 32, 100, 99, 16, 3), (2, 4, 2, 32, 100, 20, 16, 4),
                   (1, 8, 8, 64, 100, 0, 32, 2)]


def _attention_inputs(b, n, h, d, s, dtype):
  k = jax.random.split(fresh_key(), 3)
  qkv = jax.random.normal(k[0], (b, n + 2 * h, d), jnp.float32).astype(dtype)
  key, value = (jax.random.normal(k[i], (b, h, s, d), jnp.float32).astype(dtype) for i in (1, 2))
  return qkv, key, value


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("b,n,h,d,s,pos,block,splits", ATTENTION_CASES)
def test_decode_attention_kernel_equals_the_xla_step(b, n, h, d, s, pos, block, splits, dtype):
  qkv, key, value = _attention_inputs(b, n, h, d, s, dtype)
  theta = 10_000.0
  out, new_key, new_value = decode.decode_attention_kernel(qkv, key, value, jnp.array([pos], jnp.int32),
                                                           rope_frequencies(d, theta), n, block=block,
                                                           interpret=True, splits=splits)
  want, exact, want_key, want_value = _xla_attention_step(qkv, key, value, pos, n, theta)
  assert out.shape == (b, n, d) and out.dtype == dtype
  np.testing.assert_array_equal(new_value, want_value)
  others = np.arange(s) != pos
  np.testing.assert_array_equal(np.asarray(new_key)[:, :, others], np.asarray(key)[:, :, others])
  if dtype == jnp.bfloat16:  # the rotated key: float32 cos/sin may round one value to the other bf16 neighbour
    bf16_values_close(new_key[:, :, pos], want_key[:, :, pos], max_fraction=0.05, steps=1)
  else:
    np.testing.assert_allclose(new_key[:, :, pos], want_key[:, :, pos], rtol=1e-6, atol=1e-6)
  if pos == 0:  # one position: the output is the value itself
    np.testing.assert_array_equal(out, jnp.repeat(qkv[:, n + h :], n // h, axis=1))
    return
  if dtype == jnp.float32:  # float32 sums in another order: ~1e-6 relative
    assert sqnr_db(out, exact) >= 100.0, sqnr_db(out, exact)
  else:
    assert sqnr_db(out, exact) >= sqnr_db(want, exact) - 2.0, (sqnr_db(out, exact), sqnr_db(want, exact))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("b,n,h,d,s,pos,block,splits", ATTENTION_CASES)
def test_decode_attention_kernel_on_an_int8_cache_equals_the_xla_step(b, n, h, d, s, pos, block, splits, dtype):
  """An int8 cache: the new value's codes and scale are XLA's exactly; the rotated key's within one code (float32
  cos/sin may move a rounding of the key, and so of its codes); nothing else changes; the output is float32
  attention over the dequantized cache up to float32 sums (float32), or at least as close to it as XLA's int8
  attention, less 2 dB (bf16)."""
  qkv, key, value = _attention_inputs(b, n, h, d, s, dtype)
  (key, key_scale), (value, value_scale) = kv_cache.quantize_heads(key), kv_cache.quantize_heads(value)
  theta = 10_000.0
  out, *caches = decode.decode_attention_kernel(qkv, key, value, jnp.array([pos], jnp.int32),
                                                rope_frequencies(d, theta), n, block=block, interpret=True,
                                                key_scale=key_scale, value_scale=value_scale, splits=splits)
  want, exact, want_caches = _xla_attention_step_int8(qkv, key, value, key_scale, value_scale, pos, n, theta)
  assert out.shape == (b, n, d) and out.dtype == dtype
  assert [c.dtype for c in caches] == [jnp.int8, jnp.int8, jnp.float32, jnp.float32]
  others = np.arange(s) != pos
  for got_cache, before in zip(caches, (key, value, key_scale, value_scale)):
    np.testing.assert_array_equal(np.asarray(got_cache)[:, :, others], np.asarray(before)[:, :, others])
  np.testing.assert_array_equal(caches[1], want_caches[1])  # the value: no RoPE, XLA's codes and scale exactly
  np.testing.assert_array_equal(caches[3], want_caches[3])
  key_codes = np.asarray(caches[0], np.int32)[:, :, pos] - np.asarray(want_caches[0], np.int32)[:, :, pos]
  assert np.abs(key_codes).max() <= 1
  np.testing.assert_allclose(caches[2][:, :, pos], want_caches[2][:, :, pos], rtol=2e-2 if dtype == jnp.bfloat16
                             else 1e-5)
  if pos == 0:  # one position: the output is the new value's codes times its scale, rounded once
    new_value = caches[1][:, :, 0].astype(jnp.float32) * caches[3][:, :, 0, None]  # [B, H, D]
    np.testing.assert_array_equal(out, jnp.repeat(new_value, n // h, axis=1).astype(dtype))
  elif dtype == jnp.float32:  # float32 sums in another order (~1e-6 relative), against the cache the kernel wrote
    mask = (jnp.arange(s) <= pos)[None, None, None]
    mine = _exact_int8(_rotated_query(qkv, pos, n, theta), caches, mask)
    assert sqnr_db(out, mine) >= 100.0, sqnr_db(out, mine)
  else:
    assert sqnr_db(out, exact) >= sqnr_db(want, exact) - 2.0, (sqnr_db(out, exact), sqnr_db(want, exact))


@pytest.mark.parametrize("int8_cache", [False, True])
@pytest.mark.parametrize("b,n,h,d,s,pos,block,splits", [ATTENTION_CASES[i] for i in (0, 2, 3, 4, 5)])
def test_cache_positions_from_the_new_one_on_never_reach_the_output(b, n, h, d, s, pos, block, splits, int8_cache):
  """A cache holding NaN and inf from the new position on (stale rows of an earlier sequence) gives the output, bit
  for bit, of one holding zeros there: one program a KV head loads its first block before it knows the position
  and drops those positions when it uses the block; split caches mask them as they load."""
  qkv, key, value = _attention_inputs(b, n, h, d, s, jnp.bfloat16)
  caches = [key, value]
  if int8_cache:
    (key, key_scale), (value, value_scale) = kv_cache.quantize_heads(key), kv_cache.quantize_heads(value)
    caches = [key, value, key_scale, value_scale]
  stale = (jnp.arange(s) >= pos)[None, None, :]

  def attend(fill):
    filled = [jnp.where(stale if c.ndim == 3 else stale[..., None], jnp.asarray(fill, c.dtype), c)
              if jnp.issubdtype(c.dtype, jnp.floating) else c for c in caches]
    scales = dict(key_scale=filled[2], value_scale=filled[3]) if int8_cache else {}
    return decode.decode_attention_kernel(qkv, filled[0], filled[1], jnp.array([pos], jnp.int32),
                                          rope_frequencies(d, 1e4), n, block=block, interpret=True, splits=splits,
                                          **scales)[0]

  clean = attend(0.0)
  assert np.isfinite(np.asarray(clean, np.float32)).all()
  for fill in (jnp.nan, jnp.inf):
    np.testing.assert_array_equal(attend(fill), clean)


def test_attention_splits_one_program_a_kv_head_up_to_the_threshold_then_a_few_an_sm(monkeypatch):
  monkeypatch.setattr(decode, "ATTENTION_PROGRAMS_PER_SM", 2)
  assert decode.attention_splits(1, 8, decode.ATTENTION_SPLIT_FROM, sms=132) == 1
  assert decode.attention_splits(1, 8, 2048, sms=132) == 16  # 16 blocks of 128: one each (no more than blocks)
  assert decode.attention_splits(1, 8, 8192, sms=132) == 32  # 64 blocks for 2 x 132 // 8 = 33: 32 runs of 2
  assert decode.attention_splits(8, 8, 2048, sms=132) == 4
  assert decode.attention_splits(32, 8, 2048, sms=132) == 1  # the sequences and heads fill the SMs
  assert decode.attention_splits(1, 2, 600, sms=132) == 5  # no more splits than blocks


def test_decode_attention_kernel_names_int8_scales_that_do_not_match():
  qkv = jnp.zeros((1, 8, 32), jnp.bfloat16)
  codes, scales = jnp.zeros((1, 2, 16, 32), jnp.int8), jnp.ones((1, 2, 16), jnp.float32)
  step = functools.partial(decode.decode_attention_kernel, qkv, codes, codes, jnp.array([0], jnp.int32),
                           rope_frequencies(32, 1e4), 4, interpret=True)
  with pytest.raises(ValueError, match="both key_scale and value_scale"):
    step(key_scale=scales)
  with pytest.raises(ValueError, match=r"scales must be float32 \(1, 2, 16\)"):
    step(key_scale=scales, value_scale=jnp.ones((1, 2, 8), jnp.float32))
  with pytest.raises(ValueError, match="scales must be float32"):
    step(key_scale=scales, value_scale=scales.astype(jnp.bfloat16))
  with pytest.raises(ValueError, match="or int8 with key_scale"):  # int8 codes without their scales
    step()


def test_decode_attention_kernel_names_a_cache_that_does_not_match():
  qkv = jnp.zeros((1, 8, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match="does not match the cache"):
    decode.decode_attention_kernel(qkv, jnp.zeros((1, 3, 16, 32), jnp.bfloat16), jnp.zeros((1, 3, 16, 32), jnp.bfloat16),
                                   jnp.array([0], jnp.int32), rope_frequencies(32, 1e4), 4, interpret=True)
  with pytest.raises(ValueError, match="dtype"):
    decode.decode_attention_kernel(qkv, jnp.zeros((1, 2, 16, 32), jnp.float32), jnp.zeros((1, 2, 16, 32), jnp.float32),
                                   jnp.array([0], jnp.int32), rope_frequencies(32, 1e4), 4, interpret=True)


# A tiny model whose attention and norms matter to its logits (init_std 0.3); head_dim 32, the smallest the
# attention kernel takes.
TINY = dict(vocab_size=64, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256, init_std=0.3)


def count_kernel_calls(monkeypatch, norm_kernel, attention_kernel) -> dict[str, int]:
  """Route the dispatch's decode kernels through these functions, counting the calls (each trace calls once)."""
  calls = {"norm": 0, "attention": 0}

  def counted(name, fn):
    def run(*args, **kwargs):
      calls[name] += 1
      return fn(*args, **kwargs)
    return run

  monkeypatch.setattr(dispatch, "_norm_rows_kernel", counted("norm", norm_kernel))
  monkeypatch.setattr(dispatch, "decode_attention", counted("attention", attention_kernel))
  return calls


@pytest.fixture
def interpreted_kernels(monkeypatch):
  """The dispatch sends decode's norms and attention to the kernels in interpret mode; counts their calls."""
  monkeypatch.setattr(dispatch, "norm_rows_on_kernel", lambda rows, options=None: rows <= decode.NORM_ROWS_MAX)
  monkeypatch.setattr(dispatch, "decode_attention_on_kernel",
                      lambda n, h, d, options=None: decode.decode_attention_supported(n, h, d))
  return count_kernel_calls(monkeypatch, functools.partial(decode.norm_rows_kernel, interpret=True),
                            functools.partial(decode.decode_attention_kernel, interpret=True))


def _decode_logits(config, params, tokens, prefill: int, scheme: str = "bf16", **prepare_kwargs):
  """Teacher-forced logits of the decode-mode model: a prefill of ``prefill`` tokens, then one token per step."""
  return _teacher_forced(*generate.prepare(config, params, scheme, **prepare_kwargs), tokens, prefill)


def _teacher_forced(model, inference_params, tokens, prefill: int):
  """:func:`_decode_logits` of a prepared model. The parameters are the step's arguments: closed over, they would be
  constants of the executable, and the test suite's compilation cache would compress them at every compile."""
  step = jax.jit(lambda p, c, t: model.apply({"params": p, "cache": c}, t, mutable=["cache"]))
  logits, state = step(inference_params, generate.init_cache(model, tokens.shape[0], tokens.shape[1]),
                       tokens[:, :prefill])
  out = []
  for t in range(prefill, tokens.shape[1]):
    logits, state = step(inference_params, state["cache"], tokens[:, t : t + 1])
    out.append(logits)
  return jnp.concatenate(out, axis=1)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_model_decodes_through_the_kernels_as_through_xla(dtype, kv_cache_dtype, interpreted_kernels, monkeypatch):
  config = ModelConfig(**TINY, dtype=dtype)
  params = jax.jit(Transformer(config).init)(fresh_key(), jnp.zeros((1, 8), jnp.int32))["params"]
  tokens = jax.random.randint(fresh_key(), (2, 12), 0, TINY["vocab_size"])
  interpreted_kernels.update(norm=0, attention=0)  # the init's 8 rows took the norm kernel too
  got = _decode_logits(config, params, tokens, prefill=5, kv_cache_dtype=kv_cache_dtype)
  # Each trace (the prefill's 10 rows, then a step's 2) runs 2 layers x 2 pre-norms + the final norm on the kernel;
  # attention runs on it in the steps' traces (one new token), once per layer.
  steps = interpreted_kernels["attention"] // 2
  assert steps >= 1 and interpreted_kernels == {"norm": 5 * (1 + steps), "attention": 2 * steps}
  monkeypatch.setattr(policy, "DECODE_NORM_KERNEL", False)
  monkeypatch.setattr(dispatch, "norm_rows_on_kernel", lambda rows, options=None: False)
  monkeypatch.setattr(dispatch, "decode_attention_on_kernel", lambda *a, **k: False)
  want = _decode_logits(config, params, tokens, prefill=5, kv_cache_dtype=kv_cache_dtype)
  if dtype == jnp.float32 and kv_cache_dtype == "auto":  # float32 sums in other orders: relative L2 ~3e-6
    assert rel_err(got, want) <= 2e-5, rel_err(got, want)
  else:  # a moved bf16 rounding in a norm or the attention (or a key's int8 code moved by float32 cos/sin) carries
    # through the layers (1-2e-2 apart): against the float32 model's decode with a float32 cache both are as far
    # (16 seeds: the kernels' error 0.93-1.08x XLA's)
    exact = _decode_logits(dataclasses.replace(config, dtype=jnp.float32), params, tokens, prefill=5)
    assert rel_err(got, exact) <= 1.5 * rel_err(want, exact) + 2e-3, (rel_err(got, exact), rel_err(want, exact))


@pytest.mark.parametrize("placement", ["sub", "every_projection"])
def test_a_ternary_model_decodes_from_the_codes_its_norms_make(placement, interpreted_kernels, monkeypatch):
  """Converted for ternary, a BitNet model's decode norms hand each linear its int8 codes
  (``jaxlowbit.fused.decode_quantization``): the logits are those of the model whose linears quantize the norms'
  outputs themselves, bit for bit, and every norm before a BitNet linear quantized (the final norm did not)."""
  from jaxlowbit import BitNet
  from jaxlowbit.inference import weights as inference_weights

  quantized = []
  kernel = dispatch._norm_rows_kernel  # the fixture's interpreted, counted kernel

  def recording(*args, **kwargs):
    quantized.append((args + (None,) * 6)[5] is not None)
    return kernel(*args, **kwargs)

  monkeypatch.setattr(dispatch, "_norm_rows_kernel", recording)
  config = ModelConfig(**TINY, recipe=BitNet(), bitnet_norm_placement=placement)
  params = jax.jit(Transformer(config).init)(fresh_key(), jnp.zeros((1, 8), jnp.int32))["params"]
  tokens = jax.random.randint(fresh_key(), (2, 8), 0, TINY["vocab_size"])
  got = _decode_logits(config, params, tokens, prefill=5, scheme="ternary")
  # per trace, each layer's norms before BitNet linears: sub: 2 pre-norms + 2 sub-norms; every_projection: 4 own
  # norms (qkv, out, gate_up, down; the pre-norms write bf16 for them); then the final norm, unquantized
  per_layer = 4
  traces = len(quantized) // (TINY["n_layers"] * (4 if placement == "sub" else 6) + 1)
  assert traces >= 2 and quantized.count(True) == traces * TINY["n_layers"] * per_layer, quantized
  monkeypatch.setattr(inference_weights, "DECODE_INPUTS", {})
  del quantized[:]
  want = _decode_logits(config, params, tokens, prefill=5, scheme="ternary")
  assert not any(quantized)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _recording_gemvs(monkeypatch, interpret: bool) -> list[str | None]:
  """Route the W8A16 and dp4a GEMVs (``interpret``: in interpret mode) through a recorder of each call's ``gated``."""
  from pallas_kernels import dp4a_gemv, w8a16

  gated = []

  def recorded(fn):
    def run(*args, **kwargs):
      gated.append(kwargs.get("gated"))
      return fn(*args, **({"interpret": True} if interpret else {}), **kwargs)
    return run

  monkeypatch.setattr(w8a16, "w8a16_matmul_kernel", recorded(w8a16.w8a16_matmul_kernel))
  for name in ("a8w2_gemv_kernel", "a8w8_gemv_kernel", "quantize_a8w2_gemv_kernel", "quantize_a8w8_gemv_kernel"):
    monkeypatch.setattr(dp4a_gemv, name, recorded(getattr(dp4a_gemv, name)))
  return gated


@pytest.fixture
def interpreted_gemvs(monkeypatch) -> list[str | None]:
  """The dispatch sends a converted model's decode-sized linears to the W8A16 and dp4a GEMVs in interpret mode
  (wherever they would run on a GPU under auto); records the ``gated`` of each call."""
  gemvs = ("W8A16", "ternary GEMV", "W8A8 GEMV")
  monkeypatch.setattr(policy, "use_inference_kernel",
                      lambda who, wanted, fits, backend: who in gemvs and wanted and fits)
  return _recording_gemvs(monkeypatch, interpret=True)


@pytest.mark.parametrize("scheme,batch,activation", [("w8a16", 1, "silu"), ("w8a16", 1, "relu2"), ("w8a8", 1, "silu"),
                                                     ("ternary", 1, "silu"), ("ternary", 1, "relu2"),
                                                     ("ternary", 2, "silu")])
def test_the_gate_up_gemv_that_writes_the_gated_activation_moves_no_logit(scheme, batch, activation,
                                                                           interpreted_kernels, interpreted_gemvs,
                                                                           monkeypatch):
  """A decode step's gate_up GEMV that writes ``act(gate) * up`` in its epilogue (``policy.GATED_EPILOGUE``) gives
  the logits of the step that writes ``[gate | up]`` and forms the activation after it (BitNet's ffn_sub_norm
  kernel, or XLA), bit for bit, through the GEMVs the GPU runs (interpreted; ternary's takes two rows too); and the
  GEMV did form it (a W8A8 conversion does not ask for it: ``jaxlowbit.inference.weights.gated_outputs``)."""
  from jaxlowbit import BitNet

  bitnet = {"recipe": BitNet(), "bitnet_norm_placement": "sub"} if scheme == "ternary" else {}
  config = ModelConfig(**TINY, mlp_activation=activation, **bitnet)
  params = jax.jit(Transformer(config).init)(fresh_key(), jnp.zeros((1, 8), jnp.int32))["params"]
  tokens = jax.random.randint(fresh_key(), (batch, 8), 0, TINY["vocab_size"])
  got = _decode_logits(config, params, tokens, prefill=5, scheme=scheme)
  # each step's trace: every layer's gate_up GEMV gated (W8A8: none)
  fused = interpreted_gemvs.count(activation)
  assert fused >= TINY["n_layers"] if scheme != "w8a8" else interpreted_gemvs and not fused, interpreted_gemvs
  monkeypatch.setattr(policy, "GATED_EPILOGUE", False)
  del interpreted_gemvs[:]
  want = _decode_logits(config, params, tokens, prefill=5, scheme=scheme)
  assert interpreted_gemvs and not any(interpreted_gemvs)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("grad_weight", [False, True], ids=["bitnet", "bitnet_int8_grad_weight"])
def test_a_bitnet_linear_left_unconverted_reads_the_codes(grad_weight, interpreted_kernels, monkeypatch):
  """A BitNet linear kept out of the conversion (``filter_fqns``) gets the norm's codes as they are and runs its
  training recipe's forward on them (with an int8 grad_weight, the x^T layout that recipe also asks for is made
  from their values): the logits of that model decoding with the bf16 norm outputs everywhere, bit for bit."""
  from jaxlowbit import BitNet
  from jaxlowbit.inference import weights as inference_weights

  config = ModelConfig(**TINY, recipe=BitNet(grad_weight=grad_weight), bitnet_norm_placement="sub")
  params = jax.jit(Transformer(config).init)(fresh_key(), jnp.zeros((1, 8), jnp.int32))["params"]
  tokens = jax.random.randint(fresh_key(), (2, 8), 0, TINY["vocab_size"])
  kept = ("lm_head", "layers.mlp")  # stacked layers (scan_layers): every layer's MLP
  got = _decode_logits(config, params, tokens, prefill=5, scheme="ternary", filter_fqns=kept)
  monkeypatch.setattr(inference_weights, "DECODE_INPUTS", {})
  want = _decode_logits(config, params, tokens, prefill=5, scheme="ternary", filter_fqns=kept)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _recording_norm_kernel(monkeypatch) -> list[tuple[int, bool, bool]]:
  """Route the dispatch's (interpreted, counted) norm kernel through a recorder: ``(rows, quantized, kept values)``
  a call."""
  calls = []
  kernel = dispatch._norm_rows_kernel

  def recording(*args, **kwargs):
    calls.append((args[0][0].shape[0], (args + (None,) * 6)[5] is not None, bool(kwargs.get("keep_values"))))
    return kernel(*args, **kwargs)

  monkeypatch.setattr(dispatch, "_norm_rows_kernel", recording)
  return calls


@pytest.mark.parametrize("scheme", ["w8a8", "ternary"])
@pytest.mark.parametrize("kept", [(), ("layers.attn.qkv",)], ids=["all", "qkv_unconverted"])
def test_a_high_precision_model_decodes_from_the_codes_its_pre_norms_make(scheme, kept, interpreted_kernels,
                                                                           monkeypatch):
  """Converted for W8A8 (with ``policy.W8A8_DECODE_CODES`` on, the default; off: none are handed) or ternary, a
  high-precision model's decode pre-norms hand the projections they feed (qkv, gate_up) int8 codes in the scheme's
  per-token spec, with their bf16 output beside them: the logits are those of the model whose linears quantize the
  norms' outputs themselves, bit for bit in interpret mode, also where some of those linears were left in high
  precision (they read the values). The final norm, before the unconverted lm_head, hands none. W8A8's norms hand
  codes only at the rows its GEMV quantizes itself (``ExecutionOptions.decode_input_rows``: one), so a W8A8 model
  decodes at batch 1 and its prefill (5 rows) quantizes in the linears."""
  from jaxlowbit.inference import weights as inference_weights

  calls = _recording_norm_kernel(monkeypatch)
  config = ModelConfig(**TINY)
  params = jax.jit(Transformer(config).init)(fresh_key(), jnp.zeros((1, 8), jnp.int32))["params"]
  tokens = jax.random.randint(fresh_key(), (1 if scheme == "w8a8" else 2, 8), 0, TINY["vocab_size"])
  filter_fqns = ("lm_head", *kept)
  if scheme == "w8a8":
    monkeypatch.setattr(policy, "W8A8_DECODE_CODES", False)
    _decode_logits(config, params, tokens, prefill=5, scheme=scheme, filter_fqns=filter_fqns)
    assert calls and not any(quantized for _, quantized, _ in calls)  # off: none handed
    monkeypatch.setattr(policy, "W8A8_DECODE_CODES", True)
    del calls[:]
    _decode_logits(config, params, jnp.concatenate([tokens, tokens]), prefill=5, scheme=scheme,
                   filter_fqns=filter_fqns)
    assert calls and not any(quantized for _, quantized, _ in calls)  # batch 2: the XLA int8 dot quantizes
    del calls[:]
  got = _decode_logits(config, params, tokens, prefill=5, scheme=scheme, filter_fqns=filter_fqns)
  # each trace: attn_norm and mlp_norm a layer, with codes and values, then the final norm with neither (the
  # cache's initialization traces the norms without codes: nothing is converted yet)
  per_trace = 2 * TINY["n_layers"] + 1
  handing = [(True, True)] * (per_trace - 1) + [(False, False)]
  flags = [(quantized, kept_values) for _, quantized, kept_values in calls]
  traces = [flags[i : i + per_trace] for i in range(0, len(flags), per_trace)]
  # the prefill's trace and the steps' hand codes (W8A8's prefill does not)
  assert len(calls) % per_trace == 0 and traces.count(handing) >= (1 if scheme == "w8a8" else 2), calls
  assert all(trace in (handing, [(False, False)] * per_trace) for trace in traces), calls
  if scheme == "w8a8":
    assert {rows for rows, quantized, _ in calls if quantized} == {1} and any(rows == 5 for rows, _, _ in calls)
  monkeypatch.setattr(inference_weights, "DECODE_INPUTS", {})
  del calls[:]
  want = _decode_logits(config, params, tokens, prefill=5, scheme=scheme, filter_fqns=filter_fqns)
  assert not any(quantized for _, quantized, _ in calls)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_smoothed_w8a8_linear_reads_the_norms_values_not_its_codes(interpreted_kernels, monkeypatch):
  """A SmoothQuant-smoothed W8A8 linear quantizes ``x / smooth``, so a decode norm's codes are not its codes: it reads
  the values the norm kept, and the logits are those of the decode without codes, bit for bit."""
  from jaxlowbit.inference import weights as inference_weights
  from jaxlowbit.inference.weights import SMOOTH

  monkeypatch.setattr(policy, "W8A8_DECODE_CODES", True)
  config = ModelConfig(**TINY)
  params = jax.jit(Transformer(config).init)(fresh_key(), jnp.zeros((1, 8), jnp.int32))["params"]
  tokens = jax.random.randint(fresh_key(), (2, 8), 0, TINY["vocab_size"])
  smooth_key = fresh_key()

  def logits():
    model, inference_params = generate.prepare(config, params, "w8a8")
    qkv = inference_params["layers_0"]["attn"]["qkv"]
    qkv[SMOOTH] = jax.random.uniform(smooth_key, (TINY["d_model"],), jnp.float32, 0.5, 2.0)
    return _teacher_forced(model, inference_params, tokens, 5)

  got = logits()
  monkeypatch.setattr(inference_weights, "DECODE_INPUTS", {})
  np.testing.assert_array_equal(np.asarray(got), np.asarray(logits()))


def test_a_norm_that_keeps_its_values_writes_the_unquantized_output_too():
  """``keep_values``: the codes and scales as without it, and the row the norm writes unquantized, bit for bit (the
  kernel in interpret mode against itself and against the XLA reference)."""
  from jaxlowbit.inference.weights import INT8_TOKENS

  norm = RmsNorm(1e-5, jnp.dtype(jnp.bfloat16))
  x, delta = (jax.random.normal(fresh_key(), (3, 256), jnp.float32).astype(jnp.bfloat16) for _ in range(2))
  gamma = (1 + 0.1 * jax.random.normal(fresh_key(), (256,), jnp.float32)).astype(jnp.bfloat16)
  for run in (functools.partial(decode.norm_rows_kernel, interpret=True), decode.norm_rows_reference):
    (codes, scale, values), total = run((x, delta), gamma, decode.Add(), norm, True, INT8_TOKENS, keep_values=True)
    (codes_alone, scale_alone), total_alone = run((x, delta), gamma, decode.Add(), norm, True, INT8_TOKENS)
    plain, _ = run((x, delta), gamma, decode.Add(), norm, True)
    for a, b in ((codes, codes_alone), (scale, scale_alone), (values, plain), (total, total_alone)):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert values.dtype == jnp.bfloat16 and codes.dtype == jnp.int8


def test_an_unconverted_layer_takes_the_codes_as_they_are_where_its_recipe_reads_them():
  """``unconverted_input``: a BitNet recipe gets the very operand (its forward reads the rows: no round trip through
  bf16 values, which could move a code by one); the int8-grad_weight variant the same rows plus an x^T layout; a
  high-precision layer the codes' float32 values."""
  from jaxlowbit import BitNet
  from jaxlowbit.inference.linen import unconverted_input
  from jaxlowbit.inference.weights import BITNET_TOKENS
  from jaxlowbit.operand import LowBitOperand, QuantizedMatrix
  from pallas_kernels.reference import quantize_rows_reference

  x = jax.random.normal(fresh_key(), (3, 64), jnp.float32).astype(jnp.bfloat16)
  rows = QuantizedMatrix(*quantize_rows_reference(x, BITNET_TOKENS), BITNET_TOKENS)
  operand = LowBitOperand(rows, None, jnp.zeros(x.shape, x.dtype))
  assert unconverted_input(operand, BitNet()) is operand
  with_t = unconverted_input(operand, BitNet(grad_weight=True))
  assert with_t.rows is rows and with_t.transposed.data.shape == (64, 3) and with_t.transposed.data.dtype == jnp.int8
  values = unconverted_input(operand, None)
  assert values.dtype == jnp.float32
  np.testing.assert_array_equal(values, np.asarray(rows.data, np.float32) * np.asarray(rows.scale))


def test_the_deferred_residual_is_the_same_model(interpreted_kernels):
  """Decode adds each block's MLP output in the next norm; the params and the cache are those of the model."""
  config = ModelConfig(**TINY)
  params = jax.jit(Transformer(config).init)(fresh_key(), jnp.zeros((1, 8), jnp.int32))["params"]
  model, inference_params = generate.prepare(config, params, "bf16")
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32)))
  assert jax.tree.structure(shapes["params"]) == jax.tree.structure(inference_params)
  assert shapes["cache"]["layers_0"]["attn"]["key"].shape == (1, TINY["n_kv_heads"], 16, 32)


# ---------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SOURCES))
@pytest.mark.parametrize("rows,width", [(1, 2048), (8, 2048), (1, 8192), (4, 14336)])
def test_norm_rows_kernel_on_gpu(name, rows, width):
  source, _, write_source = SOURCES[name]
  inputs, gamma = _norm_inputs(fresh_key(), name, rows, width, jnp.bfloat16)
  norm = RmsNorm(1e-5, jnp.dtype(jnp.bfloat16))
  got = jax.jit(decode.norm_rows_kernel, static_argnums=(2, 3, 4))(inputs, gamma, source, norm, write_source)
  want = jax.jit(decode.norm_rows_reference, static_argnums=(2, 3, 4))(inputs, gamma, source, norm, write_source)
  if write_source:
    np.testing.assert_array_equal(got[1], want[1])
    got, want = got[0], want[0]
  bf16_values_close(got, want, max_fraction=0.05, steps=_steps(source))


# (batch, cache length, position): the 1B model's short decode; a cache split over programs, 2 per SM on 132 SMs
# (2048: 16 splits of one block at batch 1, 4 of four blocks at batch 8; 1000: 8 at batch 2; 8192: 32 of two
# blocks, and with the position in the first split, the others empty).
GPU_ATTENTION_CASES = [(1, 81, 70), (8, 81, 80), (1, 2048, 2047), (8, 2048, 2047), (2, 1000, 513), (1, 64, 0),
                       (1, 8192, 8191), (1, 8192, 100)]


@pytest.mark.gpu
@pytest.mark.parametrize("b,s,pos", GPU_ATTENTION_CASES)
def test_decode_attention_kernel_on_gpu(b, s, pos):
  n, h, d = 32, 8, 64  # the 1B model's heads
  qkv, key, value = _attention_inputs(b, n, h, d, s, jnp.bfloat16)
  step = jax.jit(decode.decode_attention_kernel, static_argnames=("n_heads",))
  out, new_key, new_value = step(qkv, key, value, jnp.array([pos], jnp.int32), rope_frequencies(d, 5e5), n_heads=n)
  want, exact, want_key, want_value = jax.jit(_xla_attention_step, static_argnums=(3, 4, 5))(
      qkv, key, value, pos, n, 5e5)
  np.testing.assert_array_equal(new_value, want_value)
  bf16_values_close(new_key, want_key, max_fraction=0.05, steps=1)
  if pos:
    assert sqnr_db(out, exact) >= sqnr_db(want, exact) - 2.0, (sqnr_db(out, exact), sqnr_db(want, exact))


@pytest.mark.gpu
@pytest.mark.parametrize("b,s,pos", GPU_ATTENTION_CASES)
def test_decode_attention_kernel_on_an_int8_cache_on_gpu(b, s, pos):
  n, h, d = 32, 8, 64
  qkv, key, value = _attention_inputs(b, n, h, d, s, jnp.bfloat16)
  (key, key_scale), (value, value_scale) = kv_cache.quantize_heads(key), kv_cache.quantize_heads(value)
  step = jax.jit(decode.decode_attention_kernel, static_argnames=("n_heads",))
  out, *caches = step(qkv, key, value, jnp.array([pos], jnp.int32), rope_frequencies(d, 5e5), n_heads=n,
                      key_scale=key_scale, value_scale=value_scale)
  want, exact, want_caches = jax.jit(_xla_attention_step_int8, static_argnums=(5, 6, 7))(
      qkv, key, value, key_scale, value_scale, pos, n, 5e5)
  np.testing.assert_array_equal(caches[1], want_caches[1])
  np.testing.assert_array_equal(caches[3], want_caches[3])
  # The new key's scale differs from XLA's in its last bits (on an H200 in every row of 16 draws; the value's never;
  # likely because XLA rotates and quantizes the key in one fusion where the kernel rounds the rotated key to bf16
  # first), so a code can move by one step.
  key_steps = np.abs(np.asarray(caches[0], np.int32) - np.asarray(want_caches[0], np.int32))
  assert key_steps.max() <= 1, (key_steps.max(), np.argwhere(key_steps > 1)[:4])
  if pos:
    assert sqnr_db(out, exact) >= sqnr_db(want, exact) - 2.0, (sqnr_db(out, exact), sqnr_db(want, exact))
  else:  # one position: the new value's codes times its scale, rounded once
    new_value = caches[1][:, :, 0].astype(jnp.float32) * caches[3][:, :, 0, None]
    np.testing.assert_array_equal(out, jnp.repeat(new_value, n // h, axis=1).astype(jnp.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("scheme,kv_cache_dtype", [("bf16", "auto"), ("ternary", "auto"), ("bf16", "int8"),
                                                   ("ternary", "int8")])
def test_decode_with_the_kernels_equals_decode_without_on_gpu(scheme, kv_cache_dtype, monkeypatch):
  from jaxlowbit import BitNet

  config = ModelConfig(vocab_size=384, d_model=512, n_layers=4, n_heads=8, n_kv_heads=2, d_ff=1024, init_std=0.1,
                       recipe=BitNet() if scheme == "ternary" else None, bitnet_norm_placement="sub")
  params = jax.jit(Transformer(config).init)(fresh_key(), jnp.zeros((1, 8), jnp.int32))["params"]
  tokens = jax.random.randint(fresh_key(), (2, 16), 0, config.vocab_size)
  calls = count_kernel_calls(monkeypatch, dispatch._norm_rows_kernel, dispatch.decode_attention)
  got = _decode_logits(config, params, tokens, 6, scheme, kv_cache_dtype=kv_cache_dtype)
  # each of the two traces: 4 layers x 2 pre-norms + the final norm (+ 4 sub-norms for ternary); attention in one
  norms, steps = 9 + (8 if scheme == "ternary" else 0), calls["attention"] // 4
  assert steps >= 1 and calls == {"norm": norms * (1 + steps), "attention": 4 * steps}, calls
  monkeypatch.setattr(policy, "DECODE_NORM_KERNEL", False)
  monkeypatch.setattr(policy, "DECODE_ATTENTION_KERNEL", False)
  want = _decode_logits(config, params, tokens, 6, scheme, kv_cache_dtype=kv_cache_dtype)
  assert calls == {"norm": norms * (1 + steps), "attention": 4 * steps}, calls  # none ran
  # Against the float32 model's decode: a moved bf16 rounding can flip an int8 activation code (ternary), so the
  # two bf16 decodes differ by about their own error; the kernels' error is that of XLA's.
  exact = _decode_logits(dataclasses.replace(config, dtype=jnp.float32), params, tokens, 6, scheme)
  assert rel_err(got, exact) <= 1.5 * rel_err(want, exact) + 2e-3, (rel_err(got, exact), rel_err(want, exact))


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["ternary", "w8a8"])
@pytest.mark.parametrize("batch", [1, 4])
def test_a_model_decodes_from_its_norms_codes_as_from_its_linears_quantizer_on_gpu(batch, scheme, monkeypatch):
  """On the GPU the norm kernel's codes feed the converted linears; without them each linear quantizes the norm's
  bf16 output itself. Ternary: a BitNet model's pre-quantized GEMV against the GEMV's own quantizer, both Triton's
  encode. W8A8: a bf16 model's int8 matmul after its pre-norms (``policy.W8A8_DECODE_CODES`` on), which hand codes
  only at the rows the dp4a GEMV quantizes (one), against XLA's quantizer elsewhere. The logits are bit-identical."""
  from jaxlowbit import BitNet
  from jaxlowbit.inference import weights as inference_weights

  recipe = dict(recipe=BitNet(), bitnet_norm_placement="sub") if scheme == "ternary" else {}
  monkeypatch.setattr(policy, "W8A8_DECODE_CODES", True)
  config = ModelConfig(vocab_size=384, d_model=512, n_layers=4, n_heads=8, n_kv_heads=2, d_ff=2048, init_std=0.1,
                       **recipe)
  params = jax.jit(Transformer(config).init)(fresh_key(), jnp.zeros((1, 8), jnp.int32))["params"]
  tokens = jax.random.randint(fresh_key(), (batch, 16), 0, config.vocab_size)
  got = _decode_logits(config, params, tokens, 6, scheme)
  monkeypatch.setattr(inference_weights, "DECODE_INPUTS", {})
  want = _decode_logits(config, params, tokens, 6, scheme)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.gpu
@pytest.mark.timeout(240)  # a slow or stalled run fails here (a main thread blocked in the driver may not be cut)
@pytest.mark.parametrize("scheme", ["bf16", "w8a16", "w8a8", "ternary"])
def test_the_early_launch_trigger_moves_no_output_on_gpu(scheme, monkeypatch):
  """``policy.PDL_EARLY_LAUNCH`` lets the next kernel be scheduled while ours run; the wait at its start keeps every
  read after the writes it depends on, so a decode's logits are bit-identical with and without the trigger (a
  kernel that read before its predecessor finished would see a buffer half written). 1B widths, two layers: the
  GEMVs run several waves of programs."""
  from jaxlowbit import BitNet

  recipe = dict(recipe=BitNet(), bitnet_norm_placement="sub") if scheme == "ternary" else {}
  config = ModelConfig(vocab_size=384, d_model=2048, n_layers=2, n_heads=32, n_kv_heads=8, d_ff=8192, init_std=0.02,
                       **recipe)
  params = jax.jit(Transformer(config).init)(fresh_key(), jnp.zeros((1, 8), jnp.int32))["params"]
  tokens = jax.random.randint(fresh_key(), (1, 16), 0, config.vocab_size)
  calls = count_kernel_calls(monkeypatch, dispatch._norm_rows_kernel, dispatch.decode_attention)
  monkeypatch.setattr(policy, "PDL_EARLY_LAUNCH", True)
  jax.clear_caches()  # the flag is read when a kernel is traced
  got = _decode_logits(config, params, tokens, 6, scheme)
  assert calls["norm"] and calls["attention"], calls  # the decode ran our kernels, which carry the trigger
  monkeypatch.setattr(policy, "PDL_EARLY_LAUNCH", False)
  jax.clear_caches()
  want = _decode_logits(config, params, tokens, 6, scheme)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.gpu
@pytest.mark.timeout(240)
@pytest.mark.parametrize("scheme", ["w8a16", "w8a8", "ternary"])
def test_the_gate_up_gemv_that_writes_the_gated_activation_on_gpu(scheme, monkeypatch):
  """1B widths, two layers, batch 1 (``policy.GATED_EPILOGUE`` on, then off). Ternary: bit-identical logits (the
  activation is Triton's either way: the GEMV's epilogue or the ffn_sub_norm kernel's source); W8A8 too (its
  conversion does not ask for it). W8A16 formed it in an XLA kernel, whose exp and division may round a last bit
  differently from Triton's, and its gated programs sum K over half the columns, possibly in another float32 order:
  its logits agree within 1e-2 (relative L2; W8A16's bound is bf16 rounding)."""
  from jaxlowbit import BitNet

  recipe = dict(recipe=BitNet(), bitnet_norm_placement="sub") if scheme == "ternary" else {}
  config = ModelConfig(vocab_size=384, d_model=2048, n_layers=2, n_heads=32, n_kv_heads=8, d_ff=8192, init_std=0.02,
                       **recipe)
  params = jax.jit(Transformer(config).init)(fresh_key(), jnp.zeros((1, 8), jnp.int32))["params"]
  tokens = jax.random.randint(fresh_key(), (1, 16), 0, config.vocab_size)
  gated = _recording_gemvs(monkeypatch, interpret=False)
  got = _decode_logits(config, params, tokens, 6, scheme)
  fused = gated.count(config.mlp_activation)  # the gate_up GEMVs formed it (W8A8's did not)
  assert fused >= config.n_layers if scheme != "w8a8" else gated and not fused, gated
  monkeypatch.setattr(policy, "GATED_EPILOGUE", False)
  want = _decode_logits(config, params, tokens, 6, scheme)
  if scheme == "w8a16":
    assert rel_err(got, want) <= 1e-2, rel_err(got, want)
  else:
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_kernels_lower_for_cuda(monkeypatch):
  """Triton-backend lowering (Pallas -> Triton IR) of both kernels for an H100 on the 1B model's shapes, on CPU,
  with and without the early-launch trigger (``pallas_kernels.launch``)."""
  f = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  norm = RmsNorm(1e-5, jnp.dtype(bf16))
  cases = {
      "norm": (functools.partial(decode.norm_rows_kernel, source=decode.Add(), norm=norm, write_source=True),
               (f((8, 2048), bf16), f((8, 2048), bf16)), f((2048,), bf16)),
      "gated norm": (functools.partial(decode.norm_rows_kernel, source=SwiGLU("silu"), norm=norm),
                     (f((1, 16384), bf16),), f((8192,), bf16)),
      "attention": (functools.partial(decode.decode_attention_kernel, n_heads=32), f((8, 48, 64), bf16),
                    f((8, 8, 512, 64), bf16), f((8, 8, 512, 64), bf16), f((1,), jnp.int32), f((32,), jnp.float32)),
      "split attention, int8 cache": (
          lambda qkv, k, v, p, fr, ks, vs: decode.decode_attention_kernel(qkv, k, v, p, fr, 32, key_scale=ks,
                                                                          value_scale=vs),
          f((1, 48, 64), bf16), f((1, 8, 8192, 64), jnp.int8), f((1, 8, 8192, 64), jnp.int8), f((1,), jnp.int32),
          f((32,), jnp.float32), f((1, 8, 8192), jnp.float32), f((1, 8, 8192), jnp.float32)),
  }
  with jax.sharding.use_abstract_mesh(H100):
    for name, (fn, *shapes) in cases.items():
      for early in (True, False):  # policy.PDL_EARLY_LAUNCH: the kernel opens with the trigger, or without it
        monkeypatch.setattr(policy, "PDL_EARLY_LAUNCH", early)
        jax.clear_caches()  # the flag is read when the kernel is traced
        text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text, name
        assert ("griddepcontrol.launch_dependents" in text) == early, (name, early)


def test_the_attention_kernel_takes_the_heads_it_tiles(monkeypatch):
  """On a (faked) sm90 GPU the dispatch sends decode's attention to the kernel for heads it tiles (any cache length:
  a long cache is split over programs), other heads to XLA; policy.DECODE_ATTENTION_KERNEL turns it off."""
  monkeypatch.delenv("JAXLOWBIT_BACKEND", raising=False)
  monkeypatch.setattr(policy, "compute_capability", lambda device=None: 9)
  assert dispatch.decode_attention_on_kernel(32, 8, 64)
  assert not dispatch.decode_attention_on_kernel(4, 2, 16)  # head_dim / 2 = 8: under tl.dot's 16
  monkeypatch.setattr(policy, "DECODE_ATTENTION_KERNEL", False)
  assert not dispatch.decode_attention_on_kernel(32, 8, 64)


@pytest.mark.parametrize("form", policy.INT8_DIVISIONS)
def test_every_int8_division_form_lowers_for_cuda_and_matches_the_reference_interpreted(form, monkeypatch):
  """``policy.INT8_DIVISION`` (the forms ``benchmarks/quantizer_agreement.py`` compares on a GPU): each lowers to
  Triton for sm90 in the decode norm (one scale a program) and the rows quantizer (a scale a row); interpreted, each
  gives the codes the reference makes of the norm's own output (there the division is XLA's; against the reference
  norm the mean square's sum order could move an output, so the kernel's output is what both quantize)."""
  from jaxlowbit.inference.weights import INT8_TOKENS
  from pallas_kernels import quantize as quantize_kernels

  monkeypatch.setattr(policy, "INT8_DIVISION", form)
  f = jax.ShapeDtypeStruct
  norm = RmsNorm(1e-5, jnp.dtype(jnp.bfloat16))
  cases = {
      "norm": (functools.partial(decode.norm_rows_kernel, source=Identity(), norm=norm, quantize=INT8_TOKENS),
               (f((1, 2048), jnp.bfloat16),), f((2048,), jnp.bfloat16)),
      "rows": (functools.partial(quantize_kernels.quantize_rows_kernel, spec=INT8_TOKENS),
               f((256, 1536), jnp.bfloat16)),
  }
  with jax.sharding.use_abstract_mesh(H100):
    for name, (fn, *shapes) in cases.items():
      text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
      assert "__gpu$xla.gpu.triton" in text, name
  x = jax.random.normal(fresh_key(), (4, 512), jnp.float32).astype(jnp.bfloat16)
  gamma = jnp.ones((512,), jnp.bfloat16)
  codes, scale, y = decode.norm_rows_kernel((x,), gamma, Identity(), norm, quantize=INT8_TOKENS, interpret=True,
                                            keep_values=True)
  want_codes, want_scale = quantize_rows_reference(y, INT8_TOKENS)
  np.testing.assert_array_equal(np.asarray(codes), np.asarray(want_codes))
  np.testing.assert_array_equal(np.asarray(scale), np.asarray(want_scale))


def test_an_unknown_int8_division_form_is_refused(monkeypatch):
  from jaxlowbit.inference.weights import INT8_TOKENS

  monkeypatch.setattr(policy, "INT8_DIVISION", "approx")
  x = jnp.ones((1, 256), jnp.bfloat16)
  with pytest.raises(ValueError, match="INT8_DIVISION"):
    decode.norm_rows_kernel((x,), jnp.ones((256,), jnp.bfloat16), Identity(), RmsNorm(1e-5, jnp.dtype(jnp.bfloat16)),
                            quantize=INT8_TOKENS, interpret=True)


def test_the_quantizer_agreement_benchmark_finds_every_form_exact_when_interpreted(tmp_path):
  """``benchmarks/quantizer_agreement.py --smoke``: a row per form and case, each counting its codes against XLA's
  (interpreted, every form is XLA's division: none differs), and the shipped form restored after."""
  from benchmarks import quantizer_agreement

  shipped = policy.INT8_DIVISION
  rows = quantizer_agreement.main(["--smoke", "--out", str(tmp_path / "agreement.json")])
  assert {row["form"] for row in rows} == set(policy.INT8_DIVISIONS)
  assert all(row["elements"] > 0 and row["differing"] == 0 for row in rows), rows
  assert policy.INT8_DIVISION == shipped and (tmp_path / "agreement.json").exists()
