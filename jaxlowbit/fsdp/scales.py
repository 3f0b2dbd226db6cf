"""``precompute_scales``: every FSDP weight's global scale for the next step, in ONE all-reduce.

Right after the optimizer step, each device computes, for every quantized linear, the
statistic of its local shard (:mod:`jaxlowbit.scaling`): amaxes (one, or one per
output channel) that reduce with MAX, and BitNet abs-sums that reduce with SUM. Both come
out of a single ``pmax`` over the FSDP axis of one float32 vector::

    [ amax statistics | abs-sums: n slots per weight, this device's sum in its own slot, zeros elsewhere ]

The MAX of an amax entry is the global amax. An abs-sum slot is non-zero on exactly one
device (sums are >= 0), so its MAX is that device's sum, exactly: for those slots the
all-reduce acts as an all-gather. Every device then adds a weight's n sums in shard order,
so all devices finish with the same bits (a ``psum`` would not promise that), and the
per-channel amaxes, the bulk of the vector, are not repeated n times.

Weights that are replicated (not sharded) have global statistics locally and join no
collective. Kernels stacked by ``nn.scan`` get one scale per layer (``[layers]`` or
``[layers, N]``), which ``jaxlowbit.fsdp.apply`` hands to the scanned body beside the
kernel, so every layer finds its own.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxlowbit.fsdp.plan import FsdpPlan, Path, flatten
from jaxlowbit.scaling import Reduction

Scales = dict[Path, jax.Array]  # {kernel path: float32 () or [N] scale}


def scaled_paths(plan: FsdpPlan) -> list[Path]:
  """Kernels that get a precomputed scale (the quantized ones), in a fixed order."""
  return sorted(p for p in plan.linears if plan.scaling(p).quantized)


def _local_scales(kernels: Mapping[Path, jax.Array], plan: FsdpPlan) -> Scales:
  """Per-device body: local statistics -> one pmax (when any kernel is sharded) -> scales."""
  axis, n = plan.config.fsdp_axis, plan.fsdp_size
  stats, parts, sharded = {}, [], []
  for path in scaled_paths(plan):
    linear, scaling = plan.linears[path], plan.scaling(path)
    w = lax.stop_gradient(kernels[path])
    stack = w.shape[: linear.stacked_ndim]
    stat = scaling.statistic(w.reshape(*stack, -1, linear.kn(w.shape)[1]))  # [*stack, S]
    stats[path] = stat
    if plan.shard_dims[path] is None:
      continue
    if scaling.reduction is Reduction.SUM:  # this device's sum in its own of n slots
      stat = jnp.zeros((*stack, n), stat.dtype).at[..., lax.axis_index(axis)].set(stat[..., 0])
    sharded.append(path)
    parts.append(stat)

  if parts:
    reduced = lax.pmax(jnp.concatenate([p.reshape(-1) for p in parts]), axis)  # the one collective
    offset = 0
    for path, part in zip(sharded, parts):
      stats[path] = reduced[offset : offset + part.size].reshape(part.shape)
      offset += part.size

  scales = {}
  for path, stat in stats.items():
    k, n_out = plan.linears[path].kn(kernels[path].shape)
    if plan.shard_dims[path] is not None:
      k *= n  # local shard -> whole weight
    scales[path] = plan.scaling(path).scale(stat, k * n_out)
  return scales


def precompute_scales(params: Mapping, plan: FsdpPlan) -> Scales:
  """Global scale of every quantized linear kernel: ``{path: float32 () or [N]}`` (stacked: per layer).

  Args:
    params: the parameter tree, sharded per ``plan`` (``shard_params``) or, for an
      unsharded plan, plain arrays.
    plan: the :class:`FsdpPlan`.

  Returns:
    A flat dict keyed by kernel path (replicated arrays on the mesh), to pass as
    ``scales`` to ``jaxlowbit.fsdp.apply`` / the train step. Call it under ``jit`` after
    each optimizer step; it issues one all-reduce for all weights (none when nothing
    quantized is sharded). Scales carry no gradient.
  """
  flat = flatten(params)
  kernels = {p: flat[p] for p in scaled_paths(plan)}
  if plan.mesh is None or not any(plan.shard_dims[p] is not None for p in kernels):
    return _local_scales(kernels, plan)
  specs = {p: plan.spec(p) for p in kernels}
  return jax.shard_map(
      lambda ks: _local_scales(ks, plan), mesh=plan.mesh, in_specs=(specs,), out_specs=P()
  )(kernels)


__all__ = ["Scales", "precompute_scales", "scaled_paths"]
