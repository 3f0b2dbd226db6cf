"""Ternary GEMV on CUDA cores for M <= 4 (Pallas, Triton backend): packed 2-bit weights, no tensor cores.

``a8w2_gemv_kernel(xq, x_scale, w_packed, w_scale)`` computes the same as
:func:`pallas_kernels.int8_gemv.a8w2_matmul_kernel`, ``out[m, n] = (sum_k xq[m, k] w[n, k]) * x_scale[m] *
w_scale[n]`` with exact int32 sums and the float32 epilogue in the reference's order (bit-identical to
:func:`pallas_kernels.int8_gemv.a8w2_matmul_reference`), for decode-sized M.

Why another kernel: the A8W2 GEMM pads M to 16 and feeds int8 mma. At M = 1 it moves 14 MiB in ~30 us (H200,
~0.5 TB/s): every decoded weight tile is converted from the load's register layout to the mma operand layout
(through shared memory) four times, once per 2-bit position, for 15 padding rows. Here each program streams
``[block_n, block_k]`` packed bytes (rows of W are K-major, so a row's bytes are contiguous), decodes the four
codes of each byte with two shifts, multiplies them by the matching activations (``x_perm``, as in
``int8_gemv``: no interleave) in int32 and keeps ``[block_n, block_k]`` partial sums in registers, reduced
across K once at the end: no layout conversion, no shared memory, no padding rows. K is split across
programs (split-K) so small-N weights still give every SM work; the int32 partials are added by XLA (exact).

Status: bit-identical in the Pallas interpreter and lowers for sm90 (tests/test_inference_ternary_gemv.py); not yet
measured on a GPU, so ``pallas_kernels.policy.TERNARY_GEMV_MAX_M`` keeps the dispatch off
(``benchmarks/inference.py --variants ternary_gemv`` times it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxlowbit_numerics.ternary import VALUES_PER_BYTE
from pallas_kernels.int8_gemv import BYTE_TOP_SHIFT, CODE_BITS, INT32_TOP_SHIFT, check_a8w2
from pallas_kernels.vma import out_struct
from pallas_kernels.w8a16 import choose_split_k, fit_block, num_sms

# Rows of x a program keeps partial sums for: each adds block_n x block_k int32 registers per thread block.
MAX_M = 4
MIN_BLOCK_N, MIN_BLOCK_K = 16, 16


@dataclasses.dataclass(frozen=True)
class TernaryGemvConfig:
  """Tiling (powers of two): ``block_n`` weight rows and ``block_k`` packed bytes per step; ``split_k``
  programs share a row block; Triton's ``num_warps`` and ``num_stages``."""

  block_n: int = 32
  block_k: int = 128
  split_k: int = 1
  num_warps: int = 4
  num_stages: int = 3


def config_for(n: int, k_bytes: int, sms: int | None = None) -> TernaryGemvConfig:
  """The tiling for an ``[N, k_bytes]`` packed weight: split-K up to ~4 programs per SM."""
  base = TernaryGemvConfig()
  block_n, block_k = fit_block(n, base.block_n, MIN_BLOCK_N), fit_block(k_bytes, base.block_k, MIN_BLOCK_K)
  split = choose_split_k(max(n // block_n, 1), k_bytes, block_k, sms or num_sms())
  return dataclasses.replace(base, block_n=block_n, block_k=block_k, split_k=split)


def supports(m: int, n: int, k_bytes: int, config: TernaryGemvConfig) -> bool:
  """Whether the kernel takes M rows and an ``[N, k_bytes]`` weight with this tiling (never padded)."""
  return (1 <= m <= MAX_M and n % config.block_n == 0 and k_bytes % (config.block_k * config.split_k) == 0
          and config.block_n >= MIN_BLOCK_N and config.block_k >= MIN_BLOCK_K)


def _kernel(x_ref, w_ref, sx_ref, sw_ref, o_ref, *, config: TernaryGemvConfig, k_per_split: int, m: int):
  """One ``block_n`` slice of the outputs over one K split; ``x_ref`` int8 ``[4, m, K/4]`` (``x_perm``)."""
  i_n, i_s = pl.program_id(0), pl.program_id(1)
  bn, bk = config.block_n, config.block_k
  cols = pl.ds(pl.multiple_of(i_n * bn, bn), bn)
  k0 = i_s * k_per_split

  def step(t, accs):
    ks = pl.ds(pl.multiple_of(k0 + t * bk, bk), bk)
    p = w_ref[cols, ks].astype(jnp.int32)  # [bn, bk] packed bytes
    accs = list(accs)
    for j in range(VALUES_PER_BYTE):
      # Code j of each byte, sign-extended (0b11 -> -1, 0b01 -> 1, 0b00 -> 0), as int8_gemv decodes it.
      w = lax.shift_right_arithmetic(lax.shift_left(p, BYTE_TOP_SHIFT + CODE_BITS * j), INT32_TOP_SHIFT)
      for r in range(m):
        accs[r] = accs[r] + w * x_ref[j, r, ks].astype(jnp.int32)[None, :]
    return tuple(accs)

  zeros = tuple(jnp.zeros((bn, bk), jnp.int32) for _ in range(m))
  accs = lax.fori_loop(0, k_per_split // bk, step, zeros)
  for r in range(m):
    total = jnp.sum(accs[r], axis=1)  # [bn] int32, exact
    if config.split_k == 1:  # the reference's epilogue, same order
      out = (total.astype(jnp.float32) * sx_ref[r] * sw_ref[cols]).astype(o_ref.dtype)
      o_ref[r, cols] = out
    else:
      o_ref[i_s * m + r, cols] = total


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def _call(xq, x_scale, w_packed, w_scale, *, out_dtype, config: TernaryGemvConfig, interpret: bool):
  m = xq.shape[0]
  n, k_bytes = w_packed.shape
  sx = jnp.broadcast_to(x_scale.astype(jnp.float32).reshape(-1), (m,))
  sw = jnp.broadcast_to(w_scale.astype(jnp.float32).reshape(-1), (n,))
  x_perm = xq.reshape(m, k_bytes, VALUES_PER_BYTE).transpose(2, 0, 1)  # x_perm[j, r, i] = xq[r, 4 i + j]
  split = config.split_k
  out_shape = (out_struct((m, n), out_dtype, xq, w_packed, sx, sw) if split == 1
               else out_struct((split * m, n), jnp.int32, xq, w_packed, sx, sw))
  out = pl.pallas_call(
      functools.partial(_kernel, config=config, k_per_split=k_bytes // split, m=m),
      out_shape=out_shape,
      grid=(n // config.block_n, split),
      compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name="jaxlowbit_ternary_gemv",
  )(x_perm, w_packed, sx, sw)
  if split > 1:
    acc = out.reshape(split, m, n).sum(axis=0)
    out = (acc.astype(jnp.float32) * sx[:, None] * sw[None, :]).astype(out_dtype)
  return out


def a8w2_gemv_kernel(xq, x_scale, w_packed, w_scale, out_dtype=jnp.bfloat16, config: TernaryGemvConfig | None = None,
                     interpret: bool = False) -> jax.Array:
  """Int8 x packed-ternary GEMV for M <= :data:`MAX_M` on CUDA cores.

  Args:
    xq: ``[M, K]`` int8 activations, x_scale: float32 ``[M]``/``[M, 1]`` (or one).
    w_packed: ``[N, K / 4]`` int8 from ``pack_2bit(w_ternary [N, K], axis=-1)``; w_scale: float32 ``[N]`` or one.
    out_dtype: result dtype. config: tiling (default :func:`config_for`; ``block_k`` in packed bytes).
    interpret: run in the Pallas interpreter (CPU tests).

  Returns:
    ``[M, N]`` of ``out_dtype``, bit-identical to :func:`pallas_kernels.int8_gemv.a8w2_matmul_reference`.
  """
  check_a8w2(xq, x_scale, w_packed, w_scale)
  m = xq.shape[0]
  n, k_bytes = w_packed.shape
  config = config or config_for(n, k_bytes)
  if not supports(m, n, k_bytes, config):
    raise ValueError(f"a8w2_gemv_kernel: M={m} (at most {MAX_M}) and weight [N={n}, {k_bytes} bytes of K] do not "
                     f"fit the tiling {config} (N a multiple of {config.block_n}, K bytes of "
                     f"{config.block_k * config.split_k}); use a8w2_matmul_kernel or the reference")
  return _call(xq, x_scale, w_packed, w_scale, out_dtype=jnp.dtype(out_dtype), config=config, interpret=interpret)
