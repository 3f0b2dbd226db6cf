"""The one explicit seam: ``jaxlowbit.ExecutionOptions`` decides how a run executes, nothing global does.

- two layers with different options in ONE trace each get their own backend (a recording
  ``select_backend``), an explicit backend wins over ``$JAXLOWBIT_BACKEND`` and options without one
  take the variable's value at the library's edge;
- ``fused_quantizers`` on and off in one trace: the producer hands one linear an operand and the
  other a high-precision array, and both linears compute the same output;
- the tensor-parallel context reaches a model only through its ``execution`` field, set by
  ``jaxlowbit.parallel.apply``; ``convert_for_inference`` turns the model's fused quantizers off the
  same way; no module of the library holds a ContextVar.
"""

import contextvars
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlowbit
from jaxlowbit import ExecutionOptions, Int8MixedPrecision, fused, inference, parallel
from jaxlowbit.operand import is_low_bit
from helpers import fresh_key
from pallas_kernels import dispatch, policy
from train.model import ModelConfig, Transformer

K, N, M = 64, 32, 16


@pytest.fixture
def recorded_backends(monkeypatch):
  """The backend every low-bit GEMM traced from now on is dispatched with (each then runs on XLA)."""
  seen = []

  def recording(a_dtype, m, n, k, device=None, per_tensor=False, *, backend):
    seen.append(backend)
    return "xla"

  monkeypatch.setattr(dispatch, "select_backend", recording)
  return seen


def test_two_options_in_one_trace_give_two_backends(recorded_backends, monkeypatch):
  monkeypatch.setenv(policy.BACKEND_ENV, "xla")
  recipe = Int8MixedPrecision(grad_input=False, grad_weight=False)  # one GEMM per layer: the forward
  layers = {name: jaxlowbit.Int8Dense(N, recipe=recipe, execution=options) for name, options in
            (("pallas", ExecutionOptions(backend="pallas")), ("auto", ExecutionOptions(backend="auto")),
             ("env", None))}
  x = jax.random.normal(fresh_key(), (M, K))
  params = {name: layer.init(jax.random.key(0), x) for name, layer in layers.items()}

  def both(params, x):
    return [layers[name].apply(params[name], x) for name in ("pallas", "auto", "env")]

  recorded_backends.clear()  # init ran the layers too
  jax.jit(both).lower(params, x)  # one trace
  assert recorded_backends == ["pallas", "auto", "xla"]  # the variable only where no backend was given
  recorded_backends.clear()
  w = params["auto"]["params"]["kernel"]
  jax.jit(lambda x, w: (jaxlowbit.quantized_matmul(x, w, recipe, options=ExecutionOptions(backend="pallas")),
                        jaxlowbit.quantized_matmul(x, w, recipe))).lower(x, w)
  assert recorded_backends == ["pallas", "xla"]


def test_fused_quantizers_on_and_off_in_one_trace():
  recipe = Int8MixedPrecision()
  kx, ks, kw = jax.random.split(fresh_key(), 3)
  x = jax.random.normal(kx, (M, K)).astype(jnp.bfloat16)
  scale = 1 + 0.1 * jax.random.normal(ks, (K,))
  w = jax.random.normal(kw, (K, N)) / np.sqrt(K)
  kinds = []

  def both(x, scale, w):
    outs = []
    for options in (ExecutionOptions(fused_quantizers=True), ExecutionOptions(fused_quantizers=False)):
      h = fused.rms_norm_for(x, scale, 1e-5, recipe, jnp.bfloat16, options=options)
      kinds.append(is_low_bit(h))
      outs.append(jaxlowbit.quantized_matmul(h, w, recipe, options=options))
    return outs

  fused_y, plain_y = jax.jit(both)(x, scale, w)
  assert kinds == [True, False]
  # The same numbers either way (the producer quantizes exactly the op's rounded output).
  np.testing.assert_array_equal(np.asarray(fused_y, np.float32), np.asarray(plain_y, np.float32))


def test_options_are_checked():
  with pytest.raises(ValueError, match="backend"):
    ExecutionOptions(backend="cuda")
  with pytest.raises(TypeError, match="fused_quantizers"):
    ExecutionOptions(fused_quantizers=1)
  with pytest.raises(TypeError, match="decode_inputs"):
    ExecutionOptions(decode_inputs="int8")
  for rows in (-1, 1.0, True):
    with pytest.raises(ValueError, match=r"decode_input_rows must be an integer >= 0 or None, got"):
      ExecutionOptions(decode_input_rows=rows)
  with pytest.raises(TypeError, match="ExecutionOptions"):
    jaxlowbit.quantized_matmul(jnp.ones((M, K)), jnp.ones((K, N)), Int8MixedPrecision(), options="xla")


def test_apply_hands_the_model_its_tensor_parallel_context():
  seen = []

  class SeesTensorParallel(nn.Module):
    """Records the tensor-parallel context its ``execution`` field carries."""

    execution: ExecutionOptions | None = None

    @nn.compact
    def __call__(self, x):
      seen.append(None if self.execution is None else self.execution.tensor_parallel)
      return nn.Dense(N, use_bias=False)(x)

  model = SeesTensorParallel()
  x = jnp.ones((8, K))
  params = model.init(jax.random.key(0), x)["params"]
  mesh = parallel.make_mesh(fsdp=2, tensor=2, devices=jax.devices()[:4])
  plan = parallel.plan_for_model(model, params, x, mesh=mesh)
  local = jax.shard_map(lambda p, x: parallel.apply(model, p, x, plan=plan), mesh=mesh,
                        in_specs=(plan.specs(), plan.batch_spec()), out_specs=plan.batch_spec())
  seen.clear()
  jax.eval_shape(local, parallel.shard_params(params, plan), x)
  assert seen == [parallel.TensorParallel("tensor", 2)]
  seen.clear()
  model.apply({"params": params}, x)  # outside apply: nothing set, nothing global to read
  assert seen == [None]


def test_inference_conversion_turns_the_models_fused_quantizers_off_through_its_field():
  model = Transformer(ModelConfig(recipe=Int8MixedPrecision()))
  converted = inference.convert_for_inference(model, "w8a16")
  # w8a16's and ternary's decode gate_up GEMVs write act(gate) * up (ExecutionOptions.gated_outputs)
  assert converted.execution == ExecutionOptions(fused_quantizers=False, gated_outputs=True)
  assert model.execution is None  # the user's model is left as it was
  # ternary's linears take a decode norm's per-token codes (jaxlowbit.fused.decode_quantization)
  ternary = inference.convert_for_inference(model, "ternary")
  assert ternary.execution == ExecutionOptions(fused_quantizers=False, decode_inputs=inference.weights.BITNET_TOKENS,
                                               gated_outputs=True)
  assert not inference.convert_for_inference(model, "w8a8").execution.gated_outputs
  with pytest.raises(TypeError, match="gated_outputs must be a bool"):
    ExecutionOptions(gated_outputs=1)


def test_no_module_of_the_library_holds_a_context_variable():
  held = [f"{name}.{attr}" for name, module in list(sys.modules.items())
          if name.split(".")[0] in ("jaxlowbit", "pallas_kernels", "jaxlowbit_numerics", "train")
          for attr, value in vars(module).items() if isinstance(value, contextvars.ContextVar)]
  assert held == []
