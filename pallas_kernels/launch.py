"""Programmatic dependent launch, the kernel's side: let the next kernel be scheduled early.

On Hopper XLA launches kernels with programmatic stream serialization (``--xla_gpu_enable_pdl``, on by default in jax
0.11.2) and starts each kernel it compiles, Pallas Triton kernels included, with PTX's ``griddepcontrol.wait``: a
kernel's programs wait there until the kernel before it has finished and its writes are visible. When the kernel
before it issues no ``griddepcontrol.launch_dependents``, the next kernel is scheduled only after all of its
programs have exited. A decode step is ~150 such kernels of 1.5-4.5 us, so that scheduling gap is paid ~150 times a
token. :func:`early_launch` issues the trigger at a kernel's start (``policy.PDL_EARLY_LAUNCH``): the next kernel's
programs can then be placed on free SMs while this one runs, and they wait at their own ``griddepcontrol.wait``.
That wait keeps every read ordered, so the trigger moves no data dependency; a kernel launched without PDL ignores
it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt

from pallas_kernels import policy

_TRIGGER = "griddepcontrol.launch_dependents;\n\tmov.b32 $0, $1;"


def early_launch(program_id: jax.Array, native: bool) -> jax.Array:
  """``program_id`` (an int32 scalar), after the kernel has issued ``griddepcontrol.launch_dependents`` (a GPU with
  ``policy.PDL_EARLY_LAUNCH``; else it is returned as is). The trigger rides on the value so that it runs before
  the first address the kernel computes from it: Pallas's inline assembly is pure, kept only where its result is
  used."""
  if not (native and policy.PDL_EARLY_LAUNCH):
    return program_id
  word = jnp.full((1,), program_id, jnp.int32)
  [out] = plt.elementwise_inline_asm(_TRIGGER, args=[word], constraints="=r,r", pack=1,
                                     result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)])
  return jnp.max(out)
