"""The training loop, in the order it runs: resolve, data, step functions, restore-or-init, loop, finish.

``train(config, workdir)`` trains ``config`` in ``workdir`` and returns a :class:`TrainResult`.
:func:`train` is the page to read: each stage is a small function below it, and the loop's state
between steps is a :class:`Run`. The config is resolved once into a ``train.spec.RunSpec`` that
everything after reads. The pieces it runs live beside it: the pure step functions and their
compiled form in ``train/steps.py``, where they execute (one device or FSDP, chosen once from the
resolved mesh) in ``train/runtime.py``, stop requests and config diffs in ``train/run_control.py``.
With several processes (hosts) every process follows the same deterministic data stream and
reads only the rows of each global batch that its devices hold; only process 0 writes
metrics, the config and progress lines.

Robustness:

- Loss or gradient norm not finite: the run stops with :class:`NonFiniteLossError` naming
  the step. That state is never saved; the newest checkpoint on disk is the last good one.
  (Metrics are fetched every ``log_every`` steps and before every save, so the run stops at
  most ``log_every - 1`` steps after the bad one, and never saves past it.)
- Ctrl-C (SIGINT) or SIGTERM (what schedulers send before preempting a job): the loop finishes
  the step it is in, saves a checkpoint and returns with ``status="interrupted"``
  (``train.main`` exits 130 or 143). Signals within ``run_control.REPEAT_WINDOW_S`` of the first
  repeat the request (a double-tapped Ctrl-C still saves); a later one stops at once, and the
  state is then saved only if it is intact and every step's metrics were recorded.
- Checkpoints carry a manifest of their files' checksums; resuming skips a corrupt or unreadable
  newest checkpoint (and says so) for the newest intact one, and a failed save (disk full,
  permissions) stops the run with :class:`~train.checkpoint.CheckpointSaveError` keeping the last
  good checkpoint. Resuming with a config whose state has other shapes is refused before any
  restore (:func:`train.run_control.check_resumable`).
- Resume: the checkpoint holds the state (params, optimizer state, step, rng), the data
  stream's position and the losses of the log interval in progress, so a resumed run
  reproduces an uninterrupted one exactly, logged losses included.
- Drills: ``config.inject_nan_at_step = s`` turns the parameters NaN right before step ``s``
  (in the loop, not in the jitted step), to exercise the non-finite path end to end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pathlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from train import checkpoint, cli, data, metrics
from train import config as train_config
from train.metrics import say
from train.model import param_count, train_flops_per_token
from train.optimizer import learning_rate_schedule
from train.run_control import (
    StopRequest,
    alive,
    any_process,
    changed_fields,
    check_resumable,
    close_quietly,
    field_change,
    finite,
)
from train.spec import RunSpec, resolve
from train.steps import StepFunctions, TrainState, step_functions

if TYPE_CHECKING:  # the config is only handed to train.config / train.spec here, never read
  import ml_collections


# The data item of a checkpoint also holds the losses of its unfinished log interval.
LOG_LOSSES = "log_losses"


class NonFiniteLossError(FloatingPointError):
  """The loss or gradient norm became NaN/inf; nothing after the last good checkpoint was saved."""


@dataclasses.dataclass
class TrainResult:
  """How :func:`train` ended: ``status`` is ``"completed"`` or ``"interrupted"``.

  ``stop_signal`` is the signal that interrupted the run (``signal.SIGINT`` / ``SIGTERM``), if one did.
  """

  status: str
  step: int
  loss: float | None
  val_loss: float | None
  checkpoint_step: int | None
  stop_signal: int | None = None


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
  notes = train_config.adjust(config)  # e.g. a warmup longer than a short run
  spec = resolve(config)  # every field, and that it fits the devices: before any output or work
  for note in notes:
    say(note)
  run_dir = cli.check_output_dir(workdir, "--workdir")  # a file in the way or a read-only folder: one line

  # 1. Data, and the jitted pure functions on the runtime the mesh asks for.
  datasets = build_data(spec)
  functions = step_functions(spec)
  throughput = Throughput.of(spec, functions)
  say(f"devices: {functions.runtime.describe()}")

  # 2. State: the latest checkpoint when resuming, else a fresh init.
  checkpointer, latest = open_checkpointer(spec, run_dir)
  state, latest, log_losses = restore_or_init(spec, run_dir, checkpointer, latest, functions, datasets)
  writer = metrics.MetricsWriter(run_dir, spec.tensorboard, enabled=jax.process_index() == 0)
  writer.write({"step": int(state.step), "event": "start", **throughput.start_record(spec, functions)})
  throughput.restart()  # the clock starts with the loop

  # 3. The loop, and 4. finish: on interruption, save where it stopped (if the state is intact and finite).
  run = Run(spec, functions, datasets, checkpointer, writer, throughput, state, latest, log_losses)
  stop = StopRequest()
  with stop.installed():  # until the last save is on disk: a repeated signal must not cut it short
    try:
      status = run.loop(stop, should_stop)
    except KeyboardInterrupt:
      status = "interrupted"
    except (NonFiniteLossError, checkpoint.CheckpointError):
      run.abandon()
      raise
    if status == "interrupted":
      run.save_where_stopped()
    writer.close()
    checkpointer.close()  # a save that fails only now raises CheckpointSaveError here
  return run.result(run_dir, status, stop.signal)


# ---------------------------------------------------------------------------------------------
# Before the loop: data, throughput accounting, checkpoints and the state.


def build_data(spec: RunSpec) -> data.Datasets:
  """The training stream and validation batches; ConfigError when their ids do not fit the vocabulary."""
  datasets = data.build(spec.data, spec.seq_len, spec.batch_size, spec.eval_batches, spec.seed)
  if datasets.vocab_size > spec.model.vocab_size:
    raise train_config.ConfigError(
        f"data has {datasets.vocab_size} token ids but config.model.vocab_size={spec.model.vocab_size}; raise it"
    )
  say(f"data: {datasets.description}")
  return datasets


@dataclasses.dataclass
class Throughput:
  """Step timing between two log lines: the first (compiling) step and eval/save pauses are left out."""

  counts: dict[str, int]  # param_count: total and in matmuls
  tokens_per_step: int
  flops_per_step: float
  peak: float | None
  num_devices: int
  timer: float = dataclasses.field(default_factory=time.perf_counter)
  timed_steps: int = 0
  excluded_s: float = 0.0
  compile_s: float | None = None

  @classmethod
  def of(cls, spec: RunSpec, functions: StepFunctions) -> Throughput:
    """The run's FLOPs and the device's peak; says the model line."""
    counts = param_count(spec.model)
    flops_per_step = train_flops_per_token(spec.model, spec.seq_len) * spec.tokens_per_step
    say(
        f"model: {counts['total'] / 1e6:.1f}M parameters ({counts['matmul'] / 1e6:.1f}M in matmuls), "
        f"recipe {spec.recipe}, compute {jnp.dtype(spec.model.dtype).name}, optimizer {spec.optimizer.name}, "
        f"{flops_per_step / spec.tokens_per_step / 1e9:.2f} GFLOP/token, {jax.devices()[0].device_kind}"
    )
    return cls(counts, spec.tokens_per_step, flops_per_step, spec.peak_tflops or metrics.peak_tflops(),
               functions.runtime.num_devices)

  def start_record(self, spec: RunSpec, functions: StepFunctions) -> dict[str, Any]:
    """The metrics file's ``start`` event (model size, FLOPs, devices)."""
    return {"params": self.counts["total"], "matmul_params": self.counts["matmul"],
            "flops_per_token": self.flops_per_step / self.tokens_per_step, "recipe": spec.recipe,
            "device": jax.devices()[0].device_kind, "peak_tflops": self.peak, "devices": self.num_devices,
            "processes": jax.process_count(), "mesh": functions.runtime.mesh_shape}

  def stepped(self, step_metrics: dict[str, jax.Array]) -> None:
    """Count a step; the first one compiles: time it on its own and start the clock after it."""
    if self.compile_s is None:
      jax.block_until_ready(step_metrics)
      self.compile_s = time.perf_counter() - self.timer
      say(f"compiled and ran the first step in {self.compile_s:.1f} s")
      self.timer, self.timed_steps = time.perf_counter(), 0
    else:
      self.timed_steps += 1

  def record(self, step: int) -> dict[str, Any]:
    """Step time, tokens/s, MFU since the last :meth:`restart` (None when only the compiling step ran)."""
    elapsed = time.perf_counter() - self.timer - self.excluded_s
    step_time = elapsed / self.timed_steps if self.timed_steps else None
    return {
        "tokens_per_s": self.tokens_per_step / step_time if step_time else None,
        "step_time_s": step_time,
        "mfu": metrics.mfu(self.flops_per_step, step_time, self.peak, self.num_devices) if step_time else None,
        "tokens": step * self.tokens_per_step,
        "compile_s": self.compile_s,
    }

  def restart(self) -> None:
    self.timer, self.timed_steps, self.excluded_s = time.perf_counter(), 0, 0.0

  @contextlib.contextmanager
  def paused(self) -> Iterator[None]:
    """Time spent inside (evaluation, saving) is not training time."""
    paused = time.perf_counter()
    try:
      yield
    finally:
      self.excluded_s += time.perf_counter() - paused


def open_checkpointer(spec: RunSpec, run_dir: pathlib.Path) -> tuple[checkpoint.Checkpointer, int | None]:
  """The run's checkpointer (leftovers of unfinished saves removed) and its latest step; FileExistsError
  for another run's checkpoints without ``--resume``."""
  checkpointer = checkpoint.Checkpointer(run_dir, spec.keep_checkpoints, spec.async_checkpointing)
  for path in checkpointer.leftovers:
    say(f"removed {path}: the leftover of a save that did not finish")
  latest = checkpointer.latest_step()
  if latest is not None and not spec.resume:
    checkpointer.close()
    raise FileExistsError(
        f"{run_dir} already holds checkpoints (latest step {latest}); pass --resume to continue that run "
        "or choose another --workdir"
    )
  return checkpointer, latest


def restore_or_init(spec: RunSpec, run_dir: pathlib.Path, checkpointer: checkpoint.Checkpointer, latest: int | None,
                    functions: StepFunctions, datasets: data.Datasets) -> tuple[TrainState, int | None, list[float]]:
  """``(state, latest checkpoint step or None, losses of its unfinished log interval)``; writes config.json
  (``spec.config_json``).

  Resuming: the newest intact checkpoint, the data stream moved to its position and the metrics
  file cut back to it. Else a fresh init (with ``init_from``'s weights) and a fresh metrics file.
  """
  main_process = jax.process_index() == 0  # the one that writes metrics and config.json
  config_file = run_dir / checkpoint.CONFIG_FILE
  log_losses = []
  if latest is not None:
    if config_file.exists():
      compare_configs(config_file, spec)
    try:  # orbax reshards to this mesh; corrupt checkpoints are skipped for the newest intact one
      latest, state, data_state, problems = checkpointer.restore_latest(functions.restore_target())
    except checkpoint.CheckpointError:
      checkpointer.close()
      raise
    for problem in problems:
      say(f"warning: {problem}")
    if functions.runtime.mesh_shape is not None and state.scales is None:  # FSDP resuming an unsharded checkpoint
      state = functions.with_scales(state)
    datasets.train.restore(data_state)
    log_losses = list(data_state.get(LOG_LOSSES, []))
    if main_process:
      metrics.truncate_after(run_dir, latest)
    say(f"resumed from {checkpointer.directory / str(latest)} (data position {datasets.train.position})")
    if latest >= spec.steps:
      say(f"this run already finished: its checkpoint is at step {latest} and config.steps={spec.steps}; "
          "raise --config.steps to train further")
  else:
    if spec.resume:
      say(f"no checkpoint in {checkpointer.directory}: starting from step 0")
    state = functions.init()
    if spec.init_from:  # a Hugging Face checkpoint's weights (train.hf)
      state = functions.with_pretrained(state, spec)
    if main_process:
      metrics.truncate_after(run_dir, -1)  # a fresh run starts a fresh metrics file
  if main_process:
    config_file.write_text(spec.config_json)
  return state, latest, log_losses


def compare_configs(config_file: pathlib.Path, spec: RunSpec) -> None:
  """Say which fields a resume changes (the saved config.json against ``spec.config_json``); ConfigError
  (before any restore) when the saved state's shapes differ."""
  old = cli.read_json(config_file, "run config", "restore it, or delete it to resume without comparing configs")
  new = json.loads(spec.config_json)
  changed = changed_fields(old, new) - {"resume"}
  # Another mesh only places the same run differently (the checkpoint is resharded).
  moved = sorted(field for field in changed if field.split(".")[0] == "mesh")
  check_resumable(old, spec, changed - set(moved))  # other shapes: refused before any restore
  if changed - set(moved):
    say(f"warning: resuming with changed config fields {sorted(changed - set(moved))}: expect a different run")
  if moved:
    say(f"config.mesh changed ({', '.join(field_change(old, new, field) for field in moved)}): "
        "the checkpoint is resharded onto this run's devices")


# ---------------------------------------------------------------------------------------------
# The loop.


class Run:
  """The loop's state between steps: the train state, step metrics not yet fetched, the losses of
  the log interval in progress and the newest checkpoint on disk.

  Step metrics stay on the device until a flush (log, eval, save, end) fetches them, so the host
  never waits for the device between steps.
  """

  def __init__(self, spec: RunSpec, functions: StepFunctions, datasets: data.Datasets,
               checkpointer: checkpoint.Checkpointer, writer: metrics.MetricsWriter, throughput: Throughput,
               state: TrainState, latest: int | None, log_losses: list[float]):
    self.spec, self.functions, self.datasets = spec, functions, datasets
    self.checkpointer, self.writer, self.throughput = checkpointer, writer, throughput
    self.schedule = learning_rate_schedule(spec)
    self.state = state
    self.start_step = self.step = self.recorded = int(state.step)
    self.start_position = datasets.train.position
    self.pending: list[tuple[int, dict[str, jax.Array]]] = []
    self.losses: list[float] = log_losses  # host losses since the last log line
    self.grad_norm = float("nan")
    self.last_loss: float | None = None
    self.val_loss: float | None = None
    self.saved_step = latest  # the step whose checkpoint is on disk already (None for a fresh run)

  def loop(self, stop: StopRequest, should_stop: Callable[[int], bool] | None) -> str:
    """Train until ``spec.steps`` (``"completed"``) or a stop request (``"interrupted"``)."""
    spec = self.spec
    while self.step < spec.steps:
      wants_stop = stop.requested or (should_stop is not None and should_stop(self.step))
      if jax.process_count() > 1:  # all processes must stop after the same step: agree at log boundaries
        wants_stop = self.step % spec.log_every == 0 and any_process(wants_stop)
      if wants_stop:
        return "interrupted"
      self.train_one_step()
      if self.step % spec.log_every == 0 or self.step == spec.steps:
        self.log()
      eval_due = self.step % spec.eval_every == 0 or self.step == spec.steps
      save_due = self.step % spec.checkpoint_every == 0 or self.step == spec.steps
      if eval_due or save_due:
        self.flush()  # waiting for the training steps still counts as training time
        with self.throughput.paused():
          if eval_due:
            self.val_loss = self.evaluate()
          if save_due:
            self.save(self.step)
    return "completed"

  def train_one_step(self) -> None:
    batch = self.functions.shard_train_batch(self.datasets.train.next_global())  # each process: its devices' rows
    if self.step + 1 == self.spec.inject_nan_at_step:  # fault injection (tests, drills): the model diverges here
      self.state = self.state.replace(params=jax.tree.map(lambda p: p * jnp.nan, self.state.params))
    self.state, step_metrics = self.functions.train_step(self.state, batch)
    if self.functions.runtime.sync_each_step:
      jax.block_until_ready(step_metrics)
    self.step += 1
    self.pending.append((self.step, step_metrics))
    self.recorded = self.step  # the state and the metrics agree up to here (a forced stop saves no state past it)
    self.throughput.stepped(step_metrics)

  def flush(self) -> None:
    """Fetch pending step metrics; NonFiniteLossError at the first bad step."""
    for s, values in jax.device_get(self.pending):
      loss, norm = float(values["loss"]), float(values["grad_norm"])
      if not (math.isfinite(loss) and math.isfinite(norm)):
        last_good = self.checkpointer.last_good_step()
        raise NonFiniteLossError(
            f"step {s}: loss {loss}, gradient norm {norm}. The run stopped and this state was not saved; "
            f"the last good checkpoint is step {last_good} in {self.checkpointer.directory}. Lower config.lr or "
            "raise warmup_steps, then continue with --resume (or start a new --workdir)"
            if last_good is not None
            else f"step {s}: loss {loss}, gradient norm {norm}. The run stopped before its first checkpoint; "
            "lower config.lr or raise warmup_steps and start again"
        )
      self.losses.append(loss)
      self.grad_norm, self.last_loss = norm, loss
    self.pending.clear()

  def log(self) -> None:
    """One metrics record and progress line: the interval's mean loss, the last gradient norm, throughput."""
    self.flush()
    record = {
        "step": self.step,
        "loss": float(np.mean(self.losses)),
        "grad_norm": self.grad_norm,
        "lr": float(self.schedule(self.step - 1)),
        **self.throughput.record(self.step),
    }
    self.writer.write(record)
    say(metrics.progress_line(record, self.spec.steps))
    self.losses.clear()
    self.throughput.restart()

  def evaluate(self) -> float:
    self.flush()
    state, functions = self.state, self.functions
    losses = [functions.eval_step(state.params, state.scales, functions.shard_eval_batch(b))
              for b in self.datasets.validation]
    value = float(np.mean(jax.device_get(losses)))
    self.writer.write({"step": self.step, "val_loss": value})
    say(f"step {self.step}: validation loss {value:.4f}")
    return value

  def data_state_at(self, step: int) -> dict[str, Any]:
    """The stream's state after ``step`` (derived from the step, so it always matches the state), and the
    losses logged since the last log line, so a resumed run logs the same interval means."""
    position = self.start_position + (step - self.start_step) * self.spec.batch_size
    return {**self.datasets.train.state(), "position": position, LOG_LOSSES: list(self.losses)}

  def save(self, step: int) -> None:
    self.flush()  # never save a state whose step was not finite
    self.checkpointer.save(step, self.state, self.data_state_at(step))
    self.saved_step = step

  def save_where_stopped(self) -> None:
    """After an interruption: save the state unless a forced stop cut a step short or it is not finite."""
    state = self.state
    if not alive(state) or int(state.step) != self.recorded:  # a forced stop landed inside a step or its bookkeeping
      say(f"interrupted mid-step; kept the last checkpoint (step {self.checkpointer.last_good_step()})")
    elif self.saved_step != int(state.step):
      self.step = int(state.step)
      try:
        if not finite(state.params):
          raise NonFiniteLossError(f"step {self.step}: parameters are not finite; kept the last checkpoint")
        self.save(self.step)
      except (NonFiniteLossError, checkpoint.CheckpointError):
        self.abandon()
        raise
      say(f"interrupted at step {self.step}: saved a checkpoint; continue with --resume")

  def abandon(self) -> None:
    """Close after an error, finishing the saves of earlier, good steps."""
    self.writer.close()
    close_quietly(self.checkpointer)

  def result(self, run_dir: pathlib.Path, status: str, stop_signal: int | None) -> TrainResult:
    """The :class:`TrainResult`, after the summary lines (where the checkpoint is, how to export it)."""
    checkpointer = self.checkpointer
    last_checkpoint = checkpointer.latest_step() if self.saved_step is None else self.saved_step
    export_args = "--scheme tq2_0" if self.spec.recipe.startswith("bitnet") else ""  # BitNet norms: GGUF
    for line in metrics.run_summary(run_dir, status, self.step, self.spec.steps, None if last_checkpoint is None
                                    else checkpointer.directory / str(last_checkpoint), export_args):
      say(line)
    return TrainResult(status, self.step, self.last_loss, self.val_loss, last_checkpoint, stop_signal)
