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

Tensor parallelism splits some weights over the ``tensor`` axis as well (along K: row-parallel;
along N: column-parallel). The one ``pmax`` then runs over ``(fsdp, tensor)``: amaxes over a
split K reduce as above; a column-parallel weight's per-channel amaxes go into its own ``N / n``
slots of its ``[N]`` entry (zeros elsewhere), so the MAX assembles every channel's; abs-sums
get one slot per shard over both axes. Every scale comes back whole and replicated (per
channel ``[N]``), the same shapes as without tensor parallelism, so checkpoints of the scales do
not depend on the mesh; a column-parallel linear takes its own channels' slice.

Weights that are replicated (not sharded) have global statistics locally and join no
collective. Kernels stacked by ``nn.scan`` get one scale per layer (``[layers]`` or
``[layers, N]``), which ``jaxlowbit.parallel.apply`` hands to the scanned body beside the
kernel, so every layer finds its own.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxlowbit.parallel.fsdp.plan import FsdpPlan, Path, flatten
from jaxlowbit.scaling import Reduction

Scales = dict[Path, jax.Array]  # {kernel path: float32 () or [N] scale}


def scaled_paths(plan: FsdpPlan) -> list[Path]:
  """Kernels that get a precomputed scale (the quantized ones), in a fixed order."""
  return sorted(p for p in plan.linears if plan.scaling(p).quantized)


def _shard_index(axes: tuple[str, ...]) -> tuple[jax.Array, int]:
  """This device's index among the shards over ``axes`` (the first axis major), and their number."""
  index, count = 0, 1
  for axis in axes:
    index = index * lax.axis_size(axis) + lax.axis_index(axis)
    count *= lax.axis_size(axis)
  return index, count


def _local_scales(kernels: Mapping[Path, jax.Array], plan: FsdpPlan) -> Scales:
  """Per-device body: local statistics -> one pmax (when any kernel is split) -> scales."""
  stats, parts, split, counts = {}, [], [], {}
  for path in scaled_paths(plan):
    linear, scaling = plan.linears[path], plan.scaling(path)
    w = lax.stop_gradient(kernels[path])
    stack = w.shape[: linear.stacked_ndim]
    k, n_out = linear.kn(w.shape)
    stat = scaling.statistic(w.reshape(*stack, -1, n_out))  # [*stack, S]
    k_axes, n_axes = plan.split_axes(path) if plan.mesh is not None else ((), ())
    (k_index, k_shards), (n_index, n_shards) = _shard_index(k_axes), _shard_index(n_axes)
    counts[path] = k * k_shards * n_out * n_shards  # local shard -> whole weight
    stats[path] = stat
    if not k_axes and not n_axes:
      continue
    if scaling.reduction is Reduction.SUM:  # this device's sum in its own slot of every shard's
      slots = jnp.zeros((*stack, k_shards * n_shards), stat.dtype)
      stat = slots.at[..., k_index * n_shards + n_index].set(stat[..., 0])
    elif scaling.per_channel and n_axes:  # this device's channels in their place of all N (zeros elsewhere)
      whole = jnp.zeros((*stack, n_out * n_shards), stat.dtype)
      stat = lax.dynamic_update_slice_in_dim(whole, stat, n_index * n_out, axis=whole.ndim - 1)
    split.append(path)
    parts.append(stat)

  if parts:  # the one collective
    reduced = lax.pmax(jnp.concatenate([p.reshape(-1) for p in parts]), plan.param_axes)
    offset = 0
    for path, part in zip(split, parts):
      stats[path] = reduced[offset : offset + part.size].reshape(part.shape)
      offset += part.size
  return {path: plan.scaling(path).scale(stat, counts[path]) for path, stat in stats.items()}


def precompute_scales(params: Mapping, plan: FsdpPlan) -> Scales:
  """Global scale of every quantized linear kernel: ``{path: float32 () or [N]}`` (stacked: per layer).

  Args:
    params: the parameter tree, sharded per ``plan`` (``shard_params``) or, for an
      unsharded plan, plain arrays.
    plan: the :class:`FsdpPlan`.

  Returns:
    A flat dict keyed by kernel path (replicated arrays on the mesh), to pass as
    ``scales`` to ``jaxlowbit.parallel.apply`` / the train step. Call it under ``jit`` after
    each optimizer step; it issues one all-reduce for all weights (none when nothing
    quantized is sharded). Scales carry no gradient.
  """
  flat = flatten(params)
  kernels = {p: flat[p] for p in scaled_paths(plan)}
  if plan.mesh is None or not any(any(plan.split_axes(p)) for p in kernels):
    return _local_scales(kernels, plan)
  specs = {p: plan.spec(p) for p in kernels}
  return jax.shard_map(
      lambda ks: _local_scales(ks, plan), mesh=plan.mesh, in_specs=(specs,), out_specs=P()
  )(kernels)


__all__ = ["Scales", "precompute_scales", "scaled_paths"]
