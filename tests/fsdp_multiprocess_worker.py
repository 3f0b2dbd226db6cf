"""One process of test_fsdp's 2-process run: ``python fsdp_multiprocess_worker.py RANK PORT SEED OUT``.

Each process has 2 CPU devices (XLA_FLAGS from the test); ``jax.distributed.initialize``
joins them into 4 global devices, CPU collectives run over gloo. The run is
``fsdp_common.train`` on a 4-device FSDP mesh; each process writes its losses to OUT.
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


def main(rank: int, port: int, seed: int, out: str) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
  jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=rank)
  losses = run(jax.devices(), seed)
  with open(out, "w") as f:
    json.dump({"losses": losses, "process_count": jax.process_count(), "device_count": jax.device_count()}, f)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
