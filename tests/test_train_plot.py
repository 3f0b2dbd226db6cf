"""train.plot and train.metrics: curves to PNG (skipped without matplotlib), jsonl records, progress line."""

import json
import sys

import pytest

from train import metrics, plot


def _fake_run(run_dir, offset):
  run_dir.mkdir()
  records = [{"step": 0, "event": "start", "params": 10}]
  for step in range(10, 110, 10):
    records.append({"step": step, "loss": 5.0 - step / 50 + offset, "tokens_per_s": 1000.0 + offset, "lr": 1e-3,
                    "grad_norm": 1.0, "step_time_s": 0.1, "mfu": None})
    if step % 50 == 0:
      records.append({"step": step, "val_loss": 5.2 - step / 50 + offset})
  (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_plot_writes_a_png(tmp_path):
  pytest.importorskip("matplotlib")
  _fake_run(tmp_path / "bf16", 0.0)
  _fake_run(tmp_path / "int8", 0.1)
  out = tmp_path / "curves.png"
  plot.main([str(tmp_path / "bf16"), str(tmp_path / "int8"), "--out", str(out)])
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_without_matplotlib_says_what_to_install(tmp_path, monkeypatch):
  _fake_run(tmp_path / "run", 0.0)
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  with pytest.raises(ImportError, match="pip install matplotlib"):
    plot.plot_runs([tmp_path / "run"], tmp_path / "x.png")


def test_series_and_truncation(tmp_path):
  _fake_run(tmp_path / "run", 0.0)
  records = metrics.read_metrics(tmp_path / "run")
  steps, values = plot.series(records, "val_loss")
  assert steps == [50, 100] and values == pytest.approx([4.2, 3.2])
  metrics.truncate_after(tmp_path / "run", 60)  # a resume from step 60 rewrites what came after
  assert max(r["step"] for r in metrics.read_metrics(tmp_path / "run")) == 60


def test_mfu_and_progress_line():
  assert metrics.mfu(1e15, 1.0, 1000.0) == pytest.approx(1.0)
  assert metrics.mfu(1e15, 1.0, None) is None
  record = {"step": 50, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 12_345.0, "step_time_s": 0.2,
            "mfu": 0.42}
  line = metrics.progress_line(record, 100)
  assert "50%" in line and "loss 2.5000" in line and "12.3k tok/s" in line and "mfu 42.0%" in line
  assert "tok/s" not in metrics.progress_line({**record, "step_time_s": None, "tokens_per_s": None}, 100)


def test_tensorboard_events_when_installed(tmp_path):
  pytest.importorskip("tensorboardX")
  writer = metrics.MetricsWriter(tmp_path, tensorboard=True)
  writer.write({"step": 1, "loss": 2.0, "mfu": None, "event": "x"})
  writer.close()
  assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
  assert metrics.read_metrics(tmp_path) == [{"step": 1, "loss": 2.0, "mfu": None, "event": "x"}]
