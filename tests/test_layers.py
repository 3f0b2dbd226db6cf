"""Linen and NNX layers: DenseGeneral's parameter tree and numerics, recipes, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.linen as nn
from flax import nnx

import jaxlowbit
from jaxlowbit import BitNet, Float8, Int8MixedPrecision
from jaxlowbit import nnx as lbnnx
from helpers import fresh_key, sqnr_db

LAYERS = [(jaxlowbit.Int8Dense, Int8MixedPrecision()), (jaxlowbit.Fp8Dense, Float8("rowwise")),
          (jaxlowbit.BitNetDense, BitNet())]
CONFIGS = [
    dict(features=48),
    dict(features=(4, 8), axis=(-2, -1)),
    dict(features=16, batch_dims=(0,), axis=-1),
    dict(features=16, use_bias=False, dtype=jnp.bfloat16),
]


@pytest.mark.parametrize("layer_cls,recipe", LAYERS, ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_same_parameter_tree_and_values_as_dense_general(layer_cls, recipe, config):
  # 64 rows: BitNet's SQNR against float (~6.4 dB, the ternary weight's error) spreads 0.12 dB over draws here; on 3
  # rows it spread 0.57 dB and crossed 5 dB on 3 draws of 400.
  x = jax.random.normal(fresh_key(), (64, 5, 32))
  ref = nn.DenseGeneral(**config).init(jax.random.key(7), x)
  params = layer_cls(**config).init(jax.random.key(7), x)
  assert jax.tree.structure(ref) == jax.tree.structure(params)
  jax.tree.map(np.testing.assert_array_equal, ref, params)
  # recipe=None is DenseGeneral exactly; the recipe is a close approximation.
  ref_out = nn.DenseGeneral(**config).apply(ref, x)
  np.testing.assert_array_equal(layer_cls(**config, recipe=None).apply(ref, x), ref_out)
  out = layer_cls(**config).apply(ref, x)
  assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
  assert sqnr_db(out, ref_out) > (5 if isinstance(recipe, BitNet) else 20)


def test_layers_are_dense_general_drop_ins():
  layer = jaxlowbit.Int8Dense(features=8, kernel_init=nn.initializers.ones, name="proj")
  assert isinstance(layer, nn.DenseGeneral)
  x = jnp.ones((2, 4))
  params = layer.init(jax.random.key(0), x)
  np.testing.assert_array_equal(params["params"]["kernel"], np.ones((4, 8)))
  np.testing.assert_allclose(layer.apply(params, x), np.full((2, 8), 4.0), rtol=1e-6)


def test_gradients_reach_params_in_param_dtype():
  layer = jaxlowbit.Int8Dense(features=32, dtype=jnp.bfloat16)
  x = jax.random.normal(fresh_key(), (16, 64))
  params = layer.init(jax.random.key(0), x)
  grads = jax.grad(lambda p: jnp.sum(layer.apply(p, x).astype(jnp.float32) ** 2))(params)
  assert grads["params"]["kernel"].dtype == jnp.float32 and grads["params"]["bias"].dtype == jnp.float32
  assert np.all(np.isfinite(grads["params"]["kernel"])) and np.any(grads["params"]["kernel"])


@pytest.mark.parametrize("recipe", [None, BitNet()], ids=["high_precision", "bitnet"])
@pytest.mark.parametrize("activation", ["silu", "relu2"])
def test_a_gated_dense_returns_the_gated_activation_of_its_output(recipe, activation):
  """``LowBitDense(gated=act)`` (``dense_for(recipe, gated=act)``): the parameters of the plain layer (for no recipe,
  ``nn.DenseGeneral``), and ``act(gate) * up`` ``[..., features / 2]`` of its output (``jaxlowbit.fused.swiglu``),
  bit for bit; its gradient is the composition's."""
  x = jax.random.normal(fresh_key(), (2, 3, 32), jnp.float32).astype(jnp.bfloat16)
  # dense_for: nn.DenseGeneral for no recipe; the gated one is a LowBitDense either way
  plain = jaxlowbit.dense_for(recipe, features=64, use_bias=False, dtype=jnp.bfloat16)
  gated = jaxlowbit.dense_for(recipe, features=64, use_bias=False, dtype=jnp.bfloat16, gated=activation)
  assert isinstance(gated, jaxlowbit.LowBitDense) and (recipe is not None) == isinstance(plain, jaxlowbit.LowBitDense)
  params = plain.init(fresh_key(), x)
  assert jax.tree.map(jnp.shape, gated.init(fresh_key(), x)) == jax.tree.map(jnp.shape, params)
  got = gated.apply(params, x)
  want = jaxlowbit.fused.swiglu(plain.apply(params, x), activation)
  assert got.shape == (2, 3, 32)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  loss = lambda layer: lambda p: jnp.sum(layer(p).astype(jnp.float32) ** 2)  # noqa: E731
  g_got = jax.grad(loss(lambda p: gated.apply(p, x)))(params)
  g_want = jax.grad(loss(lambda p: jaxlowbit.fused.swiglu(plain.apply(p, x), activation)))(params)
  np.testing.assert_array_equal(np.asarray(g_got["params"]["kernel"]), np.asarray(g_want["params"]["kernel"]))


def test_a_gated_dense_needs_no_bias_and_even_features():
  for bad in (dict(features=64), dict(features=63, use_bias=False), dict(features=64, use_bias=False, measured=True)):
    with pytest.raises(ValueError, match="gated output needs no bias"):
      jaxlowbit.LowBitDense(recipe=BitNet(), gated="silu", **bad)
  with pytest.raises(ValueError, match="gate activation 'gelu' is not known"):
    jaxlowbit.LowBitDense(features=64, use_bias=False, gated="gelu")


def test_wrong_recipe_and_dot_general_raise():
  x = jnp.ones((2, 4))
  with pytest.raises(TypeError, match="Int8Dense: recipe must be Int8MixedPrecision"):
    jaxlowbit.Int8Dense(4, recipe=Float8()).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="dot_general"):
    jaxlowbit.Fp8Dense(4, dot_general=jax.lax.dot_general).init(jax.random.key(0), x)
  with pytest.raises(TypeError, match="floating point"):
    jaxlowbit.BitNetDense(4).init(jax.random.key(0), jnp.ones((2, 4), jnp.int32))
  with pytest.raises(ValueError, match="Float8.scaling must be one of"):
    Float8("blockwise")
  with pytest.raises(TypeError, match="Int8MixedPrecision.output must be a bool"):
    Int8MixedPrecision(output="yes")


@pytest.mark.parametrize("layer_cls", [lbnnx.Int8Dense, lbnnx.Fp8Dense, lbnnx.BitNetDense])
def test_nnx_layers_match_nnx_linear(layer_cls):
  x = jax.random.normal(fresh_key(), (4, 6, 32))
  ref = nnx.Linear(32, 24, rngs=nnx.Rngs(3))
  layer = layer_cls(32, 24, rngs=nnx.Rngs(3))
  assert isinstance(layer, nnx.Linear)
  ref_state, state = nnx.state(ref, nnx.Param), nnx.state(layer, nnx.Param)
  jax.tree.map(np.testing.assert_array_equal, ref_state, state)
  out = layer(x)
  assert out.shape == (4, 6, 24)
  assert sqnr_db(out, ref(x)) > (5 if layer_cls is lbnnx.BitNetDense else 20)
  exact = layer_cls(32, 24, recipe=None, rngs=nnx.Rngs(3))
  np.testing.assert_array_equal(exact(x), ref(x))

  # trains: nnx.grad reaches the kernel
  grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(layer)
  assert np.any(np.asarray(grads.kernel[...]))


@pytest.mark.parametrize("layer_cls", [lbnnx.Int8Dense, lbnnx.Fp8Dense, lbnnx.BitNetDense])
def test_nnx_layers_run_quantized_matmul_on_their_kernel(layer_cls):
  """The layer is quantized_matmul of its own kernel and recipe plus the bias, exactly, and so not
  the high-precision product (a layer that never quantized would pass the SQNR bound above)."""
  x = jax.random.normal(fresh_key(), (4, 6, 32))
  layer = layer_cls(32, 24, rngs=nnx.Rngs(3))
  assert layer.recipe is not None
  out = layer(x)
  want = jaxlowbit.quantized_matmul(x, layer.kernel[...], layer.recipe) + layer.bias[...]
  np.testing.assert_array_equal(out, want)
  exact = layer_cls(32, 24, recipe=None, rngs=nnx.Rngs(3))(x)
  assert np.max(np.abs(out - exact)) > 1e-3 * np.max(np.abs(exact)), "the layer does not quantize"


@pytest.mark.parametrize("layer_cls,recipe", LAYERS, ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("default", [True, False], ids=["default_recipe", "given_recipe"])
def test_linen_layers_run_quantized_matmul_on_their_kernel(layer_cls, recipe, default):
  x = jax.random.normal(fresh_key(), (4, 6, 32))
  layer = layer_cls(features=24) if default else layer_cls(features=24, recipe=recipe)
  assert layer.recipe is not None
  params = layer.init(jax.random.key(1), x)["params"]
  out = layer.apply({"params": params}, x)
  want = jaxlowbit.quantized_matmul(x, params["kernel"], layer.recipe) + params["bias"]
  np.testing.assert_array_equal(out, want)
  exact = layer_cls(features=24, recipe=None).apply({"params": params}, x)
  assert np.max(np.abs(out - exact)) > 1e-3 * np.max(np.abs(exact)), "the layer does not quantize"


def test_nnx_errors():
  with pytest.raises(TypeError, match="recipe must be BitNet"):
    lbnnx.BitNetDense(4, 4, recipe=Int8MixedPrecision(), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="dot_general"):
    lbnnx.Int8Dense(4, 4, dot_general=jax.lax.dot_general, rngs=nnx.Rngs(0))


def _rounds(fn, x) -> bool:
  return "reduce_precision" in str(jax.make_jaxpr(fn)(x))


def test_a_narrowing_input_cast_rounds_where_xla_cannot_drop_it():
  """A float32 input to a bfloat16 layer is rounded by ``reduce_precision``: XLA may drop a bare
  float32 -> bfloat16 -> float32 round trip inside a fusion, so the quantizer would read other values than
  a kernel fed the cast operand (the ternary GEMV). A bfloat16 input is passed through untouched."""
  from jaxlowbit import inference

  x32 = jax.random.normal(fresh_key(), (4, 64))
  linen = jaxlowbit.BitNetDense(features=32, use_bias=False, dtype=jnp.bfloat16)
  params = linen.init(jax.random.key(0), x32)
  qparams = {"params": inference.quantize_params(params["params"], "ternary", filter_fqns=())}
  converted = inference.convert_for_inference(linen, "ternary")
  layer = lbnnx.BitNetDense(64, 32, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  cases = {"linen": lambda x: linen.apply(params, x), "converted": lambda x: converted.apply(qparams, x),
           "nnx": lambda x: layer(x)}
  for name, fn in cases.items():
    assert _rounds(fn, x32) and not _rounds(fn, x32.astype(jnp.bfloat16)), name
    np.testing.assert_array_equal(fn(x32), fn(x32.astype(jnp.bfloat16)), err_msg=name)
