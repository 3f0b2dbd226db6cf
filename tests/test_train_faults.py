"""Fault drills: what a run does when its checkpoints rot, its disk fills, it is preempted or resumed wrongly.

Each drill injects one fault into a micro run (``test_train_loop.micro_config``) and checks what
the user sees (one clear line, a documented exit code) and what is kept (the newest intact
checkpoint, a run that continues exactly). docs/training.md has the table.
"""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
from test_train_loop import REPO, TINY, corpus, micro_config, restore, train_losses  # noqa: F401  (fixture)

from train import checkpoint, loop
from train import config as train_config


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, corpus):  # noqa: F811
  """A micro run stopped at step 10 (checkpoints 4, 8, 10), and the uninterrupted run's losses."""
  root = tmp_path_factory.mktemp("faults")
  config = micro_config(corpus)
  full = loop.train(config, root / "full")
  assert full.status == "completed"
  result = loop.train(config, root / "stopped", should_stop=lambda step: step == 10)
  assert result.status == "interrupted" and result.checkpoint_step == 10
  return root / "stopped", train_losses(root / "full")


def copy_run(stopped, tmp_path) -> pathlib.Path:
  run_dir = tmp_path / "run"
  shutil.copytree(stopped, run_dir)
  return run_dir


def largest_file(step_dir: pathlib.Path) -> pathlib.Path:
  files = [p for p in step_dir.rglob("*") if p.is_file() and p.name != checkpoint.MANIFEST]
  return max(files, key=lambda p: p.stat().st_size)


def flip_bit(path: pathlib.Path) -> None:
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x10
  path.write_bytes(bytes(data))


def truncate(path: pathlib.Path) -> None:
  data = path.read_bytes()
  path.write_bytes(data[: len(data) // 2])


def write_manifest_text(text: str):
  return lambda step_dir: (step_dir / checkpoint.MANIFEST).write_text(text)


def edit_data_position(step_dir: pathlib.Path) -> None:
  """Change the data stream's saved position in the ``data`` item's JSON (a valid JSON edit)."""
  path = next(p for p in (step_dir / "data").rglob("*") if p.is_file() and '"position"' in p.read_text())
  state = json.loads(path.read_text())
  state["position"] = 1
  path.write_text(json.dumps(state))


# Every fault the issue-31 battery injected into the newest checkpoint; each must fail verification.
FILE_FAULTS = {
    "bit_flip": lambda d: flip_bit(largest_file(d)),
    "truncation": lambda d: truncate(largest_file(d)),
    "missing_file": lambda d: os.remove(largest_file(d)),
}
FAULTS = {
    **FILE_FAULTS,
    "garbage_manifest": write_manifest_text("{not json"),
    "empty_manifest": write_manifest_text(""),
    "list_manifest": write_manifest_text("[]"),
    "manifest_without_files": lambda d: (d / checkpoint.MANIFEST).write_text(json.dumps({"step": int(d.name),
                                                                                        "files": {}})),
    "manifest_of_another_step": lambda d: (d / checkpoint.MANIFEST).write_text(
        (d.parent / "4" / checkpoint.MANIFEST).read_text()),
    "no_manifest": lambda d: os.remove(d / checkpoint.MANIFEST),
    "missing_metadata": lambda d: os.remove(d / "_CHECKPOINT_METADATA"),
    "missing_state": lambda d: shutil.rmtree(d / "state"),
    "edited_data_json": edit_data_position,
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_every_injected_fault_fails_verification(fault, stopped_run, tmp_path):
  stopped, _ = stopped_run
  run_dir = copy_run(stopped, tmp_path)
  step_dir = run_dir / "checkpoints" / "10"
  assert checkpoint.verify(step_dir) is None
  FAULTS[fault](step_dir)
  reason = checkpoint.verify(step_dir)
  assert reason is not None and reason.startswith("unverified" if fault == "no_manifest" else "corrupt"), reason
  assert "\n" not in reason
  assert checkpoint.latest_verified(run_dir) == 8
  with pytest.raises(checkpoint.CorruptCheckpointError, match="checkpoints/10 is "):
    checkpoint.verified_step(run_dir, 10)
  notes = []
  assert checkpoint.verified_step(run_dir, notify=notes.append) == 8  # what generate and export read
  assert len(notes) == 1 and "checkpoints/10 is" in notes[0] and "skipped" in notes[0], notes


@pytest.mark.parametrize("fault", [*FILE_FAULTS, "no_manifest", "list_manifest", "edited_data_json"])
def test_a_damaged_checkpoint_is_moved_aside_and_the_redone_steps_save(fault, stopped_run, tmp_path, corpus, capsys):  # noqa: F811
  """Checkpoints 8 and 10 damaged: the run falls back to 4, moves both aside (saying where), redoes steps 5-12
  bit for bit, saves 8 and 12 again, and a second --resume starts from the new 12 (no StepAlreadyExistsError)."""
  stopped, expected = stopped_run
  run_dir = copy_run(stopped, tmp_path)
  for step in (8, 10):
    FAULTS[fault](run_dir / "checkpoints" / str(step))

  result = loop.train(micro_config(corpus, resume=True), run_dir)
  out = capsys.readouterr().out
  prefix = "unverified" if fault == "no_manifest" else "corrupt"
  for step in (8, 10):
    aside = run_dir / "checkpoints" / f"{prefix}-{step}"
    assert f"checkpoint {run_dir / 'checkpoints' / str(step)} is {prefix}" in out, out
    assert f"moved it to {aside}" in out and aside.is_dir(), out
  assert f"resumed from {run_dir / 'checkpoints' / '4'}" in out, out
  assert result.status == "completed" and result.step == 12
  assert train_losses(run_dir) == expected  # steps 5-12 redone from step 4: bit for bit
  assert checkpoint.verify(run_dir / "checkpoints" / "8") is None and checkpoint.latest_verified(run_dir) == 12

  again = loop.train(micro_config(corpus, resume=True, steps=14), run_dir)
  out = capsys.readouterr().out
  assert again.status == "completed" and again.step == 14 and "skipped" not in out, out
  assert f"resumed from {run_dir / 'checkpoints' / '12'}" in out, out


def test_the_manifest_is_written_before_the_commit(tmp_path, corpus, monkeypatch):  # noqa: F811
  """A checkpoint is never final without its manifest: it is written into orbax's temporary directory,
  while the final directory does not exist yet (a SIGKILL then leaves a leftover, not an unverified checkpoint)."""
  written = []
  original = checkpoint.write_manifest

  def record(step_dir, step):
    written.append((step_dir.name, (step_dir.parent / str(step)).exists()))
    return original(step_dir, step)

  monkeypatch.setattr(checkpoint, "write_manifest", record)
  loop.train(micro_config(corpus, steps=8), tmp_path / "run")
  assert [(name.split(".")[0], final) for name, final in written] == [("4", False), ("8", False)], written
  assert all(".orbax-checkpoint-tmp" in name for name, _ in written), written
  assert checkpoint.latest_verified(tmp_path / "run") == 8


def test_a_verified_checkpoint_of_another_config_is_not_called_corrupt(stopped_run, tmp_path, corpus):  # noqa: F811
  """config.json deleted and the shape changed: the intact checkpoint is not moved aside; one line says why."""
  stopped, _ = stopped_run
  run_dir = copy_run(stopped, tmp_path)
  (run_dir / checkpoint.CONFIG_FILE).unlink()
  with pytest.raises(checkpoint.CheckpointMismatchError, match="is intact but does not restore") as error:
    loop.train(micro_config(corpus, resume=True, model__d_model=48), run_dir)
  assert "\n" not in str(error.value)
  assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["10", "4", "8"]


def test_only_verified_checkpoints_are_last_good_and_none_intact_is_an_error(stopped_run, tmp_path, corpus):  # noqa: F811
  stopped, _ = stopped_run
  run_dir = copy_run(stopped, tmp_path)
  checkpointer = checkpoint.Checkpointer(run_dir, keep=10)
  try:
    assert checkpointer.last_good_step() == 10
    flip_bit(largest_file(run_dir / "checkpoints" / "10"))
    assert checkpointer.verify(10).startswith("corrupt") and checkpointer.verify(8) is None
    assert checkpointer.last_good_step() == 8
  finally:
    checkpointer.close()

  for step in (4, 8):
    truncate(largest_file(run_dir / "checkpoints" / str(step)))
  with pytest.raises(checkpoint.CorruptCheckpointError, match="no checkpoint in .* is verified"):
    loop.train(micro_config(corpus, resume=True), run_dir)
  assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["10", "4", "8"]  # nothing moved


def test_disk_full_says_one_line_and_keeps_the_last_good_checkpoint(tmp_path, corpus, monkeypatch):  # noqa: F811
  """The free-space check refuses the step-8 save; nothing of it is written, step 4 stays intact."""
  usage = shutil.disk_usage
  saves = []
  original_save = checkpoint.Checkpointer.save

  def save(self, step, state, data_state):
    saves.append(step)
    return original_save(self, step, state, data_state)

  def disk_usage(path):
    total, used, free = usage(path)
    return type(usage(path))(total, used, 0 if len(saves) > 1 else free)  # full after the first save

  monkeypatch.setattr(checkpoint.Checkpointer, "save", save)
  monkeypatch.setattr(checkpoint.shutil, "disk_usage", disk_usage)
  run_dir = tmp_path / "full_disk"
  with pytest.raises(checkpoint.CheckpointSaveError) as error:
    loop.train(micro_config(corpus), run_dir)
  message = str(error.value)
  assert "\n" not in message and message.startswith("step 8: not enough disk space"), message
  assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["4"]
  monkeypatch.undo()
  assert restore(run_dir, micro_config(corpus))[0] == 4


def test_a_failing_write_is_one_line_and_leftovers_go(tmp_path, corpus, monkeypatch, capsys):  # noqa: F811
  """An injected write error (ENOSPC) inside orbax's save: one line naming the cause; the next start
  removes what a failed save left behind."""
  original = checkpoint.ocp.CheckpointManager.save

  def failing_save(self, step, *args, **kwargs):
    if step == 8:
      (pathlib.Path(self.directory) / "8.orbax-checkpoint-tmp-1234").mkdir()  # what orbax leaves
      raise OSError(28, "No space left on device")
    return original(self, step, *args, **kwargs)

  monkeypatch.setattr(checkpoint.ocp.CheckpointManager, "save", failing_save)
  run_dir = tmp_path / "enospc"
  with pytest.raises(checkpoint.CheckpointSaveError, match=r"^step 8: saving .* failed: the disk is full"):
    loop.train(micro_config(corpus), run_dir)
  assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["4"]  # removed at once

  monkeypatch.undo()
  leftover = run_dir / "checkpoints" / "8.orbax-checkpoint-tmp-99"
  leftover.mkdir()  # e.g. a SIGKILL mid-save
  result = loop.train(micro_config(corpus, resume=True), run_dir)
  assert not leftover.exists() and f"removed {leftover}" in capsys.readouterr().out
  assert result.status == "completed" and result.step == 12


def test_sigterm_during_a_save_finishes_it_and_stops(tmp_path, corpus, monkeypatch):  # noqa: F811
  original = checkpoint.Checkpointer.save

  def save_and_get_terminated(self, step, state, data_state):
    if step == 4:
      os.kill(os.getpid(), signal.SIGTERM)  # arrives while the save is being written
    return original(self, step, state, data_state)

  monkeypatch.setattr(checkpoint.Checkpointer, "save", save_and_get_terminated)
  handler = signal.getsignal(signal.SIGTERM)
  result = loop.train(micro_config(corpus, checkpoint_every=4), tmp_path / "term")
  assert signal.getsignal(signal.SIGTERM) is handler
  assert result.status == "interrupted" and result.stop_signal == signal.SIGTERM
  assert result.step in (4, 5) and result.checkpoint_step == result.step
  checkpointer = checkpoint.Checkpointer(tmp_path / "term", keep=10)
  try:
    assert checkpointer.last_good_step() == result.step  # verified, manifest written
  finally:
    checkpointer.close()


def write_config_file(tmp_path, corpus, **overrides) -> pathlib.Path:  # noqa: F811
  path = tmp_path / "micro_config.py"
  path.write_text(
      "import sys\n"
      f"sys.path.insert(0, {str(REPO / 'tests')!r})\n"
      "import test_train_loop\n"
      f"def get_config():\n  return test_train_loop.micro_config({corpus!r}, **{overrides!r})\n"
  )
  return path


def start_main(*args: str) -> subprocess.Popen:
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  return subprocess.Popen([sys.executable, "-m", "train.main", *args], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigterm_during_a_step_saves_and_exits_143(tmp_path, corpus):  # noqa: F811
  config_file = write_config_file(tmp_path, corpus, steps=100_000, checkpoint_every=100_000, eval_every=100_000)
  run_dir = tmp_path / "preempted"
  proc = start_main(f"--config={config_file}", f"--workdir={run_dir}")
  metrics_file = run_dir / "metrics.jsonl"
  deadline = time.time() + 240
  while time.time() < deadline and proc.poll() is None:  # wait until it trains (logs every step)
    if metrics_file.exists() and '"loss"' in metrics_file.read_text():
      break
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=240)
  assert proc.returncode == 143, out[-2000:] + err[-3000:]
  assert "saved a checkpoint; continue with --resume" in out and "Traceback" not in err
  step, state, data_state = restore(run_dir, micro_config(corpus))
  assert step >= 1 and int(state.step) == step and data_state["position"] == step * 4


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("model__d_model", 48, "model.d_model 32 -> 48"),
        ("model__n_layers", 2, "model.n_layers 1 -> 2"),
        ("recipe", "bitnet", "recipe bf16 -> bitnet"),
        ("optimizer", "adamw_8bit", "optimizer adamw -> adamw_8bit"),
    ],
)
def test_resume_with_a_shape_changing_field_is_refused_before_any_restore(
    field, value, shown, stopped_run, tmp_path, corpus, monkeypatch  # noqa: F811
):
  stopped, _ = stopped_run
  run_dir = copy_run(stopped, tmp_path)

  def no_restore(*args, **kwargs):
    raise AssertionError("restore attempted")

  monkeypatch.setattr(checkpoint.Checkpointer, "restore", no_restore)
  config = micro_config(corpus, resume=True, **{field: value})
  with pytest.raises(train_config.ConfigError, match="cannot resume") as error:
    loop.train(config, run_dir)
  assert shown in str(error.value), str(error.value)


def test_logged_losses_on_resume_equal_the_uninterrupted_run(tmp_path, corpus):  # noqa: F811
  """log_every=5, stopped at step 7: the step-10 line averages steps 6-10 as the uninterrupted run's does."""
  config = micro_config(corpus, log_every=5, checkpoint_every=100)
  loop.train(config, tmp_path / "full")
  stopped = loop.train(config, tmp_path / "split", should_stop=lambda step: step == 7)
  assert stopped.checkpoint_step == 7
  config.resume = True
  loop.train(config, tmp_path / "split")
  expected, actual = train_losses(tmp_path / "full"), train_losses(tmp_path / "split")
  assert sorted(actual) == [5, 10, 12] and actual == expected  # bit for bit


def test_resume_of_a_finished_run_says_so(stopped_run, tmp_path, corpus, capsys):  # noqa: F811
  stopped, _ = stopped_run
  run_dir = copy_run(stopped, tmp_path)
  result = loop.train(micro_config(corpus, resume=True, steps=10), run_dir)
  assert result.status == "completed" and result.step == 10
  assert "this run already finished" in capsys.readouterr().out


@pytest.mark.parametrize(
    "override, shown",
    [
        ("--config.lr=-1", "lr"),
        ("--config.grad_accum_steps=0", "grad_accum_steps"),
        ("--config.model.dropout_rate=1.5", "dropout_rate"),
        ("--config.no_such_field=1", "no_such_field"),
        ("--config.recipe=int4", "recipe"),
        ("--config.lr=nan", "lr"),
        ("--config.eps=1e30", "eps"),
        ("--config.seed=-1", "seed"),
        ("--config.optimizer=chain", "optimizer"),
    ],
)
def test_a_bad_config_is_one_error_line_and_exit_2(override, shown, tmp_path):
  proc = start_main(f"--config={TINY}", f"--workdir={tmp_path / 'bad'}", override)
  out, err = proc.communicate(timeout=240)
  assert proc.returncode == 2, out[-2000:] + err[-3000:]
  lines = [line for line in err.splitlines() if line.strip()]
  assert lines[-1].startswith("error: ") and shown in lines[-1], err
  assert "Traceback" not in err and out == "", out  # the check runs before the trainer prints anything
  assert not (tmp_path / "bad" / "checkpoints").exists()


def test_a_misspelled_override_says_the_field_and_the_hint_plainly(tmp_path):
  proc = start_main(f"--config={TINY}", f"--workdir={tmp_path / 'bad'}", "--config.model.d_modl=3")
  out, err = proc.communicate(timeout=240)
  lines = [line for line in err.splitlines() if line.strip()]
  assert proc.returncode == 2 and lines == [
      "error: the config has no field 'd_modl' (in --config.model.d_modl); did you mean \"d_model\"? (every field is "
      "listed in train/config.py base_config())"], err


def test_a_bad_config_value_names_the_field():
  for field, value in [("eval_batches", 0), ("grad_clip", -1.0), ("warmup_steps", -1), ("seq_len", 0)]:
    config = train_config.load_file(TINY)
    config[field] = value
    with pytest.raises(train_config.ConfigError, match=field):
      train_config.check(config)
  config = train_config.load_file(TINY)
  config.model.d_model = 0
  with pytest.raises(train_config.ConfigError, match="d_model"):
    train_config.check(config)


def test_a_short_run_clamps_the_warmup_with_a_notice():
  config = train_config.load_file(REPO / "configs" / "bitnet_1b.py")
  config.steps = 50
  notes = train_config.adjust(config)
  assert config.warmup_steps == 50 and any("warmup" in note for note in notes), notes
  train_config.check(config)  # now runnable


def test_two_sigints_5_ms_apart_save_and_the_resumed_run_logs_the_same_losses(tmp_path, corpus):  # noqa: F811
  """Issue 31: a double-tapped Ctrl-C stopped mid-step (exit 130) and the resumed run lost step 24's logged loss.
  Now signals within run_control.REPEAT_WINDOW_S of the first repeat the request: the step finishes, the run saves,
  and resuming reproduces the uninterrupted run's logged losses bit for bit."""
  overrides = dict(steps=1500, log_every=3, eval_every=100_000, checkpoint_every=100_000)
  full = loop.train(micro_config(corpus, **overrides), tmp_path / "full")
  assert full.status == "completed"
  config_file = write_config_file(tmp_path, corpus, **overrides)
  run_dir = tmp_path / "double"
  proc = start_main(f"--config={config_file}", f"--workdir={run_dir}")
  metrics_file = run_dir / "metrics.jsonl"
  deadline = time.time() + 240
  while time.time() < deadline and proc.poll() is None:
    if metrics_file.exists() and '"loss"' in metrics_file.read_text():
      break
    time.sleep(0.05)
  proc.send_signal(signal.SIGINT)
  time.sleep(0.005)
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=240)
  assert proc.returncode == 130, out[-2000:] + err[-3000:]
  assert "saved a checkpoint; continue with --resume" in out and "Traceback" not in err, out[-2000:] + err[-2000:]
  stopped = checkpoint.latest_verified(run_dir)
  assert stopped is not None and 0 < stopped < 1500
  result = loop.train(micro_config(corpus, resume=True, **overrides), run_dir)
  assert result.status == "completed"
  assert train_losses(run_dir) == train_losses(tmp_path / "full")


def test_a_signal_after_the_repeat_window_stops_at_once():
  from train import run_control  # noqa: PLC0415

  now = [0.0]
  stop = run_control.StopRequest(clock=lambda: now[0])
  stop._handle(signal.SIGINT, None)
  now[0] = run_control.REPEAT_WINDOW_S / 2
  stop._handle(signal.SIGINT, None)  # the same request
  assert stop.requested and stop.signal == signal.SIGINT
  now[0] = run_control.REPEAT_WINDOW_S * 1.5
  with pytest.raises(KeyboardInterrupt):
    stop._handle(signal.SIGINT, None)


def test_readers_use_verified_checkpoints_only(stopped_run, tmp_path, capsys):
  """train.generate (and export, through the same load_run / checkpoint.verified_step) never read a corrupt
  checkpoint: the newest verified one is used with a warning; --step of a corrupt or missing one is one line."""
  from train import cli, generate  # noqa: PLC0415

  stopped, _ = stopped_run
  run_dir = copy_run(stopped, tmp_path)
  flip_bit(largest_file(run_dir / "checkpoints" / "10"))
  _, _, _, step = generate.load_run(run_dir)
  assert step == 8 and "checkpoints/10 is corrupt" in capsys.readouterr().err
  for argv, shown in [(["--step", "10"], "checkpoints/10 is corrupt"), (["--step", "999"], "no checkpoint for step 999")]:
    code = cli.run(generate.main, ["--checkpoint", str(run_dir), "--max_new_tokens", "2", *argv],
                   codes=((checkpoint.CheckpointError, cli.EXIT_USAGE),))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(lines) == 1 and shown in lines[0], lines


@pytest.mark.parametrize("text", ["", "{garbage", "[]"])
def test_a_garbage_config_json_on_resume_is_one_line_naming_it(text, stopped_run, tmp_path, corpus):  # noqa: F811
  from train import cli  # noqa: PLC0415

  stopped, _ = stopped_run
  run_dir = copy_run(stopped, tmp_path)
  (run_dir / checkpoint.CONFIG_FILE).write_text(text)
  with pytest.raises(cli.UserError, match=f"{run_dir / checkpoint.CONFIG_FILE}: the run config") as error:
    loop.train(micro_config(corpus, resume=True), run_dir)
  assert "\n" not in str(error.value)


def test_a_half_written_last_metrics_line_does_not_stop_the_resume(stopped_run, tmp_path, corpus, capsys):  # noqa: F811
  """A disk-full event cut the last record of metrics.jsonl short: the resume drops it with a notice and continues."""
  stopped, expected = stopped_run
  run_dir = copy_run(stopped, tmp_path)
  with open(run_dir / "metrics.jsonl", "a") as f:
    f.write('{"step": 11, "loss": 3.4')
  result = loop.train(micro_config(corpus, resume=True), run_dir)
  assert result.status == "completed" and "dropped its last line" in capsys.readouterr().out
  assert train_losses(run_dir) == expected
  with open(run_dir / "metrics.jsonl", "a") as f:
    f.write('{"step": 13, "lo')
  assert train_losses(run_dir) == expected  # readers (train.plot) skip it too
  lines = (run_dir / "metrics.jsonl").read_text().splitlines()
  (run_dir / "metrics.jsonl").write_text("\n".join(["{bad", *lines]) + "\n")
  with pytest.raises(ValueError, match="metrics.jsonl: line 1 is not a JSON record"):
    train_losses(run_dir)


def test_the_run_ends_with_a_summary(stopped_run, tmp_path, corpus, capsys):  # noqa: F811
  stopped, _ = stopped_run
  run_dir = copy_run(stopped, tmp_path)
  loop.train(micro_config(corpus, resume=True), run_dir)
  out = capsys.readouterr().out.splitlines()
  start = next(i for i, line in enumerate(out) if line.startswith("summary: "))
  summary = out[start:]
  assert summary[0] == f"summary: completed, step 12/12 in {run_dir}", summary
  vals = {r["step"]: r["val_loss"] for r in metrics_records(run_dir) if "val_loss" in r}
  best = min(vals, key=vals.get)
  assert summary[1] == f"  validation loss: final {vals[12]:.4f} (step 12), best {vals[best]:.4f} (step {best})"
  assert summary[2] == f"  checkpoint: {run_dir / 'checkpoints' / '12'}"
  assert [line.split(":")[0].strip() for line in summary[3:]] == ["generate", "plot", "export"], summary
  assert f"python -m train.generate --checkpoint {run_dir}" in summary[3]


def metrics_records(run_dir):
  from train import metrics  # noqa: PLC0415

  return metrics.read_metrics(run_dir)


def test_export_refuses_int8_storage_and_bad_out_dirs_in_one_line(stopped_run, tmp_path, capsys):
  """Issue 31: --dtype int8 exited 0 and wrote every matmul weight as 0 (a float -> int8 cast of |w| < 1)."""
  from train import cli, hf  # noqa: PLC0415
  from train.model import ModelConfig  # noqa: PLC0415

  stopped, _ = stopped_run
  (tmp_path / "afile").write_text("x")
  for argv, shown in [(["--dtype", "int8", "--out", str(tmp_path / "out")], "--dtype int8: choose one of"),
                      (["--out", str(tmp_path / "afile" / "out")], "is a file, not a directory")]:
    code = cli.run(hf.main, ["export", "--checkpoint", str(stopped), *argv],
                   codes=((checkpoint.CheckpointError, cli.EXIT_USAGE),))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(lines) == 1 and shown in lines[0], lines
  assert not (tmp_path / "out").exists()
  with pytest.raises(ValueError, match="dtype int8 cannot hold the weights"):
    hf.save_pretrained(tmp_path / "lib", ModelConfig(), {}, dtype="int8")


@pytest.mark.parametrize("fmt, writer, error", [
    ("safetensors", "save_pretrained", OSError(28, "No space left on device")),
    ("safetensors", "save_pretrained", type("SafetensorError", (Exception,), {})(
        "Error while serializing: I/O error: File too large (os error 27)")),
    ("gguf", "save_gguf", OSError("problem writing element 4096 to file")),  # numpy's tofile: no file name
])
def test_an_export_whose_write_fails_is_one_line_naming_out(fmt, writer, error, stopped_run, tmp_path, capsys,
                                                            monkeypatch):
  """Issue 31's battery: a full disk (a file-size limit) during the export exited 1 with safetensors' error, or 2
  with numpy's, neither naming --out."""
  from train import cli, hf  # noqa: PLC0415

  def fail(*args, **kwargs):
    raise error
  monkeypatch.setattr(hf, writer, fail)
  stopped, _ = stopped_run
  out = tmp_path / "out"
  code = cli.run(hf.main, ["export", "--checkpoint", str(stopped), "--out", str(out), "--format", fmt],
                 codes=((checkpoint.CheckpointError, cli.EXIT_USAGE),))
  lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
  assert code == 2 and len(lines) == 1 and f"--out {out}: writing the export failed" in lines[0], lines
  assert not [p for p in out.rglob("*") if p.is_file()]


def test_sigkill_leaves_only_verified_checkpoints_and_the_resume_continues(tmp_path, corpus):  # noqa: F811
  """A checkpoint every step, then SIGKILL mid-run: every committed checkpoint verifies (the manifest is part of the
  save), orbax's leftover (if the kill hit a save) is removed, and --resume continues from the newest one quietly."""
  config_file = write_config_file(tmp_path, corpus, steps=100_000, checkpoint_every=1, eval_every=100_000,
                                  keep_checkpoints=3)
  run_dir = tmp_path / "killed"
  proc = start_main(f"--config={config_file}", f"--workdir={run_dir}")
  deadline = time.time() + 240
  while time.time() < deadline and proc.poll() is None:
    if len(checkpoint.saved_steps(run_dir)) >= 3:
      break
    time.sleep(0.05)
  proc.kill()
  proc.communicate(timeout=60)
  steps = checkpoint.saved_steps(run_dir)
  assert steps and all(checkpoint.verify(run_dir / "checkpoints" / str(s)) is None for s in steps), steps
  proc = start_main(f"--config={config_file}", f"--workdir={run_dir}", "--resume", f"--config.steps={max(steps) + 2}")
  out, err = proc.communicate(timeout=240)
  assert proc.returncode == 0, out[-2000:] + err[-3000:]
  assert f"resumed from {run_dir / 'checkpoints' / str(max(steps))}" in out and "skipped" not in out, out[-2000:]


def test_another_configs_checkpoints_are_one_line_on_the_command_line(stopped_run, tmp_path, corpus):  # noqa: F811
  stopped, _ = stopped_run
  run_dir = copy_run(stopped, tmp_path)
  (run_dir / checkpoint.CONFIG_FILE).unlink()
  config_file = write_config_file(tmp_path, corpus, model__d_model=48)
  proc = start_main(f"--config={config_file}", f"--workdir={run_dir}", "--resume")
  out, err = proc.communicate(timeout=240)
  lines = [line for line in err.splitlines() if line.strip()]
  assert proc.returncode == 2 and len(lines) == 1 and "is intact but does not restore" in lines[0], err[-3000:]


def test_manifests_of_earlier_versions_still_verify(stopped_run, tmp_path):
  """Runs saved before the manifest moved into the save wrote it after orbax's commit, listing every file with its
  digest (commit files included): such checkpoints stay verified, and a change to any listed file still fails."""
  stopped, _ = stopped_run
  run_dir = copy_run(stopped, tmp_path)
  step_dir = run_dir / "checkpoints" / "10"
  (step_dir / checkpoint.MANIFEST).write_text(json.dumps({"step": 10, "files": checkpoint.file_digests(step_dir)}))
  assert checkpoint.verify(step_dir) is None
  flip_bit(step_dir / "_CHECKPOINT_METADATA")
  assert checkpoint.verify(step_dir).startswith("corrupt: 1 file(s) changed")


def test_failed_reads_collected_after_the_error_line_print_nothing():
  """The race behind the test above, made certain: a gathered orbax read that failed and is collected after the
  error line (asyncio logs "exception was never retrieved") and one never started ("never awaited") print nothing."""
  script = ("import asyncio, gc\n"
            "from train import main\n"
            "async def read():\n  pass\n"
            "loop = asyncio.new_event_loop()\n"
            "failed = loop.create_future()\n"
            "failed.set_exception(ValueError('Requested shape: (1, 48) is not compatible with the stored shape'))\n"
            "unstarted = read()\n"
            "try:\n  main.fail('checkpoint does not restore', 2, with_traceback=False)\n"
            "finally:\n  del failed, unstarted\n  gc.collect()\n")
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                        env={**os.environ, "PYTHONPATH": str(REPO)})
  assert proc.returncode == 2 and proc.stderr.splitlines() == ["error: checkpoint does not restore"], proc.stderr
