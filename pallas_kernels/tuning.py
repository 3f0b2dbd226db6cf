"""Tuning table for the Hopper GEMM: which ``GemmConfig`` runs which shape.

Entries come from ``benchmarks/matmul.py --tune`` on the GPU runner (see
``benchmarks/results/``); the default is the best 8192^3 configuration.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.hopper_gemm import Dim, GemmConfig

DEFAULT = GemmConfig()

# (dtype kind, M bucket, N bucket, K bucket) -> config; buckets are powers of two (floor).
TABLE: dict[tuple[str, int, int, int], GemmConfig] = {}


def _bucket(x: int) -> int:
  return 1 << max(x.bit_length() - 1, 0)


def config_for(m: int, n: int, k: int, dtype) -> GemmConfig:
  """The tuned config for an ``[M, K] x [N, K]`` problem (``DEFAULT`` when not in the table)."""
  kind = "int8" if jnp.dtype(dtype) == jnp.int8 else "fp8"
  return TABLE.get((kind, _bucket(m), _bucket(n), _bucket(k)), DEFAULT)


__all__ = ["DEFAULT", "TABLE", "config_for", "Dim"]
