"""Low-bit kernels for jaxlowbit and the one place that chooses between them (``dispatch``)."""

from pallas_kernels.dispatch import quantize_cols_t, quantize_rows, scaled_matmul, select_backend
from pallas_kernels.reference import scaled_matmul_reference

__all__ = ["quantize_cols_t", "quantize_rows", "scaled_matmul", "scaled_matmul_reference", "select_backend"]
