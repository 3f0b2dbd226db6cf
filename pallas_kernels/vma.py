"""Pallas calls inside ``jax.shard_map``: output types that vary like their operands.

Under ``shard_map`` with ``check_vma=True`` (its default, and how ``jaxlowbit.parallel`` runs
the model) ``pallas_call`` needs each output's ``manual_axis_type``: the mesh axes along
which the value differs between devices. A kernel's output differs wherever any operand
does, so it takes the union of the operands' varying axes. Outside ``shard_map`` every
operand's set is empty and so is the output's.
"""

from __future__ import annotations

import jax
from jax import lax


def _varying(operands) -> frozenset:
  """The manual mesh axes along which any of ``operands`` varies."""
  return frozenset().union(*(jax.typeof(operand).mat.varying for operand in operands))


def out_struct(shape: tuple[int, ...], dtype, *operands: jax.Array) -> jax.ShapeDtypeStruct:
  """``jax.ShapeDtypeStruct(shape, dtype)`` varying along every manual axis any operand varies along."""
  mat = jax.typeof(operands[0]).mat.update(varying=_varying(operands))
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)


def vary_like(out: jax.Array, *operands: jax.Array) -> jax.Array:
  """``out`` marked varying along every manual axis any operand varies along.

  For kernels whose wrapper traces with the check off (Mosaic GPU's ``plgpu.kernel``): their
  outputs come back invariant, which a ``custom_vjp`` backward then fails to match against
  its varying primal inputs.
  """
  missing = _varying(operands) - jax.typeof(out).mat.varying
  return lax.pcast(out, tuple(sorted(missing)), to="varying") if missing else out
