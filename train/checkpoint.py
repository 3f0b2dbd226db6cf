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

Integrity (one rule for every reader: resume, export, generate, eval): a checkpoint counts only
once it is *verified*. Every save writes ``RUN_DIR/checkpoints/<step>/jaxlowbit_manifest.json``
(every file's size and CRC-32) as part of the save itself, inside orbax's temporary directory
before the commit renames it to its final name, so a checkpoint is never final without its
manifest: a SIGKILL leaves either a verified checkpoint or orbax's leftover. :func:`verify` checks a
checkpoint against its manifest; a missing, empty or malformed manifest, or a file that changed or
is missing, fails it. :meth:`Checkpointer.restore_latest` skips checkpoints that fail for the
newest verified one and moves each skipped one aside (``checkpoints/corrupt-<step>/``, or
``unverified-<step>/`` without a manifest), so the redone steps save normally;
:meth:`Checkpointer.last_good_step` and :func:`latest_verified` only ever name a verified
checkpoint, and :func:`verified_step` is what tools that read a run (``train.generate``, export)
call. A verified checkpoint that does not restore into this config's state is not corrupt: it
belongs to another config (:class:`CheckpointMismatchError`). Leftovers of failed or interrupted
saves (``*.orbax-checkpoint-tmp*``) are removed when a run starts. A save that cannot fit on the
disk is refused before anything is written; any failed save raises :class:`CheckpointSaveError`
(one line: step, path, cause), and the last good checkpoint stays.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import sys
import zlib
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from train import cli

CHECKPOINT_DIR = "checkpoints"
CONFIG_FILE = "config.json"
SCALES = "scales"  # the TrainState field saved as an item of its own
ITEMS = ("state", SCALES, "data")
REQUIRED_ITEMS = ("state", "data")  # every checkpoint's manifest lists files of these
MANIFEST = "jaxlowbit_manifest.json"
# Files orbax rewrites or adds when it commits a save (after the manifest is written): the manifest
# requires them to exist but cannot know their final bytes.
COMMIT_FILES = ("_CHECKPOINT_METADATA",)
COMMIT_ONLY_FILES = ("commit_success.txt",)  # written by the commit on some filesystems only: not required
LEFTOVER_PATTERN = "*.orbax-checkpoint-tmp*"  # what orbax writes into until a save commits
# Where a checkpoint that fails verification goes when a resume skips it (RUN_DIR/checkpoints/<prefix>-<step>).
CORRUPT_PREFIX = "corrupt"
UNVERIFIED_PREFIX = "unverified"
# A save needs the state's bytes free (plus orbax's metadata): refuse one that cannot fit.
SPACE_MARGIN = 1.1
_CRC_CHUNK = 1 << 24


class CheckpointError(cli.UserError, RuntimeError):
  """A checkpoint could not be saved or restored (the message is one line a user can act on, so the command lines
  print it as it is: ``error: <message>``, without the type's name; each names its exit code)."""


class CheckpointSaveError(CheckpointError):
  """Saving a checkpoint failed (disk full, permissions, ...); the previous checkpoints are kept."""


class CorruptCheckpointError(CheckpointError):
  """No checkpoint of the run is verified (or the one asked for is not)."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
  """The run directory holds no checkpoint (or not the step asked for)."""


class CheckpointMismatchError(CheckpointError):
  """A verified checkpoint does not restore into this config's state: it was written by another config."""


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


def manifest_files(step_dir: pathlib.Path) -> dict[str, list[int] | None]:
  """What a manifest written before orbax's commit lists: :func:`file_digests`, with the files the commit rewrites
  (:data:`COMMIT_FILES`) as None (they must exist) and those only the commit adds left out."""
  return {name: None if name in COMMIT_FILES else digest
          for name, digest in file_digests(step_dir).items() if name not in COMMIT_ONLY_FILES}


def write_manifest(step_dir: pathlib.Path, step: int) -> None:
  """Write ``step_dir``'s manifest (renamed into place when complete: a manifest is never cut short)."""
  partial = step_dir / (MANIFEST + ".partial")
  partial.write_text(json.dumps({"step": step, "files": manifest_files(step_dir)}))
  partial.replace(step_dir / MANIFEST)


def _step_of(step_dir: pathlib.Path) -> int | None:
  return int(step_dir.name) if step_dir.name.isdigit() else None


def _manifest_problem(manifest: Any, step: int | None) -> str | None:
  """Why a parsed manifest cannot vouch for a checkpoint (None when it is well formed)."""
  if not isinstance(manifest, dict):
    return f"its manifest is not a JSON object (got {type(manifest).__name__})"
  if step is not None and manifest.get("step") != step:
    return f"its manifest is for step {manifest.get('step')!r}, not {step}"
  files = manifest.get("files")
  if not isinstance(files, dict) or not files:
    return "its manifest lists no files"
  for name, digest in files.items():
    if digest is not None and not (isinstance(digest, list) and len(digest) == 2
                                   and all(isinstance(v, int) and not isinstance(v, bool) for v in digest)):
      return f"its manifest entry for {name} is not [size, crc32]"
  for item in REQUIRED_ITEMS:
    if not any(name.startswith(item + "/") for name in files):
      return f"its manifest lists no file of the {item!r} item"
  return None


def verify(step_dir: str | pathlib.Path) -> str | None:
  """None when checkpoint directory ``step_dir`` matches its manifest, else why not, one line.

  The reason starts with ``"unverified: "`` when the checkpoint has no manifest and with
  ``"corrupt: "`` otherwise (an empty, malformed or foreign manifest; a file missing or changed).
  This is the integrity rule of every reader; :func:`verified_step` applies it to a run.
  """
  step_dir = pathlib.Path(step_dir)
  manifest = step_dir / MANIFEST
  if not step_dir.is_dir():
    return f"corrupt: {step_dir} is not a directory"
  if not manifest.is_file():
    return "unverified: it has no manifest (the run stopped before its save was complete and checked)"
  try:
    expected = json.loads(manifest.read_text())
  except (ValueError, UnicodeDecodeError) as e:
    return f"corrupt: its manifest {manifest} does not parse ({type(e).__name__})"
  problem = _manifest_problem(expected, _step_of(step_dir))
  if problem:
    return f"corrupt: {problem}"
  found = file_digests(step_dir)
  missing = sorted(set(expected["files"]) - set(found))
  if missing:
    return f"corrupt: {len(missing)} file(s) missing, e.g. {missing[0]}"
  changed = [name for name, digest in expected["files"].items() if digest is not None and found[name] != digest]
  if changed:
    return f"corrupt: {len(changed)} file(s) changed since the save (size or CRC-32), e.g. {changed[0]}"
  return None


def checkpoint_dir(run_dir: str | pathlib.Path) -> pathlib.Path:
  """``RUN_DIR/checkpoints``."""
  return pathlib.Path(run_dir).absolute() / CHECKPOINT_DIR


def saved_steps(run_dir: str | pathlib.Path) -> list[int]:
  """The steps of every committed checkpoint of ``run_dir`` (verified or not), ascending."""
  directory = checkpoint_dir(run_dir)
  return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit()) \
      if directory.is_dir() else []


def latest_verified(run_dir: str | pathlib.Path) -> int | None:
  """The newest checkpoint step of ``run_dir`` that :func:`verify` passes, or None."""
  directory = checkpoint_dir(run_dir)
  return next((step for step in reversed(saved_steps(run_dir)) if verify(directory / str(step)) is None), None)


def _stderr(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def verified_step(run_dir: str | pathlib.Path, step: int | None = None,
                  notify: Callable[[str], None] = _stderr) -> int:
  """The checkpoint step a tool reading ``run_dir`` may use: ``step`` if given, else the newest, verified.

  For readers (``train.generate``, export, evaluation): they read nothing else. With ``step=None``
  a newer checkpoint that fails :func:`verify` is skipped and ``notify`` is told (one line each);
  nothing is moved (readers do not change a run).

  Raises:
    NoCheckpointError: ``run_dir`` holds no checkpoint, or none of ``step``.
    CorruptCheckpointError: ``step`` (or, with None, every checkpoint) fails verification.
  """
  directory = checkpoint_dir(run_dir)
  steps = saved_steps(run_dir)
  if not steps:
    raise NoCheckpointError(f"no checkpoint under {directory}: is {run_dir} a train.main --workdir that saved one?")
  if step is not None:
    if step not in steps:
      raise NoCheckpointError(f"no checkpoint for step {step} under {directory}; it has steps {steps}")
    reason = verify(directory / str(step))
    if reason:
      good = latest_verified(run_dir)
      raise CorruptCheckpointError(f"checkpoint {directory / str(step)} is {reason}; " + (
          f"the newest verified one is step {good}" if good is not None else "no checkpoint of this run is verified"))
    return step
  reasons = []
  for candidate in reversed(steps):
    reason = verify(directory / str(candidate))
    if reason is None:
      for line in reasons:
        notify(f"warning: {line}; skipped it")
      return candidate
    reasons.append(f"checkpoint {directory / str(candidate)} is {reason}")
  raise CorruptCheckpointError(f"no verified checkpoint under {directory}: " + "; ".join(reasons))


def state_bytes(state: Any) -> int:
  """Bytes of every array of ``state`` (what a checkpoint of it writes, about)."""
  return sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(state))


def _fields(state: Any) -> dict[str, Any]:
  """A TrainState's fields except the scales, as a dict (what the ``state`` item holds)."""
  return {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != SCALES}


def _one_line(error: Exception) -> str:
  text = str(error).strip()
  return f"{type(error).__name__}: {text.splitlines()[0][:300] if text else ''}"


class Checkpointer:
  """Save and restore ``(TrainState, data_state)`` pairs under ``RUN_DIR/checkpoints``."""

  def __init__(self, run_dir: str | pathlib.Path, keep: int, async_save: bool = True, read_only: bool = False):
    """``read_only``: for tools that read a run (they must not remove the temporary directory of a
    save that a running trainer has in flight, nor write anything)."""
    self.directory = checkpoint_dir(run_dir)
    # Process 0 writes manifests, removes leftovers and moves bad checkpoints aside.
    self.writer = jax.process_index() == 0 and not read_only
    self.leftovers = self._remove_leftovers() if self.writer else []
    self.async_save = async_save
    # orbax's asynchronous path always: its post-finalization hook writes the manifest before the commit
    # (a synchronous save waits for it at once, below).
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=True, create=not read_only, read_only=read_only,
        async_options=ocp.AsyncOptions(post_finalization_callback=self._seal))
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
    self._saving: int | None = None  # the step of the save in flight (one at a time: save() finishes the last)

  def _remove_leftovers(self) -> list[pathlib.Path]:
    """Remove what failed or interrupted saves left behind (orbax's temporary directories)."""
    found = sorted(self.directory.glob(LEFTOVER_PATTERN)) if self.directory.is_dir() else []
    for path in found:
      shutil.rmtree(path, ignore_errors=True)
    return found

  def _seal(self) -> None:
    """orbax's hook, after every item of the save in flight is written and before its commit (process 0):
    the manifest goes into the temporary directory, so the checkpoint appears with it or not at all."""
    step = self._saving
    if step is None or not self.writer:
      return
    pending = [p for p in self.directory.glob(f"{step}{LEFTOVER_PATTERN[1:]}") if p.is_dir()]
    write_manifest(pending[0] if len(pending) == 1 else self.directory / str(step), step)

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
    self._saving = step
    try:
      self.manager.save(step, args=ocp.args.Composite(**items), force=True)
    except Exception as e:
      self._saving = None
      self._failed(step, e)
    if not self.async_save:
      self.finish()

  def finish(self) -> None:
    """Wait for the save in flight, if any (CheckpointSaveError if it failed); it then has its manifest."""
    if self._saving is None:
      return
    step = self._saving
    try:
      self.manager.wait_until_finished()  # runs _seal, which reads self._saving
      self.manager.check_for_errors()
    except Exception as e:
      self._saving = None
      self._failed(step, e)
    self._saving = None
    if not (self.directory / str(step) / MANIFEST).is_file() and self.writer and (self.directory / str(step)).is_dir():
      self._failed(step, RuntimeError("orbax committed the checkpoint without its manifest"))

  def _failed(self, step: int, error: Exception):
    """Raise the one-line CheckpointSaveError of a failed save, its leftovers removed."""
    if self.writer:
      self._remove_leftovers()
    cause = _one_line(error)
    if "RESOURCE_EXHAUSTED" in str(error) or "No space left" in str(error):
      cause = "the disk is full (" + cause[:200] + ")"
    raise CheckpointSaveError(f"step {step}: saving the checkpoint to {self.directory / str(step)} failed: {cause}")

  def has_scales(self, step: int) -> bool:
    """Whether checkpoint ``step`` was written by an FSDP run (it holds the weight scales)."""
    return (self.directory / str(step) / SCALES).is_dir()

  def verify(self, step: int) -> str | None:
    """:func:`verify` of checkpoint ``step``."""
    return verify(self.directory / str(step))

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

  def set_aside(self, step: int, reason: str) -> pathlib.Path:
    """Move checkpoint ``step`` (which failed :func:`verify` with ``reason``) to ``checkpoints/corrupt-<step>``
    (``unverified-<step>`` without a manifest; ``-2``, ``-3`` ... when taken) and return where it went.
    orbax then no longer lists it, so the run can save that step again. Process 0 moves; every process
    waits for it and reloads its step list."""
    prefix = UNVERIFIED_PREFIX if reason.startswith("unverified") else CORRUPT_PREFIX
    target = self.directory / f"{prefix}-{step}"
    copy = 1
    while target.exists():
      copy += 1
      target = self.directory / f"{prefix}-{step}-{copy}"
    if self.writer:
      (self.directory / str(step)).replace(target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"jaxlowbit-set-aside-{step}")
    self.manager.reload()
    return target

  def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict[str, Any], list[str]]:
    """``(step, state, data_state, problems)`` of the newest verified checkpoint.

    Newer checkpoints that fail :func:`verify` are skipped and moved aside (:meth:`set_aside`);
    ``problems`` says which, why and where each went.

    Raises:
      CorruptCheckpointError: no checkpoint is verified (nothing is moved).
      CheckpointMismatchError: the newest verified checkpoint does not restore into ``abstract_state``.
    """
    skipped = []
    for step in sorted(self.all_steps(), reverse=True):
      reason = self.verify(step)
      if reason:
        skipped.append((step, reason))
        continue
      previous_hook = sys.unraisablehook
      sys.unraisablehook = _without_closed_loop_reports(previous_hook)  # kept if the restore fails
      try:
        state, data_state = self.restore(step, abstract_state)
      except Exception as e:  # its files are the ones saved: the state this config builds is another
        raise CheckpointMismatchError(
            f"checkpoint {self.directory / str(step)} is intact but does not restore into this config's state "
            f"({_one_line(e)[:200]}): it was written by another config; resume with that run's config.json or "
            "start a new --workdir") from e
      sys.unraisablehook = previous_hook
      problems = [f"checkpoint {self.directory / str(bad)} is {reason}; skipped it and moved it to "
                  f"{self.set_aside(bad, reason)}" for bad, reason in skipped]
      return step, state, data_state, problems
    raise CorruptCheckpointError(f"no checkpoint in {self.directory} is verified: " + "; ".join(
        f"checkpoint {step} is {reason}" for step, reason in skipped) + "; nothing was moved or overwritten: "
        "start a new --workdir (or move these aside to start this one from step 0)")

  def wait(self) -> None:
    """Block until the save in flight is on disk with its manifest."""
    self.finish()

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self.manager.close()


def _without_closed_loop_reports(previous):
  """``previous`` (a ``sys.unraisablehook``) minus the reports a failed orbax restore leaves behind: its reads
  still in flight finish after orbax closed its asyncio loop (``RuntimeError('Event loop is closed')``) or die
  with it (an orbax coroutine collected with its error), each a traceback after the run's one error line. (Reads
  it never started are warnings instead: ``train.main`` ignores them as it exits on the error.)"""

  def leftover(unraisable) -> bool:
    error = unraisable.exc_value
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
      return True
    code = getattr(unraisable.object, "cr_code", None)  # a coroutine: orbax's own?
    return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename

  def hook(unraisable):
    if not leftover(unraisable):
      previous(unraisable)

  return hook


def abstract_on_device(abstract_state: Any, device: jax.Device | None = None) -> Any:
  """``jax.eval_shape`` output with every leaf placed on one device (the restore target)."""
  sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), abstract_state)


def restore_latest(run_dir: str | pathlib.Path, abstract_state: Any) -> tuple[int, Any, dict[str, Any]]:
  """``(step, state, data_state)`` of the newest verified checkpoint of ``run_dir`` (for tools and tests;
  it moves nothing)."""
  step = verified_step(run_dir)
  checkpointer = Checkpointer(run_dir, keep=1_000_000, async_save=False, read_only=True)
  try:
    state, data_state = checkpointer.restore(step, abstract_state)
    return step, state, data_state
  finally:
    checkpointer.close()
