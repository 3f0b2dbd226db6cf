"""Where a run's step executes: one device, or FSDP (and tensor parallelism) over a ``(data, fsdp, tensor)`` mesh.

The trainer picks a runtime once (:func:`make_runtime`, from the run's resolved mesh,
``train.spec.RunSpec.mesh``) and the step functions (``train/steps.py``) ask it for everything that differs between
the two, so they contain no sharding branches:

==================  ======================================  =============================================
                    :class:`Unsharded`                      :class:`Fsdp` (``jaxlowbit.fsdp``)
==================  ======================================  =============================================
``place``           parameters as they are                  sharded per the plan (a sharding constraint)
``init_optimizer``  ``optimizer.init``                      state sharded like the parameters
``loss_and_grads``  ``jax.value_and_grad`` of the loss      each device: its tokens, its shards, one low-bit
                                                            gather per quantized weight; loss averaged,
                                                            gradients reduce-scattered
``loss``            cross-entropy of ``model.apply``        the same, averaged over the mesh
``microbatches``    ``[accum, B / accum, T + 1]``           the placed batch's microbatch axis moved first
``tensor``          -                                       with ``mesh.tensor > 1``: heads and MLP hidden
                                                            units split over ``tensor``, each of its devices
                                                            computing the loss of its share of the tokens
``scales``          None                                    every quantized weight's global scale for the
                                                            next step (one all-reduce)
``step_weights``    BitNet weights quantized once for all   None (the gather quantizes each microbatch's
                    the step's microbatches                 shards)
``apply_update``    ``optax`` update                        the same, sharded, then the next scales
``shard_*_batch``   the host batch                          the global batch placed over the mesh, each
                                                            process reading only its devices' rows
==================  ======================================  =============================================

Numerics: parameters and optimizer state are float32 master copies; the model computes in
``spec.model.dtype`` and its linears follow ``spec.model.recipe``.
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxlowbit import BitNet, fsdp, optim, quantized_matmul
from jaxlowbit.execution import DEFAULT as DEFAULT_EXECUTION
from jaxlowbit.execution import ExecutionOptions
from jaxlowbit.interception import PASS, dense_interceptor
from jaxlowbit.layers import dense_general, flat_linear
from jaxlowbit.operand import LowBitOperand, QuantizedMatrix
from jaxlowbit.recipes import bitnet
from pallas_kernels import dispatch
from train import data
from train.model import Transformer, tensor_parallel_rules
from train.spec import RunSpec


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy: ``logits [B, T, V]`` float32, ``targets [B, T]`` int32 -> ``[]``."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _dropout_rngs(model: Transformer, rng: jax.Array | None) -> dict:
  """``model.apply``'s rngs: a dropout key only when the model has dropout (cheaper to compile and run)."""
  if rng is None or model.config.dropout_rate == 0:
    return {}
  return {"dropout": rng}


# Leaves that :meth:`Unsharded.step_weights` sets beside a BitNet kernel in the parameters a
# microbatch's model reads (never in the TrainState): its ternary codes Wq^T [N, K] and scale [1, 1].
TERNARY_CODES = "ternary_codes_t"
TERNARY_SCALE = "ternary_scale"


def _ternary_t(kernel: jax.Array, options: ExecutionOptions) -> tuple[jax.Array, jax.Array]:
  """A BitNet kernel ``[K, N]`` (or the layer scan's ``[L, K, N]``) -> ``(Wq^T int8, scale float32)``
  as BitNet.forward quantizes it, on ``options``' backend; a stack layer by layer (each its own
  abs-mean, as in the scan)."""
  kernels = options.dispatch()

  def quantize(w):
    return dispatch.quantize_cols_t(w, bitnet.TERNARY, kernels)

  return quantize(kernel) if kernel.ndim == 2 else jax.lax.map(quantize, kernel)


def _run_with_step_weights(module, inputs, path):
  """Interceptor handler: a Dense with step weights (:data:`TERNARY_CODES`) reads them as its
  low-bit weight; the kernel is the operand's gradient carrier (its value is never read)."""
  del path
  if not module.has_variable("params", TERNARY_CODES):
    return PASS
  codes = QuantizedMatrix(module.get_variable("params", TERNARY_CODES), module.get_variable("params", TERNARY_SCALE),
                          bitnet.TERNARY)

  def matmul(call, inputs, kernel):
    w = LowBitOperand(None, codes, kernel.reshape(-1, call.kn[1]))
    return flat_linear(call, inputs,
                       lambda x, m: quantized_matmul(x, w, module.recipe, options=module.execution, measured=m),
                       getattr(module, "measured", False))

  return dense_general(module, inputs, matmul)


class Unsharded:
  """One device: the plain jitted step (the mesh resolves to ``data x fsdp x tensor = 1``)."""

  num_devices = 1
  mesh_shape = None
  sync_each_step = False  # the host never waits for a step on one device

  def __init__(self, model: Transformer):
    self.model = model

  def place(self, params):
    return params

  def init_optimizer(self, optimizer: optax.GradientTransformation, params):
    return optimizer.init(params)

  def _loss(self, params, tokens: jax.Array, rng: jax.Array | None = None, weights=None) -> jax.Array:
    rngs = _dropout_rngs(self.model, rng)
    if weights:  # closed over, not differentiated: the gradient reaches each kernel through its carrier
      with nn.intercept_methods(dense_interceptor(_run_with_step_weights)):
        merged = traverse_util.unflatten_dict({**traverse_util.flatten_dict(params), **weights})
        logits = self.model.apply({"params": merged}, tokens[:, :-1], rngs=rngs)
    else:
      logits = self.model.apply({"params": params}, tokens[:, :-1], rngs=rngs)
    return cross_entropy(logits, tokens[:, 1:])

  def step_weights(self, params) -> dict | None:
    """Every BitNet weight quantized once for an optimizer step (ternary codes and scale, flat by
    parameter path), for all its microbatches (``loss_and_grads(weights=...)``); None without any.

    Each microbatch would otherwise quantize each float32 weight again (an abs-mean pass and a
    rounding pass over W). Same codes and scales as the per-microbatch path, so the same numbers.
    """
    weights = {}
    for path, leaf in traverse_util.flatten_dict(params).items():
      projection = re.sub(r"^layers_\d+", "layers", ".".join(path[:-1]))  # unrolled layers: layers_<i>
      if path[-1] == "kernel" and isinstance(self.model.config.recipe_for(projection), BitNet):
        codes, scale = _ternary_t(leaf, self.model.execution or DEFAULT_EXECUTION)
        weights[path[:-1] + (TERNARY_CODES,)], weights[path[:-1] + (TERNARY_SCALE,)] = codes, scale
    return weights or None

  def loss_and_grads(self, params, scales, tokens: jax.Array, rng: jax.Array, weights=None):
    """``(loss, grads)`` of one microbatch ``tokens [b, T + 1]`` (``scales`` is None here); ``weights``:
    the step's quantized BitNet weights (:meth:`step_weights`), or None to quantize them here."""
    del scales
    return jax.value_and_grad(self._loss)(params, tokens, rng, weights)

  def loss(self, params, scales, tokens: jax.Array) -> jax.Array:
    """Evaluation loss (no dropout) of ``tokens [b, T + 1]``."""
    del scales
    return self._loss(params, tokens)

  def microbatches(self, batch: jax.Array, accum: int) -> jax.Array:
    """``[accum, B / accum, T + 1]``: microbatch ``i`` is rows ``[i B / accum, (i + 1) B / accum)``."""
    return batch.reshape(accum, batch.shape[0] // accum, batch.shape[1])

  def scales(self, params):
    del params
    return None

  def apply_update(self, optimizer: optax.GradientTransformation, grads, opt_state, params):
    """``(params, opt_state, scales)`` after one optimizer update."""
    params, opt_state = optim.apply_step(optimizer, grads, opt_state, params)
    return params, opt_state, None

  def shard_train_batch(self, batch: np.ndarray | data.GlobalBatch, accum: int) -> np.ndarray:
    """The host batch int32 ``[B, T + 1]`` (read whole)."""
    del accum
    return data.GlobalBatch.of(batch).read()

  def shard_eval_batch(self, batch: np.ndarray):
    return batch

  def describe(self) -> str:
    return "one (unsharded)"


class Fsdp:
  """FSDP over a ``(data, fsdp, tensor)`` mesh through ``jaxlowbit.fsdp`` (the run's ``spec.mesh``).

  Parameters and optimizer state are sharded by an :class:`~jaxlowbit.fsdp.FsdpPlan`; every
  ``data x fsdp`` group runs the model on its slice of each microbatch; quantized linears
  all-gather their weights low-bit with the global scales kept in ``TrainState.scales``;
  gradients return reduce-scattered. With ``mesh.tensor > 1`` the plan also splits the
  projections the model names (``train.model.tensor_parallel_rules``) over the tensor axis: each
  of its devices holds the group's sequences, computes the model on its share of the tokens and
  heads (``jaxlowbit.fsdp.tensor``) and the loss of its tokens. Several processes (hosts) join
  one run through ``jax.distributed`` (``train.main``); each follows the same data stream and
  reads only its devices' rows of every batch.
  """

  def __init__(self, model: Transformer, spec: RunSpec):
    self.model = model
    fsdp_config, (data, size, tensor) = spec.fsdp, spec.mesh
    devices = jax.devices()[: spec.mesh.devices]
    mesh = fsdp.make_mesh(fsdp=size, data=data, tensor=tensor, devices=devices, config=fsdp_config)
    example = jax.ShapeDtypeStruct((1, spec.seq_len), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), example)["params"]
    rules = tensor_parallel_rules(model.config) if tensor > 1 else {}
    self.plan = fsdp.plan_for_model(model, params, example, mesh=mesh, config=fsdp_config, tensor_parallel=rules)
    self.num_devices = mesh.size
    self.mesh_shape = dict(mesh.shape)
    # XLA:CPU runs the collectives of its virtual devices on one shared thread pool: with several
    # sharded steps queued, the devices' threads can wait in different steps' rendezvous and the
    # runtime aborts after 40 s (seen on 2 cores, 8 devices). Such runs wait for each step.
    self.sync_each_step = mesh.devices.flat[0].platform == "cpu"

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.plan.mesh, P())

  def place(self, params):
    return jax.lax.with_sharding_constraint(params, self.plan.shardings())

  def init_optimizer(self, optimizer: optax.GradientTransformation, params):
    return fsdp.init_optimizer(optimizer, params, self.plan)

  def _device_loss(self, params, scales, tokens: jax.Array, rng: jax.Array | None = None) -> jax.Array:
    """One device's loss inside shard_map: its parameter shards, its tokens ``[b, T + 1]``."""
    rngs = _dropout_rngs(self.model, rng)  # fsdp.apply folds the key per device
    logits = fsdp.apply(self.model, params, tokens[:, :-1], plan=self.plan, scales=scales,
                        **({"rngs": rngs} if rngs else {}))
    targets, tp = tokens[:, 1:], self.plan.tensor_parallel
    return cross_entropy(logits, targets if tp is None else tp.local_tokens(targets))  # tensor: this device's tokens

  def step_weights(self, params) -> None:
    """None: each microbatch's low-bit gather quantizes its weight shards (holding every weight
    whole for the step would undo FSDP's memory saving)."""
    del params

  def loss_and_grads(self, params, scales, tokens: jax.Array, rng: jax.Array, weights=None):
    """``(loss, grads)`` of one microbatch: mean over devices, gradients sharded like the params."""
    del weights  # always None (step_weights)
    grad_fn = fsdp.value_and_grad(lambda p, s, t, r: self._device_loss(p, s, t, r), self.plan)
    return grad_fn(params, traverse_util.flatten_dict(scales), tokens, rng)

  def loss(self, params, scales, tokens: jax.Array) -> jax.Array:
    loss_fn = fsdp.evaluate(lambda p, s, t: self._device_loss(p, s, t), self.plan)
    return loss_fn(params, traverse_util.flatten_dict(scales), tokens)

  def microbatches(self, batch: jax.Array, accum: int) -> jax.Array:
    """The placed ``[B / accum, accum, T + 1]`` batch (:meth:`shard_train_batch`) -> ``[accum, B / accum, T + 1]``."""
    del accum
    return jnp.swapaxes(batch, 0, 1)

  def scales(self, params):
    """``TrainState.scales`` for ``params``: every quantized kernel's global scale, one all-reduce."""
    return traverse_util.unflatten_dict(fsdp.precompute_scales(params, self.plan))

  def apply_update(self, optimizer: optax.GradientTransformation, grads, opt_state, params):
    """``(params, opt_state, scales)`` after one update (``jaxlowbit.fsdp.apply_update``)."""
    params, opt_state, scales = fsdp.apply_update(optimizer, grads, opt_state, params, self.plan)
    return params, opt_state, traverse_util.unflatten_dict(scales)

  def shard_train_batch(self, batch: np.ndarray | data.GlobalBatch, accum: int) -> jax.Array:
    """The global batch ``[B, T + 1]`` placed for the step (:func:`place_global_batch`): each
    process reads only the rows its devices hold."""
    return place_global_batch(data.GlobalBatch.of(batch), NamedSharding(self.plan.mesh, self.plan.batch_spec()), accum)

  def shard_eval_batch(self, batch: np.ndarray) -> jax.Array:
    return fsdp.shard_batch(batch, self.plan)

  def describe(self) -> str:
    """One line: the mesh and what FSDP shards (for the log)."""
    plan = self.plan
    sharded = [path for path in plan.shard_dims if plan.spec(path) != P()]
    low_bit = [path for path, linear in plan.linears.items() if linear.recipe is not None and path in sharded]
    tensor = f" x tensor {plan.tensor_size}" if plan.tensor_size > 1 else ""
    split = f", {len(plan.tensor_splits)} linears tensor-parallel" if plan.tensor_size > 1 else ""
    return (f"FSDP over {plan.mesh.size} devices (mesh data {plan.mesh.shape[plan.config.data_axis]} x fsdp "
            f"{plan.fsdp_size}{tensor}, {jax.process_count()} process(es)): {len(sharded)} of {len(plan.shard_dims)} "
            f"parameter tensors sharded, {len(low_bit)} linears gather low-bit (int8 weights: "
            f"{plan.config.int8_weight_scaling}, remat: {plan.config.remat}), gradients reduce-scattered in "
            f"{plan.config.grad_reduce_dtype}{split}")


Runtime = Unsharded | Fsdp


def placed_rows(batch_size: int, accum: int) -> np.ndarray:
  """Global row ids in the placed layout: ``[B]``, or ``[B / accum, accum]`` with microbatch ``a`` in
  column ``a`` (its rows ``[a B / accum, (a + 1) B / accum)``, as in the unsharded step)."""
  rows = np.arange(batch_size)
  return rows if accum == 1 else rows.reshape(accum, batch_size // accum).swapaxes(0, 1)


def place_global_batch(batch: data.GlobalBatch, sharding: jax.sharding.Sharding, accum: int = 1) -> jax.Array:
  """``batch`` as a global array ``[B, T + 1]`` (``[B / accum, accum, T + 1]`` with accumulation)
  sharded by ``sharding`` along dim 0, so each device holds its slice of every microbatch.

  ``jax.make_array_from_callback`` asks only for the shards of this process's devices, and
  each shard reads only its own rows: with several processes, every one reads its share of
  the batch (``1 / process_count`` of it when the batch is split over all devices), none the
  whole. Multi-host safe: every process calls this with the same ``batch``.
  """
  rows = placed_rows(batch.shape[0], accum)

  def shard(index: tuple[slice, ...]) -> np.ndarray:
    ids = rows[index[:-1]]
    return batch.read(ids).reshape(*ids.shape, batch.shape[1])[..., index[-1]]

  return jax.make_array_from_callback((*rows.shape, batch.shape[1]), sharding, shard)


def model_for(spec: RunSpec) -> Transformer:
  """The run's model: ``spec.model`` running jaxlowbit with ``spec.execution`` (handed to every layer)."""
  return Transformer(spec.model, execution=spec.execution)


def make_runtime(spec: RunSpec) -> Runtime:
  """The runtime of ``spec.mesh``: :class:`Unsharded` on one device, else :class:`Fsdp`."""
  model = model_for(spec)
  if spec.mesh.devices == 1:
    return Unsharded(model)
  return Fsdp(model, spec)


__all__ = [
    "Fsdp", "Runtime", "Unsharded", "cross_entropy", "make_runtime", "model_for", "place_global_batch", "placed_rows",
]
