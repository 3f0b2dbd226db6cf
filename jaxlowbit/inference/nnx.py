"""Flax NNX: ``QuantizedLinear`` and in-place conversion of a model's ``nnx.Linear`` layers.

``QuantizedLinear.from_linear(linear, scheme)`` quantizes one ``nnx.Linear`` (or a
``jaxlowbit.nnx`` layer, which subclass it); ``convert_nnx(model, scheme)`` swaps every
such layer of a model for its ``QuantizedLinear``, in place, so the high-precision kernels
are no longer referenced and their memory is freed. The converted leaves are
:class:`QuantizedWeight` variables (not ``nnx.Param``: nothing to train), named as in the
Linen tree (``kernel_q``/``kernel_packed``, ``kernel_scale``, ``smooth``), so
``nnx.state(model)`` round-trips through orbax like any other state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlowbit.execution import EXECUTION_FIELD, ExecutionOptions
from jaxlowbit.inference.weights import (
    SMOOTHING_ALPHA,
    check_scheme,
    quantize_weight,
    quantized_linear,
    smoothing_factors,
)
from jaxlowbit.interception import LayerFilter, as_filter
from pallas_kernels.quantize import to_compute_dtype


class QuantizedWeight(nnx.Variable):
  """A converted (int8 / packed / scale) inference weight; not a trainable ``nnx.Param``."""


class QuantizedLinear(nnx.Module):
  """``nnx.Linear`` run from converted weights.

  Attributes:
    scheme: ``"w8a16"``, ``"w8a8"`` or ``"ternary"``.
    in_features, out_features: as the linear it came from.
    dtype: compute dtype (None: the promotion of inputs and ``param_dtype``).
    param_dtype: the original linear's parameter dtype.
    bias: ``nnx.Param [out_features]`` or None (kept high precision).
    kernel_q / kernel_packed, kernel_scale, smooth: :class:`QuantizedWeight` leaves.
    execution: how the GEMM runs (:class:`jaxlowbit.ExecutionOptions`; None: the defaults, the backend
      from ``$JAXLOWBIT_BACKEND``).
  """

  def __init__(self, leaves: Mapping[str, jax.Array], scheme: str, *, in_features: int, out_features: int,
               bias: jax.Array | None = None, dtype=None, param_dtype=jnp.float32,
               execution: ExecutionOptions | None = None):
    self.scheme = check_scheme(scheme, "QuantizedLinear")
    self.execution = execution
    self.in_features, self.out_features = in_features, out_features
    self.dtype, self.param_dtype = dtype, param_dtype
    for name, value in leaves.items():
      setattr(self, name, QuantizedWeight(value))
    self.leaf_names = tuple(sorted(leaves))
    self.bias = nnx.Param(bias) if bias is not None else None

  @classmethod
  def from_linear(cls, linear: nnx.Linear, scheme: str, act_amax: jax.Array | None = None,
                  alpha: float = SMOOTHING_ALPHA, *, execution: ExecutionOptions | None = None) -> "QuantizedLinear":
    """Quantize ``linear``'s kernel ``[in, out]`` for ``scheme`` (``act_amax [in]``: SmoothQuant, w8a8);
    ``execution`` None: the linear's own options (a ``jaxlowbit.nnx`` layer's), else the defaults."""
    check_scheme(scheme, "QuantizedLinear.from_linear")
    if not isinstance(linear, nnx.Linear):
      raise TypeError(f"QuantizedLinear.from_linear: expected an nnx.Linear, got {type(linear).__name__}")
    kernel = linear.kernel[...]
    smooth = None
    if act_amax is not None:
      if scheme != "w8a8":
        raise ValueError(f"QuantizedLinear.from_linear: act_amax (SmoothQuant) applies to w8a8 only, not {scheme}")
      smooth = smoothing_factors(jnp.asarray(act_amax), kernel, alpha)
    leaves = jax.jit(quantize_weight, static_argnums=1)(kernel, scheme, smooth)
    bias = linear.bias[...] if linear.bias is not None else None
    execution = execution if execution is not None else getattr(linear, EXECUTION_FIELD, None)
    return cls(leaves, scheme, in_features=linear.in_features, out_features=linear.out_features, bias=bias,
               dtype=linear.dtype, param_dtype=linear.param_dtype, execution=execution)

  def __call__(self, inputs: jax.Array) -> jax.Array:
    """``[..., in_features]`` floating -> ``[..., out_features]`` in the compute dtype."""
    if not jnp.issubdtype(jnp.result_type(inputs), jnp.floating):
      raise TypeError(f"QuantizedLinear: inputs must be floating point, got {jnp.result_type(inputs)}")
    if inputs.shape[-1] != self.in_features:
      raise ValueError(f"QuantizedLinear: inputs have {inputs.shape[-1]} features, the layer takes {self.in_features}")
    dtype = self.dtype or jnp.promote_types(jnp.result_type(inputs), self.param_dtype)
    leaves = {name: getattr(self, name)[...] for name in self.leaf_names}
    y = quantized_linear(to_compute_dtype(inputs, dtype), leaves, self.scheme, options=self.execution)
    if self.bias is not None:
      y = y + jnp.asarray(self.bias[...], dtype)
    return y


def _linears(model: nnx.Module) -> list[tuple[tuple, nnx.Linear]]:
  return [(tuple(path), node) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Linear)]


def _fqn(path: Sequence) -> str:
  return ".".join(str(p) for p in path)


def _parent(model: nnx.Module, path: tuple):
  node = model
  for key in path[:-1]:
    node = node[key] if isinstance(key, int) else getattr(node, key)
  return node


def _replace(model: nnx.Module, path: tuple, new) -> None:
  parent, key = _parent(model, path), path[-1]
  if isinstance(key, int):
    parent[key] = new
  else:
    setattr(parent, key, new)


def convert_nnx(model: nnx.Module, scheme: str, filter_fqns: Sequence[str] = ("lm_head",),
                act_amax: Mapping[str, jax.Array] | None = None, alpha: float = SMOOTHING_ALPHA,
                execution: ExecutionOptions | None = None) -> nnx.Module:
  """See :func:`jaxlowbit.inference.convert_for_inference` (NNX branch); converts in place."""
  check_scheme(scheme, "convert_for_inference")
  layer_filter = as_filter(filter_fqns)
  if act_amax is not None and scheme != "w8a8":
    raise ValueError(f"convert_for_inference: act_amax (SmoothQuant) applies to scheme w8a8 only, not {scheme}")
  if isinstance(model, nnx.Linear):
    return QuantizedLinear.from_linear(model, scheme, (act_amax or {}).get(""), alpha, execution=execution)
  remaining = dict(act_amax or {})
  for path, linear in _linears(model):
    fqn = _fqn(path)
    if layer_filter.keeps(fqn, linear):
      continue
    _replace(model, path, QuantizedLinear.from_linear(linear, scheme, remaining.pop(fqn, None), alpha,
                                                      execution=execution))
  if remaining:
    raise ValueError(f"convert_for_inference: act_amax names layers that were not converted: {sorted(remaining)}")
  return model


class _AmaxRecorder(nnx.Module):
  """Wraps a linear during calibration: records max |x| per input channel, then calls it."""

  def __init__(self, linear: nnx.Linear):
    self.linear = linear
    self.amax = nnx.Variable(jnp.zeros((linear.in_features,), jnp.float32))

  def __call__(self, x):
    magnitude = jnp.abs(x.astype(jnp.float32)).reshape(-1, x.shape[-1])
    self.amax[...] = jnp.maximum(self.amax[...], jnp.max(magnitude, axis=0))
    return self.linear(x)


def calibrate_nnx(model: nnx.Module, batches, call=None, filter_fqns: Sequence[str] | LayerFilter = ("lm_head",)) -> dict:
  """Max |x| per input channel of every (unfiltered) ``nnx.Linear``, over ``batches``.

  ``call(model, batch)`` runs the model (default ``model(batch)``); the linears are wrapped
  while it runs and restored afterwards. Returns ``{module path: [in_features] float32}``.
  """
  call = call or (lambda m, b: m(b))
  layer_filter = as_filter(filter_fqns)
  wrapped = []
  for path, linear in _linears(model):
    if layer_filter.keeps(_fqn(path), linear):
      continue
    recorder = _AmaxRecorder(linear)
    _replace(model, path, recorder)
    wrapped.append((path, recorder))
  try:
    for batch in batches:
      call(model, batch)
  finally:
    for path, recorder in wrapped:
      _replace(model, path, recorder.linear)
  return {_fqn(path): recorder.amax[...] for path, recorder in wrapped}
