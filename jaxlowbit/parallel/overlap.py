"""XLA options that let a multi-GPU step overlap its collectives with its GEMMs.

XLA:GPU emits every all-gather, reduce-scatter and all-reduce asynchronously (a ``-start`` /
``-done`` pair; the old ``--xla_gpu_enable_async_*`` flags are gone: XLA refuses them as unknown,
and ``--xla_gpu_disable_async_collectives`` is empty by default). What decides whether a
collective runs beside compute is the schedule between its start and its done. XLA's default GPU
scheduler keeps them close together; the latency-hiding scheduler moves independent work (the
previous layer's GEMMs, the next weight's quantization) between them, so FSDP's weight gathers
and gradient reduce-scatters run while the GEMMs do.

==================================================  ===========  ==========================================
option (``--<name>=true`` in ``XLA_FLAGS``)          XLA default  what it does here
==================================================  ===========  ==========================================
``xla_gpu_enable_latency_hiding_scheduler``          false        schedules collectives against compute by
                                                                  an estimate of their cost, so a layer's
                                                                  weight gather can start while the layer
                                                                  before computes, and its gradient's
                                                                  reduce-scatter run beside the next GEMMs
``xla_gpu_enable_pipelined_all_gather``              false        in a loop (``nn.scan`` over layers,
                                                                  gradient accumulation), starts the next
                                                                  iteration's all-gather in this one
``xla_gpu_enable_pipelined_reduce_scatter``          true         the same for reduce-scatters: the last
                                                                  iteration's finishes after the loop
==================================================  ===========  ==========================================

The names are fields of XLA's ``DebugOptions`` (``xla/debug_options_flags.cc`` sets their defaults)
in jaxlib 0.10.2 (``tests/test_train_config.py`` compiles with them), but XLA drops flags as its
defaults change: jax 0.11.2's XLA (2 x H200, 2026-11-25) no longer knows the two pipelined ones and
failed every multi-GPU compile with "No such compile option". So :func:`compiler_options` keeps only
the options the running XLA accepts (:func:`known_options`: one trivial compile per name, once per
process) and warns once naming the ones it dropped. It hands them to ``jax.jit(..., compiler_options=)``,
per compiled function: nothing global, no ``XLA_FLAGS`` to set before the backend starts, and a
benchmark can compile the same step with and without them in one process. The same set as
``XLA_FLAGS`` text: :func:`xla_flags`.

The pipelined all-gather keeps one more layer's gathered weight alive in a scanned loop; the
latency-hiding scheduler holds a gathered weight from its early start until its use (XLA bounds
both by its memory limit, ``--xla_gpu_memory_limit_slop_factor``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp

# XLA:GPU DebugOptions that overlap collectives with compute (module docstring).
GPU_OVERLAP_OPTIONS: Mapping[str, bool] = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_reduce_scatter": True,
}
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def compiler_options(devices: Iterable, enabled: bool = True) -> dict[str, bool]:
  """``jax.jit``'s ``compiler_options`` for a step over ``devices``.

  Args:
    devices: the devices of the step's mesh (``jax.Device``s; only ``.platform`` is read).
    enabled: False gives XLA's defaults (``{}``).

  Returns:
    :data:`GPU_OVERLAP_OPTIONS` when enabled and the step spans more than one GPU; ``{}`` on one
    device, on CPUs and TPUs (nothing to overlap, or options of another backend).
  """
  devices = list(devices)
  if not enabled or len(devices) < 2 or any(d.platform not in GPU_PLATFORMS for d in devices):
    return {}
  return known_options(GPU_OVERLAP_OPTIONS)


def known_options(options: Mapping[str, bool]) -> dict[str, bool]:
  """The entries of ``options`` that the default backend's XLA accepts as compile options.

  An unknown name (a flag XLA removed) is dropped with one warning naming it, instead of failing
  every compile of the step.
  """
  known = {name: value for name, value in options.items() if _accepts(name, value)}
  dropped = sorted(set(options) - set(known))
  if dropped:
    _warn_dropped(tuple(dropped))
  return known


NO_SUCH_OPTION = "No such compile option"


@functools.cache
def _accepts(name: str, value: bool) -> bool:
  """Whether XLA compiles a trivial function with ``name=value`` (cached: once per process)."""
  try:
    jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(jnp.zeros((), jnp.float32)).compile()
  except Exception as err:  # noqa: BLE001  (jaxlib's error type varies by version; the message does not)
    if NO_SUCH_OPTION in str(err):
      return False
    raise
  return True


@functools.cache
def _warn_dropped(names: tuple[str, ...]) -> None:
  warnings.warn(f"this XLA does not know the collective-overlap option(s) {', '.join(names)}; "
                "the step compiles without them", stacklevel=3)


def xla_flags(options: Mapping[str, bool] = GPU_OVERLAP_OPTIONS) -> str:
  """The options as ``XLA_FLAGS`` text, for programs that are not jitted through :func:`compiler_options`."""
  return " ".join(f"--{name}={str(value).lower()}" for name, value in options.items())


__all__ = ["GPU_OVERLAP_OPTIONS", "GPU_PLATFORMS", "compiler_options", "known_options", "xla_flags"]
