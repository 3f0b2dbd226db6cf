"""A finished (or running) ``train.main`` run read back: its config, model config and newest checkpoint.

    spec, model_config, params, step = train.runs.load_run("runs/tiny")

What a run directory holds is in ``train/checkpoint.py``; the command lines that start from a
run (``python -m train.generate``, ``python -m train.hf export``) load it here.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax

from train import checkpoint, cli, steps
from train.model import ModelConfig
from train.optimizer import make_optimizer
from train.runtime import Unsharded, model_for
from train.spec import RunSpec, from_saved


def load_run(run_dir: str | pathlib.Path, step: int | None = None) -> tuple[RunSpec, ModelConfig, Any, int]:
  """``(spec, spec.model, params, step)`` of a ``train.main`` run directory (latest verified step by default).

  The spec is the run's saved ``config.json`` through :func:`train.spec.from_saved` (over
  ``train.config.base_config()``: a field added since the run takes its default), built unchecked on
  one device: the checkpoint is restored unsharded, whatever mesh wrote it.
  """
  run_dir = pathlib.Path(run_dir)
  config_file = run_dir / checkpoint.CONFIG_FILE
  if not config_file.exists():
    raise FileNotFoundError(f"{run_dir} has no {checkpoint.CONFIG_FILE}: is it a train.main --workdir?")
  spec = from_saved(cli.read_json(config_file, "run config"))  # on one device (UNSHARDED)
  init = steps.make_init(Unsharded(model_for(spec)), make_optimizer(spec), spec)
  abstract = checkpoint.abstract_on_device(jax.eval_shape(init))
  step = checkpoint.verified_step(run_dir, step)  # verified checkpoints only (the rule of every reader)
  checkpointer = checkpoint.Checkpointer(run_dir, keep=1_000_000, async_save=False, read_only=True)
  try:
    state, _ = checkpointer.restore(step, abstract)
  finally:
    checkpointer.close()
  return spec, spec.model, state.params, step  # the optimizer state is dropped here


__all__ = ["load_run"]
