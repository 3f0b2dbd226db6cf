"""Int8-activation GEMMs for decode-sized M (Pallas, Triton backend): int8 or packed 2-bit weights.

- :func:`a8w8_matmul_kernel`: ``xq [M, K]`` int8 x ``wq [N, K]`` int8 (W8A8 inference).
- :func:`a8w2_matmul_kernel`: ``xq [M, K]`` int8 x ternary weights packed four to a byte,
  ``w_packed [N, K/4]`` (``jaxlowbit_numerics.ternary.pack_2bit`` along K), unpacked in registers:
  the weight crosses HBM at 2 bits per value, a quarter of int8 and an eighth of bf16.

Both compute ``out[m, n] = (sum_k xq[m, k] * w[n, k]) * x_scale[m] * w_scale[n]`` with exact
int32 accumulation on int8 tensor cores and the epilogue in float32 in that order, exactly
as :func:`pallas_kernels.reference.scaled_matmul_reference` does, so results are
bit-identical to the reference (and to BitNet's training forward).

Decode is memory-bound on the weight: a tile takes 16 rows (the smallest tensor-core M; rows past M are masked)
and K is split across programs (split-K) where the output tiles alone leave SMs idle, so every SM streams weights;
the int32 partial sums (``split x M x N``) are then added by XLA, which is exact. These kernels are for small M;
large M belongs on the Hopper wgmma GEMM (``pallas_kernels.dispatch.scaled_matmul``).

Unpacking without an interleave: byte ``i`` of a packed row holds ``w[4i + j]`` in bits
``7-2j .. 6-2j``. Instead of interleaving the four decoded ``[block_n, block_k/4]`` tiles back
into K order, the kernel runs four int8 dots, one per bit position ``j``. The activations arrive as
int32 words, a bitcast view of the int8 row (word ``i`` holds ``x[4i .. 4i+3]``, byte ``j`` is
``x[4i + j]``), so the operand of dot ``j`` is byte ``j`` of every word: no copy of x outside the
kernel. On a GPU one PTX sequence per plane decodes code ``j`` of four packed bytes (:func:`weight_planes`),
and a tile's rows past M are masked (x reads as zeros there, those output rows are not written), so
M is never padded by a kernel of its own; the interpreter (CPU tests) gets x padded instead.

References: :func:`a8w8_matmul_reference`, :func:`a8w2_matmul_reference`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxlowbit_numerics.ternary import VALUES_PER_BYTE, unpack_2bit
from pallas_kernels.launch import early_launch
from pallas_kernels.reference import scaled_matmul_reference
from pallas_kernels.vma import out_struct
from pallas_kernels.w8a16 import MIN_BLOCK_M, SplitRule, fit_block, load_rows, store_rows, tile_rows

# int8 mma is m16n8k32: the K step must be at least 32 bytes.
MIN_BLOCK_K = 32
MIN_BLOCK_N = 16
# Bits per ternary code and the shift that brings code j of a byte (held in an int32) to the top.
CODE_BITS = 2
BYTE_TOP_SHIFT = 24  # a byte's bit 7 moves to bit 31 of an int32
BYTE_BITS = 8
INT32_TOP_SHIFT = 32 - CODE_BITS


@dataclasses.dataclass(frozen=True)
class GemvConfig:
  """Tiling of one kernel instance (powers of two).

  Attributes:
    block_m, block_n: output tile. block_k: K step in *bytes of the weight* (int8 values for
      A8W8, packed bytes = 4 values for A8W2).
    split_k: programs that share an output tile, each summing ``1 / split_k`` of K.
    num_warps, num_stages: Triton launch parameters.
    split_rule: how :func:`config_for` splits K for this tiling (``w8a16.SplitRule``).
  """

  block_m: int = 16
  block_n: int = 64
  block_k: int = 256
  split_k: int = 1
  num_warps: int = 4
  num_stages: int = 3
  split_rule: SplitRule = SplitRule()


# A8W8: x and w tiles are both int8, so a [16, 256] x tile costs a quarter of a [64, 256] w tile.
A8W8_BASE = GemvConfig(block_m=16, block_n=64, block_k=256)
# A8W2: one packed byte meets four activation bytes; wider N tiles keep the activation reads
# (served from L2) at half the weight reads. One H200 at M = 8 and 16 (2026-11-29, device time, 8 weights a call,
# benchmarks/results/a8w2_m8_16_h200_6d76cc2.json): 128 x 64 on 4 stages was the best tiling or within 3% of it on
# the 1B gate_up and down and on 4096 x 14336 and 14336 x 4096 (1.9-2.6x bf16). K unsplit where the tiles fill half
# the SMs (gate_up, 128 tiles: 7.4 us against 8.2 split in four; 4096 x 14336 even), else split up to
# A8W2_PROGRAMS_PER_SM programs an SM (the down projection's 16 tiles split 16: 5.2 us against 6.7 split 32).
A8W2_PROGRAMS_PER_SM, A8W2_UNSPLIT_FILL = 2, 0.5
A8W2_BASE = GemvConfig(block_m=16, block_n=128, block_k=64, num_stages=4,
                       split_rule=SplitRule(A8W2_PROGRAMS_PER_SM, A8W2_UNSPLIT_FILL))


def config_for(m: int, n: int, k_bytes: int, base: GemvConfig, sms: int | None = None) -> GemvConfig:
  """Tiling for M rows, an ``[N, k_bytes]`` weight: ``block_m`` a power of two (16..64; a tile's rows past M are
  masked), ``base``'s block sizes fitted to the weight, and K split by ``base.split_rule``."""
  block_m = max(MIN_BLOCK_M, min(1 << max(m - 1, 0).bit_length(), 64))
  block_n, block_k = fit_block(n, base.block_n, MIN_BLOCK_N), fit_block(k_bytes, base.block_k, MIN_BLOCK_K)
  tiles = (-(-m // block_m)) * max(n // block_n, 1)
  return dataclasses.replace(base, block_m=block_m, block_n=block_n, block_k=block_k,
                             split_k=base.split_rule.split_k(tiles, k_bytes, block_k, sms))


def supports(n: int, k_bytes: int, config: GemvConfig) -> bool:
  """Whether the kernel takes an ``[N, k_bytes]`` weight with this tiling (weights are never padded)."""
  return (
      n % config.block_n == 0
      and k_bytes % (config.block_k * config.split_k) == 0
      and config.block_k >= MIN_BLOCK_K
      and config.block_n >= MIN_BLOCK_N
  )


def _check(xq, x_scale, w, w_scale, k_of_w: int, who: str) -> None:
  if xq.ndim != 2 or w.ndim != 2:
    raise ValueError(f"{who}: xq and the weight must be 2-D, got {xq.shape} and {w.shape}")
  if xq.dtype != jnp.int8 or w.dtype != jnp.int8:
    raise TypeError(f"{who}: xq and the weight must be int8, got {xq.dtype} and {w.dtype}")
  if xq.shape[1] != k_of_w:
    raise ValueError(f"{who}: xq has K={xq.shape[1]} but the weight {w.shape} holds K={k_of_w}")
  if x_scale.size not in (1, xq.shape[0]):
    raise ValueError(f"{who}: x_scale has shape {x_scale.shape}; expected one scale per row of xq or one in all")
  if w_scale.size not in (1, w.shape[0]):
    raise ValueError(f"{who}: w_scale has shape {w_scale.shape}; expected one scale per weight row or one in all")


def check_a8w8(xq, x_scale, wq, w_scale) -> None:
  _check(xq, x_scale, wq, w_scale, wq.shape[1] if wq.ndim == 2 else -1, "a8w8_matmul")


def check_a8w2(xq, x_scale, w_packed, w_scale) -> None:
  k = w_packed.shape[1] * VALUES_PER_BYTE if w_packed.ndim == 2 else -1
  _check(xq, x_scale, w_packed, w_scale, k, "a8w2_matmul")


def a8w8_matmul_reference(xq, x_scale, wq, w_scale, out_dtype=jnp.bfloat16) -> jax.Array:
  """XLA: ``scaled_matmul_reference`` (int32 dot, then ``* x_scale * w_scale`` in float32)."""
  check_a8w8(xq, x_scale, wq, w_scale)
  return scaled_matmul_reference(xq, x_scale, wq, w_scale, out_dtype)


def a8w2_matmul_reference(xq, x_scale, w_packed, w_scale, out_dtype=jnp.bfloat16) -> jax.Array:
  """XLA: unpack the ``[N, K/4]`` bytes to int8 ``[N, K]``, then ``scaled_matmul_reference``."""
  check_a8w2(xq, x_scale, w_packed, w_scale)
  return scaled_matmul_reference(xq, x_scale, unpack_2bit(w_packed, axis=-1), w_scale, out_dtype)


def _epilogue(acc, sx, sw, out_dtype):
  # Same operations in the same order as scaled_matmul_reference: bit-identical results. ``sw``: [N], or
  # one element for a per-tensor scale (a broadcast multiplies by the same value).
  return (acc.astype(jnp.float32) * sx[:, None] * sw.reshape(1, -1)).astype(out_dtype)


def _dot_i32(a, b):
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)


# A GPU decodes plane j of four packed bytes (one 32-bit register) with one group of PTX: shift code j to the low
# bits of each byte, mask, and widen the sign (0b11 -> 0xFF) by or-ing in 0xFC where bit 1 is set
# ((byte & 2) * 0x7E = 0xFC never carries into the next byte). Every step acts on each byte alone, so the register's
# byte order does not matter.
_PLANE_ASM = """{{
.reg .b32 t, s;
shr.u32 t, $1, {shift}; and.b32 t, t, 0x03030303; and.b32 s, t, 0x02020202; mul.lo.u32 s, s, 0x7E; or.b32 $0, t, s;
}}"""


def weight_planes(packed: jax.Array, native: bool) -> list[jax.Array]:
  """int8 packed bytes (any shape, e.g. a ``[block_n, block_k]`` tile) -> four int8 arrays of that shape, plane ``j``
  holding each byte's weight ``j`` (-1, 0 or 1).

  ``native``: inline PTX on four bytes at a time (:data:`_PLANE_ASM`); otherwise shifts on int32, for the Pallas
  interpreter. Both give the same values.
  """
  if native:  # one asm per plane: Pallas lowers an asm of one result
    return [plt.elementwise_inline_asm(_PLANE_ASM.format(shift=CODE_BITS * (VALUES_PER_BYTE - 1 - j)), args=[packed],
                                       constraints="=r,r", pack=VALUES_PER_BYTE,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(packed.shape, jnp.int8)])[0]
            for j in range(VALUES_PER_BYTE)]
  p = packed.astype(jnp.int32)
  # Code j sits in bits 7-2j..6-2j: shift it to the top of the int32, then an arithmetic right shift sign-extends it
  # (0b11 -> -1, 0b01 -> 1, 0b00 -> 0).
  planes = [lax.shift_right_arithmetic(lax.shift_left(p, BYTE_TOP_SHIFT + CODE_BITS * j), INT32_TOP_SHIFT)
            for j in range(VALUES_PER_BYTE)]
  return [plane.astype(jnp.int8) for plane in planes]


def byte_plane(words: jax.Array, j: int) -> jax.Array:
  """int32 words (any shape, e.g. a ``[block_m, block_k]`` tile of x) -> byte ``j`` of each, as int8 of that shape."""
  byte = lax.shift_right_arithmetic(lax.shift_left(words, BYTE_TOP_SHIFT - BYTE_BITS * j), BYTE_TOP_SHIFT)
  return byte.astype(jnp.int8)


def _kernel(x_ref, w_ref, sx_ref, sw_ref, o_ref, *, config: GemvConfig, k_per_split: int, m: int, m_out: int,
            packed: bool, tensor_scale: bool, masked: bool, native: bool):
  """One ``[block_m, block_n]`` output tile over one K split.

  ``x_ref``: int8 ``[M, K]`` (A8W8) or its int32 words ``[M, K / 4]`` (A8W2).
  ``w_ref``: int8 ``[N, K]`` or packed ``[N, K / 4]``; ``k_per_split`` counts weight bytes.
  ``masked``: x and the output hold only the M rows (a GPU); else both are padded to the tiles (``m_out`` rows).
  ``native``: decode the weight with inline PTX (a GPU; :func:`weight_planes`).
  Split-K partial sums of split s live at rows ``[s * m_out, (s + 1) * m_out)``.
  """
  i_n, i_m, i_s = early_launch(pl.program_id(0), native), pl.program_id(1), pl.program_id(2)
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  rows = pl.ds(pl.multiple_of(i_m * bm, bm), bm)
  cols = pl.ds(pl.multiple_of(i_n * bn, bn), bn)
  valid = i_m * bm + jnp.arange(bm) < m
  k0 = i_s * k_per_split

  def step(t, acc):
    ks = pl.ds(pl.multiple_of(k0 + t * bk, bk), bk)
    x = load_rows(x_ref.at[rows, ks], valid, masked)
    if not packed:
      return acc + _dot_i32(x, w_ref[cols, ks])
    for j, w in enumerate(weight_planes(w_ref[cols, ks], native=native)):
      acc = acc + _dot_i32(byte_plane(x, j), w)
    return acc

  acc = lax.fori_loop(0, k_per_split // bk, step, jnp.zeros((bm, bn), jnp.int32))
  if config.split_k == 1:
    sx = load_rows(sx_ref.at[rows], valid, masked)
    out, out_rows = _epilogue(acc, sx, sw_ref[pl.ds(0, 1)] if tensor_scale else sw_ref[cols], o_ref.dtype), rows
  else:  # int32 partial sums of split i_s
    out, out_rows = acc, pl.ds(i_s * m_out + i_m * bm, bm)
  store_rows(o_ref.at[out_rows, cols], out, valid, masked)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "packed", "interpret"))
def _call(xq, x_scale, w, w_scale, *, out_dtype, config: GemvConfig, packed: bool, interpret: bool):
  m = xq.shape[0]
  n, k_bytes = w.shape
  masked, m_out = tile_rows(m, config.block_m, interpret)
  sx = jnp.broadcast_to(x_scale.astype(jnp.float32).reshape(-1), (m,))
  # One scale per tensor (BitNet's) stays one element: broadcast to [N] it is a kernel of its own on every
  # decode step (39 us per token of the 1B model at batch 8 on an H100), as in dp4a_gemv.
  sw = w_scale.astype(jnp.float32).reshape(-1)
  tensor_scale = sw.size == 1
  if m_out != m:
    xq = jnp.pad(xq, ((0, m_out - m), (0, 0)))
    sx = jnp.pad(sx, (0, m_out - m))
  if packed:  # int32 words of four codes: a bitcast view, no copy
    xq = lax.bitcast_convert_type(xq.reshape(m_out, k_bytes, VALUES_PER_BYTE), jnp.int32)
  split = config.split_k
  out_shape = (out_struct((m_out, n), out_dtype, xq, w, sx, sw) if split == 1
               else out_struct((split * m_out, n), jnp.int32, xq, w, sx, sw))
  out = pl.pallas_call(
      functools.partial(_kernel, config=config, k_per_split=k_bytes // split, m=m, m_out=m_out, packed=packed,
                        tensor_scale=tensor_scale, masked=masked, native=not interpret),
      out_shape=out_shape,
      grid=(n // config.block_n, -(-m // config.block_m), split),
      compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name="jaxlowbit_a8w2_matmul" if packed else "jaxlowbit_a8w8_matmul",
  )(xq, w, sx, sw)
  if split > 1:
    out = _epilogue(out.reshape(split, m_out, n).sum(axis=0), sx, sw, out_dtype)
  return out[:m] if m_out != m else out


def _run(xq, x_scale, w, w_scale, out_dtype, config, interpret, packed, who, base):
  m = xq.shape[0]
  n, k_bytes = w.shape
  config = config or config_for(m, n, k_bytes, base)
  if not supports(n, k_bytes, config):
    raise ValueError(
        f"{who}: weight [N={n}, {k_bytes} bytes of K] does not fit the tiling {config} (N a multiple of "
        f"{config.block_n}, K bytes of {config.block_k * config.split_k}); use the reference path"
    )
  return _call(xq, x_scale, w, w_scale, out_dtype=jnp.dtype(out_dtype), config=config, packed=packed,
               interpret=interpret)


def a8w8_matmul_kernel(xq, x_scale, wq, w_scale, out_dtype=jnp.bfloat16, config: GemvConfig | None = None,
                       interpret: bool = False) -> jax.Array:
  """Int8 x int8 GEMM for small M with the scale epilogue fused.

  Args:
    xq: ``[M, K]`` int8 activations, x_scale: float32 ``[M]``/``[M, 1]`` (or one) dequant scales.
    wq: ``[N, K]`` int8 weight (K-major), w_scale: float32 ``[N]``/``[N, 1]`` (or one).
    out_dtype: result dtype. config: tiling (default :func:`config_for` with ``A8W8_BASE``).
    interpret: run in the Pallas interpreter (CPU tests).

  Returns:
    ``[M, N]`` of ``out_dtype``, bit-identical to :func:`a8w8_matmul_reference`.
  """
  check_a8w8(xq, x_scale, wq, w_scale)
  return _run(xq, x_scale, wq, w_scale, out_dtype, config, interpret, False, "a8w8_matmul_kernel", A8W8_BASE)


def a8w2_matmul_kernel(xq, x_scale, w_packed, w_scale, out_dtype=jnp.bfloat16, config: GemvConfig | None = None,
                       interpret: bool = False) -> jax.Array:
  """Int8 x packed-ternary GEMM for small M, unpacking 2-bit weights in registers.

  Args:
    xq: ``[M, K]`` int8 activations, x_scale: float32 ``[M]``/``[M, 1]`` (or one).
    w_packed: ``[N, K / 4]`` int8 bytes from ``pack_2bit(w_ternary [N, K], axis=-1)``.
    w_scale: float32 ``[N]`` or one (the BitNet absmean scale).
    out_dtype, config, interpret: as :func:`a8w8_matmul_kernel` (``block_k`` in packed bytes).

  Returns:
    ``[M, N]`` of ``out_dtype``, bit-identical to :func:`a8w2_matmul_reference`.
  """
  check_a8w2(xq, x_scale, w_packed, w_scale)
  return _run(xq, x_scale, w_packed, w_scale, out_dtype, config, interpret, True, "a8w2_matmul_kernel", A8W2_BASE)
