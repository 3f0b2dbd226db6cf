"""One process of test_fsdp's 2-process run: ``python fsdp_multiprocess_worker.py SEED OUT``.

The test sets ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``;
``jaxlowbit.fsdp.initialize_distributed`` hands them to ``jax.distributed.initialize``,
which joins the two processes' 2 CPU devices each into 4 global devices (CPU collectives
over gloo). The run is ``fsdp_common.train`` on a 4-device FSDP mesh; each process writes
its losses to OUT.
"""

from __future__ import annotations

import json
import sys

import jax

from jaxlowbit import Int8MixedPrecision, fsdp

RECIPE = Int8MixedPrecision()
STEPS = 3


def run(devices, seed: int, recipe=RECIPE, steps: int = STEPS) -> list[float]:
  from fsdp_common import data, train

  mesh = fsdp.make_mesh(fsdp=len(devices), data=1, devices=devices)
  key = jax.random.key(seed)
  tokens, labels = data(key, steps)
  return [float(v) for v in train(recipe, mesh, fsdp.FsdpConfig(), tokens, labels, jax.random.fold_in(key, 1))]


def main(seed: int, out: str) -> None:
  assert fsdp.initialize_distributed(), "the environment must name a 2-process run"
  losses = run(jax.devices(), seed)
  with open(out, "w") as f:
    json.dump({"losses": losses, "process_count": jax.process_count(), "device_count": jax.device_count()}, f)


if __name__ == "__main__":
  main(int(sys.argv[1]), sys.argv[2])
