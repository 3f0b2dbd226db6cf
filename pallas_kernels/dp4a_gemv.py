"""Int8-activation GEMV on CUDA cores for M <= 4 (Pallas, Triton backend): ternary or int8 weights, dp4a.

Two weight formats, one kernel body; every K value of a row belongs to a *group* of four (``x[4 i .. 4 i + 3]``):

=========  ==================================================  ===================================================
weights    a group is                                          reference (bit-identical)
=========  ==================================================  ===================================================
ternary    a packed byte, ``pack_2bit(w [N, K], axis=-1)``     :func:`pallas_kernels.int8_gemv.a8w2_matmul_reference`
           ``[N, K/4]`` int8 (BitNet b1.58, 2 bits a weight)
int8       an int32 word of four int8, a bitcast view of the   :func:`pallas_kernels.int8_gemv.a8w8_matmul_reference`
           ``[N, K]`` int8 weight (W8A8)
=========  ==================================================  ===================================================

Each computes ``out[m, n] = (sum_k xq[m, k] w[n, k]) * x_scale[m] * w_scale[n]`` with exact int32 sums and the
float32 epilogue in the reference's order, for decode-sized M: :func:`a8w2_gemv_kernel` and
:func:`a8w8_gemv_kernel` take int8 codes (a decode norm's, ``jaxlowbit.fused``; XLA's quantizer's);
:func:`quantize_a8w2_gemv_kernel` and :func:`quantize_a8w8_gemv_kernel` take the float activations instead and
quantize them per row in the same launch, as ``pallas_kernels.quantize`` would.

Why another kernel: the int8-mma GEMVs (``pallas_kernels.int8_gemv``) feed 16-row tensor-core tiles. At M = 1 the
A8W2 one moved 14 MiB in ~30 us (H200, ~0.5 TB/s, before 6d76cc2; ~12 us since, against ~6 here on int8 codes):
every decoded weight tile is converted from the load's register layout to the mma operand layout (through shared
memory) four times, once per 2-bit position, for 15 masked rows. Here each program streams ``[block_n, block_k]``
groups (rows of W are K-major, so a row's groups are contiguous) and does one ``dp4a`` per group and row of x: it
multiplies the group's four weights, as the four signed bytes of an int32, with the four int8 activation codes they
meet, ``x[4 i + j]``, packed into one int32, and adds the sum. An int8 group is such an int32 already; a packed
byte's four 2-bit weights are spread over an int32's bytes by a multiply and a mask first (:func:`spread_codes`).
Float rows are read in four strided loads (the row sits in L2; no interleaved copy) and quantized on the way;
pre-quantized codes arrive as those int32 words already, a bitcast view of the int8 row: one load.
Decoding each ternary weight with shifts and an int32 multiply-add instead cost ~13 integer instructions per byte,
which bound the kernel by the SM's integer throughput at a quarter of HBM bandwidth; this is ~4. K is split across
programs (split-K) where N alone gives the SMs too little work; the int32 partials are then added by XLA (exact).

Decode at M = 1 pays per launch as much as per byte (a 4096 x 4096 ternary weight is 4 MiB, ~2 us of HBM), so
the activation quantizer can run inside the GEMV: one launch per linear. Tilings and the M the dispatch sends here
come from the sweeps recorded in ``benchmarks/results`` (``policy.TERNARY_GEMV_MAX_M``, ``policy.W8A8_GEMV_MAX_M``;
the tilings below name theirs).
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
from jaxlowbit_numerics.ternary import VALUES_PER_BYTE
from pallas_kernels import quantize
from pallas_kernels.launch import early_launch
from pallas_kernels.quantize import BYTE_BITS, BYTE_MASK
from pallas_kernels.int8_gemv import check_a8w2, check_a8w8
from pallas_kernels.vma import out_struct
from pallas_kernels.w8a16 import SplitRule, fit_block

# Rows of x a program keeps partial sums for: each adds block_n x block_k int32 registers per thread block
# (block_n with reduce_per_step) and, per step, the quantization and packing of its activations. Tried to 16 on an
# H100: at M = 16 the Llama shapes took 52-187 us against the A8W2 path's 16-29 (inference_linears_h100_aafef12.json),
# and 1B decode at batch 8 ran 0.72x bf16 against the A8W2 path's 0.97x.
MAX_M = 4
MIN_BLOCK_N, MIN_BLOCK_K = 8, 16


@dataclasses.dataclass(frozen=True)
class Dp4aGemvConfig:
  """Tiling (powers of two): ``block_n`` weight rows and ``block_k`` groups of four K values per step (packed bytes
  of a ternary weight, int32 words of an int8 one); ``split_k``
  programs share a row block; Triton's ``num_warps`` and ``num_stages``. ``reduce_per_step`` sums each step's
  products across K at once (``[block_n]`` partial sums per row of x instead of ``[block_n, block_k]``): fewer
  registers for M > 1, one cross-lane reduction per step. ``split_rule``: how :func:`config_for` splits K for this
  tiling (``w8a16.SplitRule``)."""

  block_n: int = 32
  block_k: int = 128
  split_k: int = 1
  num_warps: int = 4
  num_stages: int = 3
  reduce_per_step: bool = False
  split_rule: SplitRule = SplitRule()


# Split-K costs an XLA kernel after the GEMV (the partial sums' add and the epilogue). At M = 1 it pays only where
# the row blocks alone leave SMs idle (fewer blocks than SMs); there it splits up to DECODE_PROGRAMS_PER_SM programs
# per SM. On an H100, 4096 x 4096 (256 row blocks) ran 9.1 us unsplit against 11.1 split in two
# (benchmarks/results/ternary_gemv_split_h100_aafef12.json). The 1B model's down projection (8192 x 2048: 128 row
# blocks of 16) is the shape the first clause split: 1B decode on an H200 ran 1675 and 1586 tokens/s with it split
# in four against 1620 and 1539 unsplit (two calls, inference_decode_1b{,_rest}_h200_21b5d4f.json). On codes its
# 8-row blocks fill the SMs and it runs unsplit (CODES_TILING). At M = 4 the split up to four programs per SM stays:
# 14336 x 4096 34.8 us split against 42.6 (4096 x 4096 went the other way, 20.3 against 12.9).
DECODE_PROGRAMS_PER_SM = 4
DECODE_SPLIT = SplitRule(DECODE_PROGRAMS_PER_SM, unsplit_fill=1.0)

# Tilings from the H100 sweep of the dp4a kernel (2026-11-27, benchmarks/results/ternary_gemv_dp4a_sweep_h100.json,
# quantizer inside, 8 Llama and 1B shapes): M = 1: 16 rows x 512 bytes, summed across K once at the end (4096 x
# 14336: 10.7 us; one reduction per step: 17.6); M = 2..4: 16 rows x 256 bytes, one reduction per step (the lowest
# total over the shapes at M = 4; 64 x 128 on 8 warps, the old kernel's best, was 2-7x slower here).
DECODE_TILING = Dp4aGemvConfig(block_n=16, block_k=512, num_warps=4, split_rule=DECODE_SPLIT)
BATCH_TILING = Dp4aGemvConfig(block_n=16, block_k=256, num_warps=4, reduce_per_step=True)
# M = 1 on pre-quantized codes (a decode norm's: no amax pass for a program to repeat): 8 rows x 512 bytes was the
# fastest or within 8% of it on 7 of 8 Llama 1B / 8B shapes and 3-15% under 16 x 512 (H200, device time, 16 weights
# per call; benchmarks/results/ternary_gemv_codes_sweep_h200_48e3989.json). The one K of 2048 bytes or more that a
# 1024-byte step divides (the 1B down projection, 8192 x 2048: 256 row blocks, so unsplit) took 3.3 us with such
# steps on 8 warps against 4.1 with 512 on 4 and 4.1 split in four; 14336 x 4096 (3584 bytes) keeps 512-byte steps.
CODES_TILING = Dp4aGemvConfig(block_n=8, block_k=512, num_warps=4, split_rule=DECODE_SPLIT)
CODES_LONG_K, CODES_LONG_K_TILING = 2048, Dp4aGemvConfig(block_n=8, block_k=1024, num_warps=8,
                                                           split_rule=DECODE_SPLIT)


# W8A8 (int8 weights: an int32 word a group, four times a packed byte's bytes). One H200 at M = 1, through
# quantized_linear on six 1B / 8B shapes, 8 weights a call, six tilings (benchmarks/results/
# w8a8_dp4a_tilings_h200_0c42e16.json): 8 rows x 512 words on 8 warps was the fastest on codes on all six and quantizing
# on five, the sixth (2048 x 16384) within 2% of the best (11.71 against 11.45 us); 16 x 256 on 4 warps split K where
# its row blocks were fewer than the SMs and took 11.1 against 9.1 us on the 1B down projection, 27.2 against 20.6
# on 14336 x 4096.
# M = 2..4 (the dispatch sends M = 1: policy.W8A8_GEMV_MAX_M) take the same tiling, untimed.
INT8_TILING = Dp4aGemvConfig(block_n=8, block_k=512, num_warps=8, split_rule=DECODE_SPLIT)


def config_for(n: int, k_groups: int, sms: int | None = None, m: int = 1, codes: bool = False,
               packed: bool = True) -> Dp4aGemvConfig:
  """The tiling for ``m`` rows and a weight of ``[N, k_groups]`` groups (``packed``: ternary bytes, else int8
  words; ``codes``: x arrives as int8 codes): at M = 1, split-K only where the row blocks are fewer than the SMs
  (then up to :data:`DECODE_PROGRAMS_PER_SM` programs per SM); ~4 per SM above."""
  if not packed:
    base = INT8_TILING
  elif m > 1:
    base = BATCH_TILING
  elif not codes:
    base = DECODE_TILING
  else:
    long_k = k_groups >= CODES_LONG_K and k_groups % CODES_LONG_K_TILING.block_k == 0
    base = CODES_LONG_K_TILING if long_k else CODES_TILING
  block_n, block_k = fit_block(n, base.block_n, MIN_BLOCK_N), fit_block(k_groups, base.block_k, MIN_BLOCK_K)
  split = base.split_rule.split_k(max(n // block_n, 1), k_groups, block_k, sms)
  return dataclasses.replace(base, block_n=block_n, block_k=block_k, split_k=split)


# Activation values a thread loads at once in the quantizing kernels' amax pass. Each trip of a Triton loop is a
# round trip to L2 that the next one waits for (and each block reduction a barrier that loads are not moved across),
# so the pass loads as many chunks of the row as this allows in one trip and reduces once: the 8B down projection's
# 14336 columns at M = 1 in one straight run of loads instead of seven round trips (ternary on 4 warps: a trip of
# four chunks and the three past it, no loop; W8A8 on 8 warps: one trip of seven). One H200, M = 1, device time
# (benchmarks/results/dp4a_quantizer_amax_h200_4425b32.json): ternary 14336 x 4096 13.8 -> 11.9 us, 4096 x 14336
# 9.8 -> 9.0, 4096 x 4096 3.7 -> 3.3; W8A8 20.5 -> 17.2, 19.5 -> 17.9, 7.2 -> 6.4. 128 a thread (one trip there)
# measured the same, within 4%.
AMAX_VALUES_PER_THREAD = 64


def amax_trips(n_chunks: int, values_per_chunk: int, num_warps: int) -> tuple[int, int]:
  """``(chunks a trip, full trips)`` of an amax pass over ``n_chunks`` chunks of ``values_per_chunk`` values (all
  rows) on ``num_warps`` warps: at most :data:`AMAX_VALUES_PER_THREAD` a thread in a trip; the chunks past the full
  trips are one more, shorter trip."""
  per_trip = max(1, min(n_chunks, AMAX_VALUES_PER_THREAD * 32 * num_warps // values_per_chunk))
  return per_trip, n_chunks // per_trip


def supports(m: int, n: int, k_groups: int, config: Dp4aGemvConfig, gated: bool = False) -> bool:
  """Whether the kernel takes M rows and a weight of ``[N, k_groups]`` groups with this tiling (never padded);
  ``gated``: and writes the gated output (K unsplit, each half of N a whole number of half-blocks)."""
  fits = (1 <= m <= MAX_M and n % config.block_n == 0 and k_groups % (config.block_k * config.split_k) == 0
          and config.block_n >= MIN_BLOCK_N and config.block_k >= MIN_BLOCK_K)
  return fits and (not gated or quantize.gated_fits(n, config.block_n, config.split_k))


# dp4a operands. A packed byte holds weight j in bits 7-2j .. 6-2j (pack_2bit). Multiplied by SPREAD (shifts of 0, 10,
# 20 and 30 bits, whose copies of a byte never overlap) and masked with TOP_CODES, byte j of the int32 holds weight j
# in its top two bits: the int8 64 x w (0b11 -> -64, 0b01 -> 64), so one dp4a against four int8 activation codes
# sums 64 x the byte's four products. An arithmetic shift by SPREAD_SHIFT undoes the 64 exactly.
SPREAD, TOP_CODES, SPREAD_SHIFT = 0x40100401, -0x3F3F3F40, 6  # TOP_CODES: 0xC0C0C0C0 as an int32


def spread_codes(packed: jax.Array) -> jax.Array:
  """int8 packed bytes -> int32 whose byte j is 64 x the byte's weight j (signed), for :func:`dp4a`."""
  return (packed.astype(jnp.int32) & BYTE_MASK) * SPREAD & TOP_CODES


def dp4a(a: jax.Array, b: jax.Array, c: jax.Array, native: bool) -> jax.Array:
  """``c + sum_j a_j * b_j`` over the four signed int8 bytes of int32 ``a`` and ``b`` (same shapes), int32.

  ``native``: the GPU's ``dp4a`` instruction (inline PTX: one instruction for four products and the add);
  otherwise the same sum written with shifts, for the Pallas interpreter.
  """
  if native:
    [out] = plt.elementwise_inline_asm("dp4a.s32.s32 $0, $1, $2, $3;", args=[a, b, c], constraints="=r,r,r,r",
                                       pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)])
    return out
  byte = lambda v, j: lax.shift_right_arithmetic(lax.shift_left(v, 24 - BYTE_BITS * j), 24)  # noqa: E731
  return c + sum(byte(a, j) * byte(b, j) for j in range(VALUES_PER_BYTE))


def _kernel(*refs, config: Dp4aGemvConfig, k: int, k_per_split: int, m: int, spec: QuantSpec | None, packed: bool,
            native: bool, tensor_scale: bool, gated: str | None, half: int, pairs: bool):
  """One ``block_n`` slice of the outputs over one K split.

  Refs: ``x`` (rows flattened: the int8 codes as ``[m * K / 4]`` int32 words of four, or ``[m * K]`` float
  activations when ``spec`` quantizes them here; ``pairs``: bfloat16 ones as ``[m * K / 2]`` int32 words of two),
  the weight's ``[N, K/4]`` groups (``packed``: int8 bytes of four
  2-bit weights; else int32 words of four int8 weights), the codes' scales ``[m]`` (pre-quantized only), the
  weight scales ``[N]`` (``[1]`` when ``tensor_scale``); out, then (``spec`` and split-K) the activation scales
  ``[m]``. ``k_per_split`` counts groups. ``gated`` (unsplit only): the program sums ``block_n`` gate columns and
  the ``block_n`` up columns ``half`` further on, and writes ``act(gate) * up`` of the two
  (:func:`quantize.gated_epilogue`).
  """
  if spec is None:
    x_ref, w_ref, sx_ref, sw_ref, o_ref = refs
  else:
    x_ref, w_ref, sw_ref, o_ref, *scale_out = refs
  i_n, i_s = early_launch(pl.program_id(0), native), pl.program_id(1)
  bn, bk = config.block_n, config.block_k
  cols = pl.ds(pl.multiple_of(i_n * bn, bn), bn)
  tiles = quantize.gated_rows(cols, i_n, bn, half, gated)  # the weight rows it sums
  k0 = i_s * k_per_split

  def load(t):
    start = pl.multiple_of(k0 + t * bk, bk)
    return tuple(w_ref[c, pl.ds(start, bk)] for c in tiles), start  # [bn, bk] groups a tile

  # The first step's weights, issued before the amax pass so they are in flight meanwhile. Two or three steps
  # issued there were slower at M = 1 on one H200, 64 amax values a thread (the registers they hold): 4096 x 14336
  # W8A8 19.8 us against 17.8, ternary 9.6 against 9.0 (benchmarks/results/dp4a_quantizer_prologue_h200_0aba6e6.json).
  first = load(0)
  if config.split_k == 1:  # the epilogue's weight scales, loaded now rather than after the loop
    sws = [sw_ref[0] if tensor_scale else sw_ref[c] for c in tiles]
  if spec is None:
    scales = [sx_ref[r] for r in range(m)]
  else:
    # The row's amax over all of K (every program reads the whole row, a few KiB from L2), then its scale: the
    # chunks of a trip are loaded together and met element-wise, one block reduction at the end (:func:`amax_trips`).
    # bfloat16 rows arrive as int32 words of two values (``pairs``) and are met as integers
    # (quantize.bf16_magnitude_maxes).
    chunk = VALUES_PER_BYTE * bk
    per_trip, trips = amax_trips(k // chunk, m * chunk, config.num_warps)
    if pairs:
      width, meet, finish = chunk // 2, quantize.bf16_magnitude_maxes, quantize.bf16_amax
      zeros = lambda: (jnp.zeros((width,), jnp.int32),) * 2  # noqa: E731
    else:
      width, finish = chunk, jnp.max
      meet = lambda a, v: jnp.maximum(a, quantize.magnitude(v.astype(jnp.float32)))  # noqa: E731
      zeros = lambda: jnp.zeros((width,), jnp.float32)  # noqa: E731
    row_width = k * width // chunk  # x_ref's elements a row

    def chunk_maxes(first_chunk, count, maxes):  # maxes[r]: row r's element-wise maxima so far
      for t in range(count):
        start = (first_chunk + t) * width
        maxes = tuple(meet(a, x_ref[pl.ds(r * row_width + start, width)]) for r, a in enumerate(maxes))
      return maxes

    maxes = tuple(zeros() for _ in range(m))
    looped = trips * per_trip if trips > 1 else 0  # one trip is no loop: its loads issue with the rest
    if looped:
      maxes = lax.fori_loop(0, trips, lambda i, a: chunk_maxes(i * per_trip, per_trip, a), maxes)
    maxes = chunk_maxes(looped, k // chunk - looped, maxes)  # the chunks past the loop, in straight-line code
    params, scales = zip(*(quantize.code_scales(finish(a), spec) for a in maxes))

  def x_words(r, start):
    # The codes of x[r, 4 i + j], j = 0..3, as byte j of one int32 per weight group i of the step: the four
    # activations that group's weights meet. Pre-quantized codes arrive as those words (little-endian int32 of
    # four consecutive codes: one load); float rows are read in strided loads (from L2) and quantized: bfloat16
    # as two words of two values a group, other floats value by value.
    if spec is None:
      return x_ref[pl.ds(r * (k // VALUES_PER_BYTE) + start, bk)]
    if pairs:
      halves = [quantize.bf16_halves(x_ref[pl.ds(r * (k // 2) + 2 * start + j, bk, stride=2)]) for j in range(2)]
      xs = [value for pair in halves for value in pair]
    else:
      xs = [x_ref[pl.ds(r * k + VALUES_PER_BYTE * start + j, bk, stride=VALUES_PER_BYTE)].astype(jnp.float32)
            for j in range(VALUES_PER_BYTE)]
    return quantize.encode_words(xs, params[r], spec, native)

  def step(groups, start, accs):  # accs[tile][row]
    words = [x_words(r, start) for r in range(m)]  # once a step, whatever the tiles
    new = []
    for p, tile_accs in zip(groups, accs):
      # [bn, bk] int32, byte j of each = weight j of the group (64 x it, for a packed byte)
      weights = spread_codes(p) if packed else p
      row_accs = []
      for r in range(m):
        xw = jnp.broadcast_to(words[r][None, :], weights.shape)
        if config.reduce_per_step:
          row_accs.append(tile_accs[r] + jnp.sum(dp4a(weights, xw, jnp.zeros_like(weights), native), axis=1))
        else:
          row_accs.append(dp4a(weights, xw, tile_accs[r], native))
      new.append(tuple(row_accs))
    return tuple(new)

  acc_shape = (bn,) if config.reduce_per_step else (bn, bk)
  accs = step(*first, tuple(tuple(jnp.zeros(acc_shape, jnp.int32) for _ in range(m)) for _ in tiles))
  accs = lax.fori_loop(1, k_per_split // bk, lambda t, accs: step(*load(t), accs), accs)
  for r in range(m):
    totals = []
    for tile_accs in accs:
      total = tile_accs[r] if config.reduce_per_step else jnp.sum(tile_accs[r], axis=1)
      if packed:  # [bn] int32, exact: each product was 64 x its value
        total = lax.shift_right_arithmetic(total, SPREAD_SHIFT)
      totals.append(total)
    if config.split_k == 1:  # the reference's epilogue, same order
      outs = [(total.astype(jnp.float32) * scales[r] * sw).astype(o_ref.dtype) for total, sw in zip(totals, sws)]
      o_ref[r, cols] = outs[0] if gated is None else quantize.gated_epilogue(*outs, gated)
    else:
      o_ref[i_s * m + r, cols] = totals[0]
  if spec is not None and scale_out:  # split-K: XLA's epilogue needs the scales; one program writes them

    @pl.when((i_n == 0) & (i_s == 0))
    def _write_scales():
      for r in range(m):
        scale_out[0][r] = scales[r]


def _int32_words(a: jax.Array, per_word: int) -> jax.Array:
  """``[R, C]`` -> ``[R, C / per_word]`` int32 words of ``per_word`` consecutive elements (little-endian; a bitcast
  view, no copy)."""
  return lax.bitcast_convert_type(a.reshape(a.shape[0], -1, per_word), jnp.int32)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "spec", "packed", "interpret", "gated"))
def _call(x, x_scale, w, w_scale, *, out_dtype, config: Dp4aGemvConfig, spec: QuantSpec | None, packed: bool,
          interpret: bool, gated: str | None = None):
  """``x_scale`` None: ``x`` is float and ``spec`` quantizes it in the kernel. ``w``: packed ternary ``[N, K/4]``
  (``packed``) or int8 ``[N, K]``, read as int32 words of four (little-endian, as x's codes: a bitcast view, no
  copy). ``gated`` (unsplit tilings): ``[M, N / 2]``, ``act(gate) * up`` of the output's halves; a program takes
  half of ``config.block_n`` columns of each half, so it streams as many weight rows as without."""
  m = x.shape[0]
  if not packed:
    w = _int32_words(w, VALUES_PER_BYTE)
  n, k_groups = w.shape
  # One scale per tensor (BitNet's absmean) stays one element: broadcast to [N] it would be a kernel of its own
  # on every decode step (XLA does not hoist a broadcast out of the decode loop; 2-3 us a linear on an H100).
  sw = w_scale.astype(jnp.float32).reshape(-1)
  tensor_scale = sw.size == 1
  split = config.split_k
  pairs = spec is not None and x.dtype == jnp.bfloat16
  if spec is None:
    sx = jnp.broadcast_to(x_scale.astype(jnp.float32).reshape(-1), (m,))
    operands = (_int32_words(x, VALUES_PER_BYTE).reshape(-1), w, sx, sw)
  elif pairs:  # bfloat16 rows as int32 words of two values: integer amax, half the loads
    operands = (_int32_words(x, 2).reshape(-1), w, sw)
  else:
    operands = (x.reshape(-1), w, sw)
  width, config = quantize.gated_tiling(n, config, gated)
  out_shape = (out_struct((m, width), out_dtype, *operands) if split == 1
               else out_struct((split * m, n), jnp.int32, *operands))
  if spec is not None and split > 1:
    out_shape = (out_shape, out_struct((m,), jnp.float32, *operands))
  out = pl.pallas_call(
      functools.partial(_kernel, config=config, k=x.shape[1], k_per_split=k_groups // split, m=m, spec=spec,
                        packed=packed, native=not interpret, tensor_scale=tensor_scale, gated=gated, half=width,
                        pairs=pairs),
      out_shape=out_shape,
      grid=(width // config.block_n, split),
      compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name="jaxlowbit_ternary_gemv" if packed else "jaxlowbit_a8w8_gemv",
  )(*operands)
  if split > 1:
    out, sx = out if spec is not None else (out, sx)
    acc = out.reshape(split, m, n).sum(axis=0)
    out = (acc.astype(jnp.float32) * sx[:, None] * sw[None, :]).astype(out_dtype)
  return out


def _run(who: str, x, x_scale, w, w_scale, out_dtype, config: Dp4aGemvConfig | None, spec: QuantSpec | None,
         packed: bool, interpret: bool, gated: str | None) -> jax.Array:
  """Every public GEMV after its operand checks: the tiling (:func:`_tiling`), then the kernel (:func:`_call`)."""
  if gated is not None:
    quantize.check_gate_activation(gated)
  config = _tiling(who, x.shape[0], w.shape[0], x.shape[1], config, spec is None, packed, gated is not None)
  return _call(x, x_scale, w, w_scale, out_dtype=jnp.dtype(out_dtype), config=config, spec=spec, packed=packed,
               interpret=interpret, gated=gated)


GATED_FIT = "; gated: K unsplit, N / 2 a multiple of block_n / 2"


def _tiling(who: str, m: int, n: int, k: int, config: Dp4aGemvConfig | None, codes: bool,
            packed: bool, gated: bool = False) -> Dp4aGemvConfig:
  """``config`` (default :func:`config_for`) after checking it takes M rows and the weight's ``[N, K/4]`` groups
  (``gated``: unsplit, with the gated output)."""
  k_groups = k // VALUES_PER_BYTE
  config = config or config_for(n, k_groups, m=m, codes=codes, packed=packed)
  if not supports(m, n, k_groups, config, gated):
    raise ValueError(f"{who}: M={m} (at most {MAX_M}) and weight [N={n}, K={k}] ({k_groups} groups of four) do not "
                     f"fit the tiling {config} (N a multiple of {config.block_n}, K groups of "
                     f"{config.block_k * config.split_k}{GATED_FIT if gated else ''}); "
                     f"use {'a8w2' if packed else 'a8w8'}_matmul_kernel or the reference")
  return config


def a8w2_gemv_kernel(xq, x_scale, w_packed, w_scale, out_dtype=jnp.bfloat16, config: Dp4aGemvConfig | None = None,
                     interpret: bool = False, gated: str | None = None) -> jax.Array:
  """Int8 x packed-ternary GEMV for M <= :data:`MAX_M` on CUDA cores.

  Args:
    xq: ``[M, K]`` int8 activations, x_scale: float32 ``[M]``/``[M, 1]`` (or one).
    w_packed: ``[N, K / 4]`` int8 from ``pack_2bit(w_ternary [N, K], axis=-1)``; w_scale: float32 ``[N]`` or one.
    out_dtype: result dtype. config: tiling (default :func:`config_for`; ``block_k`` in packed bytes).
    interpret: run in the Pallas interpreter (CPU tests).
    gated: an activation of ``quantize.GATE_ACTIVATIONS``: return ``act(gate) * up`` ``[M, N / 2]`` of the output's
      halves ``[gate | up]`` instead, formed in the epilogue (``quantize.gated_epilogue``; K unsplit: :func:`supports`).

  Returns:
    ``[M, N]`` of ``out_dtype``, bit-identical to :func:`pallas_kernels.int8_gemv.a8w2_matmul_reference` (gated:
    ``quantize.SwiGLU(gated).reference`` of it).
  """
  check_a8w2(xq, x_scale, w_packed, w_scale)
  return _run("a8w2_gemv_kernel", xq, x_scale, w_packed, w_scale, out_dtype, config, None, True, interpret, gated)


def quantize_a8w2_gemv_kernel(x, w_packed, w_scale, spec: QuantSpec, out_dtype=None,
                              config: Dp4aGemvConfig | None = None, interpret: bool = False,
                              gated: str | None = None) -> jax.Array:
  """Float activations x packed-ternary weights for M <= :data:`MAX_M`, the activations quantized in the kernel.

  One launch instead of a quantizer and a GEMV: each program finds the amax of the whole ``x`` row (a few KiB,
  read from L2), takes ``spec``'s scale and quantizes the slice it multiplies (``pallas_kernels.quantize.encode``).

  Args:
    x: ``[M, K]`` float activations (bf16/f16/f32). spec: per-row int8 :class:`QuantSpec` (BitNet's tokens).
    w_packed: ``[N, K / 4]`` int8 from ``pack_2bit(w_ternary [N, K], axis=-1)``; w_scale: float32 ``[N]`` or one.
    out_dtype: result dtype (default ``x.dtype``). config, interpret, gated: as :func:`a8w2_gemv_kernel`.

  Returns:
    ``[M, N]``: ``a8w2_matmul_reference(*quantize_rows_reference(x, spec), w_packed, w_scale)`` bit for bit (the
    codes are computed as XLA computes them: ``quantize.encode``).
  """
  check_a8w2(*_float_rows(x, spec, "quantize_a8w2_gemv_kernel"), w_packed, w_scale)
  return _run("quantize_a8w2_gemv_kernel", x, None, w_packed, w_scale, out_dtype or x.dtype, config, spec, True,
              interpret, gated)


def a8w8_gemv_kernel(xq, x_scale, wq, w_scale, out_dtype=jnp.bfloat16, config: Dp4aGemvConfig | None = None,
                     interpret: bool = False, gated: str | None = None) -> jax.Array:
  """Int8 x int8 GEMV (W8A8) for M <= :data:`MAX_M` on CUDA cores.

  Args:
    xq: ``[M, K]`` int8 activations, x_scale: float32 ``[M]``/``[M, 1]`` (or one).
    wq: ``[N, K]`` int8 weight (K-major); w_scale: float32 ``[N]``/``[N, 1]`` (or one).
    out_dtype: result dtype. config: tiling (default :func:`config_for`; ``block_k`` in int32 words of four).
    interpret: run in the Pallas interpreter (CPU tests). gated: as :func:`a8w2_gemv_kernel`.

  Returns:
    ``[M, N]`` of ``out_dtype``, bit-identical to :func:`pallas_kernels.int8_gemv.a8w8_matmul_reference` (gated:
    as :func:`a8w2_gemv_kernel`).
  """
  check_a8w8(xq, x_scale, wq, w_scale)
  return _run("a8w8_gemv_kernel", xq, x_scale, wq, w_scale, out_dtype, config, None, False, interpret, gated)


def quantize_a8w8_gemv_kernel(x, wq, w_scale, spec: QuantSpec, out_dtype=None, config: Dp4aGemvConfig | None = None,
                              interpret: bool = False, gated: str | None = None) -> jax.Array:
  """Float activations x int8 weights (W8A8) for M <= :data:`MAX_M`, the activations quantized per row in the kernel,
  as :func:`quantize_a8w2_gemv_kernel` does.

  Args:
    x: ``[M, K]`` float activations (bf16/f16/f32). spec: per-row int8 :class:`QuantSpec`.
    wq: ``[N, K]`` int8 weight; w_scale: float32 ``[N]`` or one. out_dtype: default ``x.dtype``.
    config, interpret, gated: as :func:`a8w8_gemv_kernel`.

  Returns:
    ``[M, N]``: ``a8w8_matmul_reference(*quantize_rows_reference(x, spec), wq, w_scale)`` where the kernel's codes
    are XLA's (``quantize.encode``; on a GPU its division is ``policy.INT8_DIVISION``'s).
  """
  check_a8w8(*_float_rows(x, spec, "quantize_a8w8_gemv_kernel"), wq, w_scale)
  return _run("quantize_a8w8_gemv_kernel", x, None, wq, w_scale, out_dtype or x.dtype, config, spec, False,
              interpret, gated)


def _float_rows(x, spec: QuantSpec, who: str) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
  """The int8 codes and scales ``spec`` makes of float ``x [M, K]``, as shapes for the operand checks; a
  ValueError for anything else."""
  if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{who}: x must be float [M, K], got {x.dtype} {x.shape}")
  quantize.check_row_int8(spec, who)
  return jax.ShapeDtypeStruct(x.shape, jnp.int8), jax.ShapeDtypeStruct((x.shape[0], 1), jnp.float32)
