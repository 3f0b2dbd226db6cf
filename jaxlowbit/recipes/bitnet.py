"""BitNet b1.58: ternary absmean weights x int8 per-token activations (torchao ``bitnet``, BitNet FAQ).

- W ternary: ``s = mean(|W|)`` (float32, >= 1e-5), ``Wq = clip(round(W / s), -1, 1)``.
- x int8 per row (absmax, eps 1e-5); forward on int8 tensor cores.
- backward straight-through: the gradient flows as if quantization were identity.
- W is quantized once per forward use: the forward keeps its codes ``Wq^T [N, K]`` (int8, 1 byte
  per value) and one scale as the residual, and grad_input reads ``Wq`` as their transpose, instead
  of quantizing the float32 W a second time (two more reads of 4 bytes per value).
- model side (:attr:`BitNet.norm_before_linear`): BitNet projections read RMSNorm outputs, placed as
  the model says (``train.model.ModelConfig.bitnet_norm_placement``): ``"sub"``, the published
  BitNet b1.58 (the pre-norms plus a sub-norm before the attention output and down projections;
  ``configs/bitnet_*.py``), or ``"every_projection"``, torchao's surgery (an RMSNorm before each).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxlowbit.operand import QuantizedMatrix, is_low_bit
from jaxlowbit.recipes.base import (
    GRAD_INPUT_SCOPE,
    GRAD_WEIGHT_SCOPE,
    OUTPUT_SCOPE,
    OperandQuantization,
    Recipe,
    check_bools,
    gemm,
    hp_dot,
    provided,
    quantize_operand,
)
from jaxlowbit.scaling import WeightScaling
from jaxlowbit_numerics import ternary
from jaxlowbit_numerics.formats import QuantSpec
from pallas_kernels import dispatch

ACTIVATIONS = QuantSpec("int8", eps=ternary.ACTIVATION_EPS)
TERNARY = QuantSpec("int8", per_tensor=True, ternary=True)
GRADIENTS = QuantSpec("int8")
# The activations' codes are exact int8 values: a bf16 grad_weight reads them (dequantized), so x^T
# is their transpose, scales and all.
INPUT = OperandQuantization(ACTIVATIONS, ACTIVATIONS, transposed_from_rows=True)
# An int8 grad_weight reads x^T quantized per input feature over the tokens, as the INT8 recipe's:
# the per-token codes' scales vary along grad_weight's reduction axis and cannot leave the GEMM.
INPUT_INT8_GRAD_WEIGHT = OperandQuantization(ACTIVATIONS, ACTIVATIONS)


@dataclasses.dataclass(frozen=True)
class BitNet(Recipe):
  """BitNet b1.58: ternary absmean weights, int8 per-token activations (torchao ``bitnet``).

  The forward always runs ternary x int8 on int8 tensor cores. The backward is
  straight-through (quantization acts as identity for the gradient): by default it runs
  in high precision against the quantized operands, exactly like the BitNet fake-quant
  reference. The flags move a backward matmul onto int8 tensor cores as well, at the
  cost of quantizing g per row (``grad_input``) or per output feature (``grad_weight``).

  Attributes:
    grad_input: ``dx = g @ (s * Wq)^T`` with g in int8 per token (Wq is exact in int8).
    grad_weight: ``dW = x^T @ g`` with x^T int8 per input feature and g^T int8 per output feature
      (both over the tokens, the INT8 recipe's grad_weight), instead of the quantized x in bf16.
  """

  grad_input: bool = False
  grad_weight: bool = False

  norm_before_linear = True

  def __post_init__(self):
    check_bools(self, ("grad_input", "grad_weight"))

  def input_quantization(self) -> OperandQuantization:
    return INPUT_INT8_GRAD_WEIGHT if self.grad_weight else INPUT

  def weight_scaling(self, int8_weight_scaling: str = "row") -> WeightScaling:
    del int8_weight_scaling
    return WeightScaling.TERNARY

  def forward(self, x, w, options):
    with jax.named_scope(OUTPUT_SCOPE):
      if is_low_bit(x):
        x_rows = provided(x, "rows", ACTIVATIONS, self, "input")
        x_t = provided(x, "transposed", ACTIVATIONS, self, "input") if self.grad_weight else None
      else:  # the rows, and x^T where an int8 grad_weight reads it (one pass for both layouts)
        how = INPUT_INT8_GRAD_WEIGHT if self.grad_weight else OperandQuantization(ACTIVATIONS)
        x_rows, x_t = quantize_operand(x, how, options)
      if is_low_bit(w):
        w_t = provided(w, "transposed", TERNARY, self, "weight")
        w_kept = w  # a producer's operand: FSDP's gather brings grad_input's rows too, train.steps' not
      else:  # Wq^T [N, K] (one scale), and Wq [K, N] where one kernel pass writes both: W is quantized once per use
        rows, transposed = dispatch.quantize_ternary_weight(w, TERNARY, options)
        w_t = QuantizedMatrix(*transposed, TERNARY)
        w_kept = (None if rows is None else QuantizedMatrix(*rows, TERNARY), w_t)
      y = gemm(x_rows, w_t, x.dtype, options)
    # The straight-through grad_weight multiplies by the quantized x (int8 + one scale per row), or
    # an int8 grad_weight by x^T quantized per input feature.
    return y, (x_t if self.grad_weight else x_rows, w_kept)

  def backward(self, residuals, g, w_dtype, options, g_maxima=None):
    x_saved, w = residuals
    # g per token for grad_input, g^T per output feature for grad_weight: one pass where both are int8.
    g_rows, g_t = quantize_operand(g, OperandQuantization(GRADIENTS if self.grad_input else None,
                                                          GRADIENTS if self.grad_weight else None), options, g_maxima)
    with jax.named_scope(GRAD_INPUT_SCOPE):
      if is_low_bit(w):
        w_rows = provided(w, "rows", TERNARY, self, "weight") if w.rows is not None else None
        w_t = provided(w, "transposed", TERNARY, self, "weight") if w_rows is None else None
      else:
        w_rows, w_t = w  # the forward's codes (Wq or None, Wq^T)
      if w_rows is None:
        # Wq [K, N] K-major for the GEMM: an int8 transpose of the forward's codes (one scale for
        # the tensor, so the rows' scale is the same), bit-identical to quantizing W again by rows.
        w_rows = QuantizedMatrix(w_t.data.T, w_t.scale, TERNARY)
      if self.grad_input:
        dx = gemm(g_rows, w_rows, g.dtype, options)  # Wq is exact in int8
      else:
        dx = hp_dot(g, w_rows.dequantize(g.dtype).T, g.dtype)  # weight-sized: cheap
    with jax.named_scope(GRAD_WEIGHT_SCOPE):
      if self.grad_weight:
        dw = gemm(x_saved, g_t, w_dtype, options)  # x^T [K, M] (per input feature) x g^T [N, M]
      else:
        # The straight-through reference's fake-quantized x, in g's dtype (bf16 in training: exact
        # enough there, and an f32 GEMM would be ~3x slower).
        x_fake = (x_saved.data.astype(jnp.float32) * x_saved.scale).astype(g.dtype)
        dw = hp_dot(x_fake.T, g, w_dtype)
    return dx, dw


# The trainer's "bitnet" runs both backward matmuls on int8 tensor cores. grad_input: the ternary weight is
# exact in int8, and on the 125M model (600 steps, one H200; benchmarks/results/bitnet_backward_125m_h200.json)
# its validation loss (0.7149) matched the high-precision backward's (0.7163). grad_weight, x^T and g^T per
# feature: two seeds of 1000 steps at 125M (2 x H100; bitnet_int8_grad_weight_125m_h100x2_1ce99e1.json) ended
# 0.41% above the bf16 grad_weight on average (+0.16%, +0.66%), while the step ran 1.46x bf16 instead of 1.23x
# under FSDP on two H100s (Llama 3 8B's layers) and 1.17x instead of 1.06x on one (1B).
BitNet.presets = {
    "bitnet": BitNet(grad_input=True, grad_weight=True),
    "bitnet_hp_bwd": BitNet(),  # the straight-through backward in high precision (BitNet()'s default)
    "bitnet_int8_gi": BitNet(grad_input=True),  # grad_weight in high precision (the default until 2026-11-26)
    "bitnet_int8_bwd": BitNet(grad_input=True, grad_weight=True),  # the same as "bitnet", by its explicit name
}
