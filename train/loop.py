"""The training loop, in the order it runs: data, step functions, state, loop, finish.

``train(config, workdir)`` trains ``config`` in ``workdir`` and returns a :class:`TrainResult`.
The pieces it runs live beside it: the pure step functions and their compiled form in
``train/steps.py``, where they execute (one device or FSDP, chosen once from ``config.mesh``)
in ``train/runtime.py``, stop requests and config diffs in ``train/run_control.py``.
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

import dataclasses
import json
import math
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
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
from train.spec import resolve
from train.steps import step_functions


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

  # 1. Data.
  datasets = data.build(spec.data, spec.seq_len, spec.batch_size, spec.eval_batches, spec.seed)
  model_config = spec.model
  if datasets.vocab_size > model_config.vocab_size:
    raise train_config.ConfigError(
        f"data has {datasets.vocab_size} token ids but config.model.vocab_size={model_config.vocab_size}; raise it"
    )
  say(f"data: {datasets.description}")

  # 2. Model, optimizer and the jitted pure functions, on the runtime config.mesh asks for.
  functions = step_functions(spec)
  init, train_step, eval_step = functions.init, functions.train_step, functions.eval_step
  runtime = functions.runtime
  schedule = learning_rate_schedule(spec)
  main_process = jax.process_index() == 0  # the one that writes metrics and config.json
  num_devices = runtime.num_devices

  counts = param_count(model_config)
  tokens_per_step = spec.batch_size * spec.seq_len
  flops_per_step = train_flops_per_token(model_config, spec.seq_len) * tokens_per_step
  peak = spec.peak_tflops or metrics.peak_tflops()
  say(
      f"model: {counts['total'] / 1e6:.1f}M parameters ({counts['matmul'] / 1e6:.1f}M in matmuls), "
      f"recipe {spec.recipe}, compute {jnp.dtype(spec.model.dtype).name}, optimizer {spec.optimizer.name}, "
      f"{flops_per_step / tokens_per_step / 1e9:.2f} GFLOP/token, {jax.devices()[0].device_kind}"
  )
  say(f"devices: {runtime.describe()}")

  # 3. State: the latest checkpoint when resuming, else a fresh init.
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
  config_file = run_dir / checkpoint.CONFIG_FILE
  log_losses: list[float] = []  # losses of the log interval the checkpoint was saved in
  if latest is not None:
    if config_file.exists():
      old = cli.read_json(config_file, "run config", "restore it, or delete it to resume without comparing configs")
      new = json.loads(train_config.to_json(config))
      changed = changed_fields(old, new) - {"resume"}
      # Another mesh only places the same run differently (the checkpoint is resharded).
      moved = sorted(field for field in changed if field.split(".")[0] == "mesh")
      check_resumable(old, config, changed - set(moved))  # other shapes: refused before any restore
      if changed - set(moved):
        say(f"warning: resuming with changed config fields {sorted(changed - set(moved))}: expect a different run")
      if moved:
        say(f"config.mesh changed ({', '.join(field_change(old, new, field) for field in moved)}): "
            "the checkpoint is resharded onto this run's devices")
    try:  # orbax reshards to this mesh; corrupt checkpoints are skipped for the newest intact one
      latest, state, data_state, problems = checkpointer.restore_latest(functions.restore_target())
    except checkpoint.CheckpointError:
      checkpointer.close()
      raise
    for problem in problems:
      say(f"warning: {problem}")
    if runtime.mesh_shape is not None and state.scales is None:  # FSDP resuming an unsharded run's checkpoint
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
    state = init()
    if spec.init_from:  # a Hugging Face checkpoint's weights (train.hf)
      state = functions.with_pretrained(state, spec)
    if main_process:
      metrics.truncate_after(run_dir, -1)  # a fresh run starts a fresh metrics file
  if main_process:
    config_file.write_text(train_config.to_json(config))

  start_step = int(state.step)
  start_position = datasets.train.position

  def data_state_at(step: int) -> dict[str, Any]:
    """The stream's state after ``step`` (derived from the step, so it always matches the state), and the
    losses logged since the last log line, so a resumed run logs the same interval means."""
    return {**datasets.train.state(), "position": start_position + (step - start_step) * spec.batch_size,
            LOG_LOSSES: list(losses)}

  writer = metrics.MetricsWriter(run_dir, spec.tensorboard, enabled=main_process)
  writer.write({"step": start_step, "event": "start", "params": counts["total"], "matmul_params": counts["matmul"],
                "flops_per_token": flops_per_step / tokens_per_step, "recipe": spec.recipe,
                "device": jax.devices()[0].device_kind, "peak_tflops": peak, "devices": num_devices,
                "processes": jax.process_count(), "mesh": runtime.mesh_shape})

  # 4. The loop. Step metrics stay on the device until a flush (log, eval, save, end) fetches
  # them, so the host never waits for the device between steps.
  step = recorded = start_step
  pending: list[tuple[int, dict[str, jax.Array]]] = []
  losses: list[float] = log_losses  # host losses since the last log line
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
        last_good = checkpointer.last_good_step()
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
  with stop.installed():  # until the last save is on disk: a repeated signal must not cut it short
    try:
      while step < spec.steps:
        wants_stop = stop.requested or (should_stop is not None and should_stop(step))
        if jax.process_count() > 1:  # all processes must stop after the same step: agree at log boundaries
          wants_stop = step % spec.log_every == 0 and any_process(wants_stop)
        if wants_stop:
          status = "interrupted"
          break
        batch = functions.shard_train_batch(datasets.train.next_global())  # each process reads its devices' rows
        if step + 1 == spec.inject_nan_at_step:  # fault injection (tests, drills): the model diverges here
          state = state.replace(params=jax.tree.map(lambda p: p * jnp.nan, state.params))
        state, step_metrics = train_step(state, batch)
        if runtime.sync_each_step:
          jax.block_until_ready(step_metrics)
        step += 1
        pending.append((step, step_metrics))
        recorded = step  # the state and the metrics agree up to here (a forced stop saves no state past it)

        if compile_s is None:  # the first step compiles: keep it out of the throughput
          jax.block_until_ready(step_metrics)
          compile_s = time.perf_counter() - timer
          say(f"compiled and ran the first step in {compile_s:.1f} s")
          timer, timed_steps = time.perf_counter(), 0
        else:
          timed_steps += 1

        if step % spec.log_every == 0 or step == spec.steps:
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
          say(metrics.progress_line(record, spec.steps))
          losses.clear()
          timer, timed_steps, excluded_s = time.perf_counter(), 0, 0.0

        eval_due = step % spec.eval_every == 0 or step == spec.steps
        save_due = step % spec.checkpoint_every == 0 or step == spec.steps
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
    except (NonFiniteLossError, checkpoint.CheckpointError):
      writer.close()
      close_quietly(checkpointer)  # finishes saves of earlier, good steps
      raise

    # 5. Finish: on interruption, save where we are (if the state is intact and finite).
    if status == "interrupted":
      if not alive(state) or int(state.step) != recorded:  # a forced stop landed inside a step or its bookkeeping
        say(f"interrupted mid-step; kept the last checkpoint (step {checkpointer.last_good_step()})")
      elif saved_step != int(state.step):
        step = int(state.step)
        try:
          if not finite(state.params):
            raise NonFiniteLossError(f"step {step}: parameters are not finite; kept the last checkpoint")
          save(step)
        except (NonFiniteLossError, checkpoint.CheckpointError):
          writer.close()
          close_quietly(checkpointer)
          raise
        say(f"interrupted at step {step}: saved a checkpoint; continue with --resume")
    writer.close()
    checkpointer.close()  # a save that fails only now raises CheckpointSaveError here
  last_checkpoint = checkpointer.latest_step() if saved_step is None else saved_step
  export_args = "--scheme tq2_0" if spec.recipe.startswith("bitnet") else ""  # BitNet norms: GGUF, not Llama HF
  for line in metrics.run_summary(run_dir, status, step, spec.steps, None if last_checkpoint is None else
                                  checkpointer.directory / str(last_checkpoint), export_args):
    say(line)
  return TrainResult(status, step, last_loss, val_loss, last_checkpoint, stop.signal)
