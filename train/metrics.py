"""What a run records: ``metrics.jsonl``, TensorBoard (when installed), the progress line, MFU.

``RUN_DIR/metrics.jsonl`` holds one JSON object per line:

- training, every ``log_every`` steps: ``step``, ``loss`` (mean over the interval),
  ``grad_norm`` (before clipping, last step), ``lr``, ``tokens_per_s``, ``step_time_s``,
  ``mfu`` (None when the peak is unknown, e.g. on CPU), ``tokens`` (seen so far),
  ``compile_s`` (the first step, compilation included); the timing fields are None for an
  interval that held only the compiling step;
- validation: ``step``, ``val_loss``;
- once at start: ``step``, ``event: "start"`` with parameter count, FLOPs per token and
  compile time.

MFU is model FLOPs per second (``train.model.train_flops_per_token``) over the device's
*bf16 dense* peak, for every recipe: INT8/FP8 runs can show an MFU that bf16 could not
reach, which is the point.
"""

from __future__ import annotations

import json
import pathlib
import shlex
import sys
from typing import Any

import jax

from train import cli

METRICS_FILE = "metrics.jsonl"
# Dense bf16 tensor-core peaks in TFLOP/s, from NVIDIA's datasheets (without sparsity),
# matched against jax's ``device_kind`` in this order (first substring that matches wins).
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM
    ("H200", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
)
PROGRESS_BAR_WIDTH = 20


def peak_tflops(device: jax.Device | None = None) -> float | None:
  """bf16 dense peak of ``device`` (default: the first device) in TFLOP/s, or None if unknown."""
  device = device or jax.devices()[0]
  if device.platform != "gpu":
    return None
  kind = device.device_kind
  for name, tflops in PEAK_BF16_TFLOPS:
    if name in kind:
      return tflops
  return None


def mfu(flops_per_step: float, step_time_s: float, peak: float | None, num_devices: int = 1) -> float | None:
  """Model FLOPs utilization in [0, 1+): ``flops_per_step / step_time / (peak * devices)``."""
  if peak is None or step_time_s <= 0:
    return None
  return flops_per_step / step_time_s / (peak * 1e12 * num_devices)


def _tensorboard_writer(log_dir: pathlib.Path):
  """A SummaryWriter from tensorboardX or torch, or None when neither is importable."""
  try:
    from tensorboardX import SummaryWriter  # noqa: PLC0415  (optional dependency)
  except ImportError:
    try:
      from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415  (needs the tensorboard package)
    except ImportError:
      return None
  return SummaryWriter(str(log_dir))


class MetricsWriter:
  """Appends records to ``RUN_DIR/metrics.jsonl`` and, when available, TensorBoard.

  ``enabled=False`` writes nothing (the processes other than 0 of a multi-host run).
  """

  def __init__(self, run_dir: str | pathlib.Path, tensorboard: bool = True, enabled: bool = True):
    self.path = pathlib.Path(run_dir) / METRICS_FILE
    self._file = self._tb = None
    if not enabled:
      return
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self._file = self.path.open("a")
    self._tb = _tensorboard_writer(pathlib.Path(run_dir) / "tensorboard") if tensorboard else None

  def write(self, record: dict[str, Any]) -> None:
    """One JSON line (flushed at once, so a killed run keeps its metrics)."""
    if self._file is None:
      return
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    if self._tb is not None:
      for key, value in record.items():
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
          self._tb.add_scalar(key, value, record["step"])

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
    if self._tb is not None:
      self._tb.close()


def _parse_records(path: pathlib.Path) -> tuple[list[str], list[dict[str, Any]], str | None]:
  """``(lines, records, notice)`` of a metrics file. A last line that does not parse is a write cut short (a full
  disk, a kill): it is dropped and ``notice`` says so. A bad line before it: ValueError naming file and line."""
  lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
  records, notice = [], None
  for number, line in enumerate(lines, 1):
    try:
      record = json.loads(line)
      if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    except ValueError:
      if number == len(lines):
        notice = f"note: {path}: dropped its last line, a record cut short (e.g. by a full disk): {line[:60]!r}"
        lines = lines[:-1]
        break
      raise MetricsFileError(f"{path}: line {number} is not a JSON record ({line[:60]!r}); delete or fix that line") \
          from None
    records.append(record)
  return lines, records, notice


def truncate_after(run_dir: str | pathlib.Path, step: int) -> None:
  """Drop records of steps after ``step`` (a resumed run rewrites them), and a last record cut short (said)."""
  path = pathlib.Path(run_dir) / METRICS_FILE
  if not path.exists():
    return
  lines, records, notice = _parse_records(path)
  if notice:
    say(notice)
  kept = [line for line, record in zip(lines, records) if record.get("step", 0) <= step]
  path.write_text("".join(line + "\n" for line in kept))


class MetricsFileError(cli.UserError, ValueError):
  """A line of ``metrics.jsonl`` before its last is not a JSON record (a user mistake: exit 2, naming file and line)."""


def read_metrics(run_dir: str | pathlib.Path) -> list[dict[str, Any]]:
  """Every record of ``RUN_DIR/metrics.jsonl`` in file order (a last line cut short is skipped, with a notice on
  stderr)."""
  path = pathlib.Path(run_dir) / METRICS_FILE
  if not path.exists():
    raise FileNotFoundError(f"no {METRICS_FILE} in {run_dir}: is it a train.main --workdir?")
  _, records, notice = _parse_records(path)
  if notice:
    print(notice, file=sys.stderr, flush=True)
  return records


def _duration(seconds: float) -> str:
  seconds = int(seconds)
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def progress_line(record: dict[str, Any], total_steps: int) -> str:
  """``[####......]  40% step 400/1000 | loss 2.1034 | 51.2k tok/s | ...`` for one training record."""
  step = record["step"]
  done = int(PROGRESS_BAR_WIDTH * step / total_steps)
  parts = [
      f"[{'#' * done}{'.' * (PROGRESS_BAR_WIDTH - done)}] {100 * step / total_steps:3.0f}%",
      f"step {step}/{total_steps}",
      f"loss {record['loss']:.4f}",
      f"lr {record['lr']:.2e}",
      f"gnorm {record['grad_norm']:.3f}",
  ]
  if record.get("step_time_s"):
    parts.append(f"{record['tokens_per_s'] / 1e3:.1f}k tok/s")
    parts.append(f"{record['step_time_s'] * 1e3:.0f} ms/step")
    if record.get("mfu") is not None:
      parts.append(f"mfu {100 * record['mfu']:.1f}%")
    parts.append(f"eta {_duration(record['step_time_s'] * (total_steps - step))}")
  return " | ".join(parts)


def run_summary(run_dir: str | pathlib.Path, status: str, step: int, total_steps: int,
                checkpoint_path: str | pathlib.Path | None, export_args: str = "") -> list[str]:
  """The lines a run ends with: steps done, the best and final validation loss (from ``metrics.jsonl``), the final
  checkpoint's path and the commands that generate from it, plot the run and export it.

  Args:
    run_dir: the run directory.
    status: ``"completed"`` or ``"interrupted"`` (:class:`train.loop.TrainResult`).
    step, total_steps: the step the run reached and ``config.steps``.
    checkpoint_path: the newest checkpoint's directory, or None when the run saved none.
    export_args: extra arguments of the export command (``--scheme tq2_0`` for a BitNet run).
  """
  run = shlex.quote(str(run_dir))
  records = read_metrics(run_dir) if (pathlib.Path(run_dir) / METRICS_FILE).exists() else []
  evals = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
  lines = [f"summary: {status}, step {step}/{total_steps} in {run_dir}"]
  if evals:
    best = min(evals, key=lambda e: e[1])
    lines.append(f"  validation loss: final {evals[-1][1]:.4f} (step {evals[-1][0]}), best {best[1]:.4f} "
                 f"(step {best[0]})")
  if checkpoint_path is None:
    lines.append("  no checkpoint was saved")
    return lines
  lines.append(f"  checkpoint: {checkpoint_path}")
  if status != "completed":
    lines.append("  continue: the same command with --resume")
  lines += [
      f"  generate: python -m train.generate --checkpoint {run} --prompt 'def main('",
      f"  plot:     python -m train.plot {run}",
      f"  export:   python -m train.hf export --checkpoint {run} --out {shlex.quote(str(pathlib.Path(run_dir) / 'export'))}"
      + (f" {export_args}" if export_args else ""),
  ]
  return lines


def say(message: str) -> None:
  """One line to stdout, flushed (progress must show up in logs of piped runs too); process 0 only."""
  if jax.process_index() == 0:
    print(message, file=sys.stdout, flush=True)
