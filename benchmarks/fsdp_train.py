"""``train.main`` with FSDP over every visible device against the same run on one device.

    PYTHONPATH=. python benchmarks/fsdp_train.py --out fsdp_train.json             # 125M, 4 recipes
    PYTHONPATH=. python benchmarks/fsdp_train.py --config configs/tiny.py --steps 20 --out tiny.json

For each recipe, two ``python -m train.main`` subprocesses train the same config, seed and
data: one with ``--config.mesh.fsdp=1`` (one device, the plain jitted step) and one with
``--config.mesh.fsdp=0`` (FSDP over all visible devices, the default there). The global batch
is the same. For bf16 and BitNet the two runs then compute the same function up to the order
of floating-point reductions (and the int8/ternary rounding ties that order can flip). FP8
tensorwise and INT8 differ by more, by design: under FSDP each device scales its own share
of the activations (FP8 tensorwise: one amax per tensor; INT8: grad_weight's operands per
feature over the tokens), and INT8's FSDP linear reuses the gathered per-channel weight for
grad_input (tests/test_fsdp.py). On CPU (float32 micro model, 5 steps) that put them 1e-5
to 1e-4 apart, against <= 8e-7 for bf16 and BitNet (tests/test_train_fsdp.py); the configs
here compute in bfloat16, whose rounding is coarser. Such differences grow over training
(Adam's normalized steps amplify them), so a third run, the control, trains on one device
with two microbatches per step: the same function summed in another order. Reports per
recipe the largest relative difference of the per-step training loss, the relative
difference of the final validation loss (FSDP and control, each against the one-device
run), and the median step time of each run; prints a table last and writes everything as
JSON to ``--out``. The learning rate warms up over all ``--steps``: at full rate within a
few steps a fresh model's loss jumps around, and those jumps amplify any difference into a
meaningless comparison.

Needs no network: the default corpus is the Python standard library's sources.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from benchmarks.common import table, write_json  # noqa: E402
from train.metrics import read_metrics  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
# name -> (--config.mesh.fsdp: 1 = one device, 0 = every visible device; extra overrides). The
# control computes the one-device run's function with another summation order (two
# microbatches): how far two runs drift apart from reordering alone.
RUNS = {"one": (1, []), "fsdp": (0, []), "control": (1, ["grad_accum_steps=2"])}


def run(config: str, recipe: str, mesh_fsdp: int, run_dir: pathlib.Path, steps: int, overrides: list[str]) -> None:
  """One ``train.main`` run (raises with its output tail when it fails)."""
  command = [
      sys.executable, "-m", "train.main", f"--config={config}", f"--workdir={run_dir}",
      f"--config.recipe={recipe}", f"--config.steps={steps}", f"--config.mesh.fsdp={mesh_fsdp}",
      f"--config.eval_every={steps}", f"--config.checkpoint_every={steps}", "--config.log_every=1",
      f"--config.warmup_steps={steps}", "--config.tensorboard=False", *[f"--config.{o}" for o in overrides],
  ]
  print("$ " + " ".join(command), flush=True)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
  proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
  print("\n".join(line for line in proc.stdout.splitlines() if not line.startswith("[")), flush=True)
  if proc.returncode:
    raise RuntimeError(f"train.main exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def summarize(run_dir: pathlib.Path) -> dict:
  """Per-step losses, final validation loss, median step time and the device count of one run."""
  records = read_metrics(run_dir)
  losses = {r["step"]: r["loss"] for r in records if "loss" in r}
  times = [r["step_time_s"] for r in records if r.get("step_time_s")][1:]  # the first includes compilation
  start = next(r for r in records if r.get("event") == "start")
  return {
      "losses": losses,
      "val_loss": [r["val_loss"] for r in records if "val_loss" in r][-1],
      "step_time_s": statistics.median(times) if times else None,
      "devices": start.get("devices", 1),
  }


def compare(one: dict, sharded: dict) -> dict:
  """Relative differences of the sharded run's losses from the one-device run's."""
  steps = sorted(set(one["losses"]) & set(sharded["losses"]))
  rel = [abs(sharded["losses"][s] - one["losses"][s]) / abs(one["losses"][s]) for s in steps]
  return {
      "steps": len(steps),
      "max_rel_loss_diff": max(rel),
      "first_step_rel_loss_diff": rel[0],
      "val_rel_diff": abs(sharded["val_loss"] - one["val_loss"]) / abs(one["val_loss"]),
  }


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default=str(REPO / "configs" / "bf16_125m.py"))
  parser.add_argument("--recipes", default="bf16,int8,fp8_tensorwise,bitnet")
  parser.add_argument("--steps", type=int, default=50)
  parser.add_argument("--workdir", default="/tmp/jaxlowbit_fsdp_train")
  parser.add_argument("--set", action="append", default=[], help="extra config override, e.g. --set batch_size=16")
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)

  devices = jax.device_count()
  if devices < 2:
    raise SystemExit(f"needs at least 2 visible devices for the FSDP run, found {devices}")
  results = []
  for recipe in args.recipes.split(","):
    runs = {}
    for name, (mesh_fsdp, extra) in RUNS.items():
      run_dir = pathlib.Path(args.workdir) / f"{recipe}_{name}"
      shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resume
      run(args.config, recipe, mesh_fsdp, run_dir, args.steps, args.set + extra)
      runs[name] = summarize(run_dir)
    control = compare(runs["one"], runs["control"])
    results.append({"recipe": recipe, **compare(runs["one"], runs["fsdp"]),
                    "control_max_rel_loss_diff": control["max_rel_loss_diff"],
                    "control_val_rel_diff": control["val_rel_diff"],
                    "step_time_one_s": runs["one"]["step_time_s"], "step_time_fsdp_s": runs["fsdp"]["step_time_s"],
                    "devices": runs["fsdp"]["devices"], "val_loss_one": runs["one"]["val_loss"],
                    "val_loss_fsdp": runs["fsdp"]["val_loss"], "runs": runs})
    save(args, results)  # after every recipe: a run cut short keeps what it measured
  print(table(results_rows(results), COLUMNS))


COLUMNS = ["recipe", "devices", "steps", "max_rel_loss_diff", "first_step_rel_loss_diff", "val_loss_one",
           "val_loss_fsdp", "val_rel_diff", "control_val_rel_diff", "ms/step one", "ms/step fsdp"]


def results_rows(results: list[dict]) -> list[dict]:
  rows = [{k: v for k, v in r.items() if k != "runs"} for r in results]
  for row in rows:
    row["ms/step one"] = row["step_time_one_s"] and row["step_time_one_s"] * 1e3
    row["ms/step fsdp"] = row["step_time_fsdp_s"] and row["step_time_fsdp_s"] * 1e3
  return rows


def save(args, results: list[dict]) -> None:
  write_json("fsdp_train", results_rows(results), out=args.out, config=args.config, steps=args.steps, overrides=args.set,
             runs={r["recipe"]: r["runs"] for r in results})


if __name__ == "__main__":
  main()
