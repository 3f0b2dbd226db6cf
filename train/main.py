"""Command line: ``python -m train.main --config configs/tiny.py --workdir runs/tiny``.

Flags:
  --config      a config file (``configs/*.py``); override any field with
                ``--config.key=value``, e.g. ``--config.recipe=int8 --config.model.n_layers=8``.
  --workdir     the run directory (checkpoints, ``config.json``, ``metrics.jsonl``).
  --resume      continue from the latest checkpoint in ``--workdir`` (= ``--config.resume=True``).
  --cluster     multi-host: let ``jax.distributed`` detect SLURM / Open MPI / Kubernetes.

Devices: with more than one visible device the run is FSDP over all of them
(``--config.mesh.fsdp=0``, the default; ``=1`` turns it off, ``--config.mesh.data=N`` makes N
data-parallel FSDP groups). Multi-host: start this command once per host (or per GPU) with
``JAX_COORDINATOR_ADDRESS=host0:port``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` set (or
``--cluster`` under a cluster manager); ``jaxlowbit.fsdp.initialize_distributed`` joins the
processes into one run before anything else touches JAX. See docs/training.md.

Exit codes: 0 done; 130 interrupted by Ctrl-C after saving a checkpoint (128 + SIGINT, the
shell's convention); 3 loss became NaN/inf (the last good checkpoint is kept); 1 other errors.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from jaxlowbit import fsdp
from train import loop

EXIT_INTERRUPTED = 130
EXIT_NONFINITE = 3

_CONFIG = config_flags.DEFINE_config_file("config", None, "config file, e.g. configs/tiny.py", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory: checkpoints, config.json, metrics.jsonl")
_RESUME = flags.DEFINE_bool("resume", False, "continue from the latest checkpoint in --workdir")
_CLUSTER = flags.DEFINE_bool("cluster", False, "multi-host: let jax.distributed detect SLURM / Open MPI / Kubernetes")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO; --verbosity=0 shows them
  fsdp.initialize_distributed(cluster=_CLUSTER.value)  # multi-host: join the run (a no-op unless configured)
  config = _CONFIG.value
  if _RESUME.value:
    config.resume = True
  try:
    result = loop.train(config, _WORKDIR.value)
  except loop.NonFiniteLossError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(EXIT_NONFINITE)
  except FileExistsError as e:  # a workdir with checkpoints and no --resume
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(1)
  if result.status == "interrupted":
    sys.exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
  app.run(main)
