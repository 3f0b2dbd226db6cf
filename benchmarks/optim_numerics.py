"""Low-bit AdamW numerics on CPU: update error against optax.adamw and the test MLP's losses.

The protocol of docs/optim.md, "Measured (CPU)", on the problems of tests/test_optim.py:

- update error: norm-wise relative error of each step's update against ``optax.adamw`` on the
  same gradients (lr 1e-3, weight decay 0.1), worst over 10 steps and the quantized tensors, for
  each of ``--seeds`` seeds (the table gives the worst seed);
- test MLP (64-256-256-16, lr 3e-3, weight decay 0.01, 300 steps): mean loss of the last 30 steps,
  ``online`` (a fresh batch every step) and ``memorize`` (50 batches cycled six times), for each
  of ``--mlp-seeds`` problem seeds (the table gives seed 0 and the mean, relative to adamw's);
- state bytes per parameter on benchmarks/optim.py's 1.1B shapes (``jax.eval_shape``).

Each candidate is ``optax.chain(optim.scale_by_adam_quantized(m, v), add_decayed_weights,
scale_by_learning_rate)``, what ``optim.make`` builds for its names, with the (m, v) formats of
:data:`CANDIDATES`: the shipped FP8 optimizers and the MS-AMP questions of issue 13 (the second
moment in e5m2, stored as itself or as its square root).

    PYTHONPATH=. python benchmarks/optim_numerics.py --out benchmarks/results/optim_numerics_cpu.json
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from benchmarks import common  # noqa: E402
from benchmarks.optim import model_shapes  # noqa: E402
from jaxlowbit import optim, qstate  # noqa: E402
from jaxlowbit.qstate import BlockFormat  # noqa: E402
from helpers import rel_err  # noqa: E402
from test_optim import TRACK_KW, _mlp_problem, _params, _trajectory, train  # noqa: E402  (the tests' problems)

E4M3_M = BlockFormat("e4m3", block=optim.BLOCK_FP8)
# label -> (m format, v format); None: optax.adamw, the reference.
CANDIDATES = {
    "adamw": None,
    "adamw_fp8": optim.moment_formats("adamw_fp8"),
    "adamw_fp8_o2": optim.moment_formats("adamw_fp8_o2"),
    "e4m3m_e5m2v": (E4M3_M, BlockFormat("e5m2", block=optim.BLOCK_FP8, nonzero=True)),
    "e4m3m_e5m2sqrtv": (E4M3_M, BlockFormat("e5m2", block=optim.BLOCK_FP8, nonzero=True, sqrt=True)),
}
QUANTIZED_LEAVES = ("kernel", "heads", "odd")  # tests/test_optim.py's _params; "norm" stays float32
MLP_KW = dict(learning_rate=3e-3, weight_decay=0.01)
MEMORIZE_BATCHES, MEMORIZE_CYCLES = 50, 6


def build(label: str, learning_rate, weight_decay) -> optax.GradientTransformation:
  """The optimizer of ``label``: ``optax.adamw`` or the chain ``optim.make`` builds, with its formats."""
  if CANDIDATES[label] is None:
    return optax.adamw(learning_rate, weight_decay=weight_decay)
  return optim.adamw_quantized(*CANDIDATES[label], learning_rate, weight_decay=weight_decay)


def update_error(label: str, seed: int) -> float:
  """Worst norm-wise relative error of a step's update against optax.adamw over 10 steps and the
  quantized tensors (tests/test_optim.py's parameters and gradients, drawn from ``seed``)."""
  key = jax.random.key(seed)
  params = _params(key)
  ref = _trajectory(optax.adamw(**TRACK_KW), params, key, 10)[2]
  ours = _trajectory(build(label, **TRACK_KW), params, key, 10)[2]
  return max(rel_err(u[leaf], r[leaf]) for u, r in zip(ours, ref) for leaf in QUANTIZED_LEAVES)


def mlp_losses(label: str, seed: int) -> dict[str, float]:
  """Mean loss of the last 30 of 300 steps on the test MLP: online and memorizing."""
  params, loss, (inputs, labels) = _mlp_problem(seed)
  cycled = tuple(jnp.tile(x[:MEMORIZE_BATCHES], (MEMORIZE_CYCLES,) + (1,) * (x.ndim - 1)) for x in (inputs, labels))
  return {
      "online": train(build(label, **MLP_KW), params, loss, (inputs, labels))[0],
      "memorize": train(build(label, **MLP_KW), params, loss, cycled)[0],
  }


def state_bytes_per_param(label: str) -> float:
  shapes = model_shapes()
  abstract = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in shapes.items()}
  state = jax.eval_shape(build(label, 1e-3, 0.0).init, abstract)
  return qstate.nbytes(state) / sum(math.prod(s) for s in shapes.values())


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=None, help="JSON file (default benchmarks/results/optim_numerics_cpu.json)")
  parser.add_argument("--seeds", type=int, default=6, help="seeds of the update-error measurement")
  parser.add_argument("--mlp-seeds", type=int, default=1, help="problem seeds of the test MLP (0 is the docs')")
  parser.add_argument("--candidates", default=",".join(CANDIDATES), help="comma-separated labels of CANDIDATES")
  args = parser.parse_args(argv)

  rows = []
  for label in (c.strip() for c in args.candidates.split(",")):
    row = {"optimizer": label, "formats": None if CANDIDATES[label] is None else [str(f) for f in CANDIDATES[label]]}
    row["state_bytes_per_param"] = state_bytes_per_param(label)
    if CANDIDATES[label] is not None:
      row["update_err_per_seed"] = [update_error(label, seed) for seed in range(args.seeds)]
      row["update_err_worst"] = max(row["update_err_per_seed"])
    losses = [mlp_losses(label, seed) for seed in range(args.mlp_seeds)]
    for regime in ("online", "memorize"):
      row[f"{regime}_per_seed"] = [x[regime] for x in losses]
      row[f"{regime}_mean"] = sum(row[f"{regime}_per_seed"]) / len(losses)
    rows.append(row)
    print(f"done {label}", flush=True)
  ref = next((r for r in rows if r["optimizer"] == "adamw"), None)
  for r in rows:
    for regime in ("online", "memorize"):
      r[f"{regime}_seed0"] = r[f"{regime}_per_seed"][0]
      if ref is not None:
        r[f"{regime}_vs_adamw"] = r[f"{regime}_mean"] / ref[f"{regime}_mean"]
  path = common.write_json("optim_numerics_cpu", rows, args.out, device_name="CPU", seeds=args.seeds,
                           mlp_seeds=args.mlp_seeds, protocol=__doc__)
  print(f"\nCPU, jax {jax.__version__}; update error: worst of 10 steps and {args.seeds} seeds; "
        f"MLP: last-30 mean loss, seed 0 and mean of {args.mlp_seeds} seeds")
  shown = [{"optimizer": r["optimizer"], "B/param": f"{r['state_bytes_per_param']:.2f}",
            "update err": f"{r['update_err_worst']:.3f}" if "update_err_worst" in r else "-",
            **{f"{regime} seed 0": f"{r[regime + '_seed0']:.4f}" for regime in ("online", "memorize")},
            **{f"{regime} vs adamw": f"{r.get(regime + '_vs_adamw', 1.0):.4f}" for regime in ("online", "memorize")}}
           for r in rows]
  print(common.table(shown, list(shown[0])))
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
