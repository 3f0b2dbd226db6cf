"""The training loop, in the order it runs: data, model, step functions, state, loop, finish.

``train(config, workdir)`` trains ``config`` in ``workdir`` and returns a :class:`TrainResult`.
The step is a pure function ``train_step(state, batch) -> (state, metrics)``, jitted with the
state donated (its buffers are reused for the new state).

Numerics: parameters and optimizer state are float32 master copies; the model computes in
``config.model.dtype`` (bfloat16) and its linears follow ``config.recipe``; gradients arrive
in float32. One optimizer step may accumulate ``grad_accum_steps`` microbatches.

Devices (``config.mesh``, see ``train.config.mesh_shape``): on one device the step is the
plain jitted function above. On more (by default as soon as more than one is visible) the
run is FSDP over a ``(data, fsdp)`` mesh with ``jaxlowbit.fsdp``: parameters and optimizer
state are sharded by an :class:`~jaxlowbit.fsdp.FsdpPlan`, every device runs the model on
its slice of each microbatch, quantized linears all-gather their weights low-bit with the
global scales kept in ``TrainState.scales`` (computed after each update in one all-reduce),
and gradients return reduce-scattered. Several processes (hosts) join one run through
``jax.distributed`` (``train.main``); each reads the same global batches from the
deterministic data stream and places its devices' slices, and only process 0 writes
metrics, the config and progress lines.

Robustness:

- Loss or gradient norm not finite: the run stops with :class:`NonFiniteLossError` naming
  the step. That state is never saved; the newest checkpoint on disk is the last good one.
  (Metrics are fetched every ``log_every`` steps and before every save, so the run stops at
  most ``log_every - 1`` steps after the bad one, and never saves past it.)
- Ctrl-C (SIGINT): the loop finishes the step it is in, saves a checkpoint and returns with
  ``status="interrupted"`` (``train.main`` exits 130). A second Ctrl-C stops at once; the
  state is then saved only if it is still intact.
- Resume: the checkpoint holds the state (params, optimizer state, step, rng) and the data
  stream's position, so a resumed run reproduces an uninterrupted one exactly.
- Drills: ``config.inject_nan_at_step = s`` turns the parameters NaN right before step ``s``
  (in the loop, not in the jitted step), to exercise the non-finite path end to end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import pathlib
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import traverse_util
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxlowbit import fsdp
from train import checkpoint, data, metrics
from train import config as train_config
from train.metrics import say
from train.model import Transformer, param_count, train_flops_per_token
from train.optimizer import learning_rate_schedule, make_optimizer


class NonFiniteLossError(FloatingPointError):
  """The loss or gradient norm became NaN/inf; nothing after the last good checkpoint was saved."""


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


@dataclasses.dataclass
class TrainResult:
  """How :func:`train` ended: ``status`` is ``"completed"`` or ``"interrupted"``."""

  status: str
  step: int
  loss: float | None
  val_loss: float | None
  checkpoint_step: int | None


# ---------------------------------------------------------------------------------------------
# Pure functions: loss, init, train step, eval step.


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy: ``logits [B, T, V]`` float32, ``targets [B, T]`` int32 -> ``[]``."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def next_scales(params, plan: fsdp.FsdpPlan):
  """``TrainState.scales`` for ``params``: every quantized kernel's global scale, one all-reduce."""
  return traverse_util.unflatten_dict(fsdp.precompute_scales(params, plan))


def _fsdp_loss(model: Transformer, plan: fsdp.FsdpPlan, params, scales, tokens: jax.Array, **apply_kwargs):
  """One device's next-token loss inside shard_map: its parameter shards, its tokens ``[b, T + 1]``."""
  logits = fsdp.apply(model, params, tokens[:, :-1], plan=plan, scales=scales, **apply_kwargs)
  return cross_entropy(logits, tokens[:, 1:])


def make_init(
    model: Transformer, optimizer: optax.GradientTransformation, config, plan: fsdp.FsdpPlan | None = None
) -> Callable[[], TrainState]:
  """``init() -> TrainState`` at step 0, seeded by ``config.seed``.

  With an FSDP ``plan`` the parameters and optimizer state come out sharded by it (the same
  values: JAX's random bits do not depend on sharding) and with the first step's scales.
  """

  def init() -> TrainState:
    params_key, dropout_key = jax.random.split(jax.random.key(config.seed))
    params = model.init(params_key, jnp.zeros((1, config.seq_len), jnp.int32))["params"]
    if plan is not None:
      params = jax.lax.with_sharding_constraint(params, plan.shardings())
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=optimizer.init(params) if plan is None else fsdp.init_optimizer(optimizer, params, plan),
        rng=jax.random.key_data(dropout_key),
        scales=None if plan is None else next_scales(params, plan),
    )

  return init


def make_train_step(
    model: Transformer, optimizer: optax.GradientTransformation, config, plan: fsdp.FsdpPlan | None = None
):
  """``train_step(state, batch) -> (state, {"loss", "grad_norm"})``; batch is int32 ``[B, T + 1]``.

  The batch is split into ``grad_accum_steps`` microbatches whose gradients are averaged
  (a ``lax.scan``, so memory holds one microbatch's activations). ``grad_norm`` is the
  global norm before clipping.

  With an FSDP ``plan``, each microbatch's loss and gradients come from
  ``jaxlowbit.fsdp.value_and_grad`` (every device: its slice of the microbatch, its shards of
  the parameters, the state's scales), and the step ends with the next step's scales. The
  batch then arrives as placed by :func:`shard_train_batch`: ``[B / accum, accum, T + 1]``
  when ``accum > 1``, so that every microbatch is spread over all devices.
  """
  accum = config.grad_accum_steps
  dropout = model.config.dropout_rate > 0  # without dropout no key is split (cheaper to compile and run)

  def loss_fn(params, tokens: jax.Array, rng: jax.Array) -> jax.Array:
    logits = model.apply({"params": params}, tokens[:, :-1], rngs={"dropout": rng} if dropout else {})
    return cross_entropy(logits, tokens[:, 1:])

  def grad_fn(state: TrainState, tokens: jax.Array, rng: jax.Array):
    """``(loss, grads)`` of one microbatch (FSDP: mean over devices, gradients sharded like the params)."""
    if plan is None:
      return jax.value_and_grad(loss_fn)(state.params, tokens, rng)
    rngs = {"rngs": {"dropout": rng}} if dropout else {}  # fsdp.apply folds the key per device
    sharded = fsdp.value_and_grad(lambda params, scales, tokens: _fsdp_loss(model, plan, params, scales, tokens, **rngs),
                                  plan)
    return sharded(state.params, traverse_util.flatten_dict(state.scales), tokens)

  def train_step(state: TrainState, batch: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
    rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    if accum == 1:
      loss, grads = grad_fn(state, batch, rng)
    else:
      if plan is None:
        micro = batch.reshape(accum, batch.shape[0] // accum, batch.shape[1])
      else:
        micro = jnp.swapaxes(batch, 0, 1)  # [B / accum, accum, T + 1], sharded on dim 0 -> [accum, B / accum, T + 1]

      def add_microbatch(carry, xs):
        index, tokens = xs
        loss, grads = grad_fn(state, tokens, jax.random.fold_in(rng, index))
        with jax.named_scope("grad_accum"):
          return jax.tree.map(jnp.add, carry, (loss, grads)), None

      zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, state.params))
      (loss, grads), _ = jax.lax.scan(add_microbatch, zeros, (jnp.arange(accum), micro))
      loss, grads = jax.tree.map(lambda x: x / accum, (loss, grads))
    with jax.named_scope("optimizer"):
      grad_norm = optax.tree.norm(grads)
      updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    if plan is not None:  # every quantized weight's scale for the next step, in one all-reduce
      new_state = new_state.replace(scales=next_scales(params, plan))
    return new_state, {"loss": loss, "grad_norm": grad_norm}

  return train_step


def make_eval_step(model: Transformer, plan: fsdp.FsdpPlan | None = None):
  """``eval_step(params, scales, batch) -> loss []`` (no dropout; ``scales`` None unless FSDP)."""

  def eval_step(params, scales, batch: jax.Array) -> jax.Array:
    del scales
    return cross_entropy(model.apply({"params": params}, batch[:, :-1]), batch[:, 1:])

  def device_loss(params, scales, batch: jax.Array) -> jax.Array:
    return _fsdp_loss(model, plan, params, scales, batch)

  def fsdp_eval_step(params, scales, batch: jax.Array) -> jax.Array:
    return fsdp.evaluate(device_loss, plan)(params, traverse_util.flatten_dict(scales), batch)

  return eval_step if plan is None else fsdp_eval_step


def shard_train_batch(batch: np.ndarray, plan: fsdp.FsdpPlan, accum: int) -> jax.Array:
  """A host batch ``[B, T + 1]`` (the same on every process) placed for the FSDP step.

  Microbatch ``i`` is rows ``[i B / accum, (i + 1) B / accum)``, as in the unsharded step; it
  is laid out ``[B / accum, accum, T + 1]`` and sharded on dim 0, so each device holds its
  slice of every microbatch.
  """
  if accum > 1:
    batch = batch.reshape(accum, batch.shape[0] // accum, batch.shape[1]).swapaxes(0, 1)
  return fsdp.shard_batch(batch, plan)


# Config fields that change nothing inside the jitted functions. Runs in one process whose
# configs differ only in these reuse the functions compiled for an earlier run (a resume in a
# notebook, tests, benchmarks); any other difference compiles afresh, so the cache is never stale.
RUNTIME_ONLY_FIELDS = frozenset({
    "resume", "log_every", "eval_every", "eval_batches", "checkpoint_every", "keep_checkpoints",
    "async_checkpointing", "tensorboard", "peak_tflops", "data", "inject_nan_at_step",
})


@dataclasses.dataclass(frozen=True)
class StepFunctions:
  """The model and the jitted functions of a config.

  Attributes:
    model: the :class:`Transformer`.
    plan: the FSDP plan (parameters sharded over ``plan.mesh``), or None for an unsharded run.
    init: ``init() -> TrainState`` (FSDP: sharded).
    train_step: ``train_step(state, batch) -> (state, metrics)``, the state donated.
    eval_step: ``eval_step(params, scales, batch) -> loss``.
    shard_train_batch, shard_eval_batch: host batch ``[B, T + 1]`` -> what the step takes
      (unsharded: the batch itself).
    state_shardings: ``TrainState`` of shardings (FSDP), or None (one device).
  """

  model: Transformer
  plan: fsdp.FsdpPlan | None
  init: Callable[[], TrainState]
  train_step: Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]
  eval_step: Callable[[Any, Any, Any], jax.Array]
  shard_train_batch: Callable[[np.ndarray], Any]
  shard_eval_batch: Callable[[np.ndarray], Any]
  state_shardings: TrainState | None

  def restore_target(self) -> TrainState:
    """The state's shapes, dtypes and shardings: what a checkpoint is restored into."""
    abstract = jax.eval_shape(self.init)
    if self.state_shardings is None:
      return checkpoint.abstract_on_device(abstract)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract,
                        self.state_shardings)

  def with_scales(self, state: TrainState) -> TrainState:
    """``state`` with the scales of its parameters (resuming an unsharded run's checkpoint under FSDP)."""
    return state.replace(scales=jax.jit(lambda params: next_scales(params, self.plan))(state.params))


def step_functions(config: ml_collections.ConfigDict) -> StepFunctions:
  """:class:`StepFunctions` for ``config`` (cached on every field not in :data:`RUNTIME_ONLY_FIELDS`)."""
  compiled = {k: v for k, v in config.to_dict().items() if k not in RUNTIME_ONLY_FIELDS}
  data_size, fsdp_size = train_config.mesh_shape(config)
  compiled["mesh"] = {"data": data_size, "fsdp": fsdp_size}  # auto resolved: the key names the devices used
  return _step_functions(json.dumps(compiled, sort_keys=True))


@functools.lru_cache(maxsize=4)
def _step_functions(key: str) -> StepFunctions:
  config = ml_collections.ConfigDict(json.loads(key))
  model = Transformer(train_config.model_config(config))
  optimizer = make_optimizer(config)
  if config.mesh.data * config.mesh.fsdp == 1:
    return StepFunctions(
        model=model,
        plan=None,
        init=jax.jit(make_init(model, optimizer, config)),
        train_step=jax.jit(make_train_step(model, optimizer, config), donate_argnums=0),
        eval_step=jax.jit(make_eval_step(model)),
        shard_train_batch=lambda batch: batch,
        shard_eval_batch=lambda batch: batch,
        state_shardings=None,
    )

  # FSDP: the plan from the model's linears, then the init compiled first so that its output
  # shardings (parameters and optimizer state per the plan, the rest replicated) pin the step's.
  fsdp_config = train_config.fsdp_config(config)
  devices = jax.devices()[: config.mesh.data * config.mesh.fsdp]
  mesh = fsdp.make_mesh(fsdp=config.mesh.fsdp, data=config.mesh.data, devices=devices, config=fsdp_config)
  example = jax.ShapeDtypeStruct((1, config.seq_len), jnp.int32)
  params = jax.eval_shape(model.init, jax.random.key(0), example)["params"]
  plan = fsdp.plan_for_model(model, params, example, mesh=mesh, config=fsdp_config)
  init = jax.jit(make_init(model, optimizer, config, plan)).lower().compile()
  replicated = NamedSharding(mesh, P())
  return StepFunctions(
      model=model,
      plan=plan,
      init=init,
      train_step=jax.jit(make_train_step(model, optimizer, config, plan), donate_argnums=0,
                         out_shardings=(init.output_shardings, replicated)),
      eval_step=jax.jit(make_eval_step(model, plan), out_shardings=replicated),
      shard_train_batch=lambda batch: shard_train_batch(batch, plan, config.grad_accum_steps),
      shard_eval_batch=lambda batch: fsdp.shard_batch(batch, plan),
      state_shardings=init.output_shardings,
  )


def describe_plan(plan: fsdp.FsdpPlan) -> str:
  """One line: the mesh and what FSDP shards (for the log)."""
  sharded = [path for path, dim in plan.shard_dims.items() if dim is not None]
  low_bit = [path for path, linear in plan.linears.items() if linear.recipe is not None and path in sharded]
  return (f"FSDP over {plan.mesh.size} devices (mesh data {plan.mesh.shape[plan.config.data_axis]} x fsdp "
          f"{plan.fsdp_size}, {jax.process_count()} process(es)): {len(sharded)} of {len(plan.shard_dims)} parameter "
          f"tensors sharded, {len(low_bit)} linears gather low-bit (int8 weights: {plan.config.int8_weight_scaling}, "
          f"remat: {plan.config.remat})")


# ---------------------------------------------------------------------------------------------
# Ctrl-C: the first SIGINT asks the loop to stop at the next step boundary.


class StopRequest:
  """Set by SIGINT while :meth:`installed` (main thread only); a second SIGINT raises KeyboardInterrupt."""

  def __init__(self):
    self.requested = False

  def _handle(self, signum, frame):
    del signum, frame
    if self.requested:
      raise KeyboardInterrupt
    self.requested = True
    say("\nCtrl-C: finishing this step, then saving a checkpoint (Ctrl-C again to stop at once)")

  @contextlib.contextmanager
  def installed(self):
    if threading.current_thread() is not threading.main_thread():
      yield self
      return
    previous = signal.signal(signal.SIGINT, self._handle)
    try:
      yield self
    finally:
      signal.signal(signal.SIGINT, previous)


def _changed_fields(old: dict, new: dict, prefix: str = "") -> set[str]:
  """Dotted names of the fields whose values differ between two config dicts."""
  changed = set()
  for key in old.keys() | new.keys():
    a, b = old.get(key), new.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      changed |= _changed_fields(a, b, f"{prefix}{key}.")
    elif a != b:
      changed.add(prefix + key)
  return changed


def _field_change(old: dict, new: dict, field: str) -> str:
  """``"mesh.fsdp 4 -> 2"``: a dotted field's value in two config dicts (None where absent)."""
  values = []
  for config in (old, new):
    for key in field.split("."):
      config = config.get(key) if isinstance(config, dict) else None
    values.append(config)
  return f"{field} {values[0]} -> {values[1]}"


def _finite(tree) -> bool:
  return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree))


def _alive(state: TrainState) -> bool:
  """False when some buffer of ``state`` was donated to a step that never returned."""
  return not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))


def _any_process(flag: bool) -> bool:
  """True on every process when ``flag`` is True on any (a collective: call it on all processes)."""
  return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


# ---------------------------------------------------------------------------------------------
# The run.


def train(
    config: ml_collections.ConfigDict,
    workdir: str | pathlib.Path,
    should_stop: Callable[[int], bool] | None = None,
) -> TrainResult:
  """Train ``config`` with checkpoints, metrics and config in ``workdir``.

  Args:
    config: a config from ``configs/`` (see ``train/config.py`` for every field).
    workdir: the run directory. Must hold no checkpoint unless ``config.resume``.
    should_stop: called with the step count before each step; True stops the run like
      Ctrl-C does (save, ``status="interrupted"``).

  Returns:
    A :class:`TrainResult`.

  Raises:
    NonFiniteLossError: the loss or gradient norm became NaN/inf (see the module docstring).
  """
  train_config.mesh_shape(config)  # the config's fields, and that it fits the devices (before the data is read)
  run_dir = pathlib.Path(workdir)
  run_dir.mkdir(parents=True, exist_ok=True)

  # 1. Data.
  datasets = data.build(config.data, config.seq_len, config.batch_size, config.eval_batches, config.seed)
  model_config = train_config.model_config(config)
  if datasets.vocab_size > model_config.vocab_size:
    raise ValueError(
        f"data has {datasets.vocab_size} token ids but config.model.vocab_size={model_config.vocab_size}; raise it"
    )
  say(f"data: {datasets.description}")

  # 2. Model, optimizer and the jitted pure functions (FSDP: the plan, sharded over the mesh).
  functions = step_functions(config)
  init, train_step, eval_step = functions.init, functions.train_step, functions.eval_step
  plan = functions.plan
  schedule = learning_rate_schedule(config)
  main_process = jax.process_index() == 0  # the one that writes metrics and config.json
  num_devices = 1 if plan is None else plan.mesh.size
  # XLA:CPU runs the collectives of its virtual devices on one shared thread pool: with several
  # sharded steps queued, the devices' threads can wait in different steps' rendezvous and the
  # runtime aborts after 40 s (seen on 2 cores, 8 devices). Such runs wait for each step.
  sync_each_step = plan is not None and plan.mesh.devices.flat[0].platform == "cpu"

  counts = param_count(model_config)
  tokens_per_step = config.batch_size * config.seq_len
  flops_per_step = train_flops_per_token(model_config, config.seq_len) * tokens_per_step
  peak = config.peak_tflops or metrics.peak_tflops()
  say(
      f"model: {counts['total'] / 1e6:.1f}M parameters ({counts['matmul'] / 1e6:.1f}M in matmuls), "
      f"recipe {config.recipe}, compute {config.model.dtype}, optimizer {config.optimizer}, "
      f"{flops_per_step / tokens_per_step / 1e9:.2f} GFLOP/token, {jax.devices()[0].device_kind}"
  )
  say("devices: one (unsharded)" if plan is None else f"devices: {describe_plan(plan)}")

  # 3. State: the latest checkpoint when resuming, else a fresh init.
  checkpointer = checkpoint.Checkpointer(run_dir, config.keep_checkpoints, config.async_checkpointing)
  latest = checkpointer.latest_step()
  if latest is not None and not config.resume:
    checkpointer.close()
    raise FileExistsError(
        f"{run_dir} already holds checkpoints (latest step {latest}); pass --resume to continue that run "
        "or choose another --workdir"
    )
  config_file = run_dir / checkpoint.CONFIG_FILE
  if latest is not None:
    if config_file.exists():
      old, new = json.loads(config_file.read_text()), json.loads(train_config.to_json(config))
      changed = _changed_fields(old, new) - {"resume"}
      # Another mesh only places the same run differently (the checkpoint is resharded).
      moved = sorted(field for field in changed if field.split(".")[0] == "mesh")
      if changed - set(moved):
        say(f"warning: resuming with changed config fields {sorted(changed - set(moved))}: expect a different run")
      if moved:
        say(f"config.mesh changed ({', '.join(_field_change(old, new, field) for field in moved)}): "
            "the checkpoint is resharded onto this run's devices")
    state, data_state = checkpointer.restore(latest, functions.restore_target())  # orbax reshards to this mesh
    if plan is not None and state.scales is None:  # an unsharded run's checkpoint
      state = functions.with_scales(state)
    datasets.train.restore(data_state)
    if main_process:
      metrics.truncate_after(run_dir, latest)
    say(f"resumed from {checkpointer.directory / str(latest)} (data position {datasets.train.position})")
  else:
    if config.resume:
      say(f"no checkpoint in {checkpointer.directory}: starting from step 0")
    state = init()
    if main_process:
      metrics.truncate_after(run_dir, -1)  # a fresh run starts a fresh metrics file
  if main_process:
    config_file.write_text(train_config.to_json(config))

  start_step = int(state.step)
  start_position = datasets.train.position

  def data_state_at(step: int) -> dict[str, Any]:
    """The stream's state after ``step`` (derived from the step, so it always matches the state)."""
    return {**datasets.train.state(), "position": start_position + (step - start_step) * config.batch_size}

  writer = metrics.MetricsWriter(run_dir, config.tensorboard, enabled=main_process)
  mesh_shape = None if plan is None else dict(plan.mesh.shape)
  writer.write({"step": start_step, "event": "start", "params": counts["total"], "matmul_params": counts["matmul"],
                "flops_per_token": flops_per_step / tokens_per_step, "recipe": config.recipe,
                "device": jax.devices()[0].device_kind, "peak_tflops": peak, "devices": num_devices,
                "processes": jax.process_count(), "mesh": mesh_shape})

  # 4. The loop. Step metrics stay on the device until a flush (log, eval, save, end) fetches
  # them, so the host never waits for the device between steps.
  step = start_step
  pending: list[tuple[int, dict[str, jax.Array]]] = []
  losses: list[float] = []  # host losses since the last log line
  grad_norm = float("nan")
  last_loss = val_loss = None
  saved_step = latest  # the step whose checkpoint is on disk already (None for a fresh run)
  status = "completed"
  timer, timed_steps, excluded_s, compile_s = time.perf_counter(), 0, 0.0, None

  def flush() -> None:
    """Fetch pending step metrics; NonFiniteLossError at the first bad step."""
    nonlocal grad_norm, last_loss
    for s, values in jax.device_get(pending):
      loss, norm = float(values["loss"]), float(values["grad_norm"])
      if not (math.isfinite(loss) and math.isfinite(norm)):
        last_good = checkpointer.latest_step()
        raise NonFiniteLossError(
            f"step {s}: loss {loss}, gradient norm {norm}. The run stopped and this state was not saved; "
            f"the last good checkpoint is step {last_good} in {checkpointer.directory}. Lower config.lr or raise "
            "warmup_steps, then continue with --resume (or start a new --workdir)"
            if last_good is not None
            else f"step {s}: loss {loss}, gradient norm {norm}. The run stopped before its first checkpoint; "
            "lower config.lr or raise warmup_steps and start again"
        )
      losses.append(loss)
      grad_norm, last_loss = norm, loss
    pending.clear()

  def save(step: int) -> None:
    nonlocal saved_step
    flush()  # never save a state whose step was not finite
    checkpointer.save(step, state, data_state_at(step))
    saved_step = step

  def evaluate(step: int) -> float:
    flush()
    losses = [eval_step(state.params, state.scales, functions.shard_eval_batch(b)) for b in datasets.validation]
    value = float(np.mean(jax.device_get(losses)))
    writer.write({"step": step, "val_loss": value})
    say(f"step {step}: validation loss {value:.4f}")
    return value

  stop = StopRequest()
  try:
    with stop.installed():
      while step < config.steps:
        wants_stop = stop.requested or (should_stop is not None and should_stop(step))
        if jax.process_count() > 1:  # all processes must stop after the same step: agree at log boundaries
          wants_stop = step % config.log_every == 0 and _any_process(wants_stop)
        if wants_stop:
          status = "interrupted"
          break
        batch = functions.shard_train_batch(datasets.train.next())  # every process reads the same global batch
        if step + 1 == config.inject_nan_at_step:  # fault injection (tests, drills): the model diverges here
          state = state.replace(params=jax.tree.map(lambda p: p * jnp.nan, state.params))
        state, step_metrics = train_step(state, batch)
        if sync_each_step:
          jax.block_until_ready(step_metrics)
        step += 1
        pending.append((step, step_metrics))

        if compile_s is None:  # the first step compiles: keep it out of the throughput
          jax.block_until_ready(step_metrics)
          compile_s = time.perf_counter() - timer
          say(f"compiled and ran the first step in {compile_s:.1f} s")
          timer, timed_steps = time.perf_counter(), 0
        else:
          timed_steps += 1

        if step % config.log_every == 0 or step == config.steps:
          flush()
          elapsed = time.perf_counter() - timer - excluded_s
          step_time = elapsed / timed_steps if timed_steps else None  # None: only the compiling step ran
          record = {
              "step": step,
              "loss": float(np.mean(losses)),
              "grad_norm": grad_norm,
              "lr": float(schedule(step - 1)),
              "tokens_per_s": tokens_per_step / step_time if step_time else None,
              "step_time_s": step_time,
              "mfu": metrics.mfu(flops_per_step, step_time, peak, num_devices) if step_time else None,
              "tokens": step * tokens_per_step,
              "compile_s": compile_s,
          }
          writer.write(record)
          say(metrics.progress_line(record, config.steps))
          losses.clear()
          timer, timed_steps, excluded_s = time.perf_counter(), 0, 0.0

        eval_due = step % config.eval_every == 0 or step == config.steps
        save_due = step % config.checkpoint_every == 0 or step == config.steps
        if eval_due or save_due:
          flush()  # waiting for the training steps still counts as training time
          paused = time.perf_counter()
          if eval_due:
            val_loss = evaluate(step)
          if save_due:
            save(step)
          excluded_s += time.perf_counter() - paused
  except KeyboardInterrupt:
    status = "interrupted"
  except NonFiniteLossError:
    writer.close()
    checkpointer.close()  # finishes saves of earlier, good steps
    raise

  # 5. Finish: on interruption, save where we are (if the state is intact and finite).
  if status == "interrupted":
    if not _alive(state):
      say(f"interrupted mid-step; kept the last checkpoint (step {checkpointer.latest_step()})")
    elif saved_step != int(state.step):
      step = int(state.step)  # the state is the authority (an interrupt may land between two statements)
      try:
        if not _finite(state.params):
          raise NonFiniteLossError(f"step {step}: parameters are not finite; kept the last checkpoint")
        save(step)
      except NonFiniteLossError:
        writer.close()
        checkpointer.close()
        raise
      say(f"interrupted at step {step}: saved a checkpoint; continue with --resume")
  writer.close()
  checkpointer.close()
  last_checkpoint = checkpointer.latest_step() if saved_step is None else saved_step
  return TrainResult(status, step, last_loss, val_loss, last_checkpoint)
