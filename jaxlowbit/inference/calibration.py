"""SmoothQuant calibration: max |x| per input channel of every linear, over calibration batches.

``calibrate(model, batches, variables=...)`` runs a Linen model (or, without ``variables``, an
NNX model) on each batch and returns ``{module path: amax}`` with ``amax`` float32 ``[*lead, K]``
(``lead`` = the stacking axes of scanned layers), ready for ``quantize_params(..., "w8a8",
act_amax=...)`` or ``convert_for_inference(nnx_model, "w8a8", act_amax=...)``.

Linen layers report through ``Module.sow`` into the ``intermediates`` collection (the one
Flax's own ``sow`` uses), so a model that stacks layers with ``nn.scan`` must list it in
``variable_axes`` (``{"params": 0, "intermediates": 0}``), as ``train/model.py`` does; other
collections are dropped by ``nn.scan``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx, traverse_util
from flax.core import unfreeze

from jaxlowbit.execution import with_execution
from jaxlowbit.inference.nnx import calibrate_nnx
from jaxlowbit.inference.params import DEFAULT_FILTER_FQNS
from jaxlowbit.interception import PASS, LayerFilter, as_filter, dense_interceptor

COLLECTION = "intermediates"
AMAX_NAME = "jaxlowbit_act_amax"


def _recording_interceptor(layer_filter: LayerFilter):
  def record(module, x, path):
    if not layer_filter.keeps(path, module):
      amax = jnp.max(jnp.abs(jnp.asarray(x, jnp.float32)).reshape(-1, x.shape[-1]), axis=0)
      module.sow(COLLECTION, AMAX_NAME, amax, init_fn=lambda: jnp.zeros_like(amax), reduce_fn=jnp.maximum)
    return PASS

  return dense_interceptor(record)


def _linen_amax(model: nn.Module, variables: Any, batch: Any, layer_filter: LayerFilter, method) -> dict:
  model = with_execution(model, fused_quantizers=False)  # the linears' float inputs are what is recorded
  with nn.intercept_methods(_recording_interceptor(layer_filter)):
    _, state = model.apply(variables, batch, mutable=[COLLECTION], method=method)
  flat = traverse_util.flatten_dict(unfreeze(state.get(COLLECTION, {})))
  return {".".join(str(p) for p in path[:-1]): v for path, v in flat.items() if path[-1] == AMAX_NAME}


def calibrate(
    model,
    batches: Iterable[Any],
    variables: Any = None,
    *,
    filter_fqns: Sequence[str] = DEFAULT_FILTER_FQNS,
    method=None,
    call=None,
) -> dict[str, jax.Array]:
  """Per-input-channel activation abs-max of every linear, over ``batches``.

  Args:
    model: a Linen module (then pass ``variables``) or an NNX module.
    batches: iterable of model inputs (a few hundred to a few thousand tokens is typical).
    variables: Linen only: ``{"params": ...}`` of the *high-precision* model.
    filter_fqns: layers to skip (keep them the same as for ``quantize_params``).
    method: Linen only: the method to apply (default ``__call__``).
    call: NNX only: ``call(model, batch)`` (default ``model(batch)``).

  Returns:
    ``{module path: float32 [*lead, K]}``.
  """
  layer_filter = as_filter(filter_fqns)
  if isinstance(model, nnx.Module):
    return calibrate_nnx(model, batches, call, layer_filter)
  if not isinstance(model, nn.Module):
    raise TypeError(f"calibrate: expected a flax Linen or NNX module, got {type(model).__name__}")
  if variables is None:
    raise ValueError("calibrate: a Linen model needs its variables ({'params': ...})")
  apply = jax.jit(lambda v, b: _linen_amax(model, v, b, layer_filter, method))
  result: dict[str, jax.Array] = {}
  for batch in batches:
    for fqn, amax in apply(variables, batch).items():
      result[fqn] = jnp.maximum(result[fqn], amax) if fqn in result else amax
  if not result:
    raise ValueError("calibrate: no linear reported statistics; were the batches empty, or does the model stack "
                     f"layers with nn.scan without {COLLECTION!r} in variable_axes?")
  return result
