"""train.loop / train.main: training runs end to end, resume is exact, NaN and Ctrl-C are handled.

Most runs use a micro model (float32, one layer, width 32) on a small generated text corpus
so that each ``train()`` compiles in seconds; ``test_tiny_config_from_the_command_line`` runs
the README command itself.
"""

import importlib.util
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags

from jaxlowbit import BitNet
from train import checkpoint, data, loop, metrics, steps
from train import config as train_config
from train.model import Transformer
from train.optimizer import make_optimizer
from train.runtime import Unsharded
from train.spec import UNSHARDED, build, resolve

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.py"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
  """A few hundred KB of generated Python-like text in a folder."""
  root = tmp_path_factory.mktemp("corpus")
  rng = np.random.default_rng(0)
  words = ["def", "return", "self", "import", "for", "in", "if", "x", "y", "(", ")", ":", "\n    ", "=", "+", "1"]
  for i in range(60):
    (root / f"module_{i}.py").write_text(" ".join(rng.choice(words, size=1500)))
  return str(root)


def micro_config(corpus: str, **overrides):
  config = train_config.load_file(TINY)
  config.model.update(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, dtype="float32")
  config.data.update(path=corpus, val_fraction=0.2)
  config.update(steps=12, batch_size=4, seq_len=32, lr=1e-2, warmup_steps=2, log_every=1, eval_every=5,
                eval_batches=2, checkpoint_every=4, keep_checkpoints=5, tensorboard=False)
  config.mesh.fsdp = 1  # the single-device loop (with 8 virtual devices, auto would shard); see test_train_fsdp.py
  for key, value in overrides.items():
    parent = config
    *parents, leaf = key.split("__")
    for name in parents:
      parent = parent[name]
    parent[leaf] = value
  return config


def logged(run_dir, key: str) -> dict[int, float]:
  """``{step: value}`` of every metrics record of the run that logs ``key``."""
  return {r["step"]: r[key] for r in metrics.read_metrics(run_dir) if key in r}


def train_losses(run_dir) -> dict[int, float]:
  return logged(run_dir, "loss")


def val_losses(run_dir) -> dict[int, float]:
  return logged(run_dir, "val_loss")


def restore(run_dir, config):
  spec = build(config, UNSHARDED)
  init = steps.make_init(Unsharded(Transformer(spec.model)), make_optimizer(spec), spec)
  abstract = checkpoint.abstract_on_device(jax.eval_shape(init))
  return checkpoint.restore_latest(run_dir, abstract)


def test_tiny_config_from_the_command_line(tmp_path):
  """The README command on CPU: exits 0 and the loss falls well below its start."""
  run_dir = tmp_path / "tiny"
  proc = run_main(f"--config={TINY}", f"--workdir={run_dir}")
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  assert "step 200/200" in proc.stdout and "validation loss" in proc.stdout
  losses = train_losses(run_dir)
  first, last = losses[min(losses)], losses[max(losses)]
  assert first > 4.0 and last < first - 1.5, losses  # ~5.1 -> ~2.4 nats/byte
  vals = val_losses(run_dir)
  assert vals[200] < 3.2, vals
  assert json.loads((run_dir / "config.json").read_text())["model"]["d_model"] == 64
  assert (run_dir / "checkpoints" / "200").is_dir()


def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, corpus):
  config = micro_config(corpus)
  full = loop.train(config, tmp_path / "full")
  assert full.status == "completed" and full.step == 12

  stopped = loop.train(config, tmp_path / "split", should_stop=lambda step: step == 6)
  assert stopped.status == "interrupted" and stopped.step == 6 and stopped.checkpoint_step == 6

  with pytest.raises(FileExistsError, match="--resume"):
    loop.train(config, tmp_path / "split")
  config.resume = True
  resumed = loop.train(config, tmp_path / "split")
  assert resumed.status == "completed" and resumed.step == 12

  expected, actual = train_losses(tmp_path / "full"), train_losses(tmp_path / "split")
  assert sorted(actual) == list(range(1, 13))
  assert [actual[s] for s in range(1, 13)] == [expected[s] for s in range(1, 13)]  # bit for bit
  assert val_losses(tmp_path / "split") == val_losses(tmp_path / "full")
  _, state_full, data_full = restore(tmp_path / "full", config)
  _, state_split, data_split = restore(tmp_path / "split", config)
  assert data_full == data_split and data_full["position"] == 12 * config.batch_size
  for a, b in zip(jax.tree.leaves(state_full), jax.tree.leaves(state_split)):
    np.testing.assert_array_equal(a, b)

  # Step 4 was saved asynchronously while training went on, donating the state's buffers:
  # resuming from it must still reproduce the run.
  shutil.copytree(tmp_path / "full", tmp_path / "from4")
  for step_dir in (tmp_path / "from4" / "checkpoints").iterdir():
    if step_dir.name.isdigit() and int(step_dir.name) > 4:
      shutil.rmtree(step_dir)
  assert loop.train(config, tmp_path / "from4").step == 12
  assert train_losses(tmp_path / "from4") == expected


def run_main(*args: str) -> subprocess.CompletedProcess:
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  return subprocess.run(
      [sys.executable, "-m", "train.main", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
  )


def test_nonfinite_loss_stops_keeps_last_good_checkpoint_and_exits_3(tmp_path, corpus, capsys):
  """``train.main`` in this process (its step is already compiled): NaN at step 7 -> exit 3, step 4 kept."""
  from train import main as train_main

  overrides = {"inject_nan_at_step": 7, "checkpoint_every": 4, "log_every": 5, "eval_every": 100}
  config_file = tmp_path / "nan_config.py"
  config_file.write_text(
      "import sys\n"
      f"sys.path.insert(0, {str(REPO / 'tests')!r})\n"
      "import test_train_loop\n"
      f"def get_config():\n  return test_train_loop.micro_config({corpus!r}, **{overrides!r})\n"
  )
  run_dir = tmp_path / "nan"
  flags.FLAGS(["prog", f"--config={config_file}", f"--workdir={run_dir}"])
  try:
    with pytest.raises(SystemExit) as exit_info:
      train_main.main(["prog"])
  finally:
    flags.FLAGS.unparse_flags()
  assert exit_info.value.code == train_main.EXIT_NONFINITE == 3
  err = capsys.readouterr().err
  assert "step 7: loss nan" in err and "last good checkpoint is step 4" in err, err

  step, state, data_state = restore(run_dir, micro_config(corpus))
  assert step == 4 and sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [4]
  assert data_state["position"] == 4 * 4
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state.params))
  assert max(train_losses(run_dir)) == 5  # nothing logged from the bad interval


def test_ctrl_c_saves_and_exits_cleanly(tmp_path, corpus):
  config = micro_config(corpus, checkpoint_every=100)

  def press_ctrl_c(step):
    if step == 3:
      os.kill(os.getpid(), signal.SIGINT)
    return False

  handler = signal.getsignal(signal.SIGINT)
  result = loop.train(config, tmp_path / "sigint", should_stop=press_ctrl_c)
  assert signal.getsignal(signal.SIGINT) is handler  # restored
  assert result.status == "interrupted" and result.step in (3, 4) and result.checkpoint_step == result.step
  step, state, data_state = restore(tmp_path / "sigint", config)
  assert step == result.step == int(state.step) and data_state["position"] == step * config.batch_size
  config.resume = True  # stopped again before its first step: nothing new to save, no error
  again = loop.train(config, tmp_path / "sigint", should_stop=lambda step: True)
  assert again.status == "interrupted" and again.step == again.checkpoint_step == step


def test_keyboard_interrupt_between_steps_saves(tmp_path, corpus, monkeypatch):
  """A KeyboardInterrupt raised inside the loop (here: while reading data) still saves a consistent state."""
  build = data.build

  def build_interrupting(*args, **kwargs):
    datasets = build(*args, **kwargs)
    next_batch, calls = datasets.train.next_global, []

    def next_or_interrupt():
      calls.append(1)
      if len(calls) == 6:
        raise KeyboardInterrupt
      return next_batch()

    datasets.train.next_global = next_or_interrupt
    return datasets

  monkeypatch.setattr(data, "build", build_interrupting)
  config = micro_config(corpus, checkpoint_every=100)
  result = loop.train(config, tmp_path / "kbd")
  assert result.status == "interrupted" and result.step == 5 and result.checkpoint_step == 5
  step, state, data_state = restore(tmp_path / "kbd", config)
  assert step == 5 and int(state.step) == 5 and data_state["position"] == 5 * config.batch_size


_INITIAL_STATES = {}  # one init per parameter tree (BitNet adds norms), shared by the recipes


@pytest.mark.parametrize("recipe", list(train_config.RECIPES))
def test_each_recipe_builds_and_steps(recipe, corpus):
  config = micro_config(corpus, recipe=recipe)
  spec = build(config, UNSHARDED)
  model = Transformer(spec.model)
  optimizer = make_optimizer(spec)
  tree_kind = isinstance(train_config.recipe_from_name(recipe), BitNet)
  if tree_kind not in _INITIAL_STATES:
    _INITIAL_STATES[tree_kind] = jax.device_get(jax.jit(steps.make_init(Unsharded(model), optimizer, spec))())
  before = _INITIAL_STATES[tree_kind]
  batch = np.random.default_rng(0).integers(0, 259, (config.batch_size, config.seq_len + 1)).astype(np.int32)
  step = jax.jit(steps.make_train_step(Unsharded(model), optimizer, spec))
  state, step_metrics = step(jax.device_put(before), batch)
  assert np.isfinite(float(step_metrics["loss"])) and 4.0 < float(step_metrics["loss"]) < 7.0
  assert float(step_metrics["grad_norm"]) > 0 and int(state.step) == 1
  moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before.params), jax.tree.leaves(state.params))]
  assert all(moved)


def test_gradient_accumulation_matches_one_big_batch(corpus):
  """Two microbatches of 2 give the same step as one batch of 4 (Adam with a large eps is ~linear in g)."""
  batch = np.random.default_rng(1).integers(0, 259, (4, 33)).astype(np.int32)
  state = jax.device_get(steps.step_functions(resolve(micro_config(corpus))).init())  # same tree; compiled above
  results = []
  for accum in (1, 2):
    spec = build(micro_config(corpus, grad_accum_steps=accum, eps=1.0, weight_decay=0.0), UNSHARDED)
    step = jax.jit(steps.make_train_step(Unsharded(Transformer(spec.model)), make_optimizer(spec), spec))
    new_state, step_metrics = step(jax.device_put(state), batch)
    results.append((new_state.params, step_metrics))
  (p1, m1), (p2, m2) = results
  np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-6)
  np.testing.assert_allclose(float(m2["grad_norm"]), float(m1["grad_norm"]), rtol=1e-5)
  for a, b, before in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), jax.tree.leaves(state.params)):
    np.testing.assert_allclose(b - before, a - before, rtol=1e-4, atol=1e-8)  # atol: ~1 ulp of |p| < 0.1


def _load_benchmark(name: str):
  spec = importlib.util.spec_from_file_location(f"benchmark_{name}", REPO / "benchmarks" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_throughput_benchmark_runs_and_writes_json(tmp_path, corpus):
  """The GPU script on CPU with the micro model (its step is already compiled by the tests above)."""
  throughput = _load_benchmark("train_throughput")
  fields = {"model.d_model": 32, "model.n_layers": 1, "model.n_heads": 2, "model.n_kv_heads": 1, "model.d_ff": 64,
            "model.dtype": "float32", "steps": 12, "batch_size": 4, "seq_len": 32, "lr": 0.01, "warmup_steps": 2}
  out = tmp_path / "throughput.json"
  throughput.main(["--configs", str(TINY), "--steps", "2", "--warmup", "1", "--out", str(out),
                   *[arg for k, v in fields.items() for arg in ("--set", f"{k}={v}")]])
  result = json.loads(out.read_text())
  (row,) = result["rows"]
  assert row["recipe"] == "bf16" and row["tokens_per_s"] > 0 and row["speedup_vs_first"] == 1.0
  assert np.isfinite(row["last_loss"]) and result["overrides"]["data.source"] == "synthetic"


def test_convergence_report_from_existing_runs(tmp_path, capsys):
  convergence = _load_benchmark("convergence")
  for recipe, val in (("bf16", 2.00), ("int8", 2.03), ("fp8", 2.05), ("bitnet", 2.30)):
    run = tmp_path / recipe
    run.mkdir()
    records = [{"step": 10, "loss": val + 0.1, "tokens_per_s": 100.0}, {"step": 10, "val_loss": val}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  out = tmp_path / "convergence.json"
  convergence.main(["--report_only", "--workdir", str(tmp_path), "--out", str(out)])
  rows = {r["recipe"]: r for r in json.loads(out.read_text())["rows"]}
  assert rows["int8"]["bar"] == "pass" and rows["fp8"]["bar"] == "FAIL"  # 1.5% and 2.5% above bf16
  assert rows["bitnet"]["gap_vs_bf16"] == pytest.approx(0.15) and "bar" not in rows["bitnet"]
  assert "+2.50%" in capsys.readouterr().out
