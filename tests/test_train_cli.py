"""Every command line's errors: one ``error:`` line naming the file, exit 2 for a user mistake (train/cli.py).

The run-directory cases (a corrupt checkpoint, --step 999, a garbage config.json) are in test_train_faults.py,
which has a run to damage.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from test_train_loop import REPO, TINY

from train import cli, data, generate, plot


def run_cli(main, argv, capsys):
  code = cli.run(main, argv)
  err = capsys.readouterr().err
  lines = [line for line in err.splitlines() if line.strip()]
  return code, lines


def one_error_line(lines):
  errors = [line for line in lines if line.startswith("error: ")]
  assert len(errors) == 1 and not any("Traceback" in line for line in lines), lines
  return errors[0]


def test_run_says_one_line_for_a_mistake_and_the_type_for_a_bug(capsys):
  def mistake(argv):
    raise cli.UserError("x.json: the token file description is empty")

  def bug(argv):
    raise KeyError("oops")

  code, lines = run_cli(mistake, [], capsys)
  assert code == cli.EXIT_USAGE and one_error_line(lines) == "error: x.json: the token file description is empty"
  code, lines = run_cli(bug, [], capsys)
  assert code == cli.EXIT_ERROR and one_error_line(lines).startswith("error: KeyError: 'oops' (run again with --debug")
  code, lines = run_cli(mistake, ["--debug"], capsys)
  assert code == cli.EXIT_USAGE and "Traceback (most recent call last):" in lines


def test_os_errors_name_their_file(tmp_path, capsys):
  def read(argv):
    open(argv[0]).read()

  code, lines = run_cli(read, [str(tmp_path / "missing.txt")], capsys)
  assert code == 2 and one_error_line(lines) == f"error: {tmp_path / 'missing.txt'}: No such file or directory"


def test_output_dirs_under_a_file_or_read_only_are_refused_naming_them(tmp_path):
  (tmp_path / "file").write_text("x")
  with pytest.raises(cli.UserError, match="is a file, not a directory"):
    cli.check_output_dir(tmp_path / "file" / "out", "--out")
  if os.geteuid() != 0:  # root writes anywhere
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(cli.UserError, match="cannot"):
      cli.check_output_dir(locked / "out", "--out")
  assert cli.check_output_dir(tmp_path / "a" / "b").is_dir()


def test_generate_without_a_run_is_one_line(tmp_path, capsys):
  code, lines = run_cli(generate.main, ["--checkpoint", str(tmp_path / "nope")], capsys)
  assert code == 2 and "nope" in one_error_line(lines)


def test_plot_without_metrics_is_one_line(tmp_path, capsys):
  code, lines = run_cli(plot.main, [str(tmp_path)], capsys)
  assert code == 2 and "metrics.jsonl" in one_error_line(lines)


def test_token_files_with_bad_descriptions_or_ids_name_the_file(tmp_path):
  path = data.write_token_file(tmp_path / "t.bin", np.arange(10, dtype=np.uint16), vocab_size=300)
  assert data.read_token_file(path)[1] == 300
  meta = tmp_path / "t.bin.json"
  original = meta.read_text()
  for text, match in [("", "is empty"), ("{garbage", "not valid JSON"), ("[]", "not a dict"),
                      ('{"dtype": "float64", "vocab_size": 300, "num_tokens": 10}', "needs dtype")]:
    meta.write_text(text)
    with pytest.raises(cli.UserError, match=f"{meta}: .*{match}"):
      data.read_token_file(path)
  meta.write_text(original.replace("300", "5"))  # ids 5..9 lie past a vocabulary of 5
  with pytest.raises(cli.UserError, match=f"{path}: holds token id 9, outside its vocabulary of 5"):
    data.read_token_file(path)
  meta.write_text(original.replace('"num_tokens": 10', '"num_tokens": 11'))
  with pytest.raises(cli.UserError, match=f"{path}: holds 10 tokens but"):
    data.read_token_file(path)


def test_a_one_file_corpus_gets_advice_that_can_work(tmp_path):
  (tmp_path / "only.py").write_text("x = 1\n" * 2000)
  corpus = data.load_text_corpus([str(tmp_path)], [".py"], 0.5)
  assert corpus.documents == 1
  with pytest.raises(ValueError, match="one-file corpus cannot be split") as error:
    data.validation_batches(corpus.validation, 32, 4, 2, data._split_advice(corpus))
  assert "raise data.val_fraction" not in str(error.value)
  assert isinstance(error.value, cli.UserError)  # train.main: exit 2 (the battery found exit 1)


def _main(*args):
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  return subprocess.run([sys.executable, "-m", "train.main", *args], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=240)


def test_train_main_missing_config_file_and_workdir_that_is_a_file(tmp_path):
  proc = _main(f"--config={tmp_path / 'missing.py'}", f"--workdir={tmp_path / 'run'}")
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2 and lines == [
      f"error: cannot load the --config file {tmp_path / 'missing.py'}: [Errno 2] No such file or directory: "
      f"'{tmp_path / 'missing.py'}'"], proc.stderr
  (tmp_path / "afile").write_text("x")
  proc = _main(f"--config={TINY}", f"--workdir={tmp_path / 'afile'}")
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2 and lines[-1].startswith(f"error: --workdir {tmp_path / 'afile'}: ") and \
      "Traceback" not in proc.stderr and proc.stdout == "", proc.stdout + proc.stderr


def test_modules_end_in_cli_run():
  for module in ("main", "hf", "generate", "data", "plot"):
    text = (REPO / "train" / f"{module}.py").read_text()
    assert "cli." in text, module


def test_hf_config_json_missing_keys_or_zero_heads_is_one_line(tmp_path):
  from train.io import hf_config  # noqa: PLC0415

  good = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
          "intermediate_size": 128, "vocab_size": 300}
  hf_config.model_config_from_hf(good)
  for key, value in [("num_attention_heads", 0), ("hidden_size", None), ("vocab_size", "300")]:
    broken = {**good, key: value}
    if value is None:
      del broken[key]
    with pytest.raises(hf_config.UnsupportedCheckpointError, match=f"{key} must be an integer >= 1"):
      hf_config.model_config_from_hf(broken)
  for text in ("", "{bad", "[]"):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(hf_config.UnsupportedCheckpointError, match="config.json: "):
      hf_config.read_config(tmp_path)


def test_checkpoint_and_metrics_errors_print_as_user_errors_with_their_documented_codes(tmp_path):
  """A CheckpointError's one line carries no type name (issue 31's battery: 'error: CorruptCheckpointError: ...'),
  and a damaged metrics.jsonl line before the last exits 2 naming file and line (it exited 1)."""
  from train import checkpoint, main, metrics  # noqa: PLC0415

  def code(error):
    return next(code for kind, code in main.EXIT_CODES if isinstance(error, kind))

  corrupt = checkpoint.CorruptCheckpointError("no checkpoint in x is verified")
  assert cli.one_line(corrupt) == "no checkpoint in x is verified" and code(corrupt) == main.EXIT_CHECKPOINT
  assert code(checkpoint.CheckpointSaveError("step 8: ...")) == main.EXIT_CHECKPOINT
  assert code(checkpoint.CheckpointMismatchError("another config")) == main.EXIT_USAGE
  assert cli.exit_code(corrupt) == cli.EXIT_USAGE  # the readers (generate, export)
  (tmp_path / metrics.METRICS_FILE).write_text('{"step": 1, "loss": 2.0}\n{"step": 2\n{"step": 3, "loss": 1.0}\n')
  with pytest.raises(cli.UserError, match=r"metrics.jsonl: line 2 is not a JSON record") as error:
    metrics.read_metrics(tmp_path)
  assert code(error.value) == main.EXIT_USAGE and isinstance(error.value, ValueError)
