"""Hopper (sm90) 8-bit GEMM with the scale epilogue fused: Pallas Mosaic GPU, wgmma.

``scaled_matmul_hopper(a, a_scale, b, b_scale)`` computes

    out[m, n] = (sum_k a[m, k] * b[n, k]) * a_scale[m] * b_scale[n]

for int8 x int8 (exact int32 accumulation) or fp8 x fp8 (e4m3/e5m2, float32 accumulation),
writing bf16 or float32. Both operands are K-major (``b`` is ``[N, K]``), which is what
wgmma requires of 8-bit operands: the B tile is staged as ``[tile_n, tile_k]`` and handed to
wgmma through a transposed view of the ref. The kernel is persistent (one CTA per SM walking output
tiles in a planar-snake order for L2 reuse), the K loop is a TMA pipeline with a dedicated
memory warpgroup (warp specialization) and two compute warpgroups, and the epilogue
multiplies the accumulator by the row and column scales in registers before a swizzled
TMA store. Nothing of size ``[M, N]`` other than the output ever touches memory, which is
what the XLA path loses (it writes an s32/f32 result and reads it back to scale it).

Reference: :func:`pallas_kernels.reference.scaled_matmul_reference`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.reference import accumulator_dtype, check_operands
from pallas_kernels.vma import out_struct, vary_like

# SMs of an H100 SXM / H200; used only when no GPU is attached (lowering tests on CPU).
DEFAULT_NUM_SMS = 132
# Registers given to the TMA-issuing warpgroup (JAX's Hopper matmul uses 40).
MEMORY_WARPGROUP_REGISTERS = 40


class Dim(enum.IntEnum):
  M = 0
  N = 1


@dataclasses.dataclass(frozen=True)
class GemmConfig:
  """Tiling of one kernel instance.

  Attributes:
    tile_m, tile_n: output tile of ONE compute warpgroup; the CTA computes two of them side
      by side along ``wg_dimension``.
    tile_k: K step of the TMA pipeline; 128 bytes of 8-bit data gives the 128-byte swizzle.
    stages: pipeline depth (shared memory holds ``stages`` A and B tiles).
    epi_tile_m, epi_tile_n: epilogue store tile (output staged through shared memory).
    grid_minor_dim, grid_tile_width: planar-snake order of output tiles (L2 reuse).
    wg_dimension: how the two compute warpgroups split the CTA tile.
    wgmma_in_flight: wgmma groups left running when a K step ends (0 or 1); with 1 the
      pipeline releases each shared-memory slot one step later.
  """

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 128
  stages: int = 3
  epi_tile_m: int = 64
  epi_tile_n: int = 64
  grid_minor_dim: Dim = Dim.N
  grid_tile_width: int = 8
  wg_dimension: Dim = Dim.N
  wgmma_in_flight: int = 0

  @property
  def cta_tile_m(self) -> int:
    return self.tile_m * (2 if self.wg_dimension == Dim.M else 1)

  @property
  def cta_tile_n(self) -> int:
    return self.tile_n * (2 if self.wg_dimension == Dim.N else 1)


def num_sms() -> int:
  """SM count of the default GPU (the persistent grid size); DEFAULT_NUM_SMS without one."""
  device = jax.devices()[0]
  if device.platform != "gpu":
    return DEFAULT_NUM_SMS
  return getattr(device, "core_count", None) or DEFAULT_NUM_SMS


def _load(ref, layout):
  """``plgpu.load`` across jax versions (0.10 needs an explicit index, 0.11 deprecates it)."""
  try:
    return plgpu.load(ref, layout=layout, optimized=False)
  except TypeError:
    return plgpu.load(ref, (), layout=layout, optimized=False)


def supports(m: int, n: int, k: int, config: GemmConfig) -> bool:
  """Whether the kernel takes an ``[M, K] x [N, K]`` problem without padding."""
  return m % config.cta_tile_m == 0 and n % config.cta_tile_n == 0 and k % config.tile_k == 0


def _kernel(a_gmem, b_gmem, sa_gmem, sb_gmem, out_gmem, *, config: GemmConfig):
  m, k = a_gmem.shape
  n = b_gmem.shape[0]
  out_dtype = out_gmem.dtype
  acc_dtype = accumulator_dtype(a_gmem.dtype)
  itemsize = jnp.dtype(a_gmem.dtype).itemsize
  tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
  cta_tile_m, cta_tile_n = config.cta_tile_m, config.cta_tile_n
  m_iters, n_iters, k_iters = m // cta_tile_m, n // cta_tile_n, k // tile_k

  swizzle = plgpu.find_swizzle(tile_k * itemsize * 8)
  transforms = (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))
  epi_m, epi_n = config.epi_tile_m, config.epi_tile_n
  num_out_slots = min(2, (tile_m * tile_n) // (epi_m * epi_n))
  out_itemsize = jnp.dtype(out_dtype).itemsize
  out_swizzle = plgpu.find_swizzle(epi_n * out_itemsize * 8)
  out_transforms = (plgpu.TilingTransform((8, out_swizzle // out_itemsize)), plgpu.SwizzleTransform(out_swizzle))

  def pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k_iters,),
        memory_registers=MEMORY_WARPGROUP_REGISTERS,
        in_specs=[
            plgpu.BlockSpec(
                (cta_tile_m, tile_k), lambda ki: (0, ki), transforms=transforms, memory_space=plgpu.SMEM,
                delay_release=config.wgmma_in_flight,
            ),
            plgpu.BlockSpec(
                (cta_tile_n, tile_k), lambda ki: (0, ki), transforms=transforms, memory_space=plgpu.SMEM,
                delay_release=config.wgmma_in_flight,
            ),
        ],
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=config.stages,
        compute_context=compute_context,
    )

  ignore = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the bodies)

  @functools.partial(
      pl.run_scoped,
      pipeline_allocs=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
      out_smem=plgpu.SMEM((2, num_out_slots, epi_m, epi_n), out_dtype, transforms=out_transforms),
      collective_axes="wg",
  )
  def _scope(pipeline_allocs, out_smem):
    wg = lax.axis_index("wg")

    @plgpu.nd_loop((m_iters * n_iters,), collective_axes="cluster_grid")
    def _tile_loop(loop_info):
      (linear,) = loop_info.index
      m_idx, n_idx = plgpu.planar_snake(linear, (m_iters, n_iters), config.grid_minor_dim, config.grid_tile_width)
      cta_m = pl.ds(m_idx * cta_tile_m, cta_tile_m)
      cta_n = pl.ds(n_idx * cta_tile_n, cta_tile_n)
      if config.wg_dimension == Dim.M:
        wg_m, wg_n = pl.ds(wg * tile_m, tile_m), slice(None)
        row0, col0 = m_idx * cta_tile_m + wg * tile_m, n_idx * cta_tile_n
      else:
        wg_m, wg_n = slice(None), pl.ds(wg * tile_n, tile_n)
        row0, col0 = m_idx * cta_tile_m, n_idx * cta_tile_n + wg * tile_n

      def compute_context(run_pipeline):
        # Issue the scale loads before the K loop so their latency hides behind it.
        row_scale = _load(sa_gmem.at[pl.ds(row0, tile_m)], plgpu.Layout.WGMMA.reduce(1))
        col_scale = _load(sb_gmem.at[pl.ds(col0, tile_n)], plgpu.Layout.WGMMA.reduce(0))

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), acc_dtype))
        def _acc_scope(acc_ref):
          run_pipeline(acc_ref)
          acc = acc_ref[...].astype(jnp.float32)
          acc = acc * lax.broadcast_in_dim(row_scale, (tile_m, tile_n), (0,))
          acc = acc * lax.broadcast_in_dim(col_scale, (tile_m, tile_n), (1,))
          out = acc.astype(out_dtype)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          for ei in range(tile_m // epi_m):
            for ej in range(tile_n // epi_n):
              slot = (ei * (tile_n // epi_n) + ej) % 2
              em, en = slice(ei * epi_m, (ei + 1) * epi_m), slice(ej * epi_n, (ej + 1) * epi_n)
              plgpu.wait_smem_to_gmem(1, wait_read_only=True)
              out_smem[wg, slot] = out[em, en]
              plgpu.commit_smem()
              plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], out_gmem.at[cta_m, cta_n].at[wg_m, wg_n].at[em, en])

      def mma(_, a_smem, b_smem, acc_ref):
        # 8-bit wgmma needs K-major B: the [tile_n, tile_k] tile viewed as [tile_k, tile_n].
        plgpu.wgmma(acc_ref, a_smem.at[wg_m], b_smem.at[wg_n].transpose((1, 0)))
        plgpu.wgmma_wait(config.wgmma_in_flight)
        return acc_ref

      pipeline(mma, compute_context)(a_gmem.at[cta_m, :], b_gmem.at[cta_n, :], allocations=pipeline_allocs)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "sms"))
def _scaled_matmul_hopper(a, a_scale, b, b_scale, *, out_dtype, config: GemmConfig, sms: int):
  m, _ = a.shape
  n = b.shape[0]
  call = plgpu.kernel(
      functools.partial(_kernel, config=config),
      out_type=out_struct((m, n), out_dtype, a, a_scale, b, b_scale),
      grid=(sms,),
      grid_names=("cluster_grid",),
      cluster=(1,),
      cluster_names=("cluster",),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )
  return vary_like(call(a, b, a_scale, b_scale), a, a_scale, b, b_scale)


def _per_row(scale: jax.Array, rows: int) -> jax.Array:
  return jnp.broadcast_to(scale.astype(jnp.float32).reshape(-1), (rows,))


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def scaled_matmul_hopper(
    a: jax.Array,
    a_scale: jax.Array,
    b: jax.Array,
    b_scale: jax.Array,
    out_dtype=jnp.bfloat16,
    config: GemmConfig | None = None,
    sms: int | None = None,
) -> jax.Array:
  """Scaled 8-bit GEMM on Hopper tensor cores (see the module docstring).

  Args:
    a: ``[M, K]`` int8 or fp8. b: ``[N, K]`` of the same family.
    a_scale: float32 ``[M]``/``[M, 1]`` or a single value. b_scale: ``[N]``/``[N, 1]`` or single.
    out_dtype: ``bfloat16`` or ``float32``.
    config: tiling (``pallas_kernels.tuning.config_for`` picks it per shape; default ``GemmConfig()``).
    sms: persistent grid size (default: the device's SM count).

  Returns:
    ``[M, N]`` of ``out_dtype``. Shapes that are not tile multiples are zero-padded (zero
    rows/columns/K-slices contribute nothing) and the result is sliced back.
  """
  check_operands(a, a_scale, b, b_scale)
  m, k = a.shape
  n = b.shape[0]
  config = config or GemmConfig()
  sa, sb = _per_row(a_scale, m), _per_row(b_scale, n)
  mp, np_, kp = _round_up(m, config.cta_tile_m), _round_up(n, config.cta_tile_n), _round_up(k, config.tile_k)
  if (mp, np_, kp) != (m, n, k):
    a = jnp.pad(a, ((0, mp - m), (0, kp - k)))
    b = jnp.pad(b, ((0, np_ - n), (0, kp - k)))
    sa, sb = jnp.pad(sa, (0, mp - m)), jnp.pad(sb, (0, np_ - n))
  out = _scaled_matmul_hopper(a, sa, b, sb, out_dtype=jnp.dtype(out_dtype), config=config, sms=sms or num_sms())
  return out[:m, :n] if (mp, np_) != (m, n) else out
