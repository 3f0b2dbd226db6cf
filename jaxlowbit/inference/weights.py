"""Inference schemes: how one linear's weight is stored, and the matmul that reads it.

A linear ``y = x @ W`` with ``W [K, N]`` (float32 master weights from training) is stored,
per scheme, as these leaves (replacing ``kernel``):

==========  ==========================================  ==============================================
scheme      leaves                                      forward
==========  ==========================================  ==============================================
w8a16       ``kernel_q`` int8 ``[N, K]``,                ``(x @ kernel_q.T) * kernel_scale`` in x's dtype
            ``kernel_scale`` float32 ``[N]``             (dequantized inside the GEMM)
w8a8        as w8a16, optionally ``smooth`` float32 [K]  ``x / smooth`` quantized per token to int8;
                                                        int8 x int8 -> int32, then both scales
ternary     ``kernel_packed`` int8 ``[N, K/4]``,         x quantized per token (eps 1e-5) to int8;
            ``kernel_scale`` float32 ``[]``              int8 x ternary -> int32, then both scales
==========  ==========================================  ==============================================

The weight is stored K-major (``[N, K]``, transposed from Flax's ``[K, N]``): the layout the
tensor-core GEMMs and the GEMV kernels read without a transpose pass. Weights are
quantized per output channel (``quantize_int8`` over K: ``scale = amax/127``) for the int8
schemes and with BitNet's absmean (``quantize_ternary``, one scale per linear) for ternary,
packed four values to a byte along K (``pack_2bit``). These are exactly the quantizations
the training recipes apply in their forward (``Int8MixedPrecision``, ``BitNet``), so a
converted model computes what it computed in training.

SmoothQuant (w8a8 only): activation outliers concentrate in a few input channels. With a
per-channel factor ``s`` (:func:`smoothing_factors`), ``x @ W = (x / s) @ (s W)``: the weight is
quantized after scaling its rows by ``s`` and the activations are divided by ``s`` before
their per-token quantization, which moves difficulty from activations to weights.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from jaxlowbit.execution import ExecutionOptions, resolve
from jaxlowbit.operand import LowBitOperand, is_low_bit
from jaxlowbit.recipes.bitnet import ACTIVATIONS as BITNET_ACTIVATIONS
from jaxlowbit.recipes.int8_mixed_precision import INT8_ROWS
from jaxlowbit_numerics import int8, ternary
from jaxlowbit_numerics.formats import QuantSpec
from pallas_kernels import inference_dispatch, policy
from pallas_kernels.quantize import check_gate_activation

SCHEMES = ("w8a16", "w8a8", "ternary")
KERNEL_Q = "kernel_q"
KERNEL_PACKED = "kernel_packed"
KERNEL_SCALE = "kernel_scale"
SMOOTH = "smooth"
# Leaves each scheme stores (SMOOTH is optional for w8a8).
LEAVES = {
    "w8a16": (KERNEL_Q, KERNEL_SCALE),
    "w8a8": (KERNEL_Q, KERNEL_SCALE),
    "ternary": (KERNEL_PACKED, KERNEL_SCALE),
}
CONVERTED_NAMES = frozenset({KERNEL_Q, KERNEL_PACKED, KERNEL_SCALE, SMOOTH})

# Activation quantization per token: exactly the training recipes' forwards (Int8MixedPrecision: eps
# 1e-12; BitNet: eps 1e-5).
INT8_TOKENS = INT8_ROWS
BITNET_TOKENS = BITNET_ACTIVATIONS
# SmoothQuant's migration strength (Xiao et al. 2023 use 0.5 for most models) and the floor
# on both statistics, so dead channels give a finite factor.
SMOOTHING_ALPHA = 0.5
SMOOTHING_EPS = 1e-5


def check_scheme(scheme: object, who: str) -> str:
  """ValueError unless ``scheme`` is one of :data:`SCHEMES`."""
  if scheme not in SCHEMES:
    raise ValueError(f"{who}: scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
  return scheme


def scheme_of(leaves: Mapping[str, object]) -> tuple[str, ...]:
  """The schemes a set of converted leaves can belong to (empty when it holds none)."""
  if KERNEL_PACKED in leaves:
    return ("ternary",)
  if KERNEL_Q in leaves:
    return ("w8a16", "w8a8")
  return ()


def smoothing_factors(act_amax: jax.Array, kernel: jax.Array, alpha: float = SMOOTHING_ALPHA) -> jax.Array:
  """SmoothQuant per-input-channel factors ``s = amax_x^alpha / amax_w^(1 - alpha)``.

  Args:
    act_amax: ``[K]`` max |x| per input channel over calibration tokens (:func:`calibrate`).
    kernel: ``[K, N]`` weight.
    alpha: migration strength in [0, 1] (0: no smoothing of activations, 1: all onto weights).

  Returns:
    float32 ``[K]``; activations are divided by it and weight rows multiplied by it.
  """
  if not 0.0 <= alpha <= 1.0:
    raise ValueError(f"smoothing_factors: alpha must lie in [0, 1], got {alpha}")
  if act_amax.shape != kernel.shape[:1]:
    raise ValueError(f"smoothing_factors: act_amax has shape {act_amax.shape}; expected [K]={kernel.shape[:1]}")
  x_max = jnp.maximum(act_amax.astype(jnp.float32), SMOOTHING_EPS)
  w_max = jnp.maximum(jnp.max(jnp.abs(kernel.astype(jnp.float32)), axis=1), SMOOTHING_EPS)
  return x_max**alpha / w_max ** (1.0 - alpha)


def quantize_weight(kernel: jax.Array, scheme: str, smooth: jax.Array | None = None) -> dict[str, jax.Array]:
  """The converted leaves of one ``[K, N]`` floating kernel (see the module table).

  Args:
    kernel: ``[K, N]`` float32/bf16 weight (the high-precision master weight).
    scheme: ``"w8a16"``, ``"w8a8"`` or ``"ternary"``.
    smooth: w8a8 only: ``[K]`` SmoothQuant factors, or None.

  Returns:
    A dict of arrays: ``kernel_q [N, K]`` int8 + ``kernel_scale [N]`` (+ ``smooth [K]``), or
    ``kernel_packed [N, K/4]`` int8 + ``kernel_scale []`` for ternary.
  """
  check_scheme(scheme, "quantize_weight")
  if kernel.ndim != 2:
    raise ValueError(f"quantize_weight: expected a 2-D [K, N] kernel, got shape {kernel.shape}")
  if smooth is not None and scheme != "w8a8":
    raise ValueError(f"quantize_weight: SmoothQuant factors apply to w8a8 only, not {scheme}")
  if scheme == "ternary":
    k = kernel.shape[0]
    if k % ternary.VALUES_PER_BYTE:
      raise ValueError(f"quantize_weight: ternary packing needs K (in features) divisible by 4, got K={k}; "
                       "keep this layer high precision (filter_fqns) or pad it")
    q, scale = ternary.quantize_ternary(kernel)  # exactly BitNet's training forward
    return {KERNEL_PACKED: ternary.pack_2bit(q.T, axis=-1), KERNEL_SCALE: scale}
  leaves = {}
  if smooth is not None:
    kernel = kernel.astype(jnp.float32) * smooth[:, None]
    leaves[SMOOTH] = smooth.astype(jnp.float32)
  q, scale = int8.quantize_int8(kernel, axis=0)  # per output channel, as Int8MixedPrecision's forward
  return {KERNEL_Q: q.T, KERNEL_SCALE: scale.reshape(-1), **leaves}


def dequantize_weight(leaves: Mapping[str, jax.Array], scheme: str) -> jax.Array:
  """float32 ``[K, N]`` weight that a set of converted leaves stands for (smoothing undone)."""
  check_scheme(scheme, "dequantize_weight")
  if scheme == "ternary":
    q = ternary.unpack_2bit(leaves[KERNEL_PACKED], axis=-1)
    return (q.astype(jnp.float32) * leaves[KERNEL_SCALE]).T
  w = (leaves[KERNEL_Q].astype(jnp.float32) * leaves[KERNEL_SCALE][:, None]).T
  if SMOOTH in leaves:
    w = w / leaves[SMOOTH][:, None]
  return w


def _check_leaves(leaves: Mapping[str, jax.Array], scheme: str, k: int, who: str) -> int:
  """N of the converted weight; ValueError when the leaves do not fit ``scheme`` or K."""
  missing = [name for name in LEAVES[scheme] if name not in leaves]
  if missing:
    found = scheme_of(leaves)
    hint = f" (they look converted for {' or '.join(found)})" if found else ""
    raise ValueError(f"{who}: scheme {scheme} needs leaves {LEAVES[scheme]}, missing {missing}{hint}; convert "
                     f"the params with quantize_params(params, {scheme!r})")
  w = leaves[LEAVES[scheme][0]]
  k_stored = w.shape[-1] * (ternary.VALUES_PER_BYTE if scheme == "ternary" else 1)
  if w.ndim != 2 or k_stored != k:
    raise ValueError(f"{who}: converted weight {LEAVES[scheme][0]} has shape {w.shape}; expected [N, K] with K={k} "
                     f"({'packed 4 per byte' if scheme == 'ternary' else 'int8'})")
  return w.shape[0]


# What a converted linear's input may arrive as, already quantized (a decode step's norm quantizes it:
# ``ExecutionOptions.decode_inputs``, set by ``convert_for_inference`` from :func:`decode_input_spec`): scheme -> its
# per-row spec.
DECODE_INPUTS = {"ternary": BITNET_TOKENS, "w8a8": INT8_TOKENS}


def decode_input_spec(scheme: str) -> QuantSpec | None:
  """The per-row spec in which a model converted for ``scheme`` has its decode norms hand its linears their input
  (``ExecutionOptions.decode_inputs``), or None: ternary's always; W8A8's where
  ``pallas_kernels.policy.W8A8_DECODE_CODES`` says so (on: see there)."""
  if scheme == "w8a8" and not policy.W8A8_DECODE_CODES:
    return None
  return DECODE_INPUTS.get(scheme)


def decode_input_rows(scheme: str) -> int | None:
  """The most rows at which a decode norm hands a model converted for ``scheme`` its codes
  (``ExecutionOptions.decode_input_rows``), or None (any). Ternary's linears quantize with the norm's encode at
  every M. W8A8's take the norm's codes only where the dp4a GEMV would quantize inside
  (:func:`inference_dispatch.w8a8_gemv_rows`: one row), whose codes the norm's equal on the GPU; at more rows XLA
  quantizes, and there they were not its codes: handed at the 6-row prefill, they moved 95% of a 4-layer model's
  prefill logits and its KV cache on an H200 (``policy.W8A8_DECODE_CODES``)."""
  return inference_dispatch.w8a8_gemv_rows() if scheme == "w8a8" else None


def gated_outputs(scheme: str) -> bool:
  """Whether a model converted for ``scheme`` has its decode steps' gate_up projections return the gated activation
  (``ExecutionOptions.gated_outputs``): where ``pallas_kernels.policy.GATED_EPILOGUE`` is on, for ternary and W8A16,
  whose decode GEMVs form it in their epilogue. Not W8A8: its decode gave XLA's logits bit for bit, and with the
  activation returned by the projection (formed by XLA either way) a two-layer 1B-wide model's logits moved on an
  H200 (92.6% of them by a bf16 step or more). The cause was not found; one candidate, not tested: where the
  projection is an XLA int8 dot (the prefill's rows), XLA may fuse the activation into its epilogue and keep the
  gate and up values in float32 there (excess precision), skipping the bf16 rounding a ``[gate | up]`` output has."""
  return policy.GATED_EPILOGUE and scheme in ("ternary", "w8a16")


def _prequantized_linear(x: LowBitOperand, leaves: Mapping[str, jax.Array], scheme: str,
                         options: ExecutionOptions | None, gated: str | None) -> jax.Array:
  """``quantized_linear`` of an input its producer quantized: ``x [M, K]`` -> ``[M, N]`` in x's dtype.

  The codes where they are this scheme's (:data:`DECODE_INPUTS`; a SmoothQuant-smoothed W8A8 linear quantizes
  ``x / smooth``, other codes); else the operand's values, where its producer kept them, as a float x.
  """
  spec = DECODE_INPUTS.get(scheme)
  rows = x.rows
  takes_codes = (spec is not None and rows is not None and rows.spec == spec and rows.per_row
                 and SMOOTH not in leaves)
  if not takes_codes:
    if x.values is not None:
      return quantized_linear(x.values, leaves, scheme, options=options, gated=gated)
    raise TypeError(f"quantized_linear: scheme {scheme} takes a float x{f' or {spec} rows' if spec else ''}; got a "
                    f"low-bit operand of {None if rows is None else rows.spec}"
                    f"{' (smoothed: it quantizes x / smooth)' if SMOOTH in leaves else ''}")
  _check_leaves(leaves, scheme, x.shape[-1], "quantized_linear")
  kernels = resolve(options).dispatch()
  if scheme == "w8a8":
    return inference_dispatch.w8a8_matmul(rows.data, rows.scale, leaves[KERNEL_Q], leaves[KERNEL_SCALE], x.dtype,
                                          options=kernels, gated=gated)
  return inference_dispatch.ternary_matmul(rows.data, rows.scale, leaves[KERNEL_PACKED], leaves[KERNEL_SCALE],
                                           x.dtype, options=kernels, gated=gated)


def quantized_linear(x: jax.Array | LowBitOperand, leaves: Mapping[str, jax.Array], scheme: str, *,
                     options: ExecutionOptions | None = None, gated: str | None = None) -> jax.Array:
  """``x @ W`` from converted leaves: ``x [..., K]`` floating -> ``[..., N]`` in x's dtype.

  ``x`` may also arrive quantized, as the :class:`~jaxlowbit.operand.LowBitOperand` ``[M, K]`` of its per-row codes
  in :data:`DECODE_INPUTS`'s spec for the scheme (ternary: BitNet's per-token int8; W8A8: Int8MixedPrecision's;
  from a decode step's norm), or with its float values beside them; the result is then ``[M, N]``, what the float
  x the codes came from gives.

  The matmul runs through :mod:`pallas_kernels.inference_dispatch` (GEMV/GEMM kernels on
  GPU, XLA elsewhere) on the backend of ``options`` (:class:`jaxlowbit.ExecutionOptions`; None, or
  a backend of None: ``$JAXLOWBIT_BACKEND``, read here, the public edge). For ``ternary`` this is
  bit-for-bit BitNet's training forward; for ``w8a8`` without smoothing, Int8MixedPrecision's.

  ``gated`` (an activation of ``pallas_kernels.quantize.GATE_ACTIVATIONS``): the linear is a gated MLP's fused
  ``[gate | up]`` projection, and the result is ``act(gate) * up`` ``[..., N / 2]`` of its output, in the float32
  formula of ``jaxlowbit.fused.swiglu`` (a decode GEMV forms it in its epilogue instead of writing both halves:
  ``pallas_kernels.inference_dispatch.gate``).
  """
  check_scheme(scheme, "quantized_linear")
  if gated is not None:
    check_gate_activation(gated)
    w = leaves.get(KERNEL_PACKED if scheme == "ternary" else KERNEL_Q)
    if w is not None and w.shape[0] % 2:
      raise ValueError(f"quantized_linear: gated={gated!r} takes [gate | up] outputs, an even number; the weight has "
                       f"{w.shape[0]}")
  if is_low_bit(x):
    return _prequantized_linear(x, leaves, scheme, options, gated)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"quantized_linear: x must be floating point, got {x.dtype}")
  if x.ndim < 1:
    raise ValueError("quantized_linear: x must have at least one dimension [..., K], got a scalar")
  k = x.shape[-1]
  _check_leaves(leaves, scheme, k, "quantized_linear")
  batch_shape = x.shape[:-1]
  x2 = x.reshape(-1, k)
  kernels = resolve(options).dispatch()  # the backend, once, for the quantizer and the GEMM
  if scheme == "w8a16":
    y = inference_dispatch.w8a16_matmul(x2, leaves[KERNEL_Q], leaves[KERNEL_SCALE], x.dtype, options=kernels,
                                        gated=gated)
  elif scheme == "w8a8":
    if SMOOTH in leaves:
      x2 = x2.astype(jnp.float32) / leaves[SMOOTH]  # quantized straight from float32
    y = inference_dispatch.w8a8_linear(x2, INT8_TOKENS, leaves[KERNEL_Q], leaves[KERNEL_SCALE], x.dtype,
                                       options=kernels, gated=gated)
  else:
    y = inference_dispatch.ternary_linear(x2, BITNET_TOKENS, leaves[KERNEL_PACKED], leaves[KERNEL_SCALE], x.dtype,
                                          options=kernels, gated=gated)
  return y.reshape(*batch_shape, y.shape[-1])
