"""``precompute_scales``: every FSDP weight's global scale for the next step, in ONE all-reduce.

Right after the optimizer step, each device computes, for every quantized linear, the
statistic of its local shard (amax: one or one per output channel; BitNet: sum of |W|).
The global values need MAX for amaxes and SUM for abs-sums; both come out of a single
``pmax`` over the FSDP axis of one float32 vector::

    [ amax statistics (S_max) | abs-sums placed in this device's row of an [n, S_sum] zero block ]

Amaxes reduce to their global MAX directly. An abs-sum sits in its own row with zeros in
every other device's row, so the MAX of each entry is that device's sum exactly (sums are
>= 0); afterwards every device adds the ``n`` rows in the same order, so the global sum
is exact, deterministic and identical everywhere. Per-channel amaxes, the bulk of the
vector, are not multiplied by ``n``.

Weights that are replicated (not sharded) have global statistics locally and join no
collective; kernels stacked by ``nn.scan`` get no precomputed scale (their layer reduces
its own, see ``jaxlowbit.fsdp.linear.global_scale``).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxlowbit.fsdp.plan import FsdpPlan, Path, flatten
from jaxlowbit.fsdp.scaling import Reduction

Scales = dict[Path, jax.Array]  # {kernel path: float32 () or [N] scale}


def scaled_paths(plan: FsdpPlan) -> list[Path]:
  """Kernels that get a precomputed scale: quantized, not stacked, in a fixed order."""
  return sorted(p for p, lw in plan.linears.items() if plan.scaling(p).quantized and lw.stacked_ndim == 0)


def _local_scales(kernels: Mapping[Path, jax.Array], plan: FsdpPlan) -> Scales:
  """Per-device body: local statistics -> one pmax (when any kernel is sharded) -> scales."""
  axis = plan.config.fsdp_axis
  n = plan.fsdp_size
  stats, sharded = {}, {Reduction.MAX: [], Reduction.SUM: []}
  for path in scaled_paths(plan):
    linear, scaling = plan.linears[path], plan.scaling(path)
    w = lax.stop_gradient(kernels[path])
    stats[path] = scaling.statistic(w.reshape(-1, linear.kn(w.shape)[1]))
    if plan.shard_dims[path] is not None:
      sharded[scaling.reduction].append(path)

  if sharded[Reduction.MAX] or sharded[Reduction.SUM]:
    maxes = [stats[p] for p in sharded[Reduction.MAX]]
    sums = [stats[p] for p in sharded[Reduction.SUM]]
    s_max = sum(s.size for s in maxes)
    s_sum = sum(s.size for s in sums)
    own_row = jnp.zeros((n, s_sum), jnp.float32)
    if sums:
      own_row = own_row.at[lax.axis_index(axis)].set(jnp.concatenate(sums))
    vector = jnp.concatenate([*maxes, own_row.reshape(-1)])
    reduced = lax.pmax(vector, axis)  # the one collective
    global_max = reduced[:s_max]
    global_sum = jnp.sum(reduced[s_max:].reshape(n, s_sum), axis=0)
    for paths, flat in ((sharded[Reduction.MAX], global_max), (sharded[Reduction.SUM], global_sum)):
      offset = 0
      for p in paths:
        size = stats[p].size
        stats[p] = flat[offset : offset + size]
        offset += size

  scales = {}
  for path, stat in stats.items():
    k, n_out = plan.linears[path].kn(kernels[path].shape)
    k *= 1 if plan.shard_dims[path] is None else n  # local shard -> whole weight
    scales[path] = plan.scaling(path).scale(stat, k * n_out)
  return scales


def precompute_scales(params: Mapping, plan: FsdpPlan) -> Scales:
  """Global scale of every quantized, unstacked linear kernel: ``{path: float32 () or [N]}``.

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
