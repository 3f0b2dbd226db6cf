"""The single dispatch point for jaxlowbit's low-bit GEMMs.

``jaxlowbit.quantized_matmul`` sends every low-bit matmul of every recipe (forward,
grad_input, grad_weight) through :func:`scaled_matmul`; which implementation runs is
decided here and nowhere else.

Backends:
- ``"xla"``: :func:`pallas_kernels.reference.scaled_matmul_reference` (XLA dot + epilogue).
- ``"pallas"``: the Pallas GPU kernels (Hopper wgmma), where the device and shape allow.

``JAXLOWBIT_BACKEND=xla|pallas|auto`` (default ``auto``) forces a backend; ``auto`` picks
the kernel on devices where it is proven faster and XLA everywhere else.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from pallas_kernels.reference import check_operands, scaled_matmul_reference

BACKEND_ENV = "JAXLOWBIT_BACKEND"
BACKENDS = ("auto", "xla", "pallas")


def requested_backend() -> str:
  """The backend named by ``$JAXLOWBIT_BACKEND`` (``auto`` when unset); ValueError if unknown."""
  value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
  if value not in BACKENDS:
    raise ValueError(f"{BACKEND_ENV}={value!r} is not one of {BACKENDS}")
  return value


def select_backend(a: jax.Array, b: jax.Array, platform: str | None = None) -> str:
  """Which implementation ``scaled_matmul`` uses for these operands: ``"xla"`` or ``"pallas"``."""
  del a, b, platform  # No Pallas kernel is registered yet: every shape takes the XLA path.
  requested = requested_backend()
  if requested == "pallas":
    raise NotImplementedError(f"{BACKEND_ENV}=pallas: no Pallas kernel is available in this build")
  return "xla"


def scaled_matmul(
    a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array, out_dtype=jnp.bfloat16
) -> jax.Array:
  """``(a @ b.T) * a_scale[:, None] * b_scale[None, :]`` on the selected backend.

  Args:
    a: ``[M, K]`` int8 or fp8. b: ``[N, K]`` (K-major, as tensor cores want it).
    a_scale, b_scale: float32 dequantization scales, one per row or one in all.
    out_dtype: dtype of the ``[M, N]`` result.
  """
  check_operands(a, a_scale, b, b_scale)
  select_backend(a, b)
  return scaled_matmul_reference(a, a_scale, b, b_scale, out_dtype)
