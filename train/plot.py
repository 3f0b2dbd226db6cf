"""``python -m train.plot RUN_DIR [RUN_DIR ...] [--out FILE.png]``: loss curves and throughput.

Draws three panels from each run's ``metrics.jsonl``: training loss and validation loss
against step, and tokens/s against step, one line per run (labelled with the run
directory's name). Writes ``--out`` (default ``<first RUN_DIR>/curves.png``).
Needs matplotlib (``pip install matplotlib``); it is imported only here.
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Sequence

from train import cli
from train.metrics import read_metrics


def _matplotlib_pyplot():
  try:
    import matplotlib  # noqa: PLC0415  (optional dependency)
  except ImportError as e:
    raise ImportError("train.plot needs matplotlib: pip install matplotlib") from e
  matplotlib.use("Agg")  # files only, no display needed
  import matplotlib.pyplot as plt  # noqa: PLC0415

  return plt


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
  """``(steps, values)`` of the records that carry a finite-or-None ``key``."""
  points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
  return [s for s, _ in points], [v for _, v in points]


def plot_runs(run_dirs: Sequence[str | pathlib.Path], out: str | pathlib.Path) -> pathlib.Path:
  """Draw the runs' curves into the PNG ``out`` and return its path."""
  plt = _matplotlib_pyplot()
  fig, (ax_loss, ax_val, ax_speed) = plt.subplots(1, 3, figsize=(16, 4.5))
  for run_dir in run_dirs:
    records = read_metrics(run_dir)
    label = pathlib.Path(run_dir).name
    ax_loss.plot(*series(records, "loss"), label=label)
    ax_val.plot(*series(records, "val_loss"), marker="o", markersize=3, label=label)
    ax_speed.plot(*series(records, "tokens_per_s"), label=label)
  for ax, title, ylabel in (
      (ax_loss, "training loss", "loss (nats/token)"),
      (ax_val, "validation loss", "loss (nats/token)"),
      (ax_speed, "throughput", "tokens/s"),
  ):
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  out = pathlib.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=120)
  plt.close(fig)
  return out


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("run_dirs", nargs="+", help="run directories holding metrics.jsonl")
  parser.add_argument("--out", default=None, help="PNG to write (default: <first run>/curves.png)")
  args = parser.parse_args(argv)
  out = plot_runs(args.run_dirs, args.out or pathlib.Path(args.run_dirs[0]) / "curves.png")
  print(out)


if __name__ == "__main__":
  raise SystemExit(cli.run(main))
