"""Low-bit inference: convert trained weights to int8 or packed ternary and run them.

    from jaxlowbit import inference
    qparams = inference.quantize_params(params, "w8a16")        # Linen tree, kernels -> int8
    qmodel = inference.convert_for_inference(model, "w8a16")    # reads the converted leaves
    logits = qmodel.apply({"params": qparams}, tokens)

    nnx_model = inference.convert_for_inference(nnx_model, "ternary")   # NNX: in place

Schemes (``weights.py`` has the storage table): ``"w8a16"`` int8 weights with a per-output-
channel scale and 16-bit activations; ``"w8a8"`` int8 weights and per-token dynamic int8
activations, optionally SmoothQuant-smoothed (:func:`calibrate`); ``"ternary"`` BitNet
b1.58 weights packed 2 bits per value, which reproduces a BitNet-trained model's forward
exactly. The GEMMs dispatch in ``pallas_kernels/inference_dispatch.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import flax.linen as nn
import jax
from flax import nnx as _nnx

from jaxlowbit.execution import ExecutionOptions
from jaxlowbit.inference.calibration import calibrate
from jaxlowbit.inference.linen import convert_linen
from jaxlowbit.inference.nnx import QuantizedLinear, QuantizedWeight, convert_nnx
from jaxlowbit.inference.params import DEFAULT_FILTER_FQNS, converted_layers, quantize_params, weight_bytes
from jaxlowbit.inference.weights import (
    SCHEMES,
    dequantize_weight,
    quantize_weight,
    quantized_linear,
    smoothing_factors,
)


def convert_for_inference(
    model,
    scheme: str,
    *,
    filter_fqns: Sequence[str] = DEFAULT_FILTER_FQNS,
    act_amax: Mapping[str, jax.Array] | None = None,
    execution: ExecutionOptions | None = None,
):
  """Make ``model`` run its linears from converted weights.

  Linen (``model`` an unbound ``nn.Module``): returns a copy of the model (an instance of a
  subclass of its class) whose ``Dense``/``DenseGeneral`` layers run :func:`quantized_linear`
  wherever their parameters hold converted leaves; convert the parameters with
  :func:`quantize_params` (``filter_fqns`` and ``act_amax`` belong there, and must be left
  unset here).

  NNX (``model`` an ``nnx.Module``): quantizes and replaces every ``nnx.Linear`` (jaxlowbit's
  NNX layers included) whose path avoids ``filter_fqns`` with a :class:`QuantizedLinear`,
  in place, and returns the model (an ``nnx.Linear`` itself comes back as a new
  ``QuantizedLinear``). ``act_amax`` (w8a8) comes from :func:`calibrate`.

  Args:
    model: the model to convert.
    scheme: ``"w8a16"``, ``"w8a8"`` or ``"ternary"``.
    filter_fqns: NNX only: layers whose dot-joined path contains one of these stay as they are.
    act_amax: NNX only: SmoothQuant statistics ``{path: [in_features]}``.
    execution: how the converted linears' GEMMs run (:class:`jaxlowbit.ExecutionOptions`); None: the
      model's own ``execution`` field (Linen, a model that declares one) or each layer's (a jaxlowbit
      layer's), else the defaults (the backend from ``$JAXLOWBIT_BACKEND``, read when traced).
  """
  if isinstance(model, _nnx.Module):
    return convert_nnx(model, scheme, filter_fqns, act_amax, execution=execution)
  if isinstance(model, nn.Module):
    if act_amax is not None or tuple(filter_fqns) != DEFAULT_FILTER_FQNS:
      raise ValueError("convert_for_inference: for Linen models, filter_fqns and act_amax are arguments of "
                       "quantize_params (the converted parameter tree decides which layers run quantized)")
    return convert_linen(model, scheme, execution)
  raise TypeError(f"convert_for_inference: expected a flax Linen or NNX module, got {type(model).__name__}")


__all__ = [
    "SCHEMES",
    "QuantizedLinear",
    "QuantizedWeight",
    "calibrate",
    "convert_for_inference",
    "converted_layers",
    "dequantize_weight",
    "quantize_params",
    "quantize_weight",
    "quantized_linear",
    "smoothing_factors",
    "weight_bytes",
]
