"""``FsdpConfig``: the FSDP options (a frozen dataclass, usable as a static argument)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxlowbit.parallel.mesh import MeshAxes
from jaxlowbit.parallel.tensor import REQUANTIZE, check_transposed_mode
from jaxlowbit.scaling import INT8_WEIGHT_SCALINGS

REMAT_MODES = ("save_gathered", "regather")
# Element types FSDP's gradient reduce-scatters may sum in (``FsdpConfig.grad_reduce_dtype``).
GRAD_REDUCE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class FsdpConfig(MeshAxes):
  """Options of jaxlowbit's FSDP, and the mesh axes it runs over (:class:`~jaxlowbit.parallel.mesh.MeshAxes`).

  Attributes:
    fsdp_axis: mesh axis the parameters are sharded over (and the batch, too).
    data_axis: mesh axis the parameters are replicated over and the batch sharded over
      (HSDP); ignored when the mesh has no such axis.
    tensor_axis: mesh axis of tensor parallelism (``jaxlowbit.parallel.tensor``): the linears the
      plan's rules name are split over it, the batch is not; ignored when the mesh has no such axis.
    int8_weight_scaling: how an INT8 mixed-precision weight travels.
      ``"row"`` (default): int8 with one global scale per output channel, exactly the
      forward of ``quantized_matmul``; grad_input re-quantizes the gathered (dequantized)
      weight per input channel.
      ``"tensor"``: int8 with one global scale, reused as is by grad_input (no
      re-quantization, 4 scale bytes instead of 4 N).
      SQNR against float64 (``benchmarks/fsdp.py``, CPU, M,K,N = 4096, 2048, 2048; output /
      grad_input; grad_weight is 38.2 dB in every case): Gaussian W: row 38.6 / 36.9,
      tensor 36.8 / 36.8, quantized_matmul 38.6 / 38.6; output channels spanning 100x:
      row 38.6 / 33.3, tensor 29.7 / 29.7, quantized_matmul 38.6 / 34.0.
    remat: what the backward of a linear does for the weight.
      ``"save_gathered"`` (default): keep the gathered low-bit weight from the forward
      (K x N bytes, ``2 K N`` with its transposed copy; ternary unpacks to int8 too)
      until the backward.
      ``"regather"``: keep only the linear's inputs; the backward runs the gather again
      (``jax.checkpoint`` of gather + matmul with nothing saved: one more all-gather and one
      more quantization of the input per linear, for 1/n of the weight memory).
    grad_reduce_dtype: the element type every FSDP gradient reduce-scatter sums in (the
      linears' ``dW`` and the gathered non-linear parameters' gradients); the result is cast back
      to the parameter's dtype. ``"float32"`` (default): exact sums of float32 gradients.
      ``"bfloat16"``: half the bytes on the wire (the 1B model reduce-scatters 5.85 GB of float32
      gradients per step on 2 GPUs, issue 29); each device's gradient is rounded to bfloat16
      (relative error <= 2^-9) before the sum, and the collective adds in bfloat16. The same dtype
      reduce-scatters a fused kernel's gradient over the tensor axis (``ColumnParallel.regroup``).
      The gradient all-reduce over the ``data`` axis (HSDP) and of replicated parameters stays in
      the parameter's dtype.
    tensor_transposed: how a tensor-parallel gather makes x^T (and g's copy) where the recipe scales it
      on its own (INT8, FP8 rowwise, BitNet's int8 grad_weight): ``"requantize"`` (default) from the
      gathered codes, 1 byte per element on the tensor axis; ``"send"`` quantized before the gather and
      sent too, 2 bytes, the unsplit step's numbers exactly (``jaxlowbit.parallel.tensor``).
  """

  int8_weight_scaling: Literal["tensor", "row"] = "row"
  remat: Literal["save_gathered", "regather"] = "save_gathered"
  grad_reduce_dtype: Literal["float32", "bfloat16"] = "float32"
  tensor_transposed: Literal["requantize", "send"] = REQUANTIZE

  def __post_init__(self):
    super().__post_init__()
    if self.int8_weight_scaling not in INT8_WEIGHT_SCALINGS:
      raise ValueError(
          f"FsdpConfig.int8_weight_scaling must be one of {INT8_WEIGHT_SCALINGS}, got {self.int8_weight_scaling!r}"
      )
    if self.remat not in REMAT_MODES:
      raise ValueError(f"FsdpConfig.remat must be one of {REMAT_MODES}, got {self.remat!r}")
    if self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
      raise ValueError(f"FsdpConfig.grad_reduce_dtype must be one of {GRAD_REDUCE_DTYPES}, got "
                       f"{self.grad_reduce_dtype!r}")
    check_transposed_mode(self.tensor_transposed, "FsdpConfig.tensor_transposed")


__all__ = ["GRAD_REDUCE_DTYPES", "REMAT_MODES", "FsdpConfig"]
