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

Integrity: once a save is on disk (at the next save, or at close), process 0 writes
``RUN_DIR/checkpoints/<step>/jaxlowbit_manifest.json``: every file's size and CRC-32 (in a
background thread: reading a large checkpoint back must not stall training).
:meth:`Checkpointer.restore_latest` checks it and skips a checkpoint whose files changed, are
missing or do not restore (a bit flip loads silently in orbax), falling back to the newest
intact one; :meth:`Checkpointer.last_good_step` only ever names a verified checkpoint. A
checkpoint without a manifest (the run stopped between orbax's commit and the manifest) is
tried but reported as unverified. Leftovers of failed or interrupted saves
(``*.orbax-checkpoint-tmp*``) are removed when a run starts. A save that cannot fit on the disk
is refused before anything is written; any failed save raises :class:`CheckpointSaveError`
(one line: step, path, cause), and the last good checkpoint stays.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import threading
import zlib
from typing import Any

import jax
import orbax.checkpoint as ocp

CHECKPOINT_DIR = "checkpoints"
CONFIG_FILE = "config.json"
SCALES = "scales"  # the TrainState field saved as an item of its own
MANIFEST = "jaxlowbit_manifest.json"
LEFTOVER_PATTERN = "*.orbax-checkpoint-tmp*"  # what orbax writes into until a save commits
# A save needs the state's bytes free (plus orbax's metadata): refuse one that cannot fit.
SPACE_MARGIN = 1.1
_CRC_CHUNK = 1 << 24


class CheckpointError(RuntimeError):
  """A checkpoint could not be saved or restored (the message is one line a user can act on)."""


class CheckpointSaveError(CheckpointError):
  """Saving a checkpoint failed (disk full, permissions, ...); the previous checkpoints are kept."""


class CorruptCheckpointError(CheckpointError):
  """No checkpoint of the run restores intact."""


def _crc32(path: pathlib.Path) -> int:
  crc = 0
  with open(path, "rb") as f:
    while chunk := f.read(_CRC_CHUNK):
      crc = zlib.crc32(chunk, crc)
  return crc


def file_digests(step_dir: pathlib.Path) -> dict[str, list[int]]:
  """``{relative path: [size, crc32]}`` of every file of a checkpoint directory but its manifest."""
  return {str(p.relative_to(step_dir)): [p.stat().st_size, _crc32(p)]
          for p in sorted(step_dir.rglob("*")) if p.is_file() and p.name != MANIFEST}


def state_bytes(state: Any) -> int:
  """Bytes of every array of ``state`` (what a checkpoint of it writes, about)."""
  return sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(state))


def _fields(state: Any) -> dict[str, Any]:
  """A TrainState's fields except the scales, as a dict (what the ``state`` item holds)."""
  return {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != SCALES}


class Checkpointer:
  """Save and restore ``(TrainState, data_state)`` pairs under ``RUN_DIR/checkpoints``."""

  def __init__(self, run_dir: str | pathlib.Path, keep: int, async_save: bool = True):
    self.directory = pathlib.Path(run_dir).absolute() / CHECKPOINT_DIR
    self.writer = jax.process_index() == 0  # writes manifests and removes leftovers
    self.leftovers = self._remove_leftovers() if self.writer else []
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", SCALES, "data"))
    self._unverified: list[int] = []  # started saves whose manifest is not written yet
    self._manifests: threading.Thread | None = None  # writing the manifests of finished saves

  def _remove_leftovers(self) -> list[pathlib.Path]:
    """Remove what failed or interrupted saves left behind (orbax's temporary directories)."""
    found = sorted(self.directory.glob(LEFTOVER_PATTERN)) if self.directory.is_dir() else []
    for path in found:
      shutil.rmtree(path, ignore_errors=True)
    return found

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step (verified or not), or None."""
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, state: Any, data_state: dict[str, Any]) -> None:
    """Start saving ``state`` (a ``TrainState`` of arrays) and ``data_state`` (JSON) as ``step``.

    Raises:
      CheckpointSaveError: this save (or an earlier asynchronous one) failed, or would not fit
        on the disk; nothing of it is left behind.
    """
    self.finish()
    self.directory.mkdir(parents=True, exist_ok=True)
    needed, free = state_bytes(state) * SPACE_MARGIN, shutil.disk_usage(self.directory).free
    if needed > free:
      raise CheckpointSaveError(
          f"step {step}: not enough disk space for a checkpoint in {self.directory}: it needs about "
          f"{needed / 2**30:.2f} GiB and {free / 2**30:.2f} GiB are free; free space, lower keep_checkpoints or "
          "choose another --workdir"
      )
    items = {"state": ocp.args.StandardSave(_fields(state)), "data": ocp.args.JsonSave(data_state)}
    if jax.tree.leaves(state.scales):  # FSDP with quantized linears
      items[SCALES] = ocp.args.StandardSave(state.scales)
    try:
      self.manager.save(step, args=ocp.args.Composite(**items), force=True)
    except Exception as e:
      self._failed(step, e)
    self._unverified.append(step)

  def finish(self) -> None:
    """Wait for every started save (CheckpointSaveError if one failed); their manifests are then
    written in a background thread, so training does not wait while every file is read for its
    CRC-32 (:meth:`wait`, :meth:`last_good_step` and :meth:`close` wait for it)."""
    if not self._unverified:
      return
    steps, self._unverified = self._unverified, []
    try:
      self.manager.wait_until_finished()
    except Exception as e:
      self._failed(steps[-1], e)
    if self.writer:
      self._join_manifests()
      self._manifests = threading.Thread(target=self._write_manifests, args=(steps,), name="checkpoint-manifests")
      self._manifests.start()

  def _write_manifests(self, steps: list[int]) -> None:
    for step in steps:
      step_dir = self.directory / str(step)
      try:
        manifest = json.dumps({"step": step, "files": file_digests(step_dir)})
        partial = step_dir / (MANIFEST + ".partial")  # renamed when complete: a manifest is never cut short
        partial.write_text(manifest)
        partial.replace(step_dir / MANIFEST)
      except OSError:  # the checkpoint was rotated out (keep_checkpoints) meanwhile
        continue

  def _join_manifests(self) -> None:
    if self._manifests is not None:
      self._manifests.join()
      self._manifests = None

  def _failed(self, step: int, error: Exception):
    """Raise the one-line CheckpointSaveError of a failed save, its leftovers removed."""
    if self.writer:
      self._remove_leftovers()
    cause = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    if "RESOURCE_EXHAUSTED" in str(error) or "No space left" in str(error):
      cause = "the disk is full (" + cause[:200] + ")"
    raise CheckpointSaveError(f"step {step}: saving the checkpoint to {self.directory / str(step)} failed: {cause}")

  def has_scales(self, step: int) -> bool:
    """Whether checkpoint ``step`` was written by an FSDP run (it holds the weight scales)."""
    return (self.directory / str(step) / SCALES).is_dir()

  def verify(self, step: int) -> str | None:
    """None when checkpoint ``step``'s files match its manifest, else why not (``"unverified: ..."`` without one)."""
    step_dir = self.directory / str(step)
    manifest = step_dir / MANIFEST
    if not manifest.is_file():
      return "unverified: it has no manifest (the run stopped before checking its save)"
    try:
      expected = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as e:
      return f"corrupt: its manifest does not parse ({e})"
    found = file_digests(step_dir)
    missing = sorted(set(expected) - set(found))
    if missing:
      return f"corrupt: {len(missing)} file(s) missing, e.g. {missing[0]}"
    changed = [name for name, digest in expected.items() if found[name] != digest]
    if changed:
      return f"corrupt: {len(changed)} file(s) changed since the save (size or CRC-32), e.g. {changed[0]}"
    return None

  def last_good_step(self) -> int | None:
    """The newest checkpoint whose files verify against its manifest, or None."""
    self.wait()
    return next((step for step in sorted(self.all_steps(), reverse=True) if self.verify(step) is None), None)

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """``(state, data_state)`` of checkpoint ``step`` (no integrity check: see :meth:`restore_latest`).

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

  def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict[str, Any], list[str]]:
    """``(step, state, data_state, problems)`` of the newest checkpoint that restores intact.

    Checkpoints whose files fail their manifest, or that do not restore, are skipped (newest
    first); ``problems`` says which and why (an unverified one that restores is used, and said).

    Raises:
      CorruptCheckpointError: none restores.
    """
    problems = []
    for step in sorted(self.all_steps(), reverse=True):
      reason = self.verify(step)
      if reason and not reason.startswith("unverified"):
        problems.append(f"checkpoint {step} in {self.directory} is {reason}; skipped it")
        continue
      try:
        state, data_state = self.restore(step, abstract_state)
      except Exception as e:  # truncated or unreadable files: orbax's errors are long, the cause is this
        problems.append(f"checkpoint {step} in {self.directory} does not restore ({type(e).__name__}); skipped it")
        continue
      if reason:
        problems.append(f"checkpoint {step} in {self.directory} is {reason}")
      return step, state, data_state, problems
    raise CorruptCheckpointError(f"no checkpoint in {self.directory} restores intact: " + "; ".join(problems))

  def wait(self) -> None:
    """Block until every started save is on disk and has its manifest."""
    try:
      self.finish()
    finally:
      self._join_manifests()

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self.manager.close()


def abstract_on_device(abstract_state: Any, device: jax.Device | None = None) -> Any:
  """``jax.eval_shape`` output with every leaf placed on one device (the restore target)."""
  sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), abstract_state)


def restore_latest(run_dir: str | pathlib.Path, abstract_state: Any) -> tuple[int, Any, dict[str, Any]]:
  """``(step, state, data_state)`` of the newest intact checkpoint of ``run_dir`` (for tools and tests)."""
  checkpointer = Checkpointer(run_dir, keep=1_000_000, async_save=False)
  try:
    if checkpointer.latest_step() is None:
      raise FileNotFoundError(f"no checkpoint under {checkpointer.directory}")
    step, state, data_state, _ = checkpointer.restore_latest(abstract_state)
    return step, state, data_state
  finally:
    checkpointer.close()
