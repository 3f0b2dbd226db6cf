"""train.loop under FSDP (8 virtual CPU devices): sharded runs equal unsharded ones end to end.

Every run trains the micro model of ``test_train_loop`` (float32 compute and parameters) for
5 steps from one fresh ``config.seed`` per module, so runs of one config share their
compiled functions (``steps.step_functions``' cache) across the tests here:

- 5 steps under FSDP give the per-step training losses and the validation loss of the
  unsharded run within 1e-5 relative, recipe by recipe (and on a data x fsdp mesh; which
  run is "unsharded" for recipes whose scales span the batch: see SHARDED_VS_UNSHARDED);
- a checkpoint resumes on another mesh (FSDP -> smaller FSDP, FSDP -> one device, one
  device -> FSDP, the weight scales then recomputed) and continues the uninterrupted run;
- a run stopped and resumed under FSDP places the uninterrupted run's batches;
- a NaN under FSDP stops the run and keeps the last good checkpoint;
- gradient accumulation under FSDP equals it on one device;
- ``mesh_shape`` resolves ``config.mesh`` and rejects what does not fit the devices;
- ``python -m train.main`` on two devices runs FSDP by default.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_train_loop
from helpers import fresh_key, xla_flags_with_devices
from test_train_loop import REPO, TINY, logged, micro_config, train_losses, val_losses
from train import checkpoint, loop, metrics, steps
from train import config as train_config
from train.spec import resolve

corpus = test_train_loop.corpus  # its module-scoped fixture (generated text), here for this module

STEPS = 5
# 16 sequences per step: the accumulation test needs 2 per device in each of its microbatches.
BATCH = 16
# The bound: sharded and unsharded losses equal within 1e-5 relative (fp32 parameters).
LOSS_RTOL = 1e-5
# Runs on two meshes differ by float32 rounding (the devices' gradients are summed in other
# orders, BitNet's weight scales are sums over shards), and stay that close only while no
# weight or activation lands across an int8/ternary rounding boundary in one run and not in
# the other: one such flip moves this micro model's loss by up to ~1e-4. Adam passes gradient
# rounding differences on to the weights where |g| is near its eps (the update is linear
# there, and a sign that is rounding noise flips a whole step), scaled by the rate. At the
# micro config's lr 1e-2 INT8 reached 6e-6 (weights 1e-4 apart; 4 seeds), and with eps raised
# to 1e-5 or 1e-3 BitNet broke the bound (3e-5, 1e-4: ternary weights flipped). At lr 1e-3
# and the default eps, every comparison below stayed within 8e-7 over 12 seeds (72 runs),
# and the loss still falls 3-5% in the 5 steps, 30x the bound.
LEARNING_RATE = 1e-3
# BitNet only: its runs can land a ternary weight on the other side of a rounding boundary when
# the two meshes sum its abs-mean scale in different orders (a tie flip); that moves the micro
# model's loss by up to ~2e-4 (2 of 30 seeds: 4e-5 and 2e-4 at step 5; the other 28 <= 5e-7,
# with and without fused quantizers). The first step has no update behind it: the tight bound.
TIE_FLIP_RTOL = 1e-3


def run_config(corpus: str, seed: int, recipe: str, fsdp: int, data: int = 1, **overrides):
  """The micro config for ``STEPS`` steps of ``BATCH`` sequences on a ``data x fsdp`` mesh."""
  overrides = {"steps": STEPS, "batch_size": BATCH, "eval_every": STEPS, "checkpoint_every": STEPS, "lr": LEARNING_RATE,
               **overrides}
  return micro_config(corpus, recipe=recipe, seed=seed, mesh__fsdp=fsdp, mesh__data=data, **overrides)


@pytest.fixture(scope="module")
def seed() -> int:
  """One fresh ``config.seed`` (parameter init and data order) for the whole module."""
  return int(jax.random.randint(fresh_key(), (), 0, 2**31 - 1))


@pytest.fixture(scope="module")
def run(corpus, seed, tmp_path_factory):
  """``run(recipe, fsdp, data=1, grad_accum_steps=1) -> run dir`` of a completed run (each runs once)."""
  root = tmp_path_factory.mktemp("runs")
  done = {}

  def run_once(recipe: str, fsdp: int, data: int = 1, grad_accum_steps: int = 1):
    key = (recipe, data, fsdp, grad_accum_steps)
    if key not in done:
      run_dir = root / "_".join(map(str, key))
      config = run_config(corpus, seed, recipe, fsdp, data, grad_accum_steps=grad_accum_steps)
      result = loop.train(config, run_dir)
      assert result.status == "completed" and result.step == STEPS
      done[key] = run_dir
    return done[key]

  return run_once


def assert_same_run(run_dir, reference_dir, validation: bool = True, rtol: float = LOSS_RTOL) -> None:
  """Per-step training losses (and the final validation loss) of two runs within ``rtol`` (step 1: ``LOSS_RTOL``)."""
  actual, expected = train_losses(run_dir), train_losses(reference_dir)
  assert sorted(actual) == sorted(expected) == list(range(1, STEPS + 1))
  np.testing.assert_allclose(actual[1], expected[1], rtol=LOSS_RTOL)
  steps = range(1, STEPS + 1)
  np.testing.assert_allclose([actual[s] for s in steps], [expected[s] for s in steps], rtol=rtol)
  # The runs must move for the comparison to mean something: 100x the bound.
  assert expected[STEPS] < (1 - 100 * LOSS_RTOL) * expected[1], expected
  if validation:
    np.testing.assert_allclose(val_losses(run_dir)[STEPS], val_losses(reference_dir)[STEPS], rtol=rtol)


def rtol_for(recipe: str) -> float:
  return TIE_FLIP_RTOL if recipe.startswith("bitnet") else LOSS_RTOL


def has_scales(run_dir, step: int) -> bool:
  checkpointer = checkpoint.Checkpointer(run_dir, keep=5, async_save=False)
  try:
    return checkpointer.has_scales(step)
  finally:
    checkpointer.close()


def run_main(run_dir, fields: dict, devices: int) -> subprocess.CompletedProcess:
  """``python -m train.main --config=configs/tiny.py`` with ``--config.KEY=VALUE`` per field on
  ``devices`` virtual CPU devices, in a subprocess; asserts it exits 0."""
  env = {**os.environ, "PYTHONPATH": str(REPO), "XLA_FLAGS": xla_flags_with_devices(devices)}
  proc = subprocess.run(
      [sys.executable, "-m", "train.main", f"--config={TINY}", f"--workdir={run_dir}",
       *[f"--config.{k}={v}" for k, v in fields.items()]],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  return proc


def start_record(run_dir) -> dict:
  """The ``start`` record of the run's latest (re)start."""
  return [r for r in metrics.read_metrics(run_dir) if r.get("event") == "start"][-1]


# (recipe, FSDP run's (data, fsdp), reference run's (data, fsdp)).
#
# bf16 and BitNet with its bf16 grad_weight (bitnet_int8_gi) quantize nothing over the batch
# (activations per token, weights with global scales), so the reference is the one-device run.
# FP8 tensorwise scales each device's activations by their own amax, and INT8 and the shipped
# BitNet quantize grad_weight's operands per feature over the device's tokens: one device over
# the whole batch computes another,
# equally valid, function (FP8: 2e-5 to 6e-5 apart in 5 steps, 4 seeds). INT8's FSDP linear
# also reuses the gathered per-channel weight for grad_input where quantized_matmul
# re-quantizes it per input channel (tests/test_fsdp.py: 35 dB), which alone moves the loss
# by 7e-6 to 1.1e-5 (one device with the batch in 4 microbatches, split as the devices
# split it). Their reference is therefore data parallelism over the same 4 devices with
# replicated parameters (data=4 x fsdp=1): the same per-device numerics, so what differs is
# exactly what FSDP shards. test_gradient_accumulation_under_fsdp compares FP8 tensorwise
# with the one-device step, the batch split as the devices split it.
SHARDED_VS_UNSHARDED = [
    ("bf16", (1, 4), (1, 1)),
    ("int8", (1, 4), (4, 1)),
    ("fp8_tensorwise", (1, 4), (4, 1)),
    ("bitnet", (1, 4), (4, 1)),
    ("bitnet_int8_gi", (2, 2), (1, 1)),  # BitNet's weight scales are sums over shards: the fsdp axis only, not data
]


@pytest.mark.parametrize("recipe, mesh, reference_mesh", SHARDED_VS_UNSHARDED, ids=lambda v: str(v))
def test_fsdp_run_equals_unsharded_run(recipe, mesh, reference_mesh, run, corpus, seed):
  """Per-step training losses and the final validation loss within 1e-5; the run really sharded."""
  (data, fsdp), (ref_data, ref_fsdp) = mesh, reference_mesh
  run_dir = run(recipe, fsdp, data)
  assert_same_run(run_dir, run(recipe, ref_fsdp, ref_data), rtol=rtol_for(recipe))

  # It really ran FSDP: the mesh in the log, parameters and optimizer state sharded.
  assert start_record(run_dir)["devices"] == data * fsdp
  assert start_record(run_dir)["mesh"] == {"data": data, "fsdp": fsdp}
  functions = steps.step_functions(resolve(run_config(corpus, seed, recipe, fsdp, data)))  # cached by the run
  assert functions.runtime.plan.fsdp_size == fsdp
  for tree in (functions.state_shardings.params, functions.state_shardings.opt_state):
    assert any(not s.is_fully_replicated for s in jax.tree.leaves(tree))
  # Quantized linears keep their global weight scales in the checkpoint.
  assert has_scales(run_dir, STEPS) == (recipe != "bf16")


def test_checkpoints_move_between_meshes(run, corpus, seed, tmp_path, capsys):
  """Runs stopped at step 3 resume on another mesh and continue the uninterrupted FSDP run (BitNet with its
  bf16 grad_weight: nothing quantized over a device's tokens, so every mesh computes the same function)."""
  recipe = "bitnet_int8_gi"
  uninterrupted = run(recipe, fsdp=4)
  stop_at_3 = lambda step: step == 3  # noqa: E731

  def stopped(fsdp: int, run_dir):
    result = loop.train(run_config(corpus, seed, recipe, fsdp), run_dir, should_stop=stop_at_3)
    assert result.status == "interrupted" and result.checkpoint_step == 3
    return run_dir

  sharded = stopped(4, tmp_path / "fsdp4")
  shutil.copytree(sharded, tmp_path / "fsdp4_then_one")
  unsharded = stopped(1, tmp_path / "one")
  # An FSDP checkpoint holds the weight scales; an unsharded one does not (FSDP recomputes them).
  assert has_scales(sharded, 3) and not has_scales(unsharded, 3)

  # FSDP over 4 -> over 2 in each of 2 data-parallel groups; FSDP -> one device; one device -> FSDP.
  resumes = [(sharded, 4, (2, 2)), (tmp_path / "fsdp4_then_one", 4, (1, 1)), (unsharded, 1, (1, 4))]
  for run_dir, old_fsdp, (data, fsdp) in resumes:
    capsys.readouterr()
    result = loop.train(run_config(corpus, seed, recipe, fsdp, data, resume=True), run_dir)
    assert result.status == "completed" and result.step == STEPS
    out = capsys.readouterr().out  # a new mesh is no changed run
    assert f"mesh.fsdp {old_fsdp} -> {fsdp}" in out and "expect a different run" not in out, out
    assert start_record(run_dir)["step"] == 3 and start_record(run_dir)["devices"] == data * fsdp
    assert_same_run(run_dir, uninterrupted, rtol=TIE_FLIP_RTOL)  # BitNet
    assert has_scales(run_dir, STEPS) == (fsdp > 1)


def test_a_resumed_fsdp_run_steps_on_the_uninterrupted_runs_batches(corpus, seed, tmp_path, monkeypatch):
  """Stopped at step 3 and resumed, the run places exactly the global batches of an uninterrupted one
  (the config of test_fsdp_run_equals_unsharded_run's bf16 run: its step is compiled already)."""
  placed = []
  shard = steps.StepFunctions.shard_train_batch
  monkeypatch.setattr(steps.StepFunctions, "shard_train_batch",
                      lambda self, batch: placed.append(np.asarray(out := shard(self, batch))) or out)
  config = run_config(corpus, seed, "bf16", 4)
  loop.train(config, tmp_path / "full")
  uninterrupted, placed[:] = list(placed), []
  assert loop.train(config, tmp_path / "split", should_stop=lambda step: step == 3).step == 3
  assert loop.train(run_config(corpus, seed, "bf16", 4, resume=True), tmp_path / "split").step == STEPS
  assert len(placed) == len(uninterrupted) == STEPS and placed[0].shape == (BATCH, config.seq_len + 1)
  for a, b in zip(placed, uninterrupted):
    np.testing.assert_array_equal(a, b)
  assert not np.array_equal(placed[3], placed[4]), "the batches differ from step to step"


def test_nonfinite_loss_under_fsdp_keeps_last_good_checkpoint(corpus, seed, tmp_path):
  """NaN parameters before step 4: NonFiniteLossError; step 2's sharded checkpoint (with scales) is the last."""
  config = run_config(corpus, seed, "bitnet", 4, inject_nan_at_step=4, checkpoint_every=2, eval_every=100)
  run_dir = tmp_path / "nan"
  with pytest.raises(loop.NonFiniteLossError, match="step 4: loss nan.*last good checkpoint is step 2"):
    loop.train(config, run_dir)
  assert max(train_losses(run_dir)) == 3  # nothing logged from the bad step

  checkpointer = checkpoint.Checkpointer(run_dir, keep=5, async_save=False)
  try:
    assert checkpointer.all_steps() == [2] and checkpointer.has_scales(2)
    state, data_state = checkpointer.restore(2, steps.step_functions(resolve(config)).restore_target())
  finally:
    checkpointer.close()
  assert int(state.step) == 2 and data_state["position"] == 2 * BATCH
  assert jax.tree.leaves(state.scales)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves((state.params, state.scales)))


def test_gradient_accumulation_under_fsdp(run):
  """2 microbatches on 4 devices equal 8 microbatches on one device: each holds what one device held.

  FP8 tensorwise scales activations per tensor, so the losses depend on which sequences compute together: microbatch
  ``i`` of the FSDP step must give device ``d`` sequences ``[8 i + 2 d, 8 i + 2 d + 2)``, microbatch ``4 i + d`` of
  the one-device step (``test_train_data`` pins that layout row by row; with bf16 any placement would pass).
  Validation is not compared: the one-device run evaluates each batch whole (the activation scale over 16
  sequences, not 4 as on each device).

  Step 1 starts both runs from the same state: its losses agree to float32 rounding (<= 1.6e-7 over 14 seeds). The
  two runs sum their gradients in other orders, so from then on an FP8 code can flip in one run and not in the other
  (as under tensor parallelism, ``test_train_tensor``): measured up to 1.3e-5 over 14 seeds, 2.3e-5 in one CI run;
  hence the tie-flip bound from step 2. The grad norms, which such flips move by up to 7.2e-4, must agree within
  1e-2: a wrong accumulation scale moves them by a factor (Adam's update alone would not show it in the losses).
  A one-device run of 2 microbatches (the wrong placement) was 4e-7 to 2.8e-5 off at step 1 (14 seeds).
  """
  fsdp, one_device = (run("fp8_tensorwise", fsdp=4, grad_accum_steps=2),
                      run("fp8_tensorwise", fsdp=1, grad_accum_steps=8))
  assert_same_run(fsdp, one_device, validation=False, rtol=TIE_FLIP_RTOL)
  norms, expected = logged(fsdp, "grad_norm"), logged(one_device, "grad_norm")
  np.testing.assert_allclose([norms[s] for s in range(1, STEPS + 1)], [expected[s] for s in range(1, STEPS + 1)],
                             rtol=1e-2)


def test_mesh_shape_resolves_and_rejects(corpus):
  def shape(devices: int = 8, processes: int = 1, **overrides):
    return resolve(micro_config(corpus, **overrides), device_count=devices, process_count=processes).mesh

  auto = {"mesh__fsdp": train_config.MESH_AUTO, "batch_size": 16}
  assert shape(**auto) == (1, 8, 1)
  assert shape(devices=1, **auto) == (1, 1, 1)  # one device: the unsharded run
  assert shape(mesh__data=2, **auto) == (2, 4, 1)
  assert shape(mesh__fsdp=4) == (1, 4, 1)  # one process may leave devices idle
  assert shape(mesh__fsdp=1) == (1, 1, 1)

  with pytest.raises(ValueError, match="do not split over the 8 data x fsdp groups.*multiple of 8"):
    shape(**{**auto, "batch_size": 12})
  with pytest.raises(ValueError, match="microbatches of 4 sequences.*make batch_size a multiple of 32"):
    shape(grad_accum_steps=4, **auto)  # every microbatch, not just the batch, splits over the devices
  with pytest.raises(ValueError, match="data=2 x fsdp=8 needs 16 devices but 8 are visible"):
    shape(mesh__data=2, mesh__fsdp=8, batch_size=16)
  with pytest.raises(ValueError, match="uses 4 of the 8 devices of this 2-process run"):
    shape(processes=2, mesh__fsdp=4)
  with pytest.raises(ValueError, match="mesh.data=3 does not divide the 8 visible devices"):
    shape(mesh__data=3, **auto)
  with pytest.raises(ValueError, match=r"config.mesh.data must be an integer in \[1, inf\), got 0"):
    shape(mesh__data=0)


def test_main_runs_fsdp_over_two_devices(tmp_path, corpus):
  """``python -m train.main`` with two visible devices: FSDP by default (mesh.fsdp=0), exit 0."""
  fields = {"model.d_model": 32, "model.n_layers": 1, "model.n_heads": 2, "model.n_kv_heads": 1, "model.d_ff": 64,
            "model.dtype": "float32", "data.path": corpus, "steps": 2, "batch_size": 4, "seq_len": 32,
            "warmup_steps": 1, "log_every": 1, "eval_every": 2, "eval_batches": 1, "checkpoint_every": 2,
            "tensorboard": False}
  run_dir = tmp_path / "main"
  proc = run_main(run_dir, fields, devices=2)
  assert "devices: FSDP over 2 devices (mesh data 1 x fsdp 2, 1 process(es))" in proc.stdout, proc.stdout
  assert start_record(run_dir)["devices"] == 2 and sorted(train_losses(run_dir)) == [1, 2]
