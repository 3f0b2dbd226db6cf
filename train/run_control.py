"""Run control: stop requests, config changes on resume, and checks of the state between steps."""

from __future__ import annotations

import contextlib
import signal
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from train.metrics import say


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
  for config in (old, new):
    for key in field.split("."):
      config = config.get(key) if isinstance(config, dict) else None
    values.append(config)
  return f"{field} {values[0]} -> {values[1]}"


def finite(tree) -> bool:
  """Whether every leaf of ``tree`` is finite (fetches them)."""
  return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree))


def alive(tree) -> bool:
  """False when some buffer of ``tree`` was donated to a step that never returned."""
  return not any(leaf.is_deleted() for leaf in jax.tree.leaves(tree))


def any_process(flag: bool) -> bool:
  """True on every process when ``flag`` is True on any (a collective: call it on all processes)."""
  return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


__all__ = ["StopRequest", "alive", "any_process", "changed_fields", "field_change", "finite"]
