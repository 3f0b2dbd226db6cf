"""``fsdp_linear``: ``y = x @ W`` for a weight sharded along K: gather it low-bit, then the ordinary matmul.

    y = quantized_matmul(x, gather_weight(w_shard, ...), recipe)

:func:`~jaxlowbit.parallel.fsdp.gather.gather_weight` turns this device's rows of ``W`` into the whole
weight as a low-bit operand in one all-gather (and reduce-scatters its gradient);
:func:`jaxlowbit.quantized_matmul` runs the recipe on it exactly as on one device, so there is
one implementation of every recipe's three matmuls. ``FsdpConfig(remat="regather")`` runs the
two under ``jax.checkpoint`` saving nothing but the linear's inputs, so the backward gathers the
weight again instead of keeping it (and re-quantizes the input it reads).

Activation scales are per device, as in any data-parallel run: per-token scales are
unaffected, per-tensor and per-column (over tokens) ones see the local tokens only.

Tensor parallelism: ``tensor`` is the linear's collective (``jaxlowbit.parallel.tensor``). A
``ColumnParallel`` linear holds ``[K/n, N/t]`` (its own output channels), reads the whole
sequence and gives ``[M, N/t]``; a ``RowParallel`` one holds ``[K/(t n), N]``, reads ``[M, K/t]``
and gives its ``[M/t, N]`` rows, reduce-scattered. The FSDP gather is the same in both.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxlowbit.parallel.fsdp.config import FsdpConfig
from jaxlowbit.parallel.fsdp.gather import gather_weight, weight_scaling
from jaxlowbit.parallel.tensor import ColumnParallel, RowParallel
from jaxlowbit.execution import ExecutionOptions, resolve
from jaxlowbit.matmul import match_varying_axes, quantized_matmul
from jaxlowbit.operand import MeasuredOutput, is_low_bit
from jaxlowbit.recipes import Recipe, check_recipe


def fsdp_linear(
    x: jax.Array,
    w: jax.Array,
    recipe: Recipe | None,
    *,
    scale: jax.Array | None = None,
    axis_name: str | None = None,
    config: FsdpConfig = FsdpConfig(),
    tensor: ColumnParallel | RowParallel | None = None,
    options: ExecutionOptions | None = None,
    measured: bool = False,
) -> jax.Array | MeasuredOutput:
  """``x @ W`` for a weight ``W [K, N]`` sharded along K over the mesh axis ``axis_name``.

  Call inside ``jax.shard_map`` (with ``axis_name`` bound) or anywhere with
  ``axis_name=None``, which runs the same numerics on a whole weight without collectives.

  Args:
    x: ``[..., K]`` float32/bfloat16/float16 activations (the local tokens).
    w: the local shard ``[K/n, N]`` (rows ``i*K/n ... (i+1)*K/n`` on device ``i`` of the
      axis), or the whole ``[K, N]`` when ``axis_name`` is None.
    recipe: a recipe (:class:`Int8MixedPrecision`, :class:`Float8`, :class:`BitNet`) or None.
    scale: the weight's global scale for this step (``precompute_scales``: float32 ``()``
      or ``[N]``, all N channels also for a column-parallel weight); None computes it here with
      one all-reduce over the axis.
    axis_name: the FSDP mesh axis, or None for an unsharded weight.
    config: ``int8_weight_scaling``, ``remat`` and ``grad_reduce_dtype`` are read from it.
    tensor: the linear's tensor-parallel collective (module docstring), or None.
    options: how the kernels run (:class:`jaxlowbit.ExecutionOptions`; None: the defaults).
    measured: return the :class:`~jaxlowbit.operand.MeasuredOutput` of ``[M, N]`` values (``M``: x's leading dims'
      product), as ``quantized_matmul(..., measured=True)``; not with ``tensor``.

  Returns:
    ``[..., N]`` in x's dtype (row-parallel: this device's ``[M/t, N]``); differentiable in x
    (``dx`` in x's dtype) and w (``dw`` the ``[K/n, N]`` shard of the full gradient summed over
    devices, in w's dtype).
  """
  check_recipe(recipe, "fsdp_linear")
  for name, a in (("x", x), ("w", w)):  # a low-bit x (a fused producer's) has its logical dtype
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise TypeError(f"fsdp_linear: {name} must be floating point, got {a.dtype}")
  if w.ndim != 2:
    raise ValueError(f"fsdp_linear: w must be a 2-D [K/n, N] shard, got shape {w.shape}")
  scaling = weight_scaling(recipe, config.int8_weight_scaling)
  if isinstance(tensor, ColumnParallel):
    # A fused kernel's stored block -> this device's slice of every group. A high-precision kernel crosses the
    # axis in the compute dtype where it is narrower (bf16: half of float32's bytes, the same numbers: the linear
    # casts it to that anyway); a quantized recipe's master block in float32, which its quantizer reads. The
    # gradient sums (one nonzero per element) in float32 unless FSDP's gradients are reduced in bfloat16 anyway
    # (grad_reduce_dtype).
    narrower = jnp.dtype(x.dtype).itemsize < jnp.dtype(w.dtype).itemsize
    w = tensor.regroup(w, travel_dtype=x.dtype if narrower and not scaling.quantized else None,
                       grad_reduce_dtype=config.grad_reduce_dtype)
  num_shards = 1 if axis_name is None else lax.axis_size(axis_name)
  k = w.shape[0] * num_shards
  if x.ndim < 1 or x.shape[-1] != k:
    raise ValueError(
        f"fsdp_linear: x {x.shape} must end in K={k} (w shard {w.shape} x {num_shards} shards on {axis_name!r})"
    )
  if isinstance(tensor, RowParallel) and x.ndim != 2:
    raise ValueError(f"fsdp_linear: a row-parallel linear reads x as [M, K/t] and returns its [M/t, N] rows; got x "
                     f"{x.shape}: flatten the tokens first")
  if isinstance(tensor, ColumnParallel) and scale is not None and scaling.per_channel:
    scale = tensor.local_columns(scale)  # the precomputed scale covers all N channels
  options = resolve(options)
  x, w = match_varying_axes(x, w)  # dW of data-parallel tokens: autodiff of this cast sums it over them
  batch_shape = x.shape[:-1]

  def linear(x, w, scale):
    gathered = gather_weight(w, scaling, x.dtype, scale=scale, axis_name=axis_name, tensor=tensor,
                             grad_reduce_dtype=config.grad_reduce_dtype)
    return quantized_matmul(x, gathered, recipe, collective=tensor, options=options, measured=measured)

  if config.remat == "regather":  # keep nothing of the linear but its inputs: the backward gathers again
    linear = jax.checkpoint(linear, policy=jax.checkpoint_policies.nothing_saveable)
  y = linear(x if is_low_bit(x) else x.reshape(math.prod(batch_shape), k), w, scale)
  return y if isinstance(tensor, RowParallel) or measured else y.reshape(*batch_shape, w.shape[1])


__all__ = ["fsdp_linear"]
