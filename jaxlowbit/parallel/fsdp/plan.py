"""``FsdpPlan``: which parameter is sharded along which dimension, over which mesh.

The sharding rule (one dimension per tensor, over the ``fsdp`` axis; replicated over ``data``):

- a linear's kernel (``LinearWeight``, found by :func:`jaxlowbit.parallel.plan_for_model`) is
  sharded along its leading contracted dimension K (dim 0, or the first dim after the
  layer axes that ``nn.scan``/``nn.vmap`` stack in front), so each device holds whole
  rows ``[K/n, N]`` and the linear gathers them low-bit;
- any other tensor of rank >= 2 is sharded along dim 0 and gathered in its own dtype
  before the model runs (embeddings, stacked norm scales);
- a tensor whose sharded dimension does not divide by the axis size, and every tensor of
  rank < 2 (biases, norm scales), stays replicated: no padding, no gather.

Tensor parallelism (a ``tensor`` mesh axis, ``jaxlowbit.parallel.tensor``): the plan's rules name
modules by the end of their path (``{"attn.q": COLUMN, "attn.out": ROW, "attn.out_norm":
FEATURES}``) and split their parameters over ``tensor`` as well, never gathered along it:

- ``COLUMN``: the kernel ``[K, N]`` along N (and its bias along N); FSDP shards K as before;
- ``ROW``: the kernel along K, tensor-major: ``P(("tensor", "fsdp"))``, so the FSDP gather
  returns this device's ``[K / n_tensor, N]`` rows;
- ``FEATURES``: every parameter of the module along its last dimension (a norm's scale over the
  features a row-parallel linear reads);
- ``ColumnGroups(widths)``: a fused column-parallel kernel (``[q | k | v]``, ``[gate | up]``), stored
  as ``COLUMN``; its linear regroups the blocks into this device's slice of every group
  (``ColumnParallel.regroup``: one all-gather of the kernel over ``tensor`` per call).

Everything else is replicated over ``tensor`` (its gradient is summed over it, as over ``data``).
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

from jaxlowbit.parallel.fsdp.config import FsdpConfig
from jaxlowbit.parallel.fsdp.gather import weight_scaling
from jaxlowbit.parallel.tensor import (
    COLUMN,
    FEATURES,
    ROW,
    ColumnGroups,
    ColumnParallel,
    RowParallel,
    TensorParallel,
    TensorSplit,
)
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

  Build it with :func:`make_plan` (arrays) or :func:`jaxlowbit.parallel.plan_for_model` (a
  Linen model). ``mesh=None`` is the unsharded plan: the same numerics on one device.

  Attributes:
    mesh: a mesh with ``config.fsdp_axis`` (and optionally ``config.data_axis``,
      ``config.tensor_axis``), or None.
    config: the :class:`FsdpConfig`.
    linears: ``{kernel path: LinearWeight}`` of every linear that gathers its own weight.
    shard_dims: ``{path: dim or None}`` for every parameter leaf (over the FSDP axis).
    tensor_dims: ``{path: dim}``: the dimension split over the tensor axis (only where it has
      more than one device).
    tensor_splits: ``{kernel path: COLUMN or ROW}`` of the tensor-parallel linears.
    tensor_groups: ``{kernel or bias path: group widths}`` of the fused column-parallel linears
      (:class:`~jaxlowbit.parallel.tensor.ColumnGroups`).
  """

  mesh: Mesh | None
  config: FsdpConfig
  linears: Mapping[Path, LinearWeight]
  shard_dims: Mapping[Path, int | None]
  tensor_dims: Mapping[Path, int] = dataclasses.field(default_factory=dict)
  tensor_splits: Mapping[Path, TensorSplit] = dataclasses.field(default_factory=dict)
  tensor_groups: Mapping[Path, tuple[int, ...]] = dataclasses.field(default_factory=dict)

  @property
  def fsdp_size(self) -> int:
    return 1 if self.mesh is None else self.mesh.shape[self.config.fsdp_axis]

  @property
  def tensor_size(self) -> int:
    """Devices on the tensor axis (1 without one)."""
    if self.mesh is None or self.config.tensor_axis not in self.mesh.axis_names:
      return 1
    return self.mesh.shape[self.config.tensor_axis]

  @property
  def tensor_parallel(self) -> TensorParallel | None:
    """The tensor axis the model runs over inside ``shard_map``, or None (size 1 or no mesh)."""
    if self.tensor_size == 1:
      return None
    return TensorParallel(self.config.tensor_axis, self.tensor_size, self.config.tensor_transposed)

  def collective(self, path: Path) -> ColumnParallel | RowParallel | None:
    """The tensor-parallel collective of the linear whose kernel is at ``path`` (None: not split)."""
    tp, split = self.tensor_parallel, self.tensor_splits.get(path)
    if tp is None or split is None:
      return None
    return tp.column(self.tensor_groups.get(path, ())) if split is COLUMN else tp.row()

  def split_axes(self, path: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(axes splitting K, axes splitting N)`` of the kernel at ``path``: what its statistics reduce over."""
    k_axes, n_axes = [], []
    split = self.tensor_splits.get(path) if self.tensor_size > 1 else None
    if split is ROW:
      k_axes.append(self.config.tensor_axis)
    if self.mesh is not None and self.shard_dims[path] is not None:
      k_axes.append(self.config.fsdp_axis)  # after tensor: K is split tensor-major
    if split is COLUMN:
      n_axes.append(self.config.tensor_axis)
    return tuple(k_axes), tuple(n_axes)

  @property
  def param_axes(self) -> tuple[str, ...]:
    """Mesh axes parameters are split over (FSDP, tensor) that have more than one device."""
    if self.mesh is None:
      return ()
    names = (self.config.fsdp_axis, self.config.tensor_axis)
    return tuple(a for a in names if a in self.mesh.axis_names and self.mesh.shape[a] > 1)

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

  @property
  def loss_axes(self) -> tuple[str, ...]:
    """Mesh axes a per-device mean loss is averaged over: the batch axes, and tensor (each of its
    devices holds other tokens: ``TensorParallel.local_tokens``)."""
    return self.batch_axes + ((self.config.tensor_axis,) if self.tensor_size > 1 else ())

  def spec(self, path: Path) -> P:
    dim, tdim = self.shard_dims[path], self.tensor_dims.get(path)
    if dim is None and tdim is None:
      return P()
    entries: list = [None] * (max(d for d in (dim, tdim) if d is not None) + 1)
    if tdim is not None:
      entries[tdim] = self.config.tensor_axis
    if dim is not None:  # on a tensor-split dim, tensor-major (see the module docstring)
      entries[dim] = (self.config.tensor_axis, self.config.fsdp_axis) if dim == tdim else self.config.fsdp_axis
    return P(*entries)

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


def shard_dim(shape: tuple[int, ...], fsdp_size: int, linear: LinearWeight | None, tensor_dim: int | None = None,
              tensor_size: int = 1) -> int | None:
  """The dimension a leaf of ``shape`` is sharded along over FSDP (module docstring), or None.

  ``tensor_dim``: the dimension split over ``tensor_size`` devices of the tensor axis; a kernel's
  K that is split there is FSDP-sharded within each tensor slice, another leaf's never on it.
  """
  dim = linear.stacked_ndim if linear is not None else 0
  if len(shape) - dim < 2 or fsdp_size <= 1:
    return None
  size = shape[dim]
  if tensor_dim == dim and tensor_size > 1:
    if linear is None:
      return None
    size //= tensor_size
  return None if size % fsdp_size else dim


TensorRules = Mapping[str, "TensorSplit | ColumnGroups | str"]


def _module_matches(path: Path, rule: str) -> bool:
  """Whether the module holding the parameter at ``path`` ends with the dotted ``rule`` (whole names)."""
  names = tuple(rule.split("."))
  return len(path) > len(names) and tuple(path[-1 - len(names) : -1]) == names


def _tensor_layout(flat: Mapping[Path, Any], linears: Mapping[Path, LinearWeight], rules: TensorRules,
                   tensor_size: int) -> tuple[dict[Path, int], dict[Path, TensorSplit], dict[Path, tuple[int, ...]]]:
  """``(tensor_dims, tensor_splits, tensor_groups)`` of the parameters the rules name (module docstring);
  ValueError for rules that name nothing, kernels that are not 2-D ``[K, N]`` linears, and sizes that
  do not split."""
  dims: dict[Path, int] = {}
  splits: dict[Path, TensorSplit] = {}
  groups: dict[Path, tuple[int, ...]] = {}
  for rule, split in dict(rules).items():
    widths = split.widths if isinstance(split, ColumnGroups) else None
    split = COLUMN if widths else TensorSplit(split)
    matched = [path for path in flat if _module_matches(path, rule)]
    if not matched:
      raise ValueError(f"tensor_parallel: no parameter belongs to a module named {rule!r}; rules name modules by the "
                       "end of their dotted path (e.g. 'attn.q' for layers.attn.q)")
    for path in matched:
      shape = tuple(flat[path].shape)
      if split is FEATURES:
        dims[path] = len(shape) - 1
      elif path[-1] == "kernel":
        linear = linears.get(path)
        if linear is None or linear.contract_ndim != 1 or len(shape) - linear.stacked_ndim != 2:
          raise ValueError(f"tensor_parallel: {'/'.join(path)} ({shape}) is not the 2-D [K, N] kernel of a linear "
                           f"the plan found; {split.value}-parallel linears need one contracted and one output dim")
        dims[path] = linear.stacked_ndim if split is ROW else len(shape) - 1
        splits[path] = split
      elif split is COLUMN:  # the bias of a column-parallel linear: its output features
        dims[path] = len(shape) - 1
      else:
        continue  # a row-parallel linear's bias is added after the reduce-scatter: whole
      size = shape[dims[path]]
      if size % tensor_size:
        raise ValueError(f"tensor_parallel: {'/'.join(path)} has {size} entries along the dim split over tensor, "
                         f"which do not divide by tensor={tensor_size}; choose a tensor size that divides the "
                         "heads and hidden sizes")
      if widths:
        if sum(widths) != size or any(w % tensor_size for w in widths):
          raise ValueError(f"tensor_parallel: {'/'.join(path)} has {size} output columns in groups {widths}, which "
                           f"must add up to them and each divide by tensor={tensor_size}")
        groups[path] = tuple(widths)
  return dims, splits, groups


def make_plan(
    params: Mapping,
    mesh: Mesh | None,
    linears: Mapping[Path, LinearWeight | Recipe | None] = (),
    config: FsdpConfig = FsdpConfig(),
    tensor_parallel: TensorRules = (),
) -> FsdpPlan:
  """The plan for a parameter tree (arrays or ``jax.ShapeDtypeStruct``s, unsharded shapes).

  Args:
    params: nested dict of parameters.
    mesh: mesh with ``config.fsdp_axis`` (and optionally ``config.tensor_axis``), or None for
      the unsharded plan.
    linears: ``{path: LinearWeight}`` (a bare recipe means a 2-D ``[K, N]`` kernel).
    config: :class:`FsdpConfig`.
    tensor_parallel: ``{module path end: COLUMN | ROW | FEATURES}`` (module docstring); applied
      when the mesh has a tensor axis of more than one device, checked always.
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
  tensor_size = 1 if mesh is None or config.tensor_axis not in mesh.axis_names else mesh.shape[config.tensor_axis]
  tensor_dims, tensor_splits, tensor_groups = _tensor_layout(flat, linears, tensor_parallel, tensor_size)
  if tensor_size == 1:
    tensor_dims = {}
  dims = {path: shard_dim(tuple(leaf.shape), size, linears.get(path), tensor_dims.get(path), tensor_size)
          for path, leaf in flat.items()}
  return FsdpPlan(mesh=mesh, config=config, linears=linears, shard_dims=dims, tensor_dims=tensor_dims,
                  tensor_splits=tensor_splits, tensor_groups=tensor_groups)


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
    "make_plan",
    "shard_batch",
    "shard_dim",
    "shard_params",
    "unflatten",
]
