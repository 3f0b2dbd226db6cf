"""Pallas calls inside ``jax.shard_map``: output types that vary like their operands.

Under ``shard_map`` with ``check_vma=True`` (its default, and how ``jaxlowbit.fsdp`` runs
the model) ``pallas_call`` needs each output's ``manual_axis_type``: the mesh axes along
which the value differs between devices. A kernel's output differs wherever any operand
does, so it takes the union of the operands' varying axes. Outside ``shard_map`` every
operand's set is empty and so is the output's.
"""

from __future__ import annotations

import jax


def out_struct(shape: tuple[int, ...], dtype, *operands: jax.Array) -> jax.ShapeDtypeStruct:
  """``jax.ShapeDtypeStruct(shape, dtype)`` varying along every manual axis any operand varies along."""
  mats = [jax.typeof(operand).mat for operand in operands]
  varying = frozenset().union(*(mat.varying for mat in mats))
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mats[0].update(varying=varying))
