"""Flax Linen under FSDP: find a model's linears, then run it on local shards.

:func:`plan_for_model` traces the model once (``jax.eval_shape``) and records every
``nn.Dense`` / ``nn.DenseGeneral`` / jaxlowbit layer: its path, its recipe and its kernel
layout. :func:`apply` runs ``model.apply`` inside ``shard_map`` with a Linen method
interceptor: each recorded linear computes through :func:`jaxlowbit.parallel.fsdp_linear` on
its local kernel shard (one low-bit gather), and every other sharded parameter is
all-gathered in its own dtype before the model starts.

Tensor parallelism: ``plan_for_model(..., tensor_parallel=rules)`` names the column- and
row-parallel linears (``jaxlowbit.parallel.fsdp.plan``); :func:`apply` runs them with their collectives
and hands the model the :class:`~jaxlowbit.parallel.tensor.TensorParallel`: a model with an
``execution`` field runs as ``model.clone(execution=...)`` with ``execution.tensor_parallel`` set, so
it reads its device's tokens and gathers the whole sequence before its column-parallel groups
(``train/model.py`` does). A column-parallel linear's
output has its device's ``N / t`` features; a row-parallel one returns ``[M / t, N]``.

Which recipe a linear runs: a jaxlowbit layer (``Int8Dense``, ``Fp8Dense``,
``BitNetDense``, or ``dense_for(recipe)``) keeps its own; a plain Flax ``Dense`` /
``DenseGeneral`` runs the ``recipe`` given to :func:`plan_for_model` unless
``filter_fqns`` / ``auto_filter_small_kn`` keep it high precision (the rules of
``jaxlowbit.convert``). Layers with their own ``dot_general`` (other than ``dense_for(None)``'s
high-precision one) or with ``batch_dims`` are not FSDP linears: their kernels are gathered in their
own dtype like any parameter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import flax.linen as nn
import jax
from jax import lax

from jaxlowbit.convert import worth_quantizing
from jaxlowbit.execution import with_execution
from jaxlowbit.parallel.fsdp.config import FsdpConfig
from jaxlowbit.parallel.fsdp.gather import gather_param
from jaxlowbit.parallel.fsdp.linear import fsdp_linear
from jaxlowbit.parallel.fsdp.plan import FsdpPlan, LinearWeight, Path, TensorRules, flatten, make_plan, unflatten
from jaxlowbit.parallel.fsdp.scales import Scales
from jaxlowbit.parallel.tensor import ColumnParallel
from jaxlowbit.interception import PASS, as_filter, dense_interceptor
from jaxlowbit.layers import DenseCall, LowBitDense, dense_general, flat_linear, resolve
from jaxlowbit.recipes import Recipe, check_recipe

# Name of the parameter that ``apply`` puts beside each kernel to hand its layer the
# precomputed scale: as a parameter it is sliced per layer by nn.scan like the kernel.
SCALE_PARAM = "jaxlowbit_fsdp_scale"


def _is_fsdp_linear(module: nn.Module) -> bool:
  """A Dense whose dot FSDP can take over: no batch_dims (one ``[K, N]`` kernel per call)."""
  return not getattr(module, "batch_dims", ())


def _kernel_path(module: nn.Module) -> Path:
  return tuple(str(p) for p in module.path) + ("kernel",)


def linears_of(
    model: nn.Module,
    params: Mapping,
    *args,
    recipe: Recipe | None = None,
    filter_fqns: Sequence[str] = (),
    auto_filter_small_kn: bool = False,
    filter_fn: Callable[[str, nn.Module], bool] | None = None,
    method=None,
    **kwargs,
) -> dict[Path, LinearWeight]:
  """``{kernel path: LinearWeight}`` of every linear ``model.apply(..., *args)`` calls.

  ``params`` and ``args`` may be arrays or ``jax.ShapeDtypeStruct``s (nothing is
  computed). ``recipe`` / ``filter_fqns`` / ``filter_fn`` / ``auto_filter_small_kn`` choose
  plain Flax Dense layers' recipe as ``jaxlowbit.convert`` would; jaxlowbit layers keep their own.
  """
  check_recipe(recipe, "linears_of")
  layer_filter = as_filter(filter_fqns, filter_fn)
  if hasattr(type(model), "jaxlowbit_recipe"):
    raise TypeError(
        "FSDP: got a model from jaxlowbit.convert, whose interceptor would run before FSDP's; pass the "
        "unconverted model with recipe=..., filter_fqns=..., auto_filter_small_kn=... instead"
    )
  leaves = flatten(params)
  found: dict[Path, LinearWeight] = {}

  def record(module, inputs, path):
    if not _is_fsdp_linear(module):
      return PASS
    call = resolve(module, inputs)
    if isinstance(module, LowBitDense):
      chosen = module.recipe
    else:
      skip = layer_filter.keeps(path, module)
      skip = skip or (recipe is not None and auto_filter_small_kn and not worth_quantizing(*call.kn, recipe))
      chosen = None if skip else recipe
    kernel_path = _kernel_path(module)
    kernel_ndim = len(call.axis) + len(call.features)
    found[kernel_path] = LinearWeight(chosen, contract_ndim=len(call.axis),
                                      stacked_ndim=leaves[kernel_path].ndim - kernel_ndim)
    return PASS

  def run(p, *a):
    with nn.intercept_methods(dense_interceptor(record)):
      return model.apply({"params": p}, *a, method=method, **kwargs)

  jax.eval_shape(run, params, *args)
  return found


def plan_for_model(
    model: nn.Module,
    params: Mapping,
    *args,
    mesh,
    config: FsdpConfig = FsdpConfig(),
    recipe: Recipe | None = None,
    filter_fqns: Sequence[str] = (),
    auto_filter_small_kn: bool = False,
    filter_fn: Callable[[str, nn.Module], bool] | None = None,
    method=None,
    tensor_parallel: TensorRules = (),
    **kwargs,
) -> FsdpPlan:
  """The :class:`FsdpPlan` of a Linen model's (unsharded) ``params`` over ``mesh``.

  Args:
    model: the Linen model (not a ``jaxlowbit.convert`` result: pass ``recipe`` instead).
    params: its ``"params"`` collection (arrays or ``jax.ShapeDtypeStruct``s, full shapes).
    *args, method, **kwargs: an example call, as for ``model.apply`` (shapes only).
    mesh: from :func:`jaxlowbit.parallel.make_mesh`, or None for the unsharded plan.
    config: :class:`FsdpConfig`.
    recipe, filter_fqns, filter_fn, auto_filter_small_kn: the recipe of plain Flax Dense layers.
    tensor_parallel: ``{module path end: COLUMN | ROW | FEATURES}`` for a mesh with a tensor
      axis (:func:`jaxlowbit.parallel.make_plan`); the model must gather before its column-parallel
      linears (module docstring).
  """
  linears = linears_of(
      model,
      params,
      *args,
      recipe=recipe,
      filter_fqns=filter_fqns,
      auto_filter_small_kn=auto_filter_small_kn,
      filter_fn=filter_fn,
      method=method,
      **kwargs,
  )
  return make_plan(params, mesh, linears, config, tensor_parallel)


def _fsdp_matmul(linear: LinearWeight, scale, axis_name, config: FsdpConfig, tensor=None, options=None,
                 measured: bool = False):
  """The Dense body's matmul under FSDP: ``fsdp_linear`` on this device's kernel shard (``measured``: the layer's
  :attr:`jaxlowbit.LowBitDense.measured`, outside tensor parallelism)."""

  def matmul(call: DenseCall, inputs, kernel):
    w = kernel.reshape(math.prod(kernel.shape[: len(call.axis)]), -1)  # [K/n, N] (N/t column-parallel)

    def run(x, m):
      return fsdp_linear(x, w, linear.recipe, scale=scale, axis_name=axis_name, config=config, tensor=tensor,
                         options=options, measured=m)

    if tensor is not None:  # tensor-parallel: one output dim, its share
      return run(call.flat_inputs(inputs), False)
    return flat_linear(call, inputs, run, measured)

  return matmul


def _device_index(plan: FsdpPlan) -> jax.Array:
  """This device's position along the axes its tokens differ over (data-major), inside shard_map."""
  index = 0
  for name in plan.loss_axes:
    index = index * lax.axis_size(name) + lax.axis_index(name)
  return index


def apply(model: nn.Module, params: Mapping, *args, plan: FsdpPlan, scales: Scales | None = None, method=None, **kwargs):
  """``model.apply({"params": params}, *args)`` on this device's shards, inside ``shard_map``.

  Args:
    model: the model the plan was made for.
    params: the local shards (shard_map with ``in_specs=plan.specs()``), or the whole
      parameters for an unsharded plan (then call it anywhere).
    *args, method, **kwargs: as for ``model.apply`` (e.g. ``rngs=``, ``mutable=``).
    plan: from :func:`plan_for_model`.
    scales: from :func:`jaxlowbit.parallel.precompute_scales` for these parameters; a linear
      without an entry reduces its own scale (one all-reduce).

  ``rngs`` (e.g. dropout) are folded with the device's index along the batch axes (and the
  tensor axis), so each device draws for its own tokens. With a tensor axis a model that declares an
  ``execution`` field gets the plan's ``TensorParallel`` in it (module docstring).

  Returns:
    What ``model.apply`` returns. Differentiable in ``params``: sharded leaves get their
    shard of the gradient (reduce-scattered), replicated leaves the full one.
  """
  axis = plan.config.fsdp_axis
  sharded = plan.mesh is not None
  flat = dict(flatten(params))
  for path, leaf in flat.items():
    dim = plan.shard_dims.get(path)
    if sharded and dim is not None and path not in plan.linears:
      flat[path] = gather_param(leaf, axis, dim, plan.config.grad_reduce_dtype)  # gradient: reduce-scattered
  for path, scale in (scales or {}).items():
    if path not in plan.linears:
      raise ValueError(f"FSDP: scales name {'/'.join(path)}, which is not a linear of the plan")
    flat[path[:-1] + (SCALE_PARAM,)] = lax.stop_gradient(scale)
  if sharded and kwargs.get("rngs") is not None:
    index = _device_index(plan)
    rngs = kwargs["rngs"]
    rngs = {name: jax.random.fold_in(key, index) for name, key in rngs.items()} if isinstance(rngs, Mapping) else (
        jax.random.fold_in(rngs, index))
    kwargs = {**kwargs, "rngs": rngs}

  def run_linear(module, inputs, path):
    if not _is_fsdp_linear(module):
      return PASS
    kernel_path = _kernel_path(module)
    linear = plan.linears.get(kernel_path)
    if linear is None:
      raise ValueError(f"FSDP: linear {path} was not seen when the plan was made; plan with the same call")
    axis_name = axis if sharded and plan.shard_dims[kernel_path] is not None else None
    scale = module.get_variable("params", SCALE_PARAM)  # None: the layer reduces its own
    matmul = _fsdp_matmul(linear, scale, axis_name, plan.config, plan.collective(kernel_path) if sharded else None,
                          getattr(module, "execution", None),  # a jaxlowbit layer's own options
                          getattr(module, "measured", False))
    bias = module.get_variable("params", "bias") if module.use_bias else None  # tensor-parallel: its share
    collective = plan.collective(kernel_path) if sharded else None
    if bias is not None and isinstance(collective, ColumnParallel):
      bias = collective.regroup(bias)  # a fused linear's bias: this device's slice of every group
    return dense_general(module, inputs, matmul, kernel=module.get_variable("params", "kernel"), bias=bias)

  tp = plan.tensor_parallel if sharded else None
  if tp is not None:  # handed to the model explicitly: its execution options (module docstring)
    model = with_execution(model, tensor_parallel=tp)
  with nn.intercept_methods(dense_interceptor(run_linear)):
    return model.apply({"params": unflatten(flat)}, *args, method=method, **kwargs)


__all__ = ["apply", "linears_of", "plan_for_model"]
