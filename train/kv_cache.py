"""The KV cache of the decode-mode model (``Transformer(config, decode=True)``), used by ``train/generate.py``.

Each attention layer keeps its keys and values in the ``"cache"`` collection (stacked
``[n_layers, ...]`` under ``nn.scan``); the Transformer keeps ``index``, the tokens written so far.
``S`` is the token length the decode-mode model is initialized with, ``H`` the kv heads, ``D`` head_dim:

==================  =================================================  ==========================
``kv_cache_dtype``  leaves per layer                                   bytes per token, kv head
==================  =================================================  ==========================
``"auto"``          ``key``, ``value`` ``[B, H, S, D]`` compute dtype   ``2 * 2D`` (bf16)
``"int8"``          ``key``, ``value`` int8 ``[B, H, S, D]``;           ``2 * (D + 4)``
                    ``key_scale``, ``value_scale`` float32 ``[B, H, S]``
==================  =================================================  ==========================

Heads before positions: a decode step's two attention products (scores over D, values over S)
both take batch and kv head as their batch dimensions. With those axes major in memory, the products
read the cache where it lies; the earlier ``[B, S, H, D]`` layout made XLA transpose, i.e. copy, the
whole key and value cache of every layer on every token (seen in the compiled step's HLO on CPU;
``tests/test_generate.py`` checks that no cache-sized copy is left). Not yet for int8 on CPU: there XLA
fuses a second copy of the key cache's write into the int8 -> bf16 convert that feeds the score product,
which then reads the cache as it was before the write, so the write is no longer in place and the key
cache is copied every step (an optimization barrier does not survive to fusion; a scatter is rewritten
to the same update). Nor at batch 1 on CPU, where XLA transposes the key cache (D before S) for its dot.
``benchmarks/inference.py`` counts such copies in the GPU-compiled step.

int8 (symmetric): one float32 scale per sequence, kv head and position, over D: ``scale = amax/127``,
``q = clip(round_half_even(x / scale), -127, 127)`` (``quantize_int8``, as everywhere in jaxlowbit).
A position's scale is constant along the score product's contraction (D), so it multiplies the
float32 scores after the int8 x 16-bit product; a value's scale multiplies the probabilities before
the product over positions. The cache is dequantized inside attention and never written in 16 bits.
Per position rather than one scale per head: a per-head scale fixed at prefill would clip later
tokens' outliers, and dynamic scales need no calibration; they cost 4 bytes per D values (3% at
D = 128), so the int8 cache holds ``(D + 4) / 2D`` of the bf16 one's bytes.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxlowbit_numerics.int8 import quantize_int8

KV_CACHE_DTYPES = ("auto", "int8")
COLLECTION = "cache"
# Scores of masked positions: finite (a row masked everywhere stays NaN-free), far below any real score.
MASKED_SCORE = float(np.finfo(np.float32).min) * 0.7
# 16-bit products with float32 accumulation, named as jax.nn.dot_product_attention names them (the CPU
# backend runs a bf16 x bf16 -> f32 dot only under this explicit algorithm).
TWO_BYTE_PRODUCTS = {jnp.dtype(jnp.bfloat16): jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
                     jnp.dtype(jnp.float16): jax.lax.DotAlgorithmPreset.F16_F16_F32}


class CachedKV(NamedTuple):
  """A layer's whole cache after this call's write: ``key``/``value`` ``[B, H, S, D]`` (compute dtype or int8),
  ``key_scale``/``value_scale`` float32 ``[B, H, S]`` (int8 only, else None), ``mask`` bool ``[1, 1, T, S]``
  (query ``t`` sees the positions ``<= positions[t]``)."""

  key: jax.Array
  value: jax.Array
  key_scale: jax.Array | None
  value_scale: jax.Array | None
  mask: jax.Array


def check_kv_cache_dtype(kv_cache_dtype: object, who: str) -> str:
  """ValueError unless ``kv_cache_dtype`` is one of :data:`KV_CACHE_DTYPES`."""
  if kv_cache_dtype not in KV_CACHE_DTYPES:
    raise ValueError(f"{who}: kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
  return kv_cache_dtype


def quantize_heads(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``x [B, H, T, D]`` floating -> int8 ``[B, H, T, D]`` and float32 scales ``[B, H, T]`` (one per D values)."""
  q, scale = quantize_int8(x, axis=-1)
  return q, scale[..., 0]


def update(module: nn.Module, k: jax.Array, v: jax.Array, positions: jax.Array, kv_cache_dtype: str) -> CachedKV | None:
  """Write ``k``, ``v`` ``[B, T, H, D]`` (after RoPE) at ``positions [T]`` into ``module``'s cache.

  Returns the whole cache after the write (:class:`CachedKV`), or None while initializing (the
  variables are created with ``T = S`` then, which sizes the cache).
  """
  k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, H, T, D]
  int8 = check_kv_cache_dtype(kv_cache_dtype, "kv_cache.update") == "int8"
  dtype = jnp.int8 if int8 else k.dtype
  cached_k = module.variable(COLLECTION, "key", jnp.zeros, k.shape, dtype)
  cached_v = module.variable(COLLECTION, "value", jnp.zeros, v.shape, dtype)
  if int8:
    k_scale = module.variable(COLLECTION, "key_scale", jnp.zeros, k.shape[:-1], jnp.float32)
    v_scale = module.variable(COLLECTION, "value_scale", jnp.zeros, v.shape[:-1], jnp.float32)
  if module.is_initializing():
    return None
  start = positions[0]

  def write(variable, x):
    variable.value = jax.lax.dynamic_update_slice(variable.value, x.astype(variable.value.dtype),
                                                  (0, 0, start) + (0,) * (x.ndim - 3))

  if int8:
    (kq, ks), (vq, vs) = quantize_heads(k), quantize_heads(v)
    for variable, x in ((cached_k, kq), (k_scale, ks), (cached_v, vq), (v_scale, vs)):
      write(variable, x)
  else:
    write(cached_k, k)
    write(cached_v, v)
  mask = (jnp.arange(cached_k.value.shape[2])[None, :] <= positions[:, None])[None, None]
  return CachedKV(cached_k.value, cached_v.value, k_scale.value if int8 else None, v_scale.value if int8 else None,
                  mask)


def fused_step_runs(module: nn.Module, tokens: int, n_heads: int, n_kv_heads: int, head_dim: int,
                    options=None) -> bool:
  """Whether a decode step runs as :func:`attend_step` (one kernel): one new token per sequence, a cache (either
  dtype, any length) that exists already, and ``pallas_kernels.dispatch.decode_attention_on_kernel`` (heads)."""
  from pallas_kernels import dispatch

  if tokens != 1 or module.is_initializing() or not module.has_variable(COLLECTION, "key"):
    return False
  return dispatch.decode_attention_on_kernel(n_heads, n_kv_heads, head_dim, options)


def attend_step(module: nn.Module, qkv: jax.Array, positions: jax.Array, n_heads: int,
                frequencies: jax.Array) -> jax.Array:
  """One decode step's RoPE, cache write and attention in one kernel (``pallas_kernels.decode``).

  ``qkv [B, N + 2 H, D]``: the fused projection's output for the new token (before RoPE), ``positions [1]``, and
  ``frequencies [D / 2]`` RoPE's. Writes the rotated key and the value into ``module``'s cache at the position, in
  place (an int8 cache: their codes and scales, as :func:`update` quantizes them); returns the attention
  ``[B, 1, N, D]`` over the cache (what :func:`update` then :func:`attend` give, up to the order of float32 sums).
  """
  from pallas_kernels import dispatch

  names = ("key", "value") + (("key_scale", "value_scale") if module.has_variable(COLLECTION, "key_scale") else ())
  variables = [module.variable(COLLECTION, name, jnp.zeros, (), qkv.dtype) for name in names]  # exist: not read
  scales = {"key_scale": variables[2].value, "value_scale": variables[3].value} if len(names) == 4 else {}
  out, *caches = dispatch.decode_attention(qkv, variables[0].value, variables[1].value,
                                           positions[:1].astype(jnp.int32), frequencies, n_heads=n_heads, **scales)
  for variable, cache in zip(variables, caches):
    variable.value = cache
  return out[:, None]


def attend(q: jax.Array, cached: CachedKV) -> jax.Array:
  """Attention of ``q [B, T, N, D]`` (N query heads, a multiple of H) over the cache -> ``[B, T, N, D]`` in q's dtype.

  A compute-dtype cache runs ``jax.nn.dot_product_attention`` (XLA) on a ``[B, S, H, D]`` view of it, the
  computation the model always ran; an int8 cache runs :func:`attend_int8`.
  """
  if cached.key_scale is not None:
    return attend_int8(q, cached)
  return jax.nn.dot_product_attention(q, jnp.swapaxes(cached.key, 1, 2), jnp.swapaxes(cached.value, 1, 2),
                                      mask=cached.mask, implementation="xla")


def attend_int8(q: jax.Array, cached: CachedKV) -> jax.Array:
  """Grouped-query attention over an int8 cache, dequantized inside the products (see the module docstring).

  Scores and softmax in float32; the probabilities, times the value scales, are rounded to q's dtype
  before the product over positions, as ``jax.nn.dot_product_attention`` rounds its probabilities.
  int8 values convert exactly to bf16/f16, so the products see the stored codes unchanged.
  """
  b, t, n, d = q.shape
  h = cached.key.shape[1]
  qg = q.reshape(b, t, h, n // h, d)
  precision = TWO_BYTE_PRODUCTS.get(jnp.dtype(q.dtype))
  scores = jnp.einsum("btkgd,bksd->bkgts", qg, cached.key.astype(q.dtype), precision=precision,
                      preferred_element_type=jnp.float32)
  scores = scores * (cached.key_scale * (1.0 / np.sqrt(d)))[:, :, None, None, :]
  scores = jnp.where(cached.mask[:, :, None], scores, MASKED_SCORE)  # mask [1, 1, T, S] -> [1, 1, 1, T, S]
  probs = jax.nn.softmax(scores, axis=-1) * cached.value_scale[:, :, None, None, :]
  # In q's dtype, as jax.nn.dot_product_attention's product of probabilities and values (accumulated in float32).
  out = jnp.einsum("bkgts,bksd->btkgd", probs.astype(q.dtype), cached.value.astype(q.dtype))
  return out.reshape(b, t, n, d)


def attend_reference(q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array) -> jax.Array:
  """float32 attention of ``q [B, T, N, D]`` over ``keys``/``values [B, H, S, D]`` (any float dtype), ``mask
  [1, 1, T, S]``: what an exact cache would give, for tests."""
  b, t, n, d = q.shape
  h = keys.shape[1]
  qg = q.astype(jnp.float32).reshape(b, t, h, n // h, d)
  scores = jnp.einsum("btkgd,bksd->bkgts", qg, keys.astype(jnp.float32), precision="highest") / np.sqrt(d)
  probs = jax.nn.softmax(jnp.where(mask[:, :, None], scores, MASKED_SCORE), axis=-1)
  out = jnp.einsum("bkgts,bksd->btkgd", probs, values.astype(jnp.float32), precision="highest")
  return out.reshape(b, t, n, d)


# A compiled HLO instruction: name, element type, dims, opcode.
_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]\S* ([\w-]+)\(")
_HLO_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "int8": "s8"}
# HLO opcodes that give an existing buffer a name and write nothing.
_NAMING_OPCODES = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "constant"})


def cache_copies(hlo: str, cache: Any) -> list[str]:
  """Instructions of a compiled module (``compiled.as_text()``) that write a cache-sized buffer besides the cache.

  Cache-sized: as many elements as a leaf of ``cache`` (the tree :func:`train.generate.init_cache` builds) or one
  layer's slice of a stacked leaf, with an axis of the cache's length S. Flagged: a copy or transpose of one,
  and any buffer of that size in another dtype than the cache's keys and values (an int8 cache dequantized
  into memory). Instructions inside fusions write nothing to memory and are skipped, as are those that only
  name a buffer (:data:`_NAMING_OPCODES`: a parameter, a tuple element, a bitcast; at a 2048-token cache the
  1B ternary model's packed ``[2048, 512]`` int8 kernels have a cache leaf's size and an axis of 2048, and a
  loop's parameter tuple reads them 32 times). A decode step that reads its cache where it lies and writes it
  in place has none.
  """
  leaves = [x for x in jax.tree.leaves(cache) if x.ndim >= 3]  # [(L,) B, H, S(, D)]
  if not leaves:
    return []
  kv = max(leaves, key=lambda x: x.ndim)  # keys and values [..., S, D] (scales [..., S])
  max_len, kv_dtype = kv.shape[-2], _HLO_DTYPE_NAMES.get(jnp.dtype(kv.dtype).name)
  kv_leaves = [x for x in leaves if x.ndim == kv.ndim]
  kv_sizes = {x.size for x in kv_leaves} | {x.size // x.shape[0] for x in kv_leaves}
  sizes = kv_sizes | {x.size for x in leaves} | {x.size // x.shape[0] for x in leaves}
  fused = set(re.findall(r"calls=%([\w.-]+)", hlo))
  found, inside_fusion = [], False
  for line in hlo.splitlines():
    header = re.match(r"^(?:ENTRY )?%([\w.-]+) ", line)
    if header:
      inside_fusion = header.group(1) in fused
      continue
    match = _HLO_INSTRUCTION.match(line)
    if inside_fusion or not match:
      continue
    name, dtype, dims, opcode = match.groups()
    if opcode in _NAMING_OPCODES:
      continue
    dims = [int(d) for d in dims.split(",") if d]
    if max_len not in dims or int(np.prod(dims)) not in sizes:
      continue
    # A fusion named for a copy or transpose writes a moved buffer, unless it is the in-place write itself
    # (a dynamic-update-slice whose small update was transposed on the way in).
    moves = opcode in ("copy", "transpose") or (opcode == "fusion" and re.match(r"(copy|transpose)", name)
                                                 and "dynamic-update-slice" not in name)
    other_dtype = int(np.prod(dims)) in kv_sizes and dtype != kv_dtype
    if moves or other_dtype:
      found.append(line.strip()[:200])
  return found
