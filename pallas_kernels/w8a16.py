"""W8A16 GEMM with the int8 weight dequantized inside the kernel (Pallas, Triton backend).

``w8a16_matmul_kernel(x, wq, w_scale)`` computes

    out[m, n] = (sum_k x[m, k] * wq[n, k]) * w_scale[n]

for 16-bit activations ``x [M, K]`` and an int8 weight stored K-major as ``wq [N, K]``
with one float32 scale per output channel. Each program loads ``[block_n, block_k]`` int8
tiles of the weight, converts them to the activations' dtype in registers (int8 values are
exact in bf16/f16) and feeds the tensor cores; nothing weight-sized is ever written in 16 bits,
so the weight traffic is half of a bf16 GEMM's. The scale is applied once, to the float32
accumulator.

For decode (``M <= 16``) the GEMM is a GEMV in disguise: memory-bound on the weight. For M = 2..16 the
row tile is then 16 (the smallest tensor-core M) and K is split across programs (split-K) so
that even a ``[4096, 14336]`` weight with only 32 column tiles keeps every SM streaming;
the float32 partial sums (``split x M x N``, tiny) are added by XLA. Larger M uses bigger
row tiles and no split: it runs at Triton's tensor-core speed, not wgmma's.

Rows of a tile past M are masked on a GPU: x is read as zeros there and those output rows are never written, so
no padding pass over x runs (in a decode step it was a kernel of its own per linear, 2-3 us on an H100).

At M = 1 a small weight (up to :data:`GEMV_MAX_ELEMENTS`) is summed on CUDA cores instead (``block_m = 1``;
float32: a bf16 times an int8 value is exact in float32), its weights made float32 by bit operations
(:func:`int8_to_float32`, exact), not the quarter-rate conversion instruction. A larger one takes a 16-row
tensor-core tile, 15 rows of it masked (:data:`M1_TENSOR_CORE_TILING`): the int8 -> bf16 conversion and the mma cost
fewer instructions per weight byte than the float32 products. Its K is split only where the column tiles leave SMs
idle (:data:`M1_UNSPLIT_FILL`).

Reference: :func:`w8a16_matmul_reference`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import policy
from pallas_kernels.launch import early_launch
from pallas_kernels.quantize import check_gate_activation, gated_epilogue, gated_fits, gated_rows, gated_tiling
from pallas_kernels.vma import out_struct

# SMs of an H100 SXM / H200; only used to size split-K when no GPU is attached (tests).
DEFAULT_NUM_SMS = 132
# Split K until the grid holds about this many programs per SM: a memory-bound GEMV needs
# several CTAs resident per SM to keep enough loads in flight to saturate HBM.
PROGRAMS_PER_SM = 4
# Smallest tensor-core tile in M (mma m16n8k16); a tile's rows past M are masked (GPU) or padded (interpreter).
MIN_BLOCK_M = 16
# block_m of the CUDA-core GEMV (M = 1): one row, nothing padded.
GEMV_BLOCK_M = 1
# (block_n, block_k) of the CUDA-core GEMV at M = 1: partial sums [block_n, block_k] reduced once after the loop,
# K unsplit where the row blocks alone fill the SMs (a split costs XLA's add after it, ~1.4 us at decode). One H200
# (2026-11-29, benchmarks/results/w8a16_gemv_unsplit_h200_bb914ed.json, device time): the 1B qkv 2048 x 3072 4.0 us
# against 5.5 (tensor cores, split 8), the out projection 2048 x 2048 2.7 against 3.5 (16 x 512 reduced each step,
# split 4); reduced each step on the same blocks 4.4 and 2.9; the 1B decode at batch 1 1,666 tokens/s against 1,568
# (same process). The H100 tilings before: w8a16_gemv_tiling_sweep_h100_53950ff.json.
GEMV_TILING = (8, 1024)
# The GEMV where its row blocks leave SMs idle (N < 8 x SMs): 16 x 512, summed each step, K split (2048 x 2048 split
# 2 on 8 x 1024 summed after the loop took 3.84 us against 3.68 on this one split 4,
# w8a16_gemv_deferred_sum_h200_6894429.json).
GEMV_SPLIT_TILING = (16, 512)
# M = 1 on tensor cores: (block_n, block_k, num_warps, num_stages), K split up to PROGRAMS_PER_SM programs per SM.
# One H200 (2026-11-29, device time, 8 weights a call; benchmarks/results/w8a16_m1_tensor_cores_h200_75351e0.json):
# against the CUDA-core GEMV as it was then (16 x 512, split), 14336 x 4096 18.3 us against 23.9, 4096 x 6144 10.3 /
# 12.3, 4096 x 4096 8.4 / 9.2, the 1B model's gate_up 12.5 / 13.4 and down 8.4 / 8.9; 4096 x 14336 19.9 / 19.7. Of
# nine tilings, 64 x 128 on 4 stages was the best or within 6% of the best on all eight Llama 1B / 8B shapes. 1B decode
# at batch 1, same process: 1,591 tokens/s against 1,480 with every M = 1 linear on that GEMV
# (decode_1b_h200_f59842f.json). Weights of up to GEMV_MAX_ELEMENTS stay on CUDA cores (GEMV_TILING).
M1_TENSOR_CORE_TILING = (64, 128, 4, 4)
# K unsplit on that tiling where its column tiles alone fill this share of the SMs, as on the GEMV: the split's add
# cost more than the idle SMs. One H200 (2026-11-29, w8a16_convert_h200_47916ea.json, device time, the 1B gate_up
# 2048 x 16384 (256 tiles): 11.6 us unsplit against 13.4 split in two with XLA's add; 4096 x 14336 (224 tiles): 19.6
# against 21.5; 14336 x 4096 (64 tiles) unsplit: 39.3 against 19.7 split. Same shapes, in one later run
# (w8a16_m1_unsplit_h200_47916ea.json): 11.3 against 12.7 and 19.0 against 20.0. The 1B decode at batch 1 did not
# move (1,655 tokens/s against 1,661): there XLA fuses the add into the SwiGLU pass that runs either way.
M1_UNSPLIT_FILL = 1.0
GEMV_MAX_ELEMENTS = 2048 * 3072  # the largest weight measured faster on the GEMV (GEMV_TILING)
# Smallest column tile and K step we let Triton see (tensor-core n8/k16 shapes, 16-byte loads).
MIN_BLOCK_N, MIN_BLOCK_K = 16, 32
# Columns of each half a gated tensor-core program takes at least (the mma's n16 shape).
MIN_GATED_BLOCK_N = 16
ACTIVATION_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _next_pow2(x: int) -> int:
  return 1 << max(x - 1, 0).bit_length()


def num_sms() -> int:
  device = jax.devices()[0]
  if device.platform != "gpu":
    return DEFAULT_NUM_SMS
  return getattr(device, "core_count", None) or DEFAULT_NUM_SMS


def choose_split_k(tiles: int, k: int, block_k: int, sms: int, programs_per_sm: int = PROGRAMS_PER_SM) -> int:
  """Largest power-of-two split of K (each part a multiple of ``block_k``) up to ``programs_per_sm`` programs per SM."""
  split = 1
  while tiles * split * 2 <= programs_per_sm * sms and k % (split * 2 * block_k) == 0:
    split *= 2
  return split


def split_where_idle(row_blocks: int, k: int, block_k: int, sms: int, programs_per_sm: int = PROGRAMS_PER_SM,
                     fill: float = 1.0) -> int:
  """A decode GEMV's split of K: none where its row blocks alone fill ``fill`` of the SMs (a split costs XLA's add
  after the kernel, ~1.4 us at decode), else :func:`choose_split_k`."""
  return 1 if row_blocks >= fill * sms else choose_split_k(row_blocks, k, block_k, sms, programs_per_sm)


@dataclasses.dataclass(frozen=True)
class SplitRule:
  """How a kernel's ``config_for`` splits K over programs that share an output tile (split-K; XLA adds their
  float32 partial sums after the kernel). The one policy of the W8A16, A8W8 / A8W2 and ternary GEMV kernels; each
  tiling carries its own rule, measured where it is defined.

  Attributes:
    programs_per_sm: K is halved (each part a multiple of ``block_k``) while the grid holds at most this many
      programs an SM (:func:`choose_split_k`); 0 never splits.
    unsplit_fill: K stays whole where the output tiles alone fill this share of the SMs (:func:`split_where_idle`);
      ``inf``: split wherever ``programs_per_sm`` allows.
  """

  programs_per_sm: int = PROGRAMS_PER_SM
  unsplit_fill: float = math.inf

  def split_k(self, tiles: int, k: int, block_k: int, sms: int | None = None) -> int:
    """The split of ``k`` (weight elements or bytes) for ``tiles`` output tiles, ``block_k`` a step."""
    return split_where_idle(tiles, k, block_k, sms or num_sms(), self.programs_per_sm, self.unsplit_fill)


NEVER_SPLIT = SplitRule(programs_per_sm=0)


@dataclasses.dataclass(frozen=True)
class W8A16Config:
  """Tiling of one kernel instance (all powers of two, as Triton requires).

  Attributes:
    block_m, block_n, block_k: tile of the output rows, output columns and the K step; ``block_m = 1``
      sums on CUDA cores (:data:`GEMV_BLOCK_M`), larger ones on tensor cores.
    split_k: programs that share one output tile, each summing ``K / split_k`` of K.
    num_warps, num_stages: Triton launch parameters (``num_stages`` pipelines the K loop).
    reduce_per_step: ``block_m = 1`` only: sum each step's products across K at once (``[block_n]`` partial sums);
      False keeps ``[block_n, block_k]`` partial sums and reduces them once after the loop.
    split_rule: how :func:`config_for` chose ``split_k`` for this tiling (:class:`SplitRule`).
  """

  block_m: int = 16
  block_n: int = 64
  block_k: int = 256
  split_k: int = 1
  num_warps: int = 4
  num_stages: int = 3
  reduce_per_step: bool = True
  split_rule: SplitRule = SplitRule()


def tile_rows(m: int, block_m: int, interpret: bool) -> tuple[bool, int]:
  """How a kernel of ``block_m``-row tiles holds M rows: ``(masked, m_out)``. A GPU masks a tile's rows past M
  (``masked``: x and the output hold the M rows, :func:`load_rows` / :func:`store_rows`); the interpreter (CPU tests)
  cannot read past an array, so there x and the output are padded to ``m_out`` rows, a whole number of tiles."""
  m_pad = -(-m // block_m) * block_m
  return m_pad != m and not interpret, m_pad if interpret else m


def _row_mask(view, valid: jax.Array) -> jax.Array:
  return valid[(slice(None),) + (None,) * (len(view.shape) - 1)]  # [rows, 1, ...]


def load_rows(view, valid: jax.Array, masked: bool) -> jax.Array:
  """A tile ``view`` (``ref.at[rows, ...]``) read in a kernel; with ``masked`` its rows where ``valid [rows]`` is
  False read as zeros and are never touched."""
  return plt.load(view, mask=_row_mask(view, valid), other=0) if masked else view[...]


def store_rows(view, value: jax.Array, valid: jax.Array, masked: bool) -> None:
  """``value`` written to the tile ``view``; with ``masked`` only its rows where ``valid [rows]`` holds."""
  if masked:
    plt.store(view, value, mask=_row_mask(view, valid))
  else:
    view[...] = value


def fit_block(dim: int, block: int, minimum: int) -> int:
  """``block`` halved until it divides ``dim`` (not below ``minimum``; the caller checks the fit)."""
  while block > minimum and dim % block:
    block //= 2
  return block


def config_for(m: int, n: int, k: int, sms: int | None = None) -> W8A16Config:
  """The tiling for an ``[M, K] x [N, K]`` problem: GEMV-style for small M, tiles for large M; K split by the
  tiling's :class:`SplitRule`."""
  gemv = m == GEMV_BLOCK_M and n * k <= GEMV_MAX_ELEMENTS
  if gemv:  # GEMV_TILING where its row blocks fill the SMs (then unsplit), else GEMV_SPLIT_TILING
    fills = n // GEMV_TILING[0] >= (sms or num_sms())
    block_n, block_k = GEMV_TILING if fills else GEMV_SPLIT_TILING
    base = W8A16Config(block_m=GEMV_BLOCK_M, block_n=block_n, block_k=block_k, num_warps=4, num_stages=3,
                       reduce_per_step=not fills, split_rule=SplitRule(unsplit_fill=1.0))
  elif m == GEMV_BLOCK_M:
    block_n, block_k, warps, stages = M1_TENSOR_CORE_TILING
    base = W8A16Config(block_m=MIN_BLOCK_M, block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages,
                       split_rule=SplitRule(unsplit_fill=M1_UNSPLIT_FILL))
  elif m <= MIN_BLOCK_M:
    base = W8A16Config(block_m=MIN_BLOCK_M, block_n=64, block_k=256, num_warps=4, num_stages=3)
  elif m <= 64:
    base = W8A16Config(block_m=_next_pow2(m), block_n=64, block_k=128, num_warps=4, num_stages=3)
  else:  # large M: the row tiles fill the GPU
    base = W8A16Config(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, split_rule=NEVER_SPLIT)
  block_n, block_k = fit_block(n, base.block_n, MIN_BLOCK_N), fit_block(k, base.block_k, MIN_BLOCK_K)
  tiles = (-(-m // base.block_m)) * max(n // block_n, 1)
  return dataclasses.replace(base, block_n=block_n, block_k=block_k,
                             split_k=base.split_rule.split_k(tiles, k, block_k, sms))


def supports(n: int, k: int, config: W8A16Config, gated: bool = False) -> bool:
  """Whether the kernel takes an ``[N, K]`` weight with this tiling (no weight padding, ever); ``gated``: and writes
  the gated output (K unsplit, each half of N a whole number of half-blocks of at least :data:`MIN_GATED_BLOCK_N`
  columns on tensor cores)."""
  fits = n % config.block_n == 0 and k % (config.block_k * config.split_k) == 0
  tensor_cores_fit = config.block_m == GEMV_BLOCK_M or config.block_n // 2 >= MIN_GATED_BLOCK_N
  return fits and (not gated or (gated_fits(n, config.block_n, config.split_k) and tensor_cores_fit))


def check_operands(x: jax.Array, wq: jax.Array, w_scale: jax.Array) -> None:
  """TypeError/ValueError for operands that no W8A16 path accepts."""
  if x.ndim != 2 or wq.ndim != 2:
    raise ValueError(f"w8a16_matmul: x and wq must be 2-D ([M, K] and [N, K]), got {x.shape} and {wq.shape}")
  if x.shape[1] != wq.shape[1]:
    raise ValueError(f"w8a16_matmul: contraction sizes differ: x {x.shape} vs wq {wq.shape} (wq is [N, K])")
  if wq.dtype != jnp.int8:
    raise TypeError(f"w8a16_matmul: wq must be int8, got {wq.dtype}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"w8a16_matmul: x must be floating point, got {x.dtype}")
  if w_scale.size != wq.shape[0]:
    raise ValueError(f"w8a16_matmul: w_scale has shape {w_scale.shape}; expected one float32 scale per row of wq "
                     f"({wq.shape[0]})")


def w8a16_matmul_reference(x: jax.Array, wq: jax.Array, w_scale: jax.Array, out_dtype=None) -> jax.Array:
  """Plain XLA: ``(x @ wq.T) * w_scale`` with float32 accumulation.

  Args:
    x: ``[M, K]`` bfloat16, float16 or float32. wq: ``[N, K]`` int8. w_scale: ``[N]`` (or
      ``[N, 1]``) float32 per-output-channel dequantization scale.
    out_dtype: result dtype (default ``x.dtype``).

  Returns:
    ``[M, N]``. The int8 weight is converted to ``x``'s dtype inside the dot (exact), which
    XLA's GPU GEMM fusion applies on the fly.
  """
  check_operands(x, wq, w_scale)
  acc = lax.dot_general(x, wq.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  return (acc * w_scale.astype(jnp.float32).reshape(1, -1)).astype(out_dtype or x.dtype)


# int8 -> float32 without the conversion instruction: the byte b, offset to u = b + 128 (its bits XOR 0x80), is the
# low mantissa of the float 2^23 + u (bits 0x4B000000 | u), so subtracting 2^23 + 128 leaves b exactly. Two integer
# operations and an add per weight instead of I2F, which an SM issues at a quarter of the integer and float rate
# (16 a clock on sm80/sm90): at M = 1 the GEMV converts every weight byte it streams. One H100, alternating processes:
# 4096 x 14336 25.3 -> 24.1-24.8 us, 14336 x 4096 29.4 -> 27.4, 1B decode 1150 -> 1201-1206 tokens/s
# (benchmarks/results/w8a16_i2f_{new,old}_h100_816cf44*.json).
INT8_AS_FLOAT_BITS, INT8_AS_FLOAT_OFFSET = 0x4B000080, 8388736.0


def int8_to_float32(w: jax.Array) -> jax.Array:
  """int8 ``w`` as float32, exactly, by integer bit operations and one float subtraction (no I2F)."""
  bits = (w.astype(jnp.int32) & 0xFF) ^ INT8_AS_FLOAT_BITS
  return lax.bitcast_convert_type(bits, jnp.float32) - INT8_AS_FLOAT_OFFSET


def _kernel(x_ref, w_ref, s_ref, o_ref, *, config: W8A16Config, k_per_split: int, m: int, m_out: int,
            apply_scale: bool, masked: bool, native: bool, gated: str | None, half: int):
  """One ``[block_m, block_n]`` output tile over one K split. ``masked``: x and the output hold only the M rows
  (rows of the tile past them read as zeros and are not written); else both are padded to the tiles (``m_out``
  rows). ``native``: a GPU (:func:`~pallas_kernels.launch.early_launch`, for weights of up to
  ``policy.W8A16_EARLY_LAUNCH_MAX_BYTES``). Split-K partial sums of split s live at
  rows ``[s * m_out, (s + 1) * m_out)``. ``gated`` (unsplit only): the program sums ``block_n`` gate columns and the
  ``block_n`` up columns ``half`` further on, and writes ``act(gate) * up`` of the two
  (:func:`~pallas_kernels.quantize.gated_epilogue`)."""
  trigger = math.prod(w_ref.shape) <= policy.W8A16_EARLY_LAUNCH_MAX_BYTES
  i_n, i_m, i_s = early_launch(pl.program_id(0), native and trigger), pl.program_id(1), pl.program_id(2)
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  rows = pl.ds(pl.multiple_of(i_m * bm, bm), bm)
  cols = pl.ds(pl.multiple_of(i_n * bn, bn), bn)
  tiles = gated_rows(cols, i_n, bn, half, gated)  # the weight rows it sums
  valid = i_m * bm + jnp.arange(bm) < m
  k0 = i_s * k_per_split
  deferred = bm == GEMV_BLOCK_M and not config.reduce_per_step

  def step(t, accs):
    ks = pl.ds(pl.multiple_of(k0 + t * bk, bk), bk)
    x = load_rows(x_ref.at[rows, ks], valid, masked)
    new = []
    for c, acc in zip(tiles, accs):
      if bm == GEMV_BLOCK_M:  # CUDA cores: [1, bk] x [bn, bk] products (exact in float32), summed over K
        products = int8_to_float32(w_ref[c, ks]) * x.astype(jnp.float32)
        new.append(acc + (products if deferred else jnp.sum(products, axis=1)[None, :]))
      else:
        # int8 -> bf16/f16 in registers by the conversion instruction: exact. Three exact forms of int8_to_float32's
        # arithmetic (element-wise, then rounded to bf16 or its upper half taken; and four weights at a time by byte
        # permutes in inline PTX) were slower on every shape: the 1B down projection at M = 1 9.4-10.5 us against 8.3
        # (one H200; benchmarks/results/w8a16_convert_ab_h200_97a1914.json, w8a16_convert_prmt_ab_h200_d80af7c.json).
        w = w_ref[c, ks].astype(x.dtype)
        new.append(acc + lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32))
    return tuple(new)

  scales = [s_ref[c] for c in tiles] if apply_scale else None  # loaded before the loop: no round trip after it
  zeros = jnp.zeros((bn, bk) if deferred else (bm, bn), jnp.float32)
  accs = lax.fori_loop(0, k_per_split // bk, step, tuple(zeros for _ in tiles))
  if deferred:
    accs = tuple(jnp.sum(acc, axis=1)[None, :] for acc in accs)
  if apply_scale:
    outs = [(acc * scale[None, :]).astype(o_ref.dtype) for acc, scale in zip(accs, scales)]
    out = outs[0] if gated is None else gated_epilogue(*outs, gated)
  else:
    out = accs[0]
  out_rows = rows if apply_scale else pl.ds(i_s * m_out + i_m * bm, bm)
  store_rows(o_ref.at[out_rows, cols], out, valid, masked)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret", "gated"))
def _w8a16_call(x, wq, w_scale, *, out_dtype, config: W8A16Config, interpret: bool, gated: str | None = None):
  """``gated`` (K unsplit): ``[M, N / 2]``, ``act(gate) * up`` of the output's halves; a program takes half of
  ``config.block_n`` columns of each half, so it streams as many weight rows as without."""
  m, k = x.shape
  n = wq.shape[0]
  masked, m_out = tile_rows(m, config.block_m, interpret)
  if m_out != m:
    x = jnp.pad(x, ((0, m_out - m), (0, 0)))
  split = config.split_k
  scale = w_scale.astype(jnp.float32).reshape(n)
  width, config = gated_tiling(n, config, gated)
  out_shape = (out_struct((m_out, width), out_dtype, x, wq, scale) if split == 1
               else out_struct((split * m_out, n), jnp.float32, x, wq, scale))
  out = pl.pallas_call(
      functools.partial(_kernel, config=config, k_per_split=k // split, m=m, m_out=m_out, apply_scale=split == 1,
                        masked=masked, native=not interpret, gated=gated, half=width),
      out_shape=out_shape,
      grid=(width // config.block_n, -(-m // config.block_m), split),
      compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name="jaxlowbit_w8a16_matmul",
  )(x, wq, scale)
  if split > 1:
    out = (out.reshape(split, m_out, n).sum(axis=0) * scale[None, :]).astype(out_dtype)
  return out[:m] if m_out != m else out


def w8a16_matmul_kernel(
    x: jax.Array,
    wq: jax.Array,
    w_scale: jax.Array,
    out_dtype=None,
    config: W8A16Config | None = None,
    interpret: bool = False,
    gated: str | None = None,
) -> jax.Array:
  """W8A16 GEMM with in-kernel dequantization (see the module docstring).

  Args:
    x: ``[M, K]`` bfloat16 or float16 activations (any M >= 1; a tile's rows past M are masked on a GPU, padded in
      the interpreter).
    wq: ``[N, K]`` int8 weight, K-major. w_scale: ``[N]`` or ``[N, 1]`` float32.
    out_dtype: result dtype (default ``x.dtype``).
    config: tiling; default :func:`config_for`. N must be a multiple of ``block_n`` and K
      of ``block_k * split_k`` (:func:`supports`); the weight is never padded.
    interpret: run the kernel in the Pallas interpreter (CPU tests).
    gated: an activation of ``pallas_kernels.quantize.GATE_ACTIVATIONS``: return ``act(gate) * up`` ``[M, N / 2]``
      of the output's halves ``[gate | up]`` instead, formed in the epilogue from the two halves rounded to
      ``out_dtype`` (K unsplit: :func:`supports`).

  Returns:
    ``[M, N]`` of ``out_dtype`` (gated: ``[M, N / 2]``).
  """
  check_operands(x, wq, w_scale)
  if jnp.dtype(x.dtype) not in ACTIVATION_DTYPES:
    raise TypeError(f"w8a16_matmul_kernel: x must be bfloat16 or float16, got {x.dtype} (float32: use the reference)")
  m, k = x.shape
  n = wq.shape[0]
  if gated is not None:
    check_gate_activation(gated)
  config = config or config_for(m, n, k)
  if not supports(n, k, config, gated is not None):
    gated_fit = f"; gated: K unsplit, N / 2 a multiple of block_n / 2 >= {MIN_GATED_BLOCK_N}" if gated else ""
    raise ValueError(
        f"w8a16_matmul_kernel: weight [N={n}, K={k}] does not fit the tiling {config} (N a multiple of "
        f"{config.block_n}, K of {config.block_k * config.split_k}{gated_fit}); use the reference path"
    )
  return _w8a16_call(x, wq, w_scale, out_dtype=jnp.dtype(out_dtype or x.dtype), config=config, interpret=interpret,
                     gated=gated)
