"""``FsdpPlan``: which parameter is sharded along which dimension, over which mesh.

The sharding rule (one dimension per tensor, over the ``fsdp`` axis; replicated over ``data``):

- a linear's kernel (``LinearWeight``, found by :func:`jaxlowbit.fsdp.plan_for_model`) is
  sharded along its leading contracted dimension K (dim 0, or the first dim after the
  layer axes that ``nn.scan``/``nn.vmap`` stack in front), so each device holds whole
  rows ``[K/n, N]`` and the linear gathers them low-bit;
- any other tensor of rank >= 2 is sharded along dim 0 and gathered in its own dtype
  before the model runs (embeddings, stacked norm scales);
- a tensor whose sharded dimension does not divide by the axis size, and every tensor of
  rank < 2 (biases, norm scales), stays replicated: no padding, no gather.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxlowbit.fsdp.config import FsdpConfig
from jaxlowbit.fsdp.gather import weight_scaling
from jaxlowbit.scaling import WeightScaling
from jaxlowbit.recipes import Recipe, check_recipe

Path = tuple[str, ...]  # a parameter's key path, as flax.traverse_util.flatten_dict gives it


@dataclasses.dataclass(frozen=True)
class LinearWeight:
  """One linear's kernel, as FSDP sees it.

  Attributes:
    recipe: the linear's recipe (None: high precision).
    contract_ndim: leading kernel dims contracted with the input (K is their product);
      the remaining dims are the output features (N).
    stacked_ndim: dims in front of the kernel added by ``nn.scan``/``nn.vmap`` (layers).
  """

  recipe: Recipe | None
  contract_ndim: int = 1
  stacked_ndim: int = 0

  def __post_init__(self):
    check_recipe(self.recipe, "LinearWeight")

  def kn(self, shape: tuple[int, ...]) -> tuple[int, int]:
    """(K, N) of one layer's kernel, given the parameter's (possibly stacked) shape."""
    kernel = shape[self.stacked_ndim :]
    return math.prod(kernel[: self.contract_ndim]), math.prod(kernel[self.contract_ndim :])


def flatten(params: Mapping) -> dict[Path, Any]:
  """``{path: leaf}`` of a nested parameter dict (FrozenDict or dict)."""
  return traverse_util.flatten_dict(dict(params))


def unflatten(flat: Mapping[Path, Any]) -> dict:
  return traverse_util.unflatten_dict(dict(flat))


@dataclasses.dataclass(frozen=True, eq=False)
class FsdpPlan:
  """How one parameter tree is sharded and which of its leaves are FSDP linears.

  Build it with :func:`make_plan` (arrays) or :func:`jaxlowbit.fsdp.plan_for_model` (a
  Linen model). ``mesh=None`` is the unsharded plan: the same numerics on one device.

  Attributes:
    mesh: a mesh with ``config.fsdp_axis`` (and optionally ``config.data_axis``), or None.
    config: the :class:`FsdpConfig`.
    linears: ``{kernel path: LinearWeight}`` of every linear that gathers its own weight.
    shard_dims: ``{path: dim or None}`` for every parameter leaf.
  """

  mesh: Mesh | None
  config: FsdpConfig
  linears: Mapping[Path, LinearWeight]
  shard_dims: Mapping[Path, int | None]

  @property
  def fsdp_size(self) -> int:
    return 1 if self.mesh is None else self.mesh.shape[self.config.fsdp_axis]

  @property
  def batch_axes(self) -> tuple[str, ...]:
    """Mesh axes the batch's leading dimension is sharded over: data and fsdp, where present.

    An axis of size 1 is left out: sharding over it changes nothing but would make every
    gradient of a data-replicated weight go through a (no-op) all-reduce over it.
    """
    if self.mesh is None:
      return ()
    names = (self.config.data_axis, self.config.fsdp_axis)
    return tuple(a for a in names if a in self.mesh.axis_names and self.mesh.shape[a] > 1)

  def spec(self, path: Path) -> P:
    dim = self.shard_dims[path]
    return P() if dim is None else P(*([None] * dim), self.config.fsdp_axis)

  def specs(self) -> dict:
    """Nested dict of ``PartitionSpec`` matching the parameter tree (shard_map in_specs)."""
    return unflatten({path: self.spec(path) for path in self.shard_dims})

  def shardings(self) -> dict:
    """Nested dict of ``NamedSharding`` matching the parameter tree."""
    self._need_mesh("shardings")
    return unflatten({path: NamedSharding(self.mesh, self.spec(path)) for path in self.shard_dims})

  def batch_spec(self) -> P:
    return P(self.batch_axes) if self.batch_axes else P()

  def scaling(self, path: Path) -> WeightScaling:
    return weight_scaling(self.linears[path].recipe, self.config.int8_weight_scaling)

  def _need_mesh(self, who: str) -> None:
    if self.mesh is None:
      raise ValueError(f"FsdpPlan.{who}: this plan has no mesh (mesh=None is the unsharded plan)")


def shard_dim(shape: tuple[int, ...], fsdp_size: int, linear: LinearWeight | None) -> int | None:
  """The dimension a leaf of ``shape`` is sharded along (module docstring), or None."""
  dim = linear.stacked_ndim if linear is not None else 0
  if len(shape) - dim < 2 or fsdp_size <= 1 or shape[dim] % fsdp_size:
    return None
  return dim


def make_plan(
    params: Mapping,
    mesh: Mesh | None,
    linears: Mapping[Path, LinearWeight | Recipe | None] = (),
    config: FsdpConfig = FsdpConfig(),
) -> FsdpPlan:
  """The plan for a parameter tree (arrays or ``jax.ShapeDtypeStruct``s, unsharded shapes).

  Args:
    params: nested dict of parameters.
    mesh: mesh with ``config.fsdp_axis``, or None for the unsharded plan.
    linears: ``{path: LinearWeight}`` (a bare recipe means a 2-D ``[K, N]`` kernel).
    config: :class:`FsdpConfig`.
  """
  if mesh is not None and config.fsdp_axis not in mesh.axis_names:
    raise ValueError(f"make_plan: mesh axes {mesh.axis_names} lack the FSDP axis {config.fsdp_axis!r}")
  flat = flatten(params)
  linears = {
      tuple(path): lw if isinstance(lw, LinearWeight) else LinearWeight(lw) for path, lw in dict(linears).items()
  }
  missing = [p for p in linears if p not in flat]
  if missing:
    raise ValueError(f"make_plan: linears name paths that are not parameters: {missing}")
  size = 1 if mesh is None else mesh.shape[config.fsdp_axis]
  dims = {path: shard_dim(tuple(leaf.shape), size, linears.get(path)) for path, leaf in flat.items()}
  return FsdpPlan(mesh=mesh, config=config, linears=linears, shard_dims=dims)


def make_mesh(fsdp: int = -1, data: int = 1, devices=None, config: FsdpConfig = FsdpConfig()) -> Mesh:
  """A ``(data, fsdp)`` mesh over ``devices`` (default: all devices of all processes).

  ``fsdp=-1`` takes every device not used by ``data``. The FSDP axis is the minor one, so
  with ``jax.devices()``'s order an FSDP group sits within a host where it fits and the
  ``data`` axis spans hosts (multi-host: call ``jax.distributed.initialize()`` first).
  """
  devices = list(jax.devices() if devices is None else devices)
  if data < 1 or len(devices) % data:
    raise ValueError(f"make_mesh: data={data} must divide the {len(devices)} devices")
  if fsdp == -1:
    fsdp = len(devices) // data
  if fsdp * data != len(devices):
    raise ValueError(f"make_mesh: data={data} x fsdp={fsdp} != {len(devices)} devices; pass fsdp=-1 or a matching size")
  return Mesh(np.asarray(devices, dtype=object).reshape(data, fsdp), (config.data_axis, config.fsdp_axis))


def _global_array(value, sharding: NamedSharding) -> jax.Array:
  """A global array from a host value that every process holds in full (multi-host safe)."""
  host = np.asarray(value)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_params(params: Mapping, plan: FsdpPlan) -> dict:
  """Place every parameter on the plan's mesh, sharded per the plan.

  Every process must pass the same full values (e.g. from ``model.init`` with the same
  key); each keeps only its devices' shards.
  """
  plan._need_mesh("shard_params")
  flat = flatten(params)
  return unflatten({p: _global_array(v, NamedSharding(plan.mesh, plan.spec(p))) for p, v in flat.items()})


def shard_batch(batch, plan: FsdpPlan):
  """Place a batch pytree (leading dim = examples) sharded over the plan's batch axes.

  Every process passes the whole global batch. With a per-host data loader, build the
  arrays with ``jax.make_array_from_process_local_data(NamedSharding(mesh, plan.batch_spec()), local)``.
  """
  plan._need_mesh("shard_batch")
  sharding = NamedSharding(plan.mesh, plan.batch_spec())
  return jax.tree.map(lambda x: _global_array(x, sharding), batch)


__all__ = [
    "FsdpPlan",
    "LinearWeight",
    "Path",
    "flatten",
    "make_mesh",
    "make_plan",
    "shard_batch",
    "shard_dim",
    "shard_params",
    "unflatten",
]
