"""Checkpoints: the train state and the data stream's position, saved together by orbax.

Layout of a run directory::

    RUN_DIR/config.json           the config of the run (written at start)
    RUN_DIR/checkpoints/<step>/   one orbax checkpoint per saved step, items:
        state/                    TrainState fields step, params, opt_state, rng
        scales/                   FSDP runs only: TrainState.scales (the next step's weight scales)
        data/                     JSON: the data stream's state (position, seed, ...)
    RUN_DIR/metrics.jsonl         see train/metrics.py

Sharded arrays are saved as shards (each process writes its own; orbax coordinates the
processes of a multi-host run, so the run directory must be on a filesystem every host
sees) and restored into whatever shardings the restore target names, so a checkpoint of
one mesh resumes on another. The scales are an item of their own so that an unsharded
run's checkpoint is the same with or without FSDP: an FSDP run resuming from it computes
them from the parameters, an unsharded run resuming from an FSDP checkpoint ignores them.

Saves are asynchronous (orbax copies the arrays off the device before ``save`` returns and
writes in a background thread) and only the last ``keep`` checkpoints are kept. A
checkpoint directory appears under its final name only once complete, so a crash mid-save
leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

CHECKPOINT_DIR = "checkpoints"
CONFIG_FILE = "config.json"
SCALES = "scales"  # the TrainState field saved as an item of its own


def _fields(state: Any) -> dict[str, Any]:
  """A TrainState's fields except the scales, as a dict (what the ``state`` item holds)."""
  return {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != SCALES}


class Checkpointer:
  """Save and restore ``(TrainState, data_state)`` pairs under ``RUN_DIR/checkpoints``."""

  def __init__(self, run_dir: str | pathlib.Path, keep: int, async_save: bool = True):
    self.directory = pathlib.Path(run_dir).absolute() / CHECKPOINT_DIR
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", SCALES, "data"))

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None."""
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, state: Any, data_state: dict[str, Any]) -> None:
    """Start saving ``state`` (a ``TrainState`` of arrays) and ``data_state`` (JSON) as ``step``."""
    items = {"state": ocp.args.StandardSave(_fields(state)), "data": ocp.args.JsonSave(data_state)}
    if jax.tree.leaves(state.scales):  # FSDP with quantized linears
      items[SCALES] = ocp.args.StandardSave(state.scales)
    self.manager.save(step, args=ocp.args.Composite(**items), force=True)

  def has_scales(self, step: int) -> bool:
    """Whether checkpoint ``step`` was written by an FSDP run (it holds the weight scales)."""
    return (self.directory / str(step) / SCALES).is_dir()

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """``(state, data_state)`` of checkpoint ``step``.

    Args:
      step: a step from :meth:`all_steps`.
      abstract_state: a ``TrainState`` with ``jax.ShapeDtypeStruct`` leaves that carry the
        target ``sharding`` (see :func:`abstract_on_device`).

    Returns:
      The state (its ``scales`` None when the target or the checkpoint holds none: the
      caller computes them) and the data stream's state.
    """
    items = {"state": ocp.args.StandardRestore(_fields(abstract_state)), "data": ocp.args.JsonRestore()}
    with_scales = bool(jax.tree.leaves(abstract_state.scales)) and self.has_scales(step)
    if with_scales:
      items[SCALES] = ocp.args.StandardRestore(abstract_state.scales)
    restored = self.manager.restore(step, args=ocp.args.Composite(**items))
    state = abstract_state.replace(**restored.state, scales=restored[SCALES] if with_scales else None)
    return state, restored.data

  def wait(self) -> None:
    """Block until every started save is on disk."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_on_device(abstract_state: Any, device: jax.Device | None = None) -> Any:
  """``jax.eval_shape`` output with every leaf placed on one device (the restore target)."""
  sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), abstract_state)


def restore_latest(run_dir: str | pathlib.Path, abstract_state: Any) -> tuple[int, Any, dict[str, Any]]:
  """``(step, state, data_state)`` of the newest checkpoint of ``run_dir`` (for tools and tests)."""
  checkpointer = Checkpointer(run_dir, keep=1_000_000, async_save=False)
  try:
    step = checkpointer.latest_step()
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {checkpointer.directory}")
    state, data_state = checkpointer.restore(step, abstract_state)
    return step, state, data_state
  finally:
    checkpointer.close()
