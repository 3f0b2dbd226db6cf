"""jaxlowbit: INT8, FP8 and BitNet b1.58 training and inference for JAX/Flax on NVIDIA GPUs.

Swap a layer::

    import jaxlowbit
    layer = jaxlowbit.Int8Dense(features=4096)            # was flax.linen.DenseGeneral
    y = jaxlowbit.quantized_matmul(x, w, jaxlowbit.Float8("rowwise"))
    model = jaxlowbit.convert(model, jaxlowbit.BitNet(), filter_fqns=("lm_head",))

NNX layers live in ``jaxlowbit.nnx`` (imported with the package).
"""

from jaxlowbit import fsdp, inference, nnx, optim, parallel, qstate, quantized_training
from jaxlowbit.convert import conversion_report, convert, worth_quantizing
from jaxlowbit.execution import ExecutionOptions
from jaxlowbit_numerics.fp8 import dequantize_fp8, quantize_fp8
from jaxlowbit_numerics.int8 import dequantize_int8, quantize_int8
from jaxlowbit.layers import BitNetDense, Fp8Dense, Int8Dense, LowBitDense, dense_for
from jaxlowbit.matmul import quantized_dot_general, quantized_matmul
from jaxlowbit.operand import LowBitOperand, QuantizedMatrix
from jaxlowbit.quantized_training import Int8Weight, Int8WeightOnlyDense
from jaxlowbit.recipes import BitNet, Float8, Int8MixedPrecision, Recipe
from jaxlowbit.rounding import stochastic_round
from jaxlowbit_numerics.ternary import dequantize_ternary, pack_2bit, quantize_ternary, unpack_2bit

__version__ = "0.1.0"

__all__ = [
    "BitNet",
    "BitNetDense",
    "ExecutionOptions",
    "Float8",
    "Fp8Dense",
    "Int8Dense",
    "Int8MixedPrecision",
    "Int8Weight",
    "Int8WeightOnlyDense",
    "LowBitDense",
    "LowBitOperand",
    "QuantizedMatrix",
    "Recipe",
    "conversion_report",
    "convert",
    "dense_for",
    "dequantize_fp8",
    "dequantize_int8",
    "dequantize_ternary",
    "fsdp",
    "inference",
    "nnx",
    "optim",
    "parallel",
    "pack_2bit",
    "quantize_fp8",
    "quantize_int8",
    "quantize_ternary",
    "quantized_dot_general",
    "quantized_matmul",
    "quantized_training",
    "qstate",
    "stochastic_round",
    "unpack_2bit",
    "worth_quantizing",
]
