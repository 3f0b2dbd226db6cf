"""Command line: ``python -m train.main --config configs/tiny.py --workdir runs/tiny``.

Flags:
  --config      a config file (``configs/*.py``); override any field with
                ``--config.key=value``, e.g. ``--config.recipe=int8 --config.model.n_layers=8``.
  --workdir     the run directory (checkpoints, ``config.json``, ``metrics.jsonl``).
  --resume      continue from the latest intact checkpoint in ``--workdir`` (= ``--config.resume=True``).
  --cluster     multi-host: let ``jax.distributed`` detect SLURM / Open MPI / Kubernetes.
  --verbosity   absl's: ``--verbosity=0`` or more also prints the traceback of an error.

Devices: with more than one visible device the run is FSDP over all of them
(``--config.mesh.fsdp=0``, the default; ``=1`` turns it off, ``--config.mesh.data=N`` makes N
data-parallel FSDP groups). Multi-host: start this command once per host (or per GPU) with
``JAX_COORDINATOR_ADDRESS=host0:port``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` set (or
``--cluster`` under a cluster manager); ``jaxlowbit.fsdp.initialize_distributed`` joins the
processes into one run before anything else touches JAX. See docs/training.md.

Errors print one line, ``error: <what and what to do>``. Exit codes:

===  ==================================================================================
0    done (also: ``--resume`` of a run that already finished, which says so)
1    any other error
2    a bad command line or config (unknown field, value out of range or not finite, a --config
     file that does not load, a resume whose config changes the saved state's shapes or whose
     checkpoints are another config's, a --workdir that is a file or holds another run, a
     malformed config.json or token file: one line naming the file)
3    the loss became NaN/inf; the last good checkpoint is kept
4    a checkpoint could not be saved (disk full, permissions) or none is verified; the last
     good checkpoint is kept
130  stopped by Ctrl-C (SIGINT) after saving a checkpoint (128 + SIGINT)
143  stopped by SIGTERM (preemption) after saving a checkpoint (128 + SIGTERM)
===  ==================================================================================
"""

from __future__ import annotations

import logging as std_logging
import signal
import sys
import traceback
import warnings

from absl import app, flags, logging
from ml_collections import config_flags

from jaxlowbit import fsdp
from train import checkpoint, cli, loop
from train import config as train_config
from train.io.hf_config import UnsupportedCheckpointError

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NONFINITE = 3
EXIT_CHECKPOINT = 4
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143

_CONFIG = config_flags.DEFINE_config_file("config", None, "config file, e.g. configs/tiny.py", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory: checkpoints, config.json, metrics.jsonl")
_RESUME = flags.DEFINE_bool("resume", False, "continue from the latest checkpoint in --workdir")
_CLUSTER = flags.DEFINE_bool("cluster", False, "multi-host: let jax.distributed detect SLURM / Open MPI / Kubernetes")
flags.mark_flags_as_required(["config", "workdir"])

# Exceptions and the exit code each ends the run with (the first that matches).
EXIT_CODES = (
    (loop.NonFiniteLossError, EXIT_NONFINITE),
    (checkpoint.CheckpointMismatchError, EXIT_USAGE),  # another config's checkpoints
    (checkpoint.CheckpointError, EXIT_CHECKPOINT),
    (train_config.ConfigError, EXIT_USAGE),
    (FileExistsError, EXIT_USAGE),  # a workdir with checkpoints and no --resume
    (cli.UserError, EXIT_USAGE),  # a missing or malformed file, named
    (UnsupportedCheckpointError, EXIT_USAGE),  # init_from: a Hugging Face folder this trainer cannot read
    (OSError, EXIT_USAGE),  # a file that cannot be read or written, named
)


def fail(message: str, code: int, with_traceback: bool) -> None:
  """Print ``error: message`` (the traceback first, under --verbosity) and exit with ``code``.

  Nothing follows the line: a restore that failed leaves orbax reads it never started, which Python reports as
  "coroutine ... was never awaited", and gathered reads that failed, which asyncio logs as "exception was never
  retrieved", when it collects them at exit; the process is ending on the error they caused, so both are ignored."""
  if with_traceback:
    traceback.print_exc()
  print(f"error: {message}", file=sys.stderr, flush=True)
  warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
  std_logging.getLogger("asyncio").disabled = True
  sys.exit(code)


def _verbose() -> bool:
  return flags.FLAGS["verbosity"].present


def _config_file(argv: list[str]) -> str:
  values = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
  return values[-1] if values else "?"


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a bad flag, a --config file that does not load or an unknown config field said in
  one line (exit 2)."""
  try:
    argv_left = flags.FLAGS(argv)
  except flags.Error as e:
    fail(f"{e}; see --helpfull", EXIT_USAGE, with_traceback=False)
  except SyntaxError as e:  # the config file's own Python
    fail(f"the --config file {e.filename}:{e.lineno}: {e.msg}", EXIT_USAGE, with_traceback=False)
  except (AttributeError, KeyError) as e:  # ml_collections: an override of a field the config lacks
    if "get_config" in str(e):
      fail(f"the --config file {_config_file(argv)} defines no get_config() (see configs/tiny.py)", EXIT_USAGE,
           with_traceback=False)
    # ml_collections' message: "'modle'\nDid you mean \"model\" instead of \"modle\"?" (as a KeyError's repr)
    # (nested fields: escaped once more per level).
    text = str(e.args[0]) if e.args else str(e)
    for _ in range(3):
      if "\\" in text:
        text = text.encode().decode("unicode_escape")
    name, _, hint = text.partition("\n")
    name, hint = name.strip("\"' "), hint.split(" instead of")[0].strip()
    overrides = [a.split("=")[0] for a in argv if a.startswith("--config.")]
    fail(f"the config has no field {name!r} (in {', '.join(overrides)})"
         + (f"; {hint[0].lower() + hint[1:]}?" if hint else "")
         + " (every field is listed in train/config.py base_config())", EXIT_USAGE, with_traceback=False)
  except (ValueError, TypeError) as e:  # an override of the wrong type
    fail(f"bad --config override: {e}", EXIT_USAGE, with_traceback=False)
  try:  # config_flags keeps a file it could not load as an object that raises when first used
    _CONFIG.value.keys()
  except Exception as e:  # noqa: BLE001  (what the file's loading raised: its last line says why)
    cause = [line.strip() for line in str(e).splitlines() if line.strip()][-1:] or [type(e).__name__]
    fail(f"cannot load the --config file {_config_file(argv)}: {cause[0]}", EXIT_USAGE, with_traceback=False)
  return argv_left


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    fail(f"unexpected arguments: {argv[1:]}", EXIT_USAGE, with_traceback=False)
  if not _verbose():
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO; --verbosity=0 shows them
  fsdp.initialize_distributed(cluster=_CLUSTER.value)  # multi-host: join the run (a no-op unless configured)
  config = _CONFIG.value
  if _RESUME.value:
    config.resume = True
  try:
    result = loop.train(config, _WORKDIR.value)
  except KeyboardInterrupt:  # a second Ctrl-C before the loop started
    fail("interrupted", EXIT_INTERRUPTED, with_traceback=False)
  except Exception as e:  # noqa: BLE001  (every error ends in one line and a documented code)
    code = next((code for kind, code in EXIT_CODES if isinstance(e, kind)), EXIT_ERROR)
    fail(cli.one_line(e), code, with_traceback=_verbose())
  if result.status == "interrupted":
    sys.exit(EXIT_TERMINATED if result.stop_signal == signal.SIGTERM else EXIT_INTERRUPTED)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
