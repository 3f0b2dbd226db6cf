"""The one place that picks an implementation for the inference (weight-quantized) GEMMs.

``jaxlowbit.inference`` sends every converted linear through one of three functions:

- :func:`w8a16_matmul`  bf16 ``x [M, K]`` x int8 ``wq [N, K]`` (+ per-channel scale)
- :func:`w8a8_matmul`   int8 ``xq [M, K]`` x int8 ``wq [N, K]`` (+ per-token and per-channel scales)
- :func:`ternary_matmul` int8 ``xq [M, K]`` x packed 2-bit ``[N, K/4]`` (+ per-token scales, one weight scale)

and :func:`w8a8_linear` and :func:`ternary_linear`, which take the float activations (at decode M the quantizer
can run inside the GEMV). Each takes ``gated``: the linear is a gated MLP's fused ``[gate | up]`` projection and
returns ``act(gate) * up`` ``[M, N / 2]``; the decode GEMVs form it in their epilogue (where K is unsplit), every
other path in XLA after the matmul, in the same float32 formula (``pallas_kernels.quantize.gated_epilogue``).

Implementations under ``auto``, by M (the thresholds and the H200 measurements behind them are in
:mod:`pallas_kernels.policy`):

============  ===========================================  ==========================================
scheme        decode-sized M                               larger M
============  ===========================================  ==========================================
w8a16         ``pallas_kernels.w8a16`` (Triton, split-K)   XLA: its GEMM fusion converts int8 -> bf16
              at M = 1 and 16..32; XLA at M = 2..15        on the fly (no bf16 weight in memory)
w8a8          ``dp4a_gemv`` (int8 words, quantizer         Hopper wgmma (``dispatch.scaled_matmul``)
              inside) at M = 1                             once the output fills the GPU, else XLA
              (``policy.W8A8_GEMV_MAX_M``); XLA int8 dot
              above (it ties the A8W8 kernel)
ternary       ``pallas_kernels.int8_gemv`` A8W2 (2-bit     unpack to int8 ``[N, K]`` once, then as w8a8
              weights unpacked in registers), M <= 32;
              ``dp4a_gemv`` (quantizer inside, dp4a) at M <= 3,
              on a norm's codes at M <= 2 (``policy``)
============  ===========================================  ==========================================

Everywhere else (CPU, GPUs older than sm80, shapes a kernel does not tile) the XLA
references run, with the same numerics. The backend comes in ``options``
(``dispatch.DispatchOptions``; none given: ``$JAXLOWBIT_BACKEND``, as in ``dispatch``): ``xla``
forces the references, ``pallas`` forces the kernels for every M (the GEMV kernels, then wgmma for
w8a8/ternary above ``*_KERNEL_MAX_M``) and raises a clear error where they cannot run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlowbit_numerics.ternary import VALUES_PER_BYTE, unpack_2bit
from pallas_kernels import dispatch, policy
from pallas_kernels.dispatch import DispatchOptions
from pallas_kernels.int8_gemv import A8W2_BASE, A8W8_BASE, check_a8w2, check_a8w8
from pallas_kernels.int8_gemv import config_for as gemv_config_for
from pallas_kernels.int8_gemv import supports as gemv_supports
from pallas_kernels.quantize import SwiGLU
from pallas_kernels.reference import scaled_matmul_reference
from pallas_kernels.w8a16 import ACTIVATION_DTYPES, check_operands, w8a16_matmul_reference
from pallas_kernels.w8a16 import config_for as w8a16_config_for
from pallas_kernels.w8a16 import supports as w8a16_supports

def _backend(options: DispatchOptions | None) -> str:
  return (DispatchOptions.from_environment() if options is None else options).backend


def gate(y: jax.Array, gated: str | None) -> jax.Array:
  """``y [M, N]``, or with ``gated`` (an activation) ``act(gate) * up [M, N / 2]`` of its halves ``[gate | up]``, by
  XLA: what a kernel's gated epilogue writes."""
  return y if gated is None else SwiGLU(gated).reference((y,))


def _gated_kernel(run, gated: str | None, in_kernel: str | None) -> jax.Array:
  """``run(in_kernel)`` of a kernel whose epilogue forms ``in_kernel`` (``gated`` where its tiling takes it, else
  None); :func:`gate` forms ``gated`` after a kernel that did not."""
  return gate(run(in_kernel), gated if in_kernel is None else None)


def w8a16_matmul(x: jax.Array, wq: jax.Array, w_scale: jax.Array, out_dtype=None,
                 options: DispatchOptions | None = None, gated: str | None = None) -> jax.Array:
  """``(x @ wq.T) * w_scale``: x ``[M, K]`` float, wq ``[N, K]`` int8, w_scale ``[N]`` float32 -> ``[M, N]``
  (``gated``: its :func:`gate`)."""
  check_operands(x, wq, w_scale)
  backend = _backend(options)
  m, k = x.shape
  n = wq.shape[0]
  config = w8a16_config_for(m, n, k)
  fits = jnp.dtype(x.dtype) in ACTIVATION_DTYPES and w8a16_supports(n, k, config)
  if policy.use_inference_kernel("W8A16", policy.w8a16_kernel_wanted(m), fits, backend):
    from pallas_kernels.w8a16 import w8a16_matmul_kernel

    in_kernel = gated if gated is not None and w8a16_supports(n, k, config, gated=True) else None
    return _gated_kernel(lambda g: w8a16_matmul_kernel(x, wq, w_scale, out_dtype, gated=g), gated, in_kernel)
  return gate(w8a16_matmul_reference(x, wq, w_scale, out_dtype), gated)


def _use_gemv(who: str, m: int, n: int, k_bytes: int, kernel_max_m: int, base, backend: str) -> bool:
  """Whether an int8-activation GEMV kernel (``pallas_kernels.int8_gemv``) takes ``[M, K] x [N, K_bytes]``.

  Under ``auto`` up to ``kernel_max_m`` rows; forced (``pallas``) up to ``policy.GEMV_MAX_M``,
  above which the wgmma GEMM takes over.
  """
  if m > policy.gemv_max_m(kernel_max_m, backend):
    return False
  fits = gemv_supports(n, k_bytes, gemv_config_for(m, n, k_bytes, base))
  return policy.use_inference_kernel(who, m <= kernel_max_m, fits, backend)


def _int8_gemm(xq, x_scale, wq, w_scale, out_dtype, backend: str) -> jax.Array:
  """Large-M int8 GEMM: wgmma (``dispatch.scaled_matmul``) when it fills the GPU or is forced, else XLA."""
  if backend == "pallas" or policy.wgmma_fills_gpu(xq.shape[0], wq.shape[0]):
    return dispatch.scaled_matmul(xq, x_scale, wq, w_scale.reshape(-1), out_dtype, DispatchOptions(backend))
  return scaled_matmul_reference(xq, x_scale, wq, w_scale.reshape(-1), out_dtype)


def w8a8_matmul(xq, x_scale, wq, w_scale, out_dtype=jnp.bfloat16, options: DispatchOptions | None = None,
                gated: str | None = None) -> jax.Array:
  """``(xq @ wq.T) * x_scale * w_scale``: int8 ``[M, K]`` x int8 ``[N, K]`` -> ``[M, N]`` (int32 exact; ``gated``:
  its :func:`gate`)."""
  check_a8w8(xq, x_scale, wq, w_scale)
  backend = _backend(options)
  if _dp4a_gemv_runs(xq.shape[0], wq.shape[0], xq.shape[1], True, False, backend):
    from pallas_kernels.dp4a_gemv import a8w8_gemv_kernel

    return _gated_kernel(lambda g: a8w8_gemv_kernel(xq, x_scale, wq, w_scale, out_dtype, gated=g), gated,
                         _dp4a_gated(xq.shape[0], wq.shape[0], xq.shape[1], True, False, gated))
  if _use_gemv("W8A8", xq.shape[0], *wq.shape, policy.W8A8_KERNEL_MAX_M, A8W8_BASE, backend):
    from pallas_kernels.int8_gemv import a8w8_matmul_kernel

    return gate(a8w8_matmul_kernel(xq, x_scale, wq, w_scale, out_dtype), gated)
  return gate(_int8_gemm(xq, x_scale, wq, w_scale, out_dtype, backend), gated)


def dp4a_gemv_wanted(m: int, n: int, k: int, codes: bool = False, packed: bool = True) -> bool:
  """Whether the CUDA-core dp4a GEMV (``pallas_kernels.dp4a_gemv``) should take ``[M, K] x`` an ``[N, K]`` weight
  (``packed``: ternary, else int8; ``codes``: x as int8 codes): M up to ``policy.TERNARY_GEMV_MAX_M`` (ternary
  codes: ``policy.TERNARY_CODES_GEMV_MAX_M``) or ``policy.W8A8_GEMV_MAX_M`` (0: off, see there) and a weight it
  tiles."""
  from pallas_kernels import dp4a_gemv

  if packed:
    max_m = policy.TERNARY_CODES_GEMV_MAX_M if codes else policy.TERNARY_GEMV_MAX_M
  else:
    max_m = policy.W8A8_GEMV_MAX_M
  groups = k // VALUES_PER_BYTE
  return m <= max_m and dp4a_gemv.supports(m, n, groups, dp4a_gemv.config_for(n, groups, m=m, codes=codes,
                                                                                packed=packed))


def _dp4a_gated(m: int, n: int, k: int, codes: bool, packed: bool, gated: str | None) -> str | None:
  """``gated`` where the dp4a GEMV's epilogue forms it on its default tiling (K unsplit), else None."""
  from pallas_kernels import dp4a_gemv

  groups = k // VALUES_PER_BYTE
  config = dp4a_gemv.config_for(n, groups, m=m, codes=codes, packed=packed)
  return gated if gated is not None and dp4a_gemv.supports(m, n, groups, config, gated=True) else None


def _dp4a_gemv_runs(m: int, n: int, k: int, codes: bool, packed: bool, backend: str) -> bool:
  """:func:`dp4a_gemv_wanted`, where a kernel may run under ``backend``."""
  return (dp4a_gemv_wanted(m, n, k, codes, packed)
          and policy.use_inference_kernel("ternary GEMV" if packed else "W8A8 GEMV", True, True, backend))


def _quantizing_linear(x, spec, w, w_scale, out_dtype, options: DispatchOptions | None, matmul, packed: bool,
                       quantizes: bool, gated: str | None):
  """Float ``x [M, K]`` quantized per row by ``spec``, times ``w`` (``packed``: ternary ``[N, K/4]``, else int8
  ``[N, K]``): one dp4a GEMV with the quantizer inside where it runs and ``quantizes`` allows, else
  :func:`dispatch.quantize_rows`, then ``matmul`` (``gated``: the output's :func:`gate`)."""
  out_dtype = out_dtype or x.dtype
  options = DispatchOptions.from_environment() if options is None else options
  if x.ndim == 2 and quantizes and _dp4a_gemv_runs(x.shape[0], w.shape[0], x.shape[1], False, packed,
                                                   options.backend):
    from pallas_kernels import dp4a_gemv

    kernel = dp4a_gemv.quantize_a8w2_gemv_kernel if packed else dp4a_gemv.quantize_a8w8_gemv_kernel
    return _gated_kernel(lambda g: kernel(x, w, w_scale, spec, out_dtype, gated=g), gated,
                         _dp4a_gated(x.shape[0], w.shape[0], x.shape[1], False, packed, gated))
  xq, sx = dispatch.quantize_rows(x, spec, options=options)
  return matmul(xq, sx, w, w_scale, out_dtype, options=options, gated=gated)


def ternary_linear(x, spec, w_packed, w_scale, out_dtype=None, options: DispatchOptions | None = None,
                   gated: str | None = None) -> jax.Array:
  """BitNet's inference linear: float ``x [M, K]`` quantized per row by ``spec``, times packed ``[N, K/4]``.

  M up to ``policy.TERNARY_GEMV_MAX_M`` runs one kernel (``dp4a_gemv.quantize_a8w2_gemv_kernel``: the
  quantizer inside the GEMV); otherwise :func:`dispatch.quantize_rows`, then :func:`ternary_matmul`. The codes
  are XLA's bit for bit (``pallas_kernels.quantize.encode``).
  """
  return _quantizing_linear(x, spec, w_packed, w_scale, out_dtype, options, ternary_matmul, True, True, gated)


def w8a8_linear(x, spec, wq, w_scale, out_dtype=None, options: DispatchOptions | None = None,
                gated: str | None = None) -> jax.Array:
  """W8A8's inference linear: float ``x [M, K]`` quantized per row by ``spec``, times int8 ``wq [N, K]``.

  Where ``policy.W8A8_GEMV_QUANTIZES`` and M is up to ``policy.W8A8_GEMV_MAX_M``, one kernel
  (``dp4a_gemv.quantize_a8w8_gemv_kernel``); otherwise :func:`dispatch.quantize_rows`, then :func:`w8a8_matmul`.
  """
  return _quantizing_linear(x, spec, wq, w_scale, out_dtype, options, w8a8_matmul, False,
                            policy.W8A8_GEMV_QUANTIZES, gated)


def w8a8_gemv_rows() -> int:
  """The most rows at which :func:`w8a8_linear` quantizes its input inside the dp4a GEMV (0: nowhere)."""
  return policy.W8A8_GEMV_MAX_M if policy.W8A8_GEMV_QUANTIZES else 0


def ternary_matmul(xq, x_scale, w_packed, w_scale, out_dtype=jnp.bfloat16,
                   options: DispatchOptions | None = None, gated: str | None = None) -> jax.Array:
  """``(xq @ unpack(w_packed).T) * x_scale * w_scale``: int8 ``[M, K]`` x packed ``[N, K/4]`` -> ``[M, N]``
  (``gated``: its :func:`gate`)."""
  check_a8w2(xq, x_scale, w_packed, w_scale)
  backend = _backend(options)
  if _dp4a_gemv_runs(xq.shape[0], w_packed.shape[0], xq.shape[1], True, True, backend):
    from pallas_kernels.dp4a_gemv import a8w2_gemv_kernel

    return _gated_kernel(lambda g: a8w2_gemv_kernel(xq, x_scale, w_packed, w_scale, out_dtype, gated=g), gated,
                         _dp4a_gated(xq.shape[0], w_packed.shape[0], xq.shape[1], True, True, gated))
  if _use_gemv("ternary A8W2", xq.shape[0], *w_packed.shape, policy.TERNARY_KERNEL_MAX_M, A8W2_BASE, backend):
    from pallas_kernels.int8_gemv import a8w2_matmul_kernel

    return gate(a8w2_matmul_kernel(xq, x_scale, w_packed, w_scale, out_dtype), gated)
  # Larger M is compute-bound: one unpack pass (N*K/4 bytes in, N*K out) buys int8 tensor-core speed.
  return gate(_int8_gemm(xq, x_scale, unpack_2bit(w_packed, axis=-1), w_scale, out_dtype, backend), gated)
