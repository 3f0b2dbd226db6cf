"""Joining a multi-process run: ``jax.distributed.initialize`` with its arguments from the environment.

jaxlowbit has no launcher: start one process per host (or per GPU) with whatever starts
your jobs (SLURM, mpirun, Kubernetes, ssh, a shell loop) and call
:func:`initialize_distributed` in each before anything else touches JAX. The processes then
see one global device list, :func:`jaxlowbit.parallel.make_mesh` spans all of them, and every
jitted step runs on all hosts.

Where the three values come from, first match wins:

1. the arguments;
2. ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0, which JAX itself reads),
   ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` (read here and passed on);
3. with ``cluster=True``: JAX's cluster detection (SLURM, Open MPI, Kubernetes; the port
   from ``JAX_COORDINATOR_PORT``).

With none of them the run is single-process and nothing is called. ``JAX_LOCAL_DEVICE_IDS``
(read by JAX) restricts a process to some local GPUs, e.g. one process per GPU.
"""

from __future__ import annotations

import os

import jax

ENV_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    cluster: bool = False,
    cpu_collectives: str = "gloo",
) -> bool:
  """Call ``jax.distributed.initialize`` when a multi-process run is configured.

  Args:
    coordinator_address, num_processes, process_id: as for ``jax.distributed.initialize``;
      None reads the environment (module docstring).
    cluster: let JAX detect a cluster (SLURM, Open MPI, Kubernetes) for what is unset.
    cpu_collectives: CPU cross-process collectives implementation (``jax_cpu_collectives_implementation``),
      set before initializing; ignored on GPU.

  Returns:
    True when ``jax.distributed.initialize`` was called.
  """
  coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR_ADDRESS)
  if num_processes is None and ENV_NUM_PROCESSES in os.environ:
    num_processes = int(os.environ[ENV_NUM_PROCESSES])
  if process_id is None and ENV_PROCESS_ID in os.environ:
    process_id = int(os.environ[ENV_PROCESS_ID])
  given = [v is not None for v in (coordinator_address, num_processes, process_id)]
  if not any(given) and not cluster:
    return False
  if not all(given) and not cluster:
    raise ValueError(
        "initialize_distributed: set all of coordinator address, number of processes and process id "
        f"(arguments or ${ENV_COORDINATOR_ADDRESS}, ${ENV_NUM_PROCESSES}, ${ENV_PROCESS_ID}), "
        "or pass cluster=True to let JAX detect SLURM / Open MPI / Kubernetes"
    )
  jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id)
  return True


__all__ = ["ENV_COORDINATOR_ADDRESS", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "initialize_distributed"]
