"""``quantize_params``: a Linen parameter tree with its linear kernels converted for inference.

Which leaves convert: every ``kernel`` leaf of two or more dimensions and floating dtype
(the weight of a ``Dense``/``DenseGeneral``/jaxlowbit layer) whose module path does not
contain one of ``filter_fqns`` (dot-joined, e.g. ``"layers.mlp.down"``, as in
``jaxlowbit.convert``). A kernel is read as ``[*lead, K, N]``: ``K`` input features, ``N``
output features, and leading axes that stack layers (``nn.scan``, e.g. ``[n_layers, K, N]``),
each slice converted on its own exactly as the scanned layer quantizes it in training.
Embeddings (``embedding`` leaves), norms and biases never convert, and the LM head stays
high precision by default (``filter_fqns=("lm_head",)``).

Not handled: ``DenseGeneral`` layers that contract several axes or produce several feature
axes (their kernels are not ``[K, N]``) and convolution kernels; keep them out with
``filter_fqns``. The converted layers raise a clear error when they meet such a kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util
from flax.core import meta, unfreeze

from jaxlowbit.inference.weights import (
    CONVERTED_NAMES,
    SMOOTHING_ALPHA,
    check_scheme,
    quantize_weight,
    smoothing_factors,
)
from jaxlowbit.interception import LayerFilter, as_filter

DEFAULT_FILTER_FQNS = ("lm_head",)
# The variables collection Linen keeps weights in; a leading key of that name is not part of a path.
PARAMS_COLLECTION = "params"


def path_fqn(path: Sequence[str]) -> str:
  """Module path of a flattened parameter path.

  ``("params", "layers", "mlp", "down", "kernel")`` -> ``"layers.mlp.down"``.
  """
  keys = [str(p) for p in path[:-1]]
  if keys and keys[0] == PARAMS_COLLECTION:
    keys = keys[1:]
  return ".".join(keys)


def _flatten(params: Any) -> dict[tuple, Any]:
  tree = unfreeze(meta.unbox(params))
  if not isinstance(tree, Mapping):
    raise TypeError(f"quantize_params: expected a nested dict of parameters (Linen), got {type(params).__name__}; "
                    "for NNX modules use convert_for_inference(module, scheme)")
  return traverse_util.flatten_dict(tree)


def is_convertible(path: Sequence[str], leaf: Any, filter_fqns: Sequence[str] | LayerFilter) -> bool:
  """Whether ``quantize_params`` converts this leaf (see the module docstring)."""
  return (
      bool(path)
      and path[-1] == "kernel"
      and getattr(leaf, "ndim", 0) >= 2
      and jnp.issubdtype(leaf.dtype, jnp.floating)
      and not as_filter(filter_fqns).keeps(path_fqn(path))
  )


@functools.partial(jax.jit, static_argnames=("scheme", "alpha"))
def _convert_kernel(kernel: jax.Array, act_amax: jax.Array | None, scheme: str, alpha: float) -> dict[str, jax.Array]:
  """Converted leaves of a ``[*lead, K, N]`` kernel; each ``[K, N]`` slice on its own."""

  def one(w, amax):
    smooth = None if amax is None else smoothing_factors(amax, w, alpha)
    return quantize_weight(w, scheme, smooth)

  lead, (k, n) = kernel.shape[:-2], kernel.shape[-2:]
  if not lead:
    return one(kernel, act_amax)
  flat_w = kernel.reshape(-1, k, n)
  if act_amax is None:
    out = jax.lax.map(lambda w: one(w, None), flat_w)
  else:
    out = jax.lax.map(lambda wa: one(*wa), (flat_w, act_amax.reshape(-1, k)))
  return {name: v.reshape(*lead, *v.shape[1:]) for name, v in out.items()}


def quantize_params(
    params: Any,
    scheme: str,
    *,
    filter_fqns: Sequence[str] = DEFAULT_FILTER_FQNS,
    act_amax: Mapping[str, jax.Array] | None = None,
    alpha: float = SMOOTHING_ALPHA,
    donate: bool = False,
) -> dict:
  """A new parameter tree whose linear kernels are stored for inference with ``scheme``.

  Args:
    params: a Linen parameter tree (``variables["params"]``, or the whole variables dict),
      e.g. ``TrainState.params`` restored from a ``train.main`` checkpoint.
    scheme: ``"w8a16"`` (int8 weights, per-output-channel scale, 16-bit activations),
      ``"w8a8"`` (int8 weights, per-token dynamic int8 activations) or ``"ternary"`` (BitNet
      absmean ternary packed 2 bits per value).
    filter_fqns: kernels whose module path contains one of these strings stay as they are.
    act_amax: w8a8 only: SmoothQuant statistics from :func:`jaxlowbit.inference.calibrate`,
      ``{module path: max |x| per input channel, [*lead, K]}``; listed layers get smoothing
      factors (stored as their ``smooth`` leaf), the others none.
    alpha: SmoothQuant migration strength.
    donate: delete each original kernel's buffer as soon as it is converted, so peak memory
      stays near the original tree plus one converted kernel (the input tree is unusable after).

  Returns:
    A nested dict with the same structure except that each converted layer's ``kernel`` is
    replaced by ``kernel_q``/``kernel_packed``, ``kernel_scale`` (and ``smooth``); every
    other leaf is the input's own array. Run it with :func:`convert_for_inference`.
  """
  check_scheme(scheme, "quantize_params")
  filter_fqns = as_filter(filter_fqns)
  if act_amax is not None and scheme != "w8a8":
    raise ValueError(f"quantize_params: act_amax (SmoothQuant) applies to scheme w8a8 only, not {scheme}")
  flat = _flatten(params)
  already = sorted({path_fqn(p) for p in flat if p[-1] in CONVERTED_NAMES})
  if already:
    raise ValueError(f"quantize_params: the tree already holds converted layers ({', '.join(already[:3])}...); "
                     "convert the original high-precision parameters")
  remaining = dict(act_amax or {})
  out = {}
  for path, leaf in flat.items():
    if not is_convertible(path, leaf, filter_fqns):
      out[path] = leaf
      continue
    amax = remaining.pop(path_fqn(path), None)
    if amax is not None and amax.shape != leaf.shape[:-1]:
      raise ValueError(f"quantize_params: act_amax[{path_fqn(path)!r}] has shape {amax.shape}; expected "
                       f"{leaf.shape[:-1]} (max |x| per input channel of kernel {leaf.shape})")
    for name, value in _convert_kernel(leaf, amax, scheme, alpha).items():
      out[path[:-1] + (name,)] = value
    if donate and isinstance(leaf, jax.Array):
      leaf.delete()
  if remaining:
    raise ValueError(f"quantize_params: act_amax names layers that were not converted: {sorted(remaining)}")
  return traverse_util.unflatten_dict(out)


def weight_bytes(tree: Any) -> int:
  """Bytes held by the arrays of a pytree (arrays or ``ShapeDtypeStruct`` leaves)."""
  return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(meta.unbox(tree)))


def converted_layers(params: Any) -> list[str]:
  """Module paths of the layers that hold converted leaves."""
  return sorted({path_fqn(p) for p in _flatten(params) if p[-1] in CONVERTED_NAMES})
