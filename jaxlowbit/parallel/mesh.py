"""The device mesh of a parallel run: its axis names and :func:`make_mesh`.

Three axes, each optional but ``fsdp``:

==========  ===========================================================================================
axis        what is split over it
==========  ===========================================================================================
``data``    the batch; parameters are replicated (HSDP's outer axis; spans hosts)
``fsdp``    the batch and every parameter's dim 0 / K (``jaxlowbit.parallel.fsdp``)
``tensor``  the column- and row-parallel linears' kernels and the tokens of the residual stream
            (``jaxlowbit.parallel.tensor``); the minor axis, so its groups sit on the fastest links
==========  ===========================================================================================

:class:`MeshAxes` names them; :class:`~jaxlowbit.parallel.fsdp.config.FsdpConfig` extends it with
FSDP's options, so one config names the axes for the mesh, the plan and the collectives.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh


@dataclasses.dataclass(frozen=True)
class MeshAxes:
  """Names of the mesh axes (module docstring).

  Attributes:
    fsdp_axis: the axis parameters are sharded over (and the batch, too).
    data_axis: the axis parameters are replicated over and the batch sharded over (HSDP).
    tensor_axis: the axis of tensor parallelism.
  """

  fsdp_axis: str = "fsdp"
  data_axis: str = "data"
  tensor_axis: str = "tensor"

  def __post_init__(self):
    names = (self.data_axis, self.fsdp_axis, self.tensor_axis)
    if len(set(names)) != 3:
      raise ValueError(f"{type(self).__name__}: data_axis, fsdp_axis and tensor_axis must differ, got {names}")


def make_mesh(fsdp: int = -1, data: int = 1, devices=None, config: MeshAxes = MeshAxes(), tensor: int = 1) -> Mesh:
  """A ``(data, fsdp)`` mesh, or ``(data, fsdp, tensor)`` with ``tensor > 1``, over ``devices``
  (default: all devices of all processes).

  ``fsdp=-1`` takes every device not used by ``data`` and ``tensor``. The tensor axis is the
  minor one, then FSDP, so with ``jax.devices()``'s order a tensor group (which moves
  activations in every layer) sits on the fastest links, within a host, an FSDP group within a
  host where it fits, and the ``data`` axis spans hosts (multi-host: call
  :func:`jaxlowbit.parallel.initialize_distributed` first). ``config``: the axis names (a
  :class:`MeshAxes`, or the run's ``FsdpConfig``).
  """
  devices = list(jax.devices() if devices is None else devices)
  if tensor < 1 or data < 1 or len(devices) % (data * tensor):
    raise ValueError(f"make_mesh: data={data} x tensor={tensor} must divide the {len(devices)} devices")
  if fsdp == -1:
    fsdp = len(devices) // (data * tensor)
  if fsdp * data * tensor != len(devices):
    raise ValueError(f"make_mesh: data={data} x fsdp={fsdp} x tensor={tensor} != {len(devices)} devices; pass "
                     "fsdp=-1 or a matching size")
  if tensor == 1:
    return Mesh(np.asarray(devices, dtype=object).reshape(data, fsdp), (config.data_axis, config.fsdp_axis))
  return Mesh(np.asarray(devices, dtype=object).reshape(data, fsdp, tensor),
              (config.data_axis, config.fsdp_axis, config.tensor_axis))


__all__ = ["MeshAxes", "make_mesh"]
