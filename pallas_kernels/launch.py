"""Programmatic dependent launch, the kernel's side: let the next kernel be scheduled early.

On Hopper XLA launches kernels with programmatic stream serialization (``--xla_gpu_enable_pdl``, on by default in jax
0.11.2) and starts each kernel it compiles with PTX's ``griddepcontrol.wait`` (openxla/xla#38544: its emitters' and
Triton kernels; that Pallas's Triton kernels get it too is inferred, not read from a compiled kernel: turning PDL off
slowed the ternary decode, whose layers are all Pallas kernels). A kernel's programs wait there until the kernel
before it has finished and its writes are visible. When the kernel
before it issues no ``griddepcontrol.launch_dependents``, the next kernel is scheduled only after all of its
programs have exited. A decode step is ~150 such kernels of 1.5-4.5 us, so that scheduling gap is paid ~150 times a
token. :func:`early_launch` issues the trigger at a kernel's start (``policy.PDL_EARLY_LAUNCH``): the next kernel's
programs can then be placed on free SMs once every program of this one has issued it (the hardware may still
schedule them later), and they wait at their own ``griddepcontrol.wait``. That wait orders the loads after it; a
load the compiler treats as invariant may be hoisted above it, so the trigger is safe only where no such load in
the next kernel reads this one's output (openxla/xla#43894 turns them off for the kernels XLA's own trigger lets
start early). Where the next kernel is not launched with PDL, the trigger has no effect. ``policy.PDL_EARLY_LAUNCH``
says what has been measured, what shows the reads wait, and what has not been checked.
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
