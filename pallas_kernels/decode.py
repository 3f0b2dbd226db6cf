"""Decode-sized kernels (Pallas, Triton backend) that fold a chain of small XLA kernels into one launch.

At decode the activations are a few rows (``M = batch``) and every op of a layer is a kernel of its own. On an
H200 a ternary 1B decode token ran 311 kernels (19 per layer, most of them 1-2 us;
benchmarks/results/decode_kernels_on_h200_bddc8c0.json). Folding 10 of each layer's 19 into the two kernels here
saved about 0.26 us per kernel removed (docs/inference.md, "Decode's kernel count"). An RMSNorm was two of them
(XLA's reduce for the statistic, then an elementwise pass), three with the gated activation before it (BitNet's
``ffn_sub_norm``).

:func:`norm_rows_kernel`: an RMSNorm of a few rows in one launch, one program per row: a sweep over the row for its
mean square, a sweep writing ``x * (rstd * gamma)`` rounded to the output dtype. What it normalizes is a
:mod:`pallas_kernels.quantize` prologue's values (the input itself, ``act(gate) * up``, or a residual sum ``x +
delta`` that it also writes), so the numbers are those prologues' and :class:`~pallas_kernels.quantize.RmsNorm`'s,
equal to the XLA path's up to the order of the mean square's sum. For a ternary linear it writes the row's int8 codes
and scale instead (a sweep for the amax between the two): the GEMV then reads codes and skips its own quantizer,
which every one of its programs ran over the whole row (H200: 17.7 -> 11.7 us for a 1B layer's four GEMVs,
benchmarks/results/linears_ab3_h200_b195ebc.json).

:func:`decode_attention_kernel`: one decode step of grouped-query attention, six XLA kernels in one launch. Each
program takes one sequence and KV head: RoPE of its query group and of the new key, the key and value written into
the cache at the token's position (the cache buffers aliased in and out: in place), then attention over the
positions before it (read from the cache in blocks, an online softmax in float32) and the new one (from registers).
A cache of more than :data:`ATTENTION_SPLIT_FROM` positions is split over programs (one program per KV head would
stream it on a few SMs); XLA merges their partial softmaxes. An int8 cache (``train.kv_cache``) is read as codes,
its scales applied to the scores and the softmax weights, and the new key and value are quantized in the kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxlowbit_numerics.formats import QuantSpec
from pallas_kernels.launch import early_launch
from pallas_kernels.quantize import (RmsNorm, _col_chunk, check_row_int8, code_scales, encode, magnitude, normed,
                                     round_to)
from pallas_kernels.reference import quantize_rows_reference
from pallas_kernels.vma import out_struct
from pallas_kernels.w8a16 import num_sms

# Rows a norm kernel takes (decode: the batch); more rows are the training forward's, where XLA's two passes
# stream well and its statistic feeds the backward.
NORM_ROWS_MAX = 16
# Columns per load of a row: a row up to this width stays in registers between the two sweeps, read once. A wider
# row is read in chunks twice, and each chunk is a dependent round trip to memory: the 1B model's ffn_sub_norm
# (8192 columns, from a 16384-wide gate_up) took 6.2 us per layer as two chunks of 4096, a sixth of a ternary layer
# (H200, benchmarks/results/decode_trace_h200_e9d7263.json).
NORM_CHUNK = 8192
# Warps of a norm program by its chunk: about 8 float32 values of a row per thread. Against 16 a thread (4 warps at
# 2048 columns, 16 at 8192), the norm kernels of a 1B ternary decode token on an H200 took 158 us against 168: the
# pre-norms 2.10 -> 1.99 us, the ffn_sub_norm 4.16 -> 3.71; at 32 a thread 199 (the attention step's warps changed
# in the same variants; its own kernel time is apart: benchmarks/results/decode_latency_ab_h200_48e3989.json).
NORM_WARPS = ((1024, 4), (2048, 8), (4096, 16))
NORM_WARPS_MAX = 32


@dataclasses.dataclass(frozen=True)
class Add:
  """``x [R, C]``, ``delta [R, C]`` -> the residual sum ``x + delta`` in x's dtype (float32 sum, rounded once; the
  reference rounds explicitly: XLA on a GPU would keep the float32 sum inside a fusion that normalizes it)."""

  stats = False

  def width(self, inputs) -> int:
    return inputs[0].shape[1]

  def values(self, refs, rows, cols, stat):
    del stat
    x = refs[0][rows, cols].astype(jnp.float32)
    delta = refs[1][rows, cols].astype(jnp.float32)
    return (x + delta).astype(refs[0].dtype).astype(jnp.float32)

  def reference(self, inputs) -> jax.Array:
    x, delta = inputs
    return round_to(x.astype(jnp.float32) + delta.astype(jnp.float32), x.dtype)


def _norm_rows_kernel(*refs, source, n_inputs: int, norm: RmsNorm, width: int, chunk: int, write_source: bool,
                      quantize: QuantSpec | None, keep_values: bool, native: bool):
  """Inputs (the source prologue's), gamma; outputs: the normed row (``quantize``: its codes and their scale, and
  with ``keep_values`` the row too), and the source's values with ``write_source``."""
  inputs, gamma_ref = refs[:n_inputs], refs[n_inputs]
  outs = list(refs[n_inputs + 1:])
  y_ref = outs.pop(0)
  scale_ref = outs.pop(0) if quantize is not None else None
  kept_ref = outs.pop(0) if keep_values else None
  source_ref = outs.pop(0) if write_source else None
  rows = pl.ds(early_launch(pl.program_id(0), native), 1)
  n_chunks = width // chunk
  resident = source.values(inputs, rows, pl.ds(0, chunk), None) if n_chunks == 1 else None
  # A resident row's gamma is loaded with it, not after the mean square: its trip to memory overlaps the row's (1B
  # ternary decode on an H200: the norms 190 -> 167 us a token; decode_latency_ab_h200_48e3989.json).
  gamma = gamma_ref[pl.ds(0, chunk)] if n_chunks == 1 else None

  def values(j):
    return resident if resident is not None else source.values(inputs, rows, pl.ds(j * chunk, chunk), None)

  def square_sum(j, acc):
    v = values(j)
    return acc + jnp.sum(v * v, axis=1)

  total = lax.fori_loop(0, n_chunks, square_sum, jnp.zeros((1,), jnp.float32))
  rstd = norm.finish_stat(total, width)

  def y(j, v):  # the normed chunk j of values v, rounded to the norm's dtype, as float32
    return normed(v, rstd, gamma_ref[pl.ds(j * chunk, chunk)] if gamma is None else gamma, norm.dtype)

  if quantize is not None:  # the row's amax over the rounded outputs, then the codes the linear's quantizer makes
    amax = lax.fori_loop(0, n_chunks, lambda j, a: jnp.maximum(a, jnp.max(magnitude(y(j, values(j))))),
                         jnp.float32(0))
    param, scale = code_scales(amax, quantize)
    scale_ref[rows, :] = jnp.full((1, 1), scale, jnp.float32)

  def write(j, _):
    cols = pl.ds(j * chunk, chunk)
    v = values(j)
    normed_v = y(j, v)
    out = normed_v if quantize is None else encode(normed_v, param, quantize, native)
    y_ref[rows, cols] = out.astype(y_ref.dtype)
    if kept_ref is not None:
      kept_ref[rows, cols] = normed_v.astype(kept_ref.dtype)
    if source_ref is not None:
      source_ref[rows, cols] = v.astype(source_ref.dtype)
    return 0

  lax.fori_loop(0, n_chunks, write, 0)


def norm_warps(chunk: int) -> int:
  """Triton warps of a norm program that loads ``chunk`` columns at a time."""
  return next((warps for widest, warps in NORM_WARPS if chunk <= widest), NORM_WARPS_MAX)


def norm_rows_kernel(inputs: tuple[jax.Array, ...], gamma: jax.Array, source, norm: RmsNorm,
                     write_source: bool = False, quantize: QuantSpec | None = None, interpret: bool = False,
                     keep_values: bool = False):
  """RMSNorm of ``source``'s values in one launch: ``y [R, C]`` in ``norm.dtype`` (and the values ``[R, C]`` in
  the first input's dtype with ``write_source``).

  With ``quantize`` (a per-row int8 spec: the input quantization of the linear reading y), ``y`` is handed over
  quantized instead: ``(codes [R, C] int8, scale [R, 1] float32)``, the codes of y rounded to ``norm.dtype`` as
  ``pallas_kernels.reference.quantize_rows_reference`` makes them from that y (``quantize.encode``; one more sweep
  over the row for its amax), so a decode linear skips its own quantizer. ``keep_values`` writes y as well:
  ``(codes, scale, y)``, for a reader that may take the row in high precision instead.

  Args:
    inputs: the source prologue's inputs, 2-D with R rows: ``x [R, C]`` (:class:`~pallas_kernels.quantize.Identity`),
      ``gate_up [R, 2C]`` (:class:`~pallas_kernels.quantize.SwiGLU`) or ``x, delta [R, C]`` (:class:`Add`).
    gamma: the norm's scale ``[C]``.
    source: the prologue whose values are normalized.
    norm: the norm (its eps and output dtype).
    write_source: also write the source's values (the residual sum of :class:`Add`).
    quantize: hand y over as its per-row codes of this spec (int8, one scale per row).
    interpret: Pallas interpret mode (CPU tests).

  Returns:
    ``y``, or ``(codes, scale)`` with ``quantize`` (``(codes, scale, y)`` with ``keep_values`` too); then the
    values with ``write_source``.
  """
  r, c = inputs[0].shape[0], source.width(inputs)
  if gamma.shape != (c,):
    raise ValueError(f"norm_rows_kernel: gamma {gamma.shape} does not match the normed width {c}")
  if quantize is not None:
    check_row_int8(quantize, "norm_rows_kernel", "quantize")
  keep_values = keep_values and quantize is not None
  chunk = _col_chunk(c, NORM_CHUNK)
  if quantize is None:
    outs = [out_struct((r, c), norm.dtype, *inputs)]
  else:
    outs = [out_struct((r, c), quantize.jnp_dtype, *inputs), out_struct((r, 1), jnp.float32, *inputs)]
  if keep_values:
    outs.append(out_struct((r, c), norm.dtype, *inputs))
  if write_source:
    outs.append(out_struct((r, c), inputs[0].dtype, *inputs))
  kernel = functools.partial(_norm_rows_kernel, source=source, n_inputs=len(inputs), norm=norm, width=c, chunk=chunk,
                             write_source=write_source, quantize=quantize, keep_values=keep_values,
                             native=not interpret)
  out = pl.pallas_call(
      kernel,
      out_shape=tuple(outs),
      grid=(r,),
      compiler_params=plt.CompilerParams(num_warps=norm_warps(chunk), num_stages=1),
      interpret=interpret,
      name="jaxlowbit_norm_rows",
  )(*inputs, gamma)
  y = out[0] if quantize is None else tuple(out[:3 if keep_values else 2])
  return (y, out[-1]) if write_source else y


def norm_rows_reference(inputs: tuple[jax.Array, ...], gamma: jax.Array, source, norm: RmsNorm,
                        write_source: bool = False, quantize: QuantSpec | None = None, keep_values: bool = False):
  """What :func:`norm_rows_kernel` computes, by XLA (the model's unfused path: the norm, then the linear's
  quantizer)."""
  if quantize is not None:
    check_row_int8(quantize, "norm_rows_reference", "quantize")
  values = source.reference(inputs)
  y = norm.reference((values, gamma))
  if quantize is not None:
    codes = quantize_rows_reference(y, quantize)
    y = (*codes, y) if keep_values else codes
  return (y, values) if write_source else y


# ---------------------------------------------------------------------------------------------
# Attention of one new token over the KV cache, with its RoPE and its cache write


# Cache positions per step of the attention loop: 128 was the fastest of 64, 128 and 256 over 128-2048 positions
# (benchmarks/results/decode_attention_sweep_h200_75bfaaf.json; 64 took up to 1.6x longer from 1024 positions).
ATTENTION_BLOCK = 128
# tl.dot's smallest operand side: the query rows of a KV head (its group) are padded to it, and the RoPE halves
# (head_dim / 2), which the products read separately, must reach it.
DOT_MIN = 16
# Caches up to this many positions are walked by one program per sequence and KV head; a longer one is split over
# programs (ATTENTION_PROGRAMS_PER_SM per SM, each a run of whole blocks) whose partial softmaxes XLA then merges.
# One program per KV head took 25-33 us a layer at 128-512 positions against XLA's 38-51 on an H200, but lost from 1024
# (benchmarks/results/decode_attention_sweep_h200_75bfaaf.json): 8 programs stream the 1B model's cache on 8 SMs.
ATTENTION_SPLIT_FROM = 512
# Programs per SM a split cache aims at (each a run of whole blocks). The ternary 1B decode at batch 1, one H200
# (benchmarks/results/attention_programs_per_sm_h200_b16b2ad.json, one run each): at 8192 positions 567 us a token
# with 2 against 580 with 1 and 583 with 4 (bf16 cache), 550 against 587 and 571 (int8 cache); at 2048, 485-504 for
# all three (the rows spread 2-6% each). Only the int8 cache's gain at 8192 is clearly outside a row's spread.
ATTENTION_PROGRAMS_PER_SM = 2
# The int8 KV cache's codes: one scale per sequence, KV head and position, over head_dim (train.kv_cache).
KV_CACHE_SPEC = QuantSpec("int8")


def decode_attention_supported(n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
  """Whether :func:`decode_attention_kernel` takes these heads (Triton: power-of-two blocks of >= 16)."""
  half = head_dim // 2
  return (head_dim % 2 == 0 and half >= DOT_MIN and half & (half - 1) == 0 and n_heads % n_kv_heads == 0)


def attention_splits(batch: int, n_kv_heads: int, cache_len: int, block: int = ATTENTION_BLOCK,
                     sms: int | None = None) -> int:
  """Programs that share one sequence and KV head's cache: 1 up to :data:`ATTENTION_SPLIT_FROM` positions, else
  enough for about :data:`ATTENTION_PROGRAMS_PER_SM` programs per SM (``sms``; default the GPU's), each at least one
  block."""
  if cache_len <= ATTENTION_SPLIT_FROM:
    return 1
  return _runs(-(-cache_len // block), ATTENTION_PROGRAMS_PER_SM * (sms or num_sms()) // (batch * n_kv_heads))[1]


def _runs(blocks: int, splits: int) -> tuple[int, int]:
  """``(blocks a split walks, splits)``: ``blocks`` in equal runs, as many as ``splits`` allows (at least one)."""
  chunk = -(-blocks // max(1, min(splits, blocks)))
  return chunk, -(-blocks // chunk)


def _rotate(x1, x2, cos, sin, dtype):
  """RoPE's rotate-half of the halves ``x1, x2`` (float32) -> the rotated halves rounded to ``dtype``, in float32:
  ``train.model.rope``'s ``[x1 cos - x2 sin, x2 cos + x1 sin]``."""
  return ((x1 * cos - x2 * sin).astype(dtype).astype(jnp.float32),
          (x2 * cos + x1 * sin).astype(dtype).astype(jnp.float32))


def _dot(a, b, b_contracting: int, precision):
  """``a [m, k]`` times ``b`` (``[n, k]`` with ``b_contracting`` 1, ``[k, n]`` with 0) -> ``[m, n]`` float32."""
  return lax.dot_general(a, b, (((1,), (b_contracting,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


def _int8_codes(parts, native: bool):
  """float32 ``parts`` of one row (the key's RoPE halves, or the value) -> their int8 codes and the row's scale, as
  ``train.kv_cache.quantize_heads`` quantizes a row (one amax over all the parts)."""
  amax = functools.reduce(jnp.maximum, [jnp.max(magnitude(x)) for x in parts])
  param, scale = code_scales(amax, KV_CACHE_SPEC)
  return [encode(x, param, KV_CACHE_SPEC, native) for x in parts], scale


def _decode_attention_kernel(pos_ref, freq_ref, qkv_ref, *refs, n_heads: int, n_kv_heads: int, head_dim: int,
                             rows: int, block: int, chunk: int, partial: bool, int8_cache: bool, native: bool):
  """One program per (sequence b, KV head h, split s of the cache): RoPE of its query group and key, the key and
  value written at ``pos`` (split 0), then attention over its positions of ``0..pos`` (the new one from registers,
  in split 0; the rest from the cache, ``chunk`` blocks a split) with an online softmax.

  ``refs``: the caches in (key, value, and with ``int8_cache`` their scales), the outputs (``[B, N, D]`` attention,
  or with ``partial`` each split's float32 ``acc [B, H, S, rows, D]``, running max and sum ``[B, H, S, rows]``),
  then the caches out (aliased to the caches in)."""
  n_cache = 4 if int8_cache else 2
  caches_in, outs, caches_out = refs[:n_cache], refs[n_cache:-n_cache], refs[-n_cache:]
  k_in, v_in = caches_in[:2]
  b, h, split = early_launch(pl.program_id(0), native), pl.program_id(1), pl.program_id(2)
  group, half = n_heads // n_kv_heads, head_dim // 2
  dtype = qkv_ref.dtype
  first, second = pl.ds(0, half), pl.ds(half, half)

  def load_block(j, mask):
    """Block ``j`` of the cache: the key's RoPE halves, the value (and an int8 cache's scales), zeros off ``mask``."""
    cached = pl.ds(j * block, block)
    at = [k_in.at[b, h, cached, first], k_in.at[b, h, cached, second], v_in.at[b, h, cached, slice(None)]]
    at += [ref.at[b, h, cached] for ref in caches_in[2:]]
    return [plt.load(x, mask=mask if i > 2 else mask[:, None], other=0) for i, x in enumerate(at)]

  # One program a KV head (no split: up to ATTENTION_SPLIT_FROM positions) loads the cache's first block before the
  # position, so that its trip to memory overlaps the position's, the query's and RoPE's; the positions from pos on
  # are dropped when it is used (split 0 writes pos concurrently). A split cache does not: a split wholly past pos
  # would read a block it never uses, and early in a long generation most splits are.
  first_block = None if partial else load_block(0, jnp.arange(block) < k_in.shape[2])
  pos = pos_ref[0]
  angles = pos.astype(jnp.float32) * freq_ref[...]  # [half]
  cos, sin = jnp.cos(angles)[None, :], jnp.sin(angles)[None, :]
  valid = (jnp.arange(rows) < group)[:, None]
  q_rows = pl.ds(h * group, rows)

  def load_q(cols):
    return plt.load(qkv_ref.at[b, q_rows, cols], mask=valid, other=0).astype(jnp.float32)

  q1, q2 = _rotate(load_q(first), load_q(second), cos, sin, dtype)  # [rows, half]
  k_row, v_row = pl.ds(n_heads + h, 1), pl.ds(n_heads + n_kv_heads + h, 1)
  k1, k2 = _rotate(qkv_ref[b, k_row, first].astype(jnp.float32), qkv_ref[b, k_row, second].astype(jnp.float32),
                   cos, sin, dtype)  # [1, half]
  v_new = qkv_ref[b, v_row, :].astype(jnp.float32)  # [1, head_dim]
  here = pl.ds(pos, 1)
  inv_sqrt_d = 1.0 / float(head_dim) ** 0.5
  if int8_cache:  # what the cache holds of the new token: its codes (exact in dtype) and scales
    (k1q, k2q), k_scale = _int8_codes([k1, k2], native)
    (vq,), v_scale = _int8_codes([v_new], native)
    stored = [(caches_out[0], first, k1q), (caches_out[0], second, k2q), (caches_out[1], slice(None), vq)]
    k1, k2, v_new = k1q.astype(jnp.float32), k2q.astype(jnp.float32), vq.astype(jnp.float32) * v_scale
    key_factor = k_scale * inv_sqrt_d
  else:
    stored = [(caches_out[0], first, k1), (caches_out[0], second, k2), (caches_out[1], slice(None), v_new)]
    key_factor = inv_sqrt_d

  @pl.when(split == 0)
  def _():  # the caches out are the caches in (aliased); a program reads pos only to drop it (first_block)
    for ref, cols, x in stored:
      ref[b, h, here, cols] = x.astype(ref.dtype)
    if int8_cache:
      caches_out[2][b, h, here] = jnp.full((1,), k_scale, jnp.float32)
      caches_out[3][b, h, here] = jnp.full((1,), v_scale, jnp.float32)

  q1d, q2d = q1.astype(dtype), q2.astype(dtype)
  # The new token (split 0): its score from registers, the products of the rounded q and k summed in float32.
  first_split = split == 0
  m = jnp.where(first_split, jnp.sum(q1 * k1 + q2 * k2, axis=1) * key_factor, -jnp.inf)  # [rows]
  l = jnp.where(first_split, jnp.ones((rows,), jnp.float32), 0.0)
  acc = jnp.where(first_split, jnp.broadcast_to(v_new, (rows, head_dim)), 0.0)
  precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None

  def seen_in(j):  # [block]: which positions of block j come before pos
    return j * block + jnp.arange(block) < pos

  def update(carry, j, blocks):
    """The online softmax after block ``j``, whose ``blocks`` read as zeros from ``pos`` on."""
    m, l, acc = carry
    seen = seen_in(j)
    keys1, keys2, values, *scales = blocks
    s = _dot(q1d, keys1.astype(dtype), 1, precision) + _dot(q2d, keys2.astype(dtype), 1, precision)  # [rows, block]
    s = s * (scales[0][None, :] * inv_sqrt_d if int8_cache else inv_sqrt_d)
    s = jnp.where(seen[None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))  # finite where the block holds a position before pos
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    weights = p * scales[1][None, :] if int8_cache else p  # a value's scale rides on its probability
    acc = acc * alpha[:, None] + _dot(weights.astype(dtype), values.astype(dtype), 0, precision)
    return m_new, l, acc

  start = split * chunk
  end = jnp.minimum(start + chunk, (pos + block - 1) // block)  # blocks past pos are not walked
  carry = (m, l, acc)
  if first_block is not None:  # start is 0: walked unless pos is 0; zeros from pos on, as the masked loads give
    seen = seen_in(start)
    first_block = [jnp.where(seen if x.ndim == 1 else seen[:, None], x, 0) for x in first_block]
    carry = jax.tree.map(functools.partial(jnp.where, start < end), update(carry, start, first_block), carry)
    start = start + 1

  def step(j, carry):
    return update(carry, j, load_block(j, seen_in(j)))

  m, l, acc = lax.fori_loop(start, end, step, carry)
  if partial:
    acc_ref, m_ref, l_ref = outs
    acc_ref[b, h, split] = acc
    m_ref[b, h, split] = m
    l_ref[b, h, split] = l
  else:
    plt.store(outs[0].at[b, q_rows, :], (acc / l[:, None]).astype(outs[0].dtype), mask=valid)


def merge_splits(acc: jax.Array, m: jax.Array, l: jax.Array, group: int, dtype) -> jax.Array:
  """The splits' partial softmaxes (``acc [B, H, S, rows, D]``, ``m``, ``l [B, H, S, rows]`` float32) -> the
  attention ``[B, H group, D]`` in ``dtype`` (a split with no positions has ``m = -inf`` and weighs nothing)."""
  top = jnp.max(m, axis=2, keepdims=True)  # finite: split 0 holds the new token
  w = jnp.exp(m - top)
  out = jnp.sum(w[..., None] * acc, axis=2) / jnp.sum(w * l, axis=2)[..., None]  # [B, H, rows, D]
  b, h, _, d = out.shape
  return out[:, :, :group].reshape(b, h * group, d).astype(dtype)


def decode_attention_kernel(qkv: jax.Array, key: jax.Array, value: jax.Array, position: jax.Array,
                            frequencies: jax.Array, n_heads: int, block: int = ATTENTION_BLOCK,
                            interpret: bool = False, key_scale: jax.Array | None = None,
                            value_scale: jax.Array | None = None, splits: int | None = None):
  """One decode step of grouped-query attention in one launch: RoPE, the KV cache write, and attention.

  Args:
    qkv: ``[B, N + 2 H, D]`` the fused projection's output for one token per sequence (N query heads, then H key
      and H value heads, as ``train.model.Attention`` splits it), before RoPE; the compute dtype.
    key, value: the cache ``[B, H, S, D]``, in qkv's dtype or int8 (with ``key_scale`` and ``value_scale``);
      updated in place (aliased to the outputs).
    position: int32 ``[1]``: the token's position, the cache row it is written to (< S).
    frequencies: float32 ``[D / 2]`` RoPE's angular frequencies (``train.model.rope_frequencies``).
    n_heads: N.
    block: cache positions per step of the attention loop (a power of two >= 16).
    interpret: Pallas interpret mode (CPU tests).
    key_scale, value_scale: float32 ``[B, H, S]`` an int8 cache's scales (``train.kv_cache``: one per position over
      D); the new key and value are quantized as ``train.kv_cache.quantize_heads`` does.
    splits: programs per sequence and KV head, each walking a run of the cache's blocks (default
      :func:`attention_splits`); more than one adds an XLA merge of their partial softmaxes.

  Returns:
    ``(out [B, N, D], key, value)``, and ``key_scale, value_scale`` after them for an int8 cache: attention of
    each query head over positions ``0..position`` (softmax in float32; the cached positions' weights, times an
    int8 cache's value scales, rounded to qkv's dtype for the product with the values, as
    ``jax.nn.dot_product_attention`` rounds its probabilities; the new position's value enters in float32), and
    the caches with the rotated key and the value at ``position``.
  """
  b, width, d = qkv.shape
  _, n_kv_heads, s, _ = key.shape
  if width != n_heads + 2 * n_kv_heads or key.shape != (b, n_kv_heads, s, d) or value.shape != key.shape:
    raise ValueError(f"decode_attention_kernel: qkv {qkv.shape} with {n_heads} query heads does not match the "
                     f"cache {key.shape} / {value.shape}")
  int8_cache = key_scale is not None
  if (value_scale is not None) != int8_cache:
    raise ValueError("decode_attention_kernel: an int8 cache takes both key_scale and value_scale")
  cache_dtype = jnp.int8 if int8_cache else qkv.dtype
  if key.dtype != cache_dtype or value.dtype != cache_dtype:
    raise ValueError(f"decode_attention_kernel: cache {key.dtype}/{value.dtype} must be qkv's dtype {qkv.dtype}, "
                     f"or int8 with key_scale and value_scale")
  if int8_cache and (key_scale.shape != key.shape[:3] or value_scale.shape != key.shape[:3]
                     or key_scale.dtype != jnp.float32 or value_scale.dtype != jnp.float32):
    raise ValueError(f"decode_attention_kernel: the int8 cache's scales must be float32 {key.shape[:3]}, got "
                     f"{key_scale.dtype}{key_scale.shape} / {value_scale.dtype}{value_scale.shape}")
  if not decode_attention_supported(n_heads, n_kv_heads, d):
    raise ValueError(f"decode_attention_kernel: {n_heads}/{n_kv_heads} heads of {d}: head_dim / 2 must be a power "
                     f"of two >= {DOT_MIN}")
  group = n_heads // n_kv_heads
  rows = max(DOT_MIN, 1 << (group - 1).bit_length())
  chunk, splits = _runs(-(-s // block), splits or attention_splits(b, n_kv_heads, s, block))
  caches = (key, value) + ((key_scale, value_scale) if int8_cache else ())
  call = functools.partial(_attention_call, n_heads=n_heads, rows=rows, block=block, chunk=chunk, splits=splits,
                           interpret=interpret)
  if interpret:  # the interpreter clamps a block that runs past its array (dynamic_slice) where the GPU masks it
    return _interpreted_attention(call, qkv, caches, position, frequencies, n_heads, rows, block)
  return call(qkv, caches, position, frequencies)


def _attention_call(qkv, caches, position, frequencies, *, n_heads: int, rows: int, block: int, chunk: int,
                    splits: int, interpret: bool, out_heads: int | None = None):
  b, _, d = qkv.shape
  n_kv_heads = caches[0].shape[1]
  partial = splits > 1
  kernel = functools.partial(_decode_attention_kernel, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=d, rows=rows,
                             block=block, chunk=chunk, partial=partial, int8_cache=len(caches) == 4,
                             native=not interpret)
  if partial:
    outs = (out_struct((b, n_kv_heads, splits, rows, d), jnp.float32, qkv),
            out_struct((b, n_kv_heads, splits, rows), jnp.float32, qkv),
            out_struct((b, n_kv_heads, splits, rows), jnp.float32, qkv))
  else:
    outs = (out_struct((b, out_heads or n_heads, d), qkv.dtype, qkv),)
  results = pl.pallas_call(
      kernel,
      out_shape=outs + tuple(out_struct(c.shape, c.dtype, c) for c in caches),
      grid=(b, n_kv_heads, splits),
      input_output_aliases={3 + i: len(outs) + i for i in range(len(caches))},
      compiler_params=plt.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name="jaxlowbit_decode_attention",
  )(position, frequencies, qkv, *caches)
  out = merge_splits(*results[:3], n_heads // n_kv_heads, qkv.dtype) if partial else results[0]
  return (out,) + tuple(results[len(outs):])


def _interpreted_attention(call, qkv, caches, position, frequencies, n_heads: int, rows: int, block: int):
  """:func:`decode_attention_kernel` in interpret mode on arrays padded so that no block runs past them."""
  n_kv_heads, s = caches[0].shape[1], caches[0].shape[2]
  extra = max(0, (n_kv_heads - 1) * (n_heads // n_kv_heads) + rows - qkv.shape[1])
  grow = (0, -(-s // block) * block - s)
  padded = [jnp.pad(c, ((0, 0), (0, 0), grow) + ((0, 0),) * (c.ndim - 3)) for c in caches]
  out, *caches = call(jnp.pad(qkv, ((0, 0), (0, extra), (0, 0))), tuple(padded), position, frequencies,
                      out_heads=n_heads + extra + rows)
  return (out[:, :n_heads],) + tuple(c[:, :, :s] for c in caches)
