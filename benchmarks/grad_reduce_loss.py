"""FSDP gradient reduce-scatter in bfloat16 against float32: the losses of one ``train.main`` run each.

    PYTHONPATH=. python benchmarks/grad_reduce_loss.py --out grad_reduce_loss.json              # 125M, 200 steps
    PYTHONPATH=. python benchmarks/grad_reduce_loss.py --config configs/tiny.py --steps 10 --out tiny.json

Three ``python -m train.main`` runs of one config, seed and data, FSDP over every visible device:
``float32`` (``--config.fsdp.grad_reduce_dtype=float32``, the default), ``bfloat16`` (the same with
bfloat16 sums: each device's gradient rounded to bfloat16 before the reduce-scatter) and the control,
float32 with two microbatches per step: the same function summed in another order, so how far two runs
drift apart without any change of precision (Adam amplifies any difference over the steps; see
``benchmarks/fsdp_train.py``). Reports the largest relative difference of the per-step training loss and
the relative difference of the final validation loss of ``bfloat16`` and of the control, each against
``float32``, and the median step times; prints a table last and writes JSON to ``--out``. ``--no_control``
skips the third run.

Needs no network (the default corpus is the Python standard library's sources) and at least 2 devices.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from benchmarks.common import table, write_json  # noqa: E402
from benchmarks.fsdp_train import compare, run, summarize  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
# name -> extra overrides of the run (every run: FSDP over all devices).
RUNS = {
    "float32": ["fsdp.grad_reduce_dtype=float32"],
    "bfloat16": ["fsdp.grad_reduce_dtype=bfloat16"],
    "control": ["fsdp.grad_reduce_dtype=float32", "grad_accum_steps=2"],
}
COLUMNS = ["run", "devices", "steps", "max_rel_loss_diff", "first_step_rel_loss_diff", "val_loss", "val_rel_diff",
           "ms/step"]


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default=str(REPO / "configs" / "bf16_125m.py"))
  parser.add_argument("--recipe", default="bf16")
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--workdir", default="/tmp/jaxlowbit_grad_reduce_loss")
  parser.add_argument("--no_control", action="store_true", help="skip the float32 run with two microbatches")
  parser.add_argument("--set", action="append", default=[], help="extra config override, e.g. --set batch_size=16")
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)

  if jax.device_count() < 2:
    raise SystemExit(f"needs at least 2 visible devices for the FSDP runs, found {jax.device_count()}")
  names = [name for name in RUNS if not (args.no_control and name == "control")]
  runs, rows = {}, []
  for name in names:
    run_dir = pathlib.Path(args.workdir) / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resume
    run(args.config, args.recipe, 0, run_dir, args.steps, args.set + RUNS[name])
    runs[name] = summarize(run_dir)
    differences = {} if name == "float32" else compare(runs["float32"], runs[name])
    rows.append({"run": name, "devices": runs[name]["devices"], **differences, "val_loss": runs[name]["val_loss"],
                 "ms/step": runs[name]["step_time_s"] and 1e3 * runs[name]["step_time_s"]})
    write_json("grad_reduce_loss", rows, out=args.out, config=args.config, recipe=args.recipe, steps=args.steps,
               overrides=args.set, runs=runs)  # after every run: a call cut short keeps what it measured
  print(table(rows, COLUMNS))
  print("max_rel_loss_diff, val_rel_diff: against the float32 run (control: float32 with 2 microbatches per step)")


if __name__ == "__main__":
  main()
