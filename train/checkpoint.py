"""Checkpoints: the train state and the data stream's position, saved together by orbax.

Layout of a run directory::

    RUN_DIR/config.json           the config of the run (written at start)
    RUN_DIR/checkpoints/<step>/   one orbax checkpoint per saved step, items:
        state/                    TrainState pytree (step, params, opt_state, rng)
        data/                     JSON: the data stream's state (position, seed, ...)
    RUN_DIR/metrics.jsonl         see train/metrics.py

Saves are asynchronous (orbax copies the arrays off the device before ``save`` returns and
writes in a background thread) and only the last ``keep`` checkpoints are kept. A
checkpoint directory appears under its final name only once complete, so a crash mid-save
leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

CHECKPOINT_DIR = "checkpoints"
CONFIG_FILE = "config.json"


class Checkpointer:
  """Save and restore ``(state, data_state)`` pairs under ``RUN_DIR/checkpoints``."""

  def __init__(self, run_dir: str | pathlib.Path, keep: int, async_save: bool = True):
    self.directory = pathlib.Path(run_dir).absolute() / CHECKPOINT_DIR
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None."""
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, state: Any, data_state: dict[str, Any]) -> None:
    """Start saving ``state`` (a pytree of arrays) and ``data_state`` (JSON) as ``step``."""
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state))
    self.manager.save(step, args=args, force=True)

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """``(state, data_state)`` of checkpoint ``step``.

    Args:
      step: a step from :meth:`all_steps`.
      abstract_state: the state's structure with ``jax.ShapeDtypeStruct`` leaves that carry
        the target ``sharding`` (see :func:`abstract_on_device`).
    """
    args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore())
    restored = self.manager.restore(step, args=args)
    return restored.state, restored.data

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
