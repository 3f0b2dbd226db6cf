"""Low-bit GEMM kernels for jaxlowbit and the one place that chooses between them."""

from pallas_kernels.dispatch import scaled_matmul, select_backend
from pallas_kernels.reference import scaled_matmul_reference

__all__ = ["scaled_matmul", "scaled_matmul_reference", "select_backend"]
