"""Which backend runs, checked on CPU: the device is faked as an H100 (compute capability 9), the step
is lowered for CUDA, and the lowered program names the kernels that run (Triton quantizers and fused
Adam as ``jaxlowbit_*`` calls, the Hopper GEMM as a ``mosaic_gpu`` call). A forced
``JAXLOWBIT_BACKEND=pallas`` raises where a kernel cannot take the shape instead of running XLA unseen."""

import re

import jax
import jax.numpy as jnp
import pytest

from jaxlowbit import BitNet, Float8, Int8MixedPrecision, optim, qstate, quantized_matmul
from jaxlowbit.qstate import BlockQuantized
from jaxlowbit_numerics.adam import adam_coefficients
from pallas_kernels import dispatch, policy
from helpers import H100

pytestmark = pytest.mark.timeout(300)

TILED = (512, 1024, 768)  # (M, K, N) every quantize kernel tiles
UNTILED = (300, 200, 136)  # K = 200 is not a multiple of 16: no quantize kernel takes x
GEMM_CALL = "mosaic_gpu"
S = jax.ShapeDtypeStruct


@pytest.fixture
def hopper(monkeypatch):
  """Dispatch sees an sm90 GPU (lowering only: nothing runs on it)."""
  if jax.default_backend() != "cpu":
    pytest.skip("fakes a GPU on a CPU host; on a GPU tests/test_kernels_gpu.py checks the real choice")
  monkeypatch.setattr(policy, "compute_capability", lambda device=None: 9)
  return monkeypatch


def _lowered(fn, *args) -> str:
  with jax.sharding.use_abstract_mesh(H100):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _train_step_text(recipe, shape) -> str:
  m, k, n = shape

  def step(x, w, g):
    y, vjp = jax.vjp(lambda x, w: quantized_matmul(x, w, recipe), x, w)
    return (y, *vjp(g))

  return _lowered(step, S((m, k), jnp.bfloat16), S((k, n), jnp.float32), S((m, n), jnp.bfloat16))


def _kernels(text: str) -> set[str]:
  return set(re.findall(r"jaxlowbit_quantize_\w+|jaxlowbit_adam_\w+", text)) | ({GEMM_CALL} & set(re.findall(
      r"@(mosaic_gpu)\w*", text)))


# The quantize kernels each recipe's step runs: a rows-only pass (W per input channel for INT8's and FP8's
# grad_input; BitNet's per-token x when its grad_weight reads those codes), and the two-layout pass (rows and
# x^T / g^T, with its column statistics) wherever both backward GEMMs are low-bit. BitNet's ternary W runs in XLA.
STEP_KERNELS = {
    Int8MixedPrecision(): {"jaxlowbit_quantize_rows", "jaxlowbit_quantize_cols_t"},
    Float8("rowwise"): {"jaxlowbit_quantize_rows", "jaxlowbit_quantize_cols_t"},
    BitNet(True): {"jaxlowbit_quantize_rows"},
    BitNet(True, True): {"jaxlowbit_quantize_cols_t", "jaxlowbit_quantize_stats"},
}


@pytest.mark.parametrize("recipe", list(STEP_KERNELS), ids=str)
def test_auto_takes_the_kernels_where_they_tile_and_xla_elsewhere(recipe, hopper):
  hopper.delenv(policy.BACKEND_ENV, raising=False)
  ran = _kernels(_train_step_text(recipe, TILED))
  assert STEP_KERNELS[recipe] <= ran, ran
  assert not _kernels(_train_step_text(recipe, UNTILED)), "auto: XLA where no kernel tiles the shape"
  hopper.setenv(policy.BACKEND_ENV, "xla")
  assert not _kernels(_train_step_text(recipe, TILED)), "xla: no kernel at all"


@pytest.mark.parametrize("recipe", list(STEP_KERNELS), ids=str)
def test_forced_pallas_runs_the_kernels(recipe, hopper):
  hopper.setenv(policy.BACKEND_ENV, "pallas")
  ran = _kernels(_train_step_text(recipe, TILED))
  assert STEP_KERNELS[recipe] | {GEMM_CALL} <= ran, ran


@pytest.mark.parametrize(
    "recipe", [Int8MixedPrecision(), Float8("tensorwise"), Float8("rowwise"), Float8("rowwise_gw_hp"), BitNet(),
               BitNet(True, True)], ids=str)
def test_forced_pallas_refuses_a_shape_the_quantizers_cannot_take(recipe, hopper):
  hopper.setenv(policy.BACKEND_ENV, "pallas")
  with pytest.raises(ValueError, match=r"backend pallas: the \w+ quantize kernel cannot take a \[300, 200\]"):
    _train_step_text(recipe, UNTILED)


def _adam_text(shape, name="adamw_8bit") -> str:
  m_format, v_format = optim.moment_formats(name)
  c = adam_coefficients(0.9, 0.999, 1e-8, 0.0, jnp.int32(3), jnp.int32(4))

  def moment(fmt):
    codes, scale = qstate.stored_shapes(shape, fmt)
    return BlockQuantized(S(codes, fmt.code_dtype), S(scale, jnp.float32))

  fn = lambda g, m, v: dispatch.adam_update(g, m, v, c, m_format, v_format)  # noqa: E731
  return _lowered(fn, S(shape, jnp.float32), moment(m_format), moment(v_format))


def test_fused_adam_where_it_tiles_and_forced_pallas_refuses_what_it_cannot(hopper):
  hopper.delenv(policy.BACKEND_ENV, raising=False)
  assert "jaxlowbit_adam_update" in _kernels(_adam_text((16, 1024)))
  assert not _kernels(_adam_text((4, 384))), "auto: a short last block runs XLA's update"
  hopper.setenv(policy.BACKEND_ENV, "pallas")
  assert "jaxlowbit_adam_update" in _kernels(_adam_text((16, 1024)))
  with pytest.raises(ValueError, match=r"backend pallas: the fused Adam kernel cannot take .*\(4, 384\)"):
    _adam_text((4, 384))
  hopper.setenv(policy.BACKEND_ENV, "xla")
  assert not _kernels(_adam_text((16, 1024)))
