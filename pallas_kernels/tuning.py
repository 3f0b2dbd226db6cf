"""Tuning table for the Pallas kernels: which configuration runs which shape (whether a kernel
runs at all is :mod:`pallas_kernels.policy`'s decision). Every number here comes from a recorded run of
``benchmarks/matmul.py`` (``--tune``, ``--tune-quantize``, ``--sizes``) on the GPU runner;
the JSON files are in ``benchmarks/results/`` (H200, jax 0.11.2, 2026-11-21).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.adam import AdamKernelConfig
from pallas_kernels.hopper_gemm import Dim, GemmConfig

# 8192^3 sweep (gemm_tune_*_h200.json): int8 is best walking output tiles M-minor
# (1483 TOP/s vs 1395 N-minor); FP8 best N-minor (1394). Both: 128x256 CTA tiles split
# along N between the two compute warpgroups, 3 stages, no wgmma left in flight.
INT8_CONFIG = GemmConfig(grid_minor_dim=Dim.M)
FP8_CONFIG = GemmConfig(grid_minor_dim=Dim.N)

# quantize_tune_h200.json (16384x8192 bf16): rows per program, columns per load, warps.
QUANTIZE_ROWS = {"int8": (8, 2048, 8), "fp8": (8, 512, 8)}
# fused_quantize_tune_h200.json (rows + transposed copy of 16384 x 2048 / x 8192 bf16, 1B shapes):
# (dtype kind, prologue) -> (rows per program, columns per load, warps). int8 identity rows + columns
# of 16384 x 2048 took 0.209 ms with the table above, 0.137 ms with 4 rows and 4 warps.
QUANTIZE_ROWS_BY_PROLOGUE = {
    ("int8", "Identity"): (4, 2048, 4),
    ("int8", "RmsNorm"): (4, 2048, 4),
    ("int8", "SwiGLU"): (4, 2048, 8),
    ("fp8", "Identity"): (8, 2048, 8),
    ("fp8", "RmsNorm"): (8, 2048, 4),
    ("fp8", "SwiGLU"): (4, 4096, 8),
}
# Transposing tile kernel: (tile rows, tile columns, warps) per prologue (same file): 64 x 128 took
# identity x 8192 from 0.487 to 0.445 ms (int8); 32 x 128 RmsNorm from 0.159 to 0.147 ms. Identity moved to
# 32 x 128 on 2026-11-28: rows + q^T int8 of the 1B gate_up gradient (16384 x 16384 bf16, both passes) took
# 0.522 ms against 0.555 on an H200 (quantize_tile_sweep_h200_c1bcbdd.json; 64 x 64 0.519, the others 0.53-0.63),
# and the H100 write-pass sweep had it first too (0.443 against 0.454; prologue_tile_sweep_h100_2f26d4e.log).
QUANTIZE_TILE = {"Identity": (32, 128, 4), "RmsNorm": (32, 128, 4), "RmsNormApply": (32, 128, 4),
                 "SwiGLU": (32, 128, 4)}
# Per-column scales of a rows + transposed (or transposed-only) request come either from the rows
# kernel, which writes per-program column maxima ([R / rows per program, C] float32, as many bytes
# as the int8 output at 4 rows per program) that XLA then reduces, or from a tiled statistics pass
# (row and column maxima per tile: 1/16 of that) followed by one tiled pass writing both layouts.
# Prologues listed here take the tiled passes.
QUANTIZE_STATS_FROM_TILES = frozenset({"Identity", "RmsNormApply", "SwiGLU"})
# Tiled statistics pass: (tile rows, tile columns, warps) per prologue.
QUANTIZE_STATS_TILE = {"Identity": (64, 128, 4), "RmsNorm": (32, 128, 4), "RmsNormApply": (32, 128, 4),
                       "SwiGLU": (32, 128, 4)}
# The values kernel (a prologue's output written in its dtype): (tile rows, tile columns, warps).
# swiglu_grad_h200.json (d gate_up of 16384 x 8192, bf16): 16 x 256 0.381 ms, 32 x 128 0.412, 64 x 64
# 0.428; XLA's concatenate fusion of the same expression alone 0.367 (in the 1B step XLA did not fuse it).
# SwiGLUNormGrad (BitNet's ffn_sub_norm and SwiGLU backward, 16384 x 5632 of the 1B model, H100, 30 calls
# queued; prologue_tile_sweep_h100_2f26d4e.log): 16 x 128 x 4 warps 0.416 ms, within 1% of the best of ten
# (0.415); 16 x 64 0.454, 64 x 128 was 1.5x slower in a first timing. SwiGLUGrad's tiles all took 0.337 there.
PROLOGUE_TILE = {"SwiGLUGrad": (16, 256, 4), "SwiGLUNormGrad": (16, 128, 4)}

# Fused optimizer step (pallas_kernels.adam; the update kernel takes the same): (m kind, m bits, v kind)
# -> config; others take the default (4096 elements, 4 warps). benchmarks/optim.py --tune, the step
# kernel alone on the [22, 2048, 5632] float32 MLP weight, {1024, 2048, 4096} elements x {2, 4, 8}
# warps (optim_step_h200.json): 8-bit 1.56 ms at 2048 x 4 (tied with 1024 x 2; 1.81 at the former
# 4096 x 8), 4-bit 1.38 at 1024 x 4 (1.67 at the former 1024 x 2), FP8 1.04 at 2048 x 8 (1.27 at the
# default).
ADAM_CONFIGS: dict[tuple[str, int, str], AdamKernelConfig] = {
    ("dynamic", 8, "dynamic"): AdamKernelConfig(2048, 4),
    ("dynamic", 4, "linear"): AdamKernelConfig(1024, 4),
    ("e4m3", 8, "e4m3"): AdamKernelConfig(2048, 8),
}

# (dtype kind, M bucket, N bucket, K bucket) -> config for shapes that tune differently.
TABLE: dict[tuple[str, int, int, int], GemmConfig] = {}


def _kind(dtype) -> str:
  return "int8" if jnp.dtype(dtype) == jnp.int8 else "fp8"


def _bucket(x: int) -> int:
  return 1 << max(x.bit_length() - 1, 0)


def config_for(m: int, n: int, k: int, dtype) -> GemmConfig:
  """The tuned GEMM config for an ``[M, K] x [N, K]`` problem."""
  kind = _kind(dtype)
  default = INT8_CONFIG if kind == "int8" else FP8_CONFIG
  return TABLE.get((kind, _bucket(m), _bucket(n), _bucket(k)), default)


def quantize_tile_config(prologue=None) -> tuple[int, int, int]:
  """(tile rows, tile columns, warps) of the transposing quantization kernel."""
  return QUANTIZE_TILE.get(type(prologue).__name__, QUANTIZE_TILE["Identity"])


def quantize_rows_config(dtype, prologue=None) -> tuple[int, int, int]:
  """(rows per program, columns per load, warps) of the row-quantization kernel (``pallas_kernels.quantize``)."""
  kind = _kind(dtype)
  return QUANTIZE_ROWS_BY_PROLOGUE.get((kind, type(prologue).__name__), QUANTIZE_ROWS[kind])


def quantize_stats_tile_config(prologue=None) -> tuple[int, int, int]:
  """(tile rows, tile columns, warps) of the tiled statistics pass (row and column maxima per tile)."""
  return QUANTIZE_STATS_TILE.get(type(prologue).__name__, QUANTIZE_STATS_TILE["Identity"])


def quantize_stats_from_tiles(prologue=None) -> bool:
  """Whether a per-column quantization of ``prologue``'s values takes its scales from the tiled statistics pass."""
  return type(prologue).__name__ in QUANTIZE_STATS_FROM_TILES


def prologue_tile_config(prologue=None) -> tuple[int, int, int]:
  """(tile rows, tile columns, warps) of the values kernel (``pallas_kernels.quantize.prologue_kernel``)."""
  return PROLOGUE_TILE.get(type(prologue).__name__, (32, 128, 4))


def adam_config_key(m_format, v_format) -> tuple[str, int, str]:
  """The key of :data:`ADAM_CONFIGS` for these moment formats: ``(m kind, m bits, v kind)``."""
  return m_format.kind, m_format.bits, v_format.kind


def adam_config(m_format, v_format):
  """The launch configuration of the fused Adam update for these moment formats."""
  return ADAM_CONFIGS.get(adam_config_key(m_format, v_format), AdamKernelConfig())
