"""The pure step functions of a run and their compiled, cached form.

``train_step(state, batch) -> (state, metrics)`` is one function for every runtime (one
device, or FSDP with tensor parallelism, ``train/runtime.py``): the runtime supplies the loss and gradients of a
microbatch, the batch layout and the next step's weight scales. It is jitted with the state
donated (its buffers are reused for the new state).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxlowbit.parallel import overlap
from pallas_kernels import policy
from train import checkpoint, data
from train.io.hf_config import describe
from train.io.hf_reader import load_pretrained, merge_into
from train.metrics import say
from train.model import Transformer
from train.optimizer import make_optimizer
from train.runtime import Runtime, Unsharded, make_runtime, model_for
from train.spec import RUNTIME_ONLY_FIELDS, RunSpec


@flax.struct.dataclass
class TrainState:
  """Everything a step reads and writes (a pytree; what a checkpoint stores).

  Attributes:
    step: int32 ``[]``, optimizer steps taken.
    params: float32 master parameters (``Transformer`` tree).
    opt_state: the optimizer's state.
    rng: uint32 raw key data of the run's dropout key (``jax.random.key_data``); step ``s``
      uses ``fold_in(rng, s)``, so resuming needs no extra RNG bookkeeping.
    scales: FSDP runs only (else None): float32 global scale of every quantized kernel for
      the next step (``jaxlowbit.fsdp.precompute_scales``), nested like ``params``.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array
  scales: Any = None


def make_init(runtime: Runtime, optimizer: optax.GradientTransformation, spec: RunSpec) -> Callable[[], TrainState]:
  """``init() -> TrainState`` at step 0, seeded by ``spec.seed``, placed by the runtime.

  FSDP gives the same values as one device (JAX's random bits do not depend on sharding),
  sharded by its plan and with the first step's scales.
  """

  def init() -> TrainState:
    params_key, dropout_key = jax.random.split(jax.random.key(spec.seed))
    params = runtime.model.init(params_key, jnp.zeros((1, spec.seq_len), jnp.int32))["params"]
    params = runtime.place(params)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=runtime.init_optimizer(optimizer, params),
        rng=jax.random.key_data(dropout_key),
        scales=runtime.scales(params),
    )

  return init


def pretrained_params(spec: RunSpec, params: dict) -> dict:
  """``params`` (device arrays) with every leaf a Hugging Face checkpoint (``spec.init_from``)
  has replaced by its weights (``train.hf``), each loaded onto the old leaf's sharding: every
  process reads from the files only its devices' blocks, one at a time (never a whole model in
  host memory nor on one device); the others (a BitNet recipe's extra norms) keep their init."""
  model = spec.model
  _, pretrained = load_pretrained(spec.init_from, param_dtype=model.param_dtype,
                                  shardings=jax.tree.map(lambda x: x.sharding, params),
                                  scan_layers=model.scan_layers, fused_projections=model.fused_projections)
  params = jax.tree.map(lambda x: x, params)  # a copy of the tree: merge_into fills it in place
  kept = merge_into(params, pretrained)
  say(f"init_from {spec.init_from}: {describe(model)}" + (f"; kept the init of {', '.join(kept)}" if kept else ""))
  return params


def abstract_state(spec: RunSpec) -> TrainState:
  """The shapes and dtypes of ``spec``'s state (``jax.ShapeDtypeStruct`` leaves; sharding aside, built on one device).

  ``train.run_control`` compares the state of a checkpoint's saved config with this run's.
  """
  return jax.eval_shape(make_init(Unsharded(model_for(spec)), make_optimizer(spec), spec))


def make_train_step(runtime: Runtime, optimizer: optax.GradientTransformation, spec: RunSpec):
  """``train_step(state, batch) -> (state, {"loss", "grad_norm"})``; batch as ``runtime.shard_train_batch`` places it.

  The batch is split into ``grad_accum_steps`` microbatches whose gradients are averaged
  (a ``lax.scan``, so memory holds one microbatch's activations). ``grad_norm`` is the
  global norm before clipping. The step ends with the next step's scales (FSDP).
  """
  accum = spec.grad_accum_steps

  def train_step(state: TrainState, batch: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
    rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    if accum == 1:
      loss, grads = runtime.loss_and_grads(state.params, state.scales, batch, rng)
    else:
      # BitNet weights quantized once for the step, read by every microbatch (one device; FSDP gathers).
      weights = runtime.step_weights(state.params)

      def add_microbatch(carry, xs):
        index, tokens = xs
        loss, grads = runtime.loss_and_grads(state.params, state.scales, tokens, jax.random.fold_in(rng, index),
                                             weights)
        with jax.named_scope("grad_accum"):
          return jax.tree.map(jnp.add, carry, (loss, grads)), None

      zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, state.params))
      micro = runtime.microbatches(batch, accum)
      (loss, grads), _ = jax.lax.scan(add_microbatch, zeros, (jnp.arange(accum), micro))
      loss, grads = jax.tree.map(lambda x: x / accum, (loss, grads))
    with jax.named_scope("optimizer"):
      grad_norm = optax.tree.norm(grads)
      params, opt_state, scales = runtime.apply_update(optimizer, grads, state.opt_state, state.params)
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, scales=scales)
    return new_state, {"loss": loss, "grad_norm": grad_norm}

  return train_step


def make_eval_step(runtime: Runtime):
  """``eval_step(params, scales, batch) -> loss []`` (no dropout; ``scales`` None unless FSDP)."""
  return runtime.loss


@dataclasses.dataclass(frozen=True)
class StepFunctions:
  """The runtime and the jitted functions of a run.

  Attributes:
    runtime: :class:`~train.runtime.Unsharded` or :class:`~train.runtime.Fsdp`.
    init: ``init() -> TrainState`` (FSDP: sharded).
    train_step: ``train_step(state, batch) -> (state, metrics)``, the state donated.
    eval_step: ``eval_step(params, scales, batch) -> loss``.
    state_shardings: ``TrainState`` of shardings (FSDP), or None (one device).
    compiler_options: the XLA options the step functions compile with (``jaxlowbit.parallel.overlap``:
      collective overlap on several GPUs with ``spec.xla_overlap``; else empty).
  """

  runtime: Runtime
  init: Callable[[], TrainState]
  train_step: Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]
  eval_step: Callable[[Any, Any, Any], jax.Array]
  state_shardings: TrainState | None
  grad_accum_steps: int
  compiler_options: dict = dataclasses.field(default_factory=dict)

  @property
  def model(self) -> Transformer:
    return self.runtime.model

  def shard_train_batch(self, batch: np.ndarray | data.GlobalBatch):
    """A global batch ``[B, T + 1]`` (in host memory, or unread from a stream) -> what ``train_step`` takes."""
    return self.runtime.shard_train_batch(batch, self.grad_accum_steps)

  def shard_eval_batch(self, batch: np.ndarray):
    return self.runtime.shard_eval_batch(batch)

  def restore_target(self) -> TrainState:
    """The state's shapes, dtypes and shardings: what a checkpoint is restored into."""
    abstract = jax.eval_shape(self.init)
    if self.state_shardings is None:
      return checkpoint.abstract_on_device(abstract)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract,
                        self.state_shardings)

  def with_pretrained(self, state: TrainState, spec: RunSpec) -> TrainState:
    """A fresh ``state`` whose parameters ``spec.init_from`` replaces (:func:`pretrained_params`),
    each placed like the init's, with their scales; the optimizer state is the init's (zeros)."""
    state = state.replace(params=pretrained_params(spec, state.params))
    return self.with_scales(state) if state.scales is not None else state

  def with_scales(self, state: TrainState) -> TrainState:
    """``state`` with the scales of its parameters (resuming an unsharded run's checkpoint under FSDP)."""
    return state.replace(scales=jax.jit(self.runtime.scales)(state.params))


def step_functions(spec: RunSpec) -> StepFunctions:
  """:class:`StepFunctions` for ``spec``, cached on ``spec.compiled`` (every field not in
  :data:`~train.spec.RUNTIME_ONLY_FIELDS`, the mesh as resolved: the key names the devices used) and on
  ``pallas_kernels.policy``'s constants, which the step reads as it traces (a benchmark's A/B sets them)."""
  return _step_functions(spec.compiled, policy.constants())


@functools.lru_cache(maxsize=4)
def _step_functions(spec: RunSpec, policy_constants: tuple) -> StepFunctions:
  del policy_constants  # part of the cache key only
  runtime = make_runtime(spec)
  optimizer = make_optimizer(spec)
  init = jax.jit(make_init(runtime, optimizer, spec))
  train_step = make_train_step(runtime, optimizer, spec)
  eval_step = make_eval_step(runtime)
  if runtime.mesh_shape is None:
    return StepFunctions(runtime, init, jax.jit(train_step, donate_argnums=0), jax.jit(eval_step), None,
                         spec.grad_accum_steps)
  # Sharded: the init is compiled first so that its output shardings (parameters and optimizer
  # state per the plan, the rest replicated) pin the step's.
  init = init.lower().compile()
  options = overlap.compiler_options(runtime.plan.mesh.devices.flat, spec.xla_overlap)
  return StepFunctions(
      runtime=runtime,
      init=init,
      train_step=jax.jit(train_step, donate_argnums=0, out_shardings=(init.output_shardings, runtime.replicated),
                         compiler_options=options or None),
      eval_step=jax.jit(eval_step, out_shardings=runtime.replicated, compiler_options=options or None),
      state_shardings=init.output_shardings,
      grad_accum_steps=spec.grad_accum_steps,
      compiler_options=options,
  )


__all__ = [
    "RUNTIME_ONLY_FIELDS", "StepFunctions", "TrainState", "abstract_state", "make_eval_step", "make_init",
    "make_train_step", "step_functions",
]
