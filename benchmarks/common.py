"""Shared pieces of the benchmarks: timing, run metadata, result files, tables."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence

import jax

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")


def time_samples(fn: Callable, *args, iters: int = 10, reps: int = 5, warmup: int = 2) -> list[float]:
  """Seconds per call of a jitted ``fn``, one sample per run of ``iters`` back-to-back calls (``reps`` runs).

  Calls within a run are queued without host syncs (device time, not launch latency); the
  first ``warmup`` calls (compilation, autotuning) are discarded.
  """
  out = None
  for _ in range(warmup):
    out = fn(*args)
  jax.block_until_ready(out)
  samples = []
  for _ in range(reps):
    start = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - start) / iters)
  return samples


def time_ms(fn: Callable, *args, iters: int = 10, reps: int = 5, warmup: int = 2) -> float:
  """Median milliseconds per call of a jitted ``fn`` (:func:`time_samples`)."""
  return statistics.median(time_samples(fn, *args, iters=iters, reps=reps, warmup=warmup)) * 1e3


def commit() -> str:
  """Git commit of the tree: ``$JAXLOWBIT_COMMIT`` (set when the tree travels without .git) or git."""
  if os.environ.get("JAXLOWBIT_COMMIT"):
    return os.environ["JAXLOWBIT_COMMIT"]
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def metadata() -> dict:
  device = jax.devices()[0]
  return {
      "device": getattr(device, "device_kind", device.platform),
      "platform": device.platform,
      "jax": jax.__version__,
      "python": platform.python_version(),
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
      "commit": commit(),
  }


def write_json(name: str, rows: list[dict], out: str | None = None, **extra) -> str:
  """Write ``{"meta": ..., "rows": rows, **extra}`` to ``out`` (default benchmarks/results/NAME.json), whole: to a
  temporary file first, then renamed over it, so a run killed while writing (a device call's time limit) leaves the
  previous complete file, not a truncated one."""
  path = out or os.path.join(RESULTS_DIR, f"{name}.json")
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  temporary = f"{path}.tmp{os.getpid()}"
  with open(temporary, "w") as f:
    json.dump({"meta": metadata(), "rows": rows, **extra}, f, indent=1)
  os.replace(temporary, path)
  return path


def table(rows: list[dict], columns: Sequence[str]) -> str:
  """A fixed-width text table of ``rows`` (missing cells blank, floats to 3 significant digits)."""

  def fmt(v):
    if isinstance(v, float):
      return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return "" if v is None else str(v)

  cells = [[fmt(r.get(c)) for c in columns] for r in rows]
  widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
  lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
  lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
  return "\n".join(lines)
