"""Run control: stop requests, config changes on resume, and checks of the state between steps."""

from __future__ import annotations

import contextlib
import copy
import json
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from train import steps
from train.config import ConfigError
from train.metrics import say
from train.spec import RunSpec, from_saved


# The signals that ask a run to stop: Ctrl-C, and what SLURM, Kubernetes and most schedulers send
# before they preempt a job.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


# Signals that arrive within this many seconds of the first are the same request (a double-tapped Ctrl-C, or a
# scheduler that signals the process group and then the process): the step finishes and the run saves. A later
# one stops at once. Issue 31: two SIGINTs 5 ms apart stopped mid-step, and the resumed run lost a logged loss.
REPEAT_WINDOW_S = 1.0


class StopRequest:
  """Set by SIGINT or SIGTERM while :meth:`installed` (main thread only).

  The first signal asks the loop to stop after the step in flight and save; signals within
  :data:`REPEAT_WINDOW_S` of it repeat that request; a signal after that raises KeyboardInterrupt
  (stop at once: the loop saves only a state that is intact and whose metrics were all recorded).

  Attributes:
    requested: a stop was asked for.
    signal: which signal asked (``signal.SIGINT`` / ``signal.SIGTERM``), or None.
  """

  def __init__(self, clock=time.monotonic):
    self.requested = False
    self.signal: int | None = None
    self._clock = clock
    self._first: float | None = None

  def _handle(self, signum, frame):
    del frame
    now = self._clock()
    if self.requested:
      if now - self._first > REPEAT_WINDOW_S:
        raise KeyboardInterrupt
      return  # the same request, repeated
    self.requested, self.signal, self._first = True, signum, now
    name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    say(f"\n{name}: finishing this step, then saving a checkpoint (again after {REPEAT_WINDOW_S:g} s to stop at once)")

  @contextlib.contextmanager
  def installed(self):
    if threading.current_thread() is not threading.main_thread():
      yield self
      return
    previous = {signum: signal.signal(signum, self._handle) for signum in STOP_SIGNALS}
    try:
      yield self
    finally:
      for signum, handler in previous.items():
        signal.signal(signum, handler)


def changed_fields(old: dict, new: dict, prefix: str = "") -> set[str]:
  """Dotted names of the fields whose values differ between two config dicts."""
  changed = set()
  for key in old.keys() | new.keys():
    a, b = old.get(key), new.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      changed |= changed_fields(a, b, f"{prefix}{key}.")
    elif a != b:
      changed.add(prefix + key)
  return changed


def field_change(old: dict, new: dict, field: str) -> str:
  """``"mesh.fsdp 4 -> 2"``: a dotted field's value in two config dicts (None where absent)."""
  values = []
  for value in (old, new):
    for key in field.split("."):
      value = value.get(key) if isinstance(value, dict) else None
    values.append(value)
  return f"{field} {values[0]} -> {values[1]}"


def shapes_differ(a, b) -> bool:
  """Whether two abstract states differ in structure, shapes or dtypes."""
  if jax.tree.structure(a) != jax.tree.structure(b):
    return True
  return any(x.shape != y.shape or x.dtype != y.dtype for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def check_resumable(old: dict, spec: RunSpec, changed: set[str]) -> None:
  """Refuse, before any restore, to resume a checkpoint of config ``old`` with ``spec`` when the state's shapes differ.

  ``old`` is the run's saved ``config.json`` (parsed), ``changed`` the dotted fields in which it
  differs from ``spec.config_json``. Names each changed field that alone changes the state's
  structure, shapes or dtypes (model sizes, a recipe that adds norms, the optimizer's state, ...)
  with its old and new values. The states compared are built from specs (``train.spec.from_saved``).

  Raises:
    train.config.ConfigError: the checkpoint cannot hold this config's state.
  """
  changed = {field for field in changed if field.split(".")[0] not in steps.RUNTIME_ONLY_FIELDS}
  if not changed:
    return
  new = json.loads(spec.config_json)
  try:
    before = steps.abstract_state(from_saved(old))
  except Exception:  # an old config this version cannot build: the restore will say what does not fit
    return
  if not shapes_differ(before, steps.abstract_state(spec)):
    return
  culprits = []
  for field in sorted(changed):
    try:
      if shapes_differ(before, steps.abstract_state(from_saved(_with_value(old, field, _value_at(new, field))))):
        culprits.append(field)
    except Exception:
      culprits.append(field)
  names = ", ".join(field_change(old, new, field) for field in (culprits or sorted(changed)))
  raise ConfigError(
      f"cannot resume: {names} changes the shapes of the saved state (parameters or optimizer state), so the "
      "checkpoint cannot continue this run; restore the field(s) or start a new --workdir"
  )


def _value_at(tree: dict, field: str):
  for key in field.split("."):
    tree = tree[key]
  return tree


def _with_value(tree: dict, field: str, value) -> dict:
  """A deep copy of the config dict ``tree`` with the dotted ``field`` set to ``value``."""
  tree = copy.deepcopy(tree)
  *parents, leaf = field.split(".")
  parent = tree
  for key in parents:
    parent = parent[key]
  parent[leaf] = value
  return tree


def close_quietly(checkpointer) -> None:
  """Close ``checkpointer`` on an error path, where a failing save must not hide the error in flight."""
  try:
    checkpointer.close()
  except Exception as e:  # noqa: BLE001  (reported, then the original error continues)
    say(f"warning: {e}")


def finite(tree) -> bool:
  """Whether every leaf of ``tree`` is finite (fetches them)."""
  return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree))


def alive(tree) -> bool:
  """False when some buffer of ``tree`` was donated to a step that never returned."""
  return not any(leaf.is_deleted() for leaf in jax.tree.leaves(tree))


def any_process(flag: bool) -> bool:
  """True on every process when ``flag`` is True on any (a collective: call it on all processes)."""
  return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


__all__ = [
    "REPEAT_WINDOW_S", "STOP_SIGNALS", "StopRequest", "alive", "any_process", "changed_fields", "check_resumable", "close_quietly",
    "field_change", "finite", "shapes_differ",
]
